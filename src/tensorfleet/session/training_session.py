"""``TrainingSession``: the training loop's companion (TensorFlow's MonitoredTrainingSession).

It connects the model to the rest of the cluster, runs each step (forward and backward in
the caller's closure, then the exchange that the mode calls for), keeps the global step,
runs the hooks, and says when to stop. One argument picks the update discipline:

* ``async``: every push is applied by the parameter servers at once (optionally with
  ``max_staleness``, the fastest worker at most that many steps ahead of the slowest);
* ``sync``: the parameter servers apply the mean of ``replicas_to_aggregate`` gradients per
  step (default: every worker); fewer than the number of workers makes the rest backups;
* ``allreduce``: no parameter servers; the workers average gradients with torch.distributed
  inside ``DistributedDataParallel`` and each applies the update itself.

Without a server it trains in this one process with the same API.

Checkpoints (``checkpoint_dir``): the chief saves every ``save_checkpoint_steps`` global
steps and/or ``save_checkpoint_secs`` seconds and once more at the end, after the other
workers have finished; on start, when the parameter servers have no variables yet, it
restores the newest valid checkpoint (all shards from the same one), so running the same
command again resumes. A ps that restarts mid-training is restored the same way. Pass
``data=`` (anything with ``state_dict()``/``load_state_dict()``, e.g. a
:class:`~tensorfleet.datasets.batches.BatchStream`) and each worker's position in its data is
saved with the checkpoint and given back on resume, so no batch is replayed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from tensorfleet.errors import CheckpointError, ClusterConfigError, TensorfleetError
from tensorfleet.ps.placement import PlacementPlan, VariableSpec, plan_placement
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.session.checkpoints import Checkpoint, CheckpointDirectory
from tensorfleet.session.hooks import CheckpointHook, Hook, StepResult
from tensorfleet.session.server import Server
from tensorfleet.wire.tensors import dtype_name
from tensorfleet.worker.allreduce_updater import AllReduceUpdater
from tensorfleet.worker.client import ClientTimeouts, ParameterClient, Progress
from tensorfleet.worker.local_updater import LocalUpdater

log = logging.getLogger("tensorfleet.session")

MODES = ("async", "sync", "allreduce")

StepClosure = Callable[[], "torch.Tensor | tuple[torch.Tensor, Any]"]


class DataPosition(Protocol):
    """Where a worker is in its data: what ``data=`` takes (a BatchStream is one)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainingSession:
    """Trains ``model`` with ``optimizer`` (an :class:`UpdateRule`, e.g. ``tfl.optim.Adam``)
    on the cluster of ``server`` (or in this process when ``server`` is None).

    Use it as a context manager, and compute the loss with ``sess.model`` (the model itself,
    or its ``DistributedDataParallel`` wrapper in ``allreduce`` mode)::

        with TrainingSession(server, model, optimizer=Adam(lr=1e-4), hooks=[StopAtStep(3000)]) as sess:
            while not sess.should_stop():
                sess.step(lambda: F.cross_entropy(sess.model(x), y))

    ``clip_grad_norm`` clips by global norm: each worker's gradient in ``async`` mode, the
    aggregated gradient in ``sync`` and ``allreduce`` modes. ``ema_decay`` keeps an
    exponential moving average of the parameters where they live (the ps shards, or the
    workers without ps); :meth:`moving_average` returns it.

    ``lost_worker`` (sync mode): when a worker stops sending heartbeats for the ps's liveness
    timeout, ``"shrink"`` goes on with the live workers, ``"fail"`` stops training with an
    error naming it. See docs/reliability.md for what happens on each kind of failure.
    """

    def __init__(
        self,
        server: Server | None,
        model: nn.Module,
        optimizer: UpdateRule,
        *,
        mode: str = "async",
        hooks: Iterable[Hook] = (),
        replicas_to_aggregate: int | None = None,
        max_staleness: int | None = None,
        clip_grad_norm: float | None = None,
        ema_decay: float | None = None,
        placement: str = "greedy",
        partition_threshold_bytes: int | None = None,
        log_placement: bool = False,
        timeouts: ClientTimeouts | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        save_checkpoint_steps: int | None = None,
        save_checkpoint_secs: float | None = None,
        keep_checkpoints: int = 5,
        restore: bool = True,
        data: DataPosition | None = None,
        lost_worker: str = "shrink",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(optimizer, UpdateRule):
            raise TypeError(
                f"optimizer must be a tensorfleet update rule such as tensorfleet.optim.Adam(lr=1e-4), "
                f"got {type(optimizer).__name__}: the parameter servers apply it, so it is described, not instantiated"
            )
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0, got {clip_grad_norm}")
        if replicas_to_aggregate is not None and mode != "sync":
            raise ValueError(
                f"replicas_to_aggregate={replicas_to_aggregate} only applies to mode 'sync', not {mode!r}"
            )
        if max_staleness is not None and mode != "async":
            raise ValueError(
                f"max_staleness={max_staleness} only applies to mode 'async', not {mode!r}"
            )
        if checkpoint_dir is None and (save_checkpoint_steps or save_checkpoint_secs):
            raise ValueError("save_checkpoint_steps/secs need a checkpoint_dir to save into")
        self.server = server
        self.rule = optimizer
        self.mode = mode
        self.is_chief = server.is_chief if server is not None else True
        self.task_name = str(server.task) if server is not None else "local"
        self.checkpoints = (
            CheckpointDirectory(checkpoint_dir, keep_checkpoints)
            if checkpoint_dir is not None
            else None
        )
        self._restore = restore
        self._data = data
        hooks = list(hooks)
        if self.checkpoints is not None:
            hooks.append(
                CheckpointHook(
                    every_n_steps=save_checkpoint_steps,
                    every_n_secs=600.0
                    if save_checkpoint_steps is None and save_checkpoint_secs is None
                    else save_checkpoint_secs,
                )
            )
        self.hooks = [h for h in hooks if self.is_chief or not getattr(h, "chief_only", False)]
        self.last_checkpoint: Path | None = None
        """The directory of the newest checkpoint this session saved or restored."""
        self._checkpoint_requested = False
        self._named_params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not self._named_params:
            raise ValueError("the model has no trainable parameters")
        self._clip_on_worker = (
            clip_grad_norm if mode in ("async", "allreduce") or server is None else None
        )
        self.plan: PlacementPlan | None = None
        self.model: nn.Module = model
        """What the step closure must call: the model, or its DDP wrapper in allreduce mode."""

        if server is None:
            self._updater: ParameterClient | LocalUpdater | AllReduceUpdater = LocalUpdater(
                ema_decay
            )
        elif mode == "allreduce":
            self._updater = self._allreduce_updater(server, timeouts, ema_decay)
        else:
            if not server.ps_addresses:
                raise ClusterConfigError(
                    f"mode {mode!r} trains through parameter servers, but the cluster has no 'ps' job: "
                    "add ps tasks (tensorfleet launch --ps 1), or use mode='allreduce'"
                )
            if mode == "sync" and clip_grad_norm is not None and len(server.ps_addresses) > 1:
                raise ValueError(
                    "clip_grad_norm in mode 'sync' clips the aggregated gradient on the ps, which needs "
                    f"its norm across all shards; that works with one ps task, and this cluster has "
                    f"{len(server.ps_addresses)}. Use one ps task, or mode 'async' (each worker clips "
                    "its own gradient), or 'allreduce'"
                )
            self.discipline = UpdateDiscipline(
                mode=mode,
                replicas_to_aggregate=replicas_to_aggregate,
                max_staleness=max_staleness,
                clip_norm=clip_grad_norm if mode == "sync" else None,
                ema_decay=ema_decay,
                lost_worker=lost_worker,
            )
            specs = [
                VariableSpec(name, tuple(p.shape), dtype_name(p.dtype), p.element_size())
                for name, p in self._named_params
            ]
            self.plan = plan_placement(
                specs, len(server.ps_addresses), placement, partition_threshold_bytes
            )
            if log_placement and self.is_chief:
                print(self.plan.report(), flush=True)
            self._updater = ParameterClient(
                server.ps_addresses, server.secret, self.task_name, timeouts, encrypt=server.encrypt
            )
            if self.is_chief and self.checkpoints is not None:
                self._updater.restore_shards = self._restore_shards
        self._global_step = 0
        self._stop_requested = False
        self._started = False
        self._closed = False

    def _allreduce_updater(
        self, server: Server, timeouts: ClientTimeouts | None, ema_decay: float | None
    ) -> AllReduceUpdater:
        if server.ps_addresses:
            raise ClusterConfigError(
                f"mode 'allreduce' needs no ps tasks, but the cluster has {len(server.ps_addresses)}: "
                "they would wait for workers that never come. Launch with --ps 0"
            )
        workers = server.worker_tasks
        chief = next(
            t for t in workers if (t.job == "chief") or (t.job == "worker" and t.index == 0)
        )
        rank = workers.index(server.task)
        return AllReduceUpdater(
            server.cluster.task_address(chief.job, chief.index),
            rank,
            len(workers),
            timeouts,
            ema_decay,
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> TrainingSession:
        self.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(failed=exc is not None)

    def start(self) -> None:
        """Connect, initialize (chief) or wait for initialization (others), pull the values,
        run the hooks' ``begin``."""
        if self._started:
            raise RuntimeError("the session has already started")
        self._started = True
        try:
            if isinstance(self._updater, AllReduceUpdater):
                self._updater.connect(next(self.model.parameters()).device.type)
                self.model = self._updater.wrap(self.model)
                self._global_step = self._updater.register(
                    self._named_params, None, self.rule, self.is_chief
                )
                if self.checkpoints is not None and self._restore:
                    self._restore_replicas(self._updater)
            elif isinstance(self._updater, ParameterClient):
                initialized = self._updater.connect()
                resume = None
                fresh = not all(initialized)
                if self.is_chief and fresh and self.checkpoints is not None and self._restore:
                    # The ps tasks started empty: resume from the newest valid checkpoint.
                    resume = self.checkpoints.newest_valid()
                    if resume is not None:
                        self._check_shard_count(resume)
                        print(
                            f"{self.task_name}: restoring checkpoint {resume.path} (global step "
                            f"{resume.global_step})",
                            flush=True,
                        )
                        self.last_checkpoint = resume.path
                self._global_step = self._updater.register(
                    self._named_params,
                    self.plan,
                    self.rule,
                    self.is_chief,
                    self.discipline,
                    resume=None if resume is None else (resume.global_step, resume.documents),
                )
                if self._data is not None and self._updater.restored_data is not None:
                    self._data.load_state_dict(self._updater.restored_data)
                    log.info(
                        "%s: resuming its data at %s", self.task_name, self._updater.restored_data
                    )
            else:
                self._global_step = self._updater.register(
                    self._named_params, None, self.rule, self.is_chief
                )
                if self.checkpoints is not None and self._restore:
                    self._restore_local(self._updater)
            progress = self._updater.pull()
            self._global_step = progress.global_step
            self._stop_requested = progress.stop
        except BaseException:
            self._updater.close()
            self._closed = True
            raise
        for hook in self.hooks:
            hook.begin(self)

    def close(self, failed: bool = False) -> None:
        """Run the hooks' ``end`` (unless failed), tell the others this worker is done (the
        chief declares training over, waits for the other live workers to finish and writes
        the final checkpoint), and release the connections."""
        if self._closed:
            return
        self._closed = True
        try:
            if not failed:
                for hook in self.hooks:
                    hook.end(self)
                if isinstance(self._updater, ParameterClient):
                    final = self.save_checkpoint if self.checkpoints is not None else None
                    self._updater.finish(declare_end=self.is_chief, before_done=final)
                else:
                    if isinstance(self._updater, LocalUpdater) and self.checkpoints is not None:
                        self.save_checkpoint()
                    if isinstance(self._updater, AllReduceUpdater) and self.checkpoints is not None:
                        self._save_replicas(self._updater)  # every worker takes part
                    self._updater.finish(declare_end=self.is_chief)
            elif not isinstance(self._updater, AllReduceUpdater):
                # Tell the parameter servers this worker stopped, so they do not wait for it.
                self._updater.finish(declare_end=self.is_chief)
        except TensorfleetError as exc:
            if not failed:
                raise
            log.warning(
                "%s: could not tell the others that this worker stopped: %s", self.task_name, exc
            )
        finally:
            self._updater.close()

    # -- training -------------------------------------------------------------------------------

    @property
    def global_step(self) -> int:
        """The global step as of this worker's last exchange."""
        return self._global_step

    def should_stop(self) -> bool:
        """Whether training should end: a hook asked, or the chief declared it over. In
        ``allreduce`` mode every worker gets the same answer (they must leave together):
        call it once per step on every worker."""
        if isinstance(self._updater, AllReduceUpdater) and not self._closed:
            self._stop_requested, checkpoint = self._updater.agree(
                self._stop_requested, self._checkpoint_requested
            )
            if checkpoint:
                self._save_replicas(self._updater)
        return self._stop_requested

    def request_stop(self) -> None:
        """Ask the loop to end after the current step."""
        self._stop_requested = True

    def step(self, closure: StepClosure) -> StepResult:
        """One training step: ``closure()`` computes the loss (or ``(loss, aux)``) on the
        current parameters, then the gradients are exchanged and the update applied as the
        mode says, and the updated parameters are in the model."""
        if not self._started or self._closed:
            raise RuntimeError(
                "step() needs a started, open session: use `with TrainingSession(...) as sess:`"
            )
        for hook in self.hooks:
            hook.before_step(self)
        self.model.zero_grad(set_to_none=True)
        out = closure()
        loss, aux = out if isinstance(out, tuple) else (out, None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"the step closure must return a scalar loss tensor (or (loss, aux)), got {type(loss).__name__}"
            )
        loss.backward()
        if self._clip_on_worker is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in self._named_params], self._clip_on_worker)
        if not all(hook.before_update(self, loss) is not False for hook in self.hooks):
            progress = self._skip_update()
        else:
            data = self._data.state_dict() if self._data is not None else None
            progress = self._updater.push_pull(step=self._global_step, data=data)
        self._global_step = progress.global_step
        if progress.stop:
            self._stop_requested = True
        result = StepResult(
            loss=float(loss.detach()),
            global_step=progress.global_step,
            aux=aux,
            made_step=progress.made_step,
            dropped=progress.dropped,
        )
        for hook in self.hooks:
            hook.after_step(self, result)
        return result

    def _skip_update(self) -> Progress:
        """A hook vetoed this step's update (e.g. the NaN guard): in one process nothing is
        applied; in async mode nothing is pushed and the newest values are pulled; in sync and all-reduce modes every worker
        must take part in the step, so the gradients are zeroed and exchanged (this worker
        contributes nothing; all-reduce replicas all see the same averaged gradient, so they
        all skip alike)."""
        if isinstance(self._updater, LocalUpdater):  # nothing to exchange: just do not apply
            return Progress(self._global_step, stop=False, made_step=False, dropped=True)
        if isinstance(self._updater, ParameterClient) and self.mode == "async":
            pulled = self._updater.pull()
            return Progress(pulled.global_step, pulled.stop, made_step=False, dropped=True)
        for _, param in self._named_params:
            if param.grad is not None:
                param.grad.zero_()
        if isinstance(self._updater, AllReduceUpdater):
            return self._updater.pull()  # all replicas skip the optimizer step
        return self._updater.push_pull(step=self._global_step)

    # -- checkpoints ----------------------------------------------------------------------------

    def request_checkpoint(self) -> None:
        """Save a checkpoint as soon as possible: now, or in ``allreduce`` mode at the next
        ``should_stop()``, where every worker agrees on it (it is collective there)."""
        if isinstance(self._updater, AllReduceUpdater):
            self._checkpoint_requested = True
        else:
            self.save_checkpoint()

    def save_checkpoint(self) -> Path:
        """Save a checkpoint now (the chief; usually the checkpoint hook does it): every
        shard's state, then the manifest. Returns its directory. In ``allreduce`` mode use
        :meth:`request_checkpoint` (every worker must take part)."""
        if self.checkpoints is None:
            raise CheckpointError("this session has no checkpoint_dir to save into")
        if not self.is_chief:
            raise CheckpointError(f"only the chief saves checkpoints, not {self.task_name}")
        if isinstance(self._updater, LocalUpdater):
            global_step, documents = self._updater.save()
            placement = {
                name: {"param": name, "rows": None, "shard": 0} for name, _ in self._named_params
            }
        elif isinstance(self._updater, ParameterClient):
            global_step, documents = self._updater.save()
            placement = {
                piece.stored_name: {
                    "param": piece.variable.name,
                    "rows": None if piece.is_whole else [piece.row_start, piece.row_stop],
                    "shard": piece.shard,
                }
                for shard in self.plan.shards
                for piece in shard
            }
        else:
            raise CheckpointError(
                "in mode 'allreduce' a checkpoint is collective: call request_checkpoint()"
            )
        return self._write_checkpoint(global_step, documents, placement)

    def _write_checkpoint(
        self, global_step: int, documents: list, placement: dict[str, Any]
    ) -> Path:
        assert self.checkpoints is not None
        path = self.checkpoints.write(
            global_step, documents, placement, {"mode": self.mode, "task": self.task_name}
        )
        self.last_checkpoint = path
        log.info("%s: checkpoint of global step %d saved in %s", self.task_name, global_step, path)
        return path

    def _restore_shards(self, fresh: list[int]) -> bool:
        """Bring every shard to the newest valid checkpoint (``fresh``: shards that restarted
        without variables). False when there is no checkpoint to restore."""
        assert self.checkpoints is not None and isinstance(self._updater, ParameterClient)
        checkpoint: Checkpoint | None = self.checkpoints.newest_valid()
        if checkpoint is None:
            return False
        self._check_shard_count(checkpoint)
        self._updater.restore(checkpoint.documents, checkpoint.global_step, fresh)
        self.last_checkpoint = checkpoint.path
        self._global_step = checkpoint.global_step
        print(
            f"{self.task_name}: restored checkpoint {checkpoint.path} (global step "
            f"{checkpoint.global_step})",
            flush=True,
        )
        return True

    def _save_replicas(self, updater: AllReduceUpdater) -> Path | None:
        """allreduce: every worker sends its data position to the chief, which writes its
        replica (all replicas are the same). Collective: every worker calls it."""
        self._checkpoint_requested = False
        data = self._data.state_dict() if self._data is not None else None
        assert self.server is not None
        positions = updater.gather_data(data, [str(t) for t in self.server.worker_tasks])
        if not self.is_chief:
            return None
        global_step, documents = updater.save(positions)
        placement = {
            name: {"param": name, "rows": None, "shard": 0} for name, _ in self._named_params
        }
        return self._write_checkpoint(global_step, documents, placement)

    def _restore_replicas(self, updater: AllReduceUpdater) -> None:
        """allreduce: the chief reads the newest valid checkpoint and every replica takes it
        (collective). Without one, training starts from the chief's initial values."""
        assert self.checkpoints is not None
        checkpoint = self.checkpoints.newest_valid() if self.is_chief else None
        if checkpoint is not None:
            self._check_shard_count(checkpoint)
        try:
            data = updater.restore_collectively(
                None if checkpoint is None else checkpoint.documents[0],
                0 if checkpoint is None else checkpoint.global_step,
                self.task_name,
            )
        except TensorfleetError as exc:
            raise CheckpointError(
                f"{exc}. Start fresh (restore=False) or point checkpoint_dir elsewhere"
            ) from None
        self._global_step = updater.pull().global_step
        if checkpoint is not None:
            self.last_checkpoint = checkpoint.path
            print(
                f"{self.task_name}: restored checkpoint {checkpoint.path} (global step "
                f"{checkpoint.global_step})",
                flush=True,
            )
        if self._data is not None and data is not None:
            self._data.load_state_dict(data)

    def _restore_local(self, updater: LocalUpdater) -> None:
        """One process: resume from the newest valid checkpoint, if there is one."""
        assert self.checkpoints is not None
        checkpoint = self.checkpoints.newest_valid()
        if checkpoint is None:
            return
        self._check_shard_count(checkpoint)
        try:
            updater.restore(checkpoint.documents, checkpoint.global_step)
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint {checkpoint.path} cannot be restored: {exc}. Start fresh "
                "(restore=False) or point checkpoint_dir elsewhere"
            ) from None
        self.last_checkpoint = checkpoint.path
        print(
            f"{self.task_name}: restored checkpoint {checkpoint.path} (global step "
            f"{checkpoint.global_step})",
            flush=True,
        )
        if self._data is not None and updater.restored_data is not None:
            self._data.load_state_dict(updater.restored_data)

    def _check_shard_count(self, checkpoint: Checkpoint) -> None:
        shards = len(self.server.ps_addresses) if self.server is not None else 1
        shards = shards or 1  # allreduce: the chief's replica is the one shard
        if len(checkpoint.documents) != shards:
            raise CheckpointError(
                f"checkpoint {checkpoint.path} has {len(checkpoint.documents)} shard files, the "
                f"cluster has {shards} ps tasks: restore it with the same number of ps tasks, "
                "or start fresh (restore=False; the example's --fresh)"
            )

    def pull(self) -> int:
        """Fetch the newest parameters into the model (e.g. before evaluating); returns the
        global step they belong to."""
        progress = self._updater.pull()
        self._global_step = progress.global_step
        return progress.global_step

    def cluster_stats(self) -> list[dict[str, Any]]:
        """Each ps shard's own record: pushes, dropped gradients per worker (sync), the
        largest staleness gap applied (async with max_staleness), rejected messages."""
        if not isinstance(self._updater, ParameterClient):
            return []
        return self._updater.stats()

    def moving_average(self) -> dict[str, torch.Tensor]:
        """The exponential moving average of the parameters (``ema_decay``), by parameter
        name: load it into a copy of the model to evaluate it (``load_state_dict(...,
        strict=False)``)."""
        return self._updater.moving_average()
