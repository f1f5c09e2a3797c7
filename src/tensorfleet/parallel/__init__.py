"""Parallelism inside and across worker tasks: in-graph replication and pipelines.

- :mod:`~tensorfleet.parallel.replicas`: one task drives several local devices, the model
  replicated on each, the batch split, the gradients combined on one device (in-graph
  replication, as TensorFlow's one-client multi-tower training);
- :mod:`~tensorfleet.parallel.stages`: a sequential model cut into pipeline stages, and the
  micro-batch rule;
- :mod:`~tensorfleet.parallel.local_pipeline`: the stages on local devices of one task,
  GPipe or 1F1B schedule, one thread per stage;
- :mod:`~tensorfleet.parallel.remote_pipeline`: the stages on different worker tasks,
  exchanging activations and gradients with ``torch.distributed.pipelining`` over gloo.

This package sits between ``worker`` (devices, placement) and ``session`` (which plugs these
engines in as update modes).
"""
