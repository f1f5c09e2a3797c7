"""In-graph replication: one task drives several local devices.

The model (the *master*: the parameters the ps pulls into and the gradients it pushes from)
is deep-copied once per device. Each step:

1. the master's parameters and buffers are copied into every replica;
2. the batch is split along its first dimension, ``torch.tensor_split``-style (shard sizes
   differ by at most one: a batch of 7 on 2 replicas is 4 + 3);
3. every replica runs the caller's ``loss_fn`` on its shard and ``backward()``, all at once,
   one Python thread per replica;
4. the replicas' gradients are combined on the master's device, weighted by shard size
   (``loss_reduction="mean"``: ``sum_i n_i/N * g_i``, exactly the gradient of the mean
   loss over the whole batch; ``"sum"``: ``sum_i g_i``), into the master's ``.grad``; float
   buffers (BatchNorm's running statistics) become the shard-weighted mean of the replicas'.

The caller then pushes the master's gradients once per step (the update mode does it).

Why threads and deep copies: ``torch.nn.parallel.replicate``/``parallel_apply`` refuse CPU
devices, and ``DataParallel`` on CPU runs no replica at all (measured, torch 2.13). Autograd
runs each thread's ``backward()`` on that thread and ops release the GIL, so on CPU two
replicas in two threads with one intra-op thread each use two cores (measured 25 steps/s vs
16 for one single-threaded replica, batch 256 MLP). Hence on CPU the task's intra-op thread
budget is divided among the replicas while the engine is open, and restored by
:meth:`InGraphReplicas.close`. On GPUs each replica's kernels run on its own device; in the
backward behind :class:`ReplicatedModule`, the replicas on the device of the loss run in
autograd's own thread of that device (:mod:`~tensorfleet.parallel.autograd_threads`: queued
from another thread they would wait for it forever).

BatchNorm in train mode normalizes each shard with its own statistics, as TensorFlow's towers
do; the gradients then differ from one replica on the whole batch (by design, not rounding).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from tensorfleet.cluster.device import DeviceSpec
from tensorfleet.parallel.autograd_threads import backward_thread_device, same_device
from tensorfleet.parallel.errors import ParallelConfigError, ReplicaFailed
from tensorfleet.worker.device import torch_device

#: A loss for one shard: ``loss_fn(replica, *shard_tensors) -> scalar tensor``.
ShardLoss = Callable[..., torch.Tensor]
LOSS_REDUCTIONS = ("mean", "sum")


class InGraphReplicas:
    """Replicas of ``model`` on ``devices``, driven together by one process.

    Args:
        model: the master; its parameters are the variables, its ``.grad`` receives the
            combined gradients.
        devices: one device string per replica (``["/cpu:0", "/cpu:1"]``,
            ``["/gpu:0", "/gpu:1"]``), or a count of CPU replicas.
        loss_reduction: how ``loss_fn`` reduces over its shard, ``"mean"`` (default) or
            ``"sum"``; decides the weights of the combination.
        soft_placement: a missing GPU becomes the CPU (with one warning) instead of an error.

    Use as a context manager (or call :meth:`close`) to restore the thread budget.
    """

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[str | DeviceSpec] | int,
        *,
        loss_reduction: str = "mean",
        soft_placement: bool = False,
    ) -> None:
        if isinstance(devices, int) and not isinstance(devices, bool):
            if devices < 1:
                raise ParallelConfigError(f"need at least 1 replica, got {devices}")
            specs = [DeviceSpec(device_type="CPU", device_index=i) for i in range(devices)]
        else:
            specs = [d if isinstance(d, DeviceSpec) else DeviceSpec.parse(d) for d in devices]
            if not specs:
                raise ParallelConfigError(
                    "in-graph replication needs at least one device, e.g. ['/cpu:0', '/cpu:1']"
                )
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ParallelConfigError(
                f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}"
            )
        self.model = model
        self.specs = specs
        self.devices = [torch_device(s, soft_placement=soft_placement) for s in specs]
        self.loss_reduction = loss_reduction
        self.replicas = [copy.deepcopy(model).to(d) for d in self.devices]
        self._master_params = [p for p in model.parameters()]
        self._master_buffers = [b for b in model.buffers()]
        cpu_replicas = sum(d.type == "cpu" for d in self.devices)
        self._threads_before = torch.get_num_threads()
        if cpu_replicas > 1:
            torch.set_num_threads(max(1, self._threads_before // cpu_replicas))
        self._pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="replica")
        self._closed = False

    def __enter__(self) -> InGraphReplicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the replica threads and give torch its thread budget back."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
            torch.set_num_threads(self._threads_before)

    def broadcast(self) -> None:
        """Copy the master's parameters and buffers into every replica."""
        with torch.no_grad():
            for replica in self.replicas:
                for dst, src in zip(replica.parameters(), self._master_params, strict=True):
                    dst.copy_(src, non_blocking=True)
                for dst, src in zip(replica.buffers(), self._master_buffers, strict=True):
                    dst.copy_(src, non_blocking=True)

    def step(self, loss_fn: ShardLoss, *batch: torch.Tensor) -> torch.Tensor:
        """One forward and backward of every replica on its shard of ``batch``; the combined
        gradients land in the master's ``.grad`` (replacing what was there). Returns the loss
        over the whole batch (detached, on the master's device)."""
        if self._closed:
            raise ParallelConfigError("this InGraphReplicas is closed; create a new one")
        if not batch:
            raise ParallelConfigError(
                "step() needs the batch tensors to split, e.g. step(loss_fn, x, y)"
            )
        total = batch[0].shape[0]
        if any(t.shape[0] != total for t in batch):
            raise ParallelConfigError(
                f"the batch tensors differ in their first dimension: {[t.shape[0] for t in batch]}"
            )
        n = len(self.replicas)
        if total < n:
            raise ParallelConfigError(
                f"a batch of {total} cannot feed {n} replicas: use a batch of at least {n}"
            )
        shards = [torch.tensor_split(t, n) for t in batch]
        sizes = [s.shape[0] for s in shards[0]]
        self.broadcast()
        inputs = [
            [shard[i].to(self.devices[i], non_blocking=True) for shard in shards] for i in range(n)
        ]
        losses = self._run_all(lambda i: self._run_replica(i, loss_fn, inputs[i]), sizes)
        weights = [s / total for s in sizes] if self.loss_reduction == "mean" else [1.0] * n
        self._combine(weights, [s / total for s in sizes])
        master_device = self._master_params[0].device if self._master_params else "cpu"
        return sum(
            (w * loss.to(master_device) for w, loss in zip(weights, losses, strict=True)),
            torch.zeros((), device=master_device),
        )

    def _run_all(
        self, fn: Callable[[int], Any], sizes: list[int], inline_on: torch.device | None = None
    ) -> list[Any]:
        """``fn(i)`` for every replica at once, in the replica threads, except the replicas on
        ``inline_on``, run here one after the other (a backward on an autograd device thread:
        :mod:`~tensorfleet.parallel.autograd_threads`); the first failure is raised as
        :class:`ReplicaFailed` naming the replica, its device and shard size."""
        here = [same_device(d, inline_on) for d in self.devices]
        futures = {i: self._pool.submit(fn, i) for i in range(len(self.replicas)) if not here[i]}
        results: dict[int, Any] = {}
        # Those of this thread first, while the pool's run; then the pool's, in order.
        for i in [i for i in range(len(self.replicas)) if here[i]] + list(futures):
            try:
                results[i] = fn(i) if here[i] else futures[i].result()
            except Exception as exc:
                raise ReplicaFailed(
                    f"in-graph replica {i} on {self.specs[i].to_string()} failed on its shard of "
                    f"{sizes[i]} samples: {type(exc).__name__}: {exc}"
                ) from exc
        return [results[i] for i in range(len(self.replicas))]

    def _summed_grads(self) -> list[torch.Tensor | None]:
        """Each master parameter's gradient: the sum of the replicas' (None if none has one)."""
        self._combine([1.0] * len(self.replicas), None)
        grads = [p.grad for p in self._master_params]
        for p in self._master_params:
            p.grad = None  # returned to autograd, which accumulates it
        return grads

    def _run_replica(
        self, index: int, loss_fn: ShardLoss, shard: list[torch.Tensor]
    ) -> torch.Tensor:
        replica = self.replicas[index]
        replica.zero_grad(set_to_none=True)
        loss = loss_fn(replica, *shard)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ParallelConfigError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                + (f" of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        loss.backward()
        return loss.detach()

    def _combine(self, grad_weights: list[float], buffer_weights: list[float] | None) -> None:
        with torch.no_grad():
            replica_params = [list(r.parameters()) for r in self.replicas]
            for k, master in enumerate(self._master_params):
                combined: torch.Tensor | None = None
                for w, params in zip(grad_weights, replica_params, strict=True):
                    grad = params[k].grad
                    if grad is None:
                        continue
                    part = grad.to(master.device) * w
                    combined = part if combined is None else combined.add_(part)
                master.grad = combined
        if buffer_weights is not None:
            self._combine_buffers(buffer_weights)

    def _combine_buffers(self, buffer_weights: list[float]) -> None:
        """Float buffers (BatchNorm's running statistics): the shard-weighted mean; counters:
        replica 0's (every replica counted the same)."""
        with torch.no_grad():
            replica_buffers = [list(r.buffers()) for r in self.replicas]
            for k, master in enumerate(self._master_buffers):
                if master.is_floating_point():
                    mean = sum(
                        w * bufs[k].to(master.device)
                        for w, bufs in zip(buffer_weights, replica_buffers, strict=True)
                    )
                    master.copy_(mean)
                else:  # counters such as num_batches_tracked: every replica counted the same
                    master.copy_(replica_buffers[0][k].to(master.device))


class ReplicatedModule(nn.Module):
    """In-graph replication behind an ordinary module, for the step-closure API.

    ``wrapper(x)`` splits ``x`` along its first dimension, runs every replica's forward at
    once (one thread each) and returns the outputs concatenated on the master's device; the
    caller computes any loss on them; ``loss.backward()`` then runs every replica's backward
    at once and the master's parameters receive the sum of the replicas' gradients (the
    loss's own weighting is already in the gradient of each output slice), so the gradients
    are exactly those of the whole batch through the master. The model must return one
    tensor whose first dimension is the batch.

    Without grad mode (evaluation) the master runs the batch itself. ``wrapper.module`` is
    the master, so ``state_dict`` and ``parameters()`` are the model's.
    """

    def __init__(self, replicas: InGraphReplicas) -> None:
        super().__init__()
        self.module = replicas.model
        object.__setattr__(self, "replicas", replicas)  # not a submodule: no duplicate params

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.module(x)
        engine: InGraphReplicas = self.replicas  # type: ignore[assignment]
        params = engine._master_params
        return _ReplicaFunction.apply(engine, x, *params)


class _ReplicaFunction(torch.autograd.Function):
    """Forward: the replicas' forwards in threads. Backward: their backwards in threads, and
    the summed parameter gradients (and the input's gradient) returned to autograd."""

    @staticmethod
    def forward(
        ctx, engine: InGraphReplicas, x: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        n = len(engine.replicas)
        if x.shape[0] < n:
            raise ParallelConfigError(
                f"a batch of {x.shape[0]} cannot feed {n} replicas: use a batch of at least {n}"
            )
        engine.broadcast()
        shards = torch.tensor_split(x, n)
        wants_input_grad = ctx.needs_input_grad[1]

        def run(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            replica = engine.replicas[i]
            replica.zero_grad(set_to_none=True)
            with torch.enable_grad():
                inp = shards[i].to(engine.devices[i]).detach()
                if wants_input_grad:
                    inp.requires_grad_(True)
                out = replica(inp)
            if not isinstance(out, torch.Tensor) or out.shape[:1] != inp.shape[:1]:
                raise ParallelConfigError(
                    "a replicated model must return one tensor whose first dimension is the "
                    f"batch; replica {i} returned {type(out).__name__}"
                    + (f" of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else "")
                )
            return inp, out

        results = engine._run_all(run, [s.shape[0] for s in shards])
        sizes = [s.shape[0] for s in shards]
        ctx.engine, ctx.results, ctx.sizes = engine, results, sizes
        total = x.shape[0]
        engine._combine_buffers([s / total for s in sizes])
        device = params[0].device if params else x.device
        return torch.cat([out.detach().to(device) for _, out in results])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        engine: InGraphReplicas = ctx.engine
        pieces = torch.split(grad_out, ctx.sizes)

        def run(i: int) -> None:
            inp, out = ctx.results[i]
            torch.autograd.backward(out, pieces[i].to(out.device))

        # The replicas on this node's own device run in this thread (autograd_threads).
        engine._run_all(run, ctx.sizes, inline_on=backward_thread_device(grad_out))
        grads = engine._summed_grads()
        input_grad = None
        if ctx.needs_input_grad[1]:
            input_grad = torch.cat(
                [inp.grad.to(grad_out.device) for inp, _ in ctx.results]  # type: ignore[union-attr]
            )
        ctx.results = None  # free the replicas' graphs
        return (None, input_grad, *grads)
