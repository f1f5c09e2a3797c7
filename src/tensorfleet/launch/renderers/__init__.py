"""Job descriptions for cluster managers, written from one cluster shape.

The local launcher runs a cluster itself; on a real cluster the cluster manager runs the
tasks and tensorfleet only has to describe them. Each module here turns a
:class:`~tensorfleet.launch.renderers.shape.ClusterShape` (how many ps and worker tasks)
plus the manager's own options into the text that manager reads, and adds its
``tensorfleet`` subcommand:

- :mod:`~tensorfleet.launch.renderers.slurm`: ``tensorfleet slurm`` writes an sbatch script;
  the tasks find their identity from Slurm's variables
  (:class:`~tensorfleet.cluster.resolver.SlurmDetector`).
- :mod:`~tensorfleet.launch.renderers.kubernetes`: ``tensorfleet k8s render`` writes
  Kubernetes manifests; each pod gets its identity in ``TF_CONFIG``.

Rendering never starts anything, so every check (a shape of 0 tasks, an allocation smaller
than the shape, a name Kubernetes would refuse) fails here, before a job is submitted.
"""
