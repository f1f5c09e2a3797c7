"""``TrainingSession``: the training loop's companion (TensorFlow's MonitoredTrainingSession).

It connects the model to the rest of the cluster, runs each step (forward and backward in
the caller's closure, then the exchange that the mode calls for), keeps the global step,
runs the hooks, and says when to stop. One argument picks the update discipline:

* ``async``: every push is applied by the parameter servers at once (optionally with
  ``max_staleness``, the fastest worker at most that many steps ahead of the slowest), but
  one whose gradient was computed on values more than ``max_gradient_age`` updates old
  (default ``"auto"``: 16 per worker, at least 64; ``"off"``: none dropped), which is dropped;
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

A SIGTERM while the session is open is a preemption (:mod:`tensorfleet.session.preemption`):
the step in progress finishes, the chief writes a checkpoint, and
:class:`~tensorfleet.errors.Preempted` ends the process with status 143, which a launcher
or cluster manager that restarts tasks treats as a preemption.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tensorfleet.errors import (
    CheckpointError,
    ConfigError,
    ConfigTypeError,
    Preempted,
    TensorfleetError,
    UsageError,
)
from tensorfleet.ps.model_namespace import check_model_name
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.update_rules import UpdateRule, rule_label
from tensorfleet.session.checkpoints import CheckpointDirectory
from tensorfleet.session.data_position import DataPosition, checked_data_position
from tensorfleet.session.delta_checkpoints import DeltaPlan
from tensorfleet.session.device_engines import placement_table, wanted_engines
from tensorfleet.session.hooks import CheckpointHook, Hook, StepResult, can_veto
from tensorfleet.session.open_session import require_open
from tensorfleet.session.preempted_exit import (
    end_without_the_ps,
    ended_by_the_preemption,
    leave_after_the_error,
    leave_preempted,
)
from tensorfleet.session.preemption import PreemptionNotice
from tensorfleet.session.progress_hook import default_progress_hook
from tensorfleet.session.rule_optimizer import RuleOptimizer
from tensorfleet.session.server import Server
from tensorfleet.session.session_checkpoints import SessionCheckpoints
from tensorfleet.session.update_modes import (
    UpdateSettings,
    build_updater,
    is_chief,
    update_mode,
)
from tensorfleet.worker.bucketed_push import step_overlap
from tensorfleet.worker.compute_options import ComputeOptions, ComputeSetup
from tensorfleet.worker.push_overlap import DEFAULT_OVERLAP, Overlap, checked_overlap
from tensorfleet.worker.timeline import task_timeline
from tensorfleet.worker.timeouts import ClientTimeouts

log = logging.getLogger("tensorfleet.session")

StepClosure = Callable[[], "torch.Tensor | tuple[torch.Tensor, Any]"]


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
    workers without ps); :meth:`moving_average` returns it. It, :meth:`pull`,
    :meth:`cluster_stats`, :meth:`save_checkpoint` and :meth:`step` need the open session
    (inside the ``with`` block): before ``start()`` or after the block, UsageError.

    ``sparse_optimizer`` (modes ``async`` and ``sync``): the row-sparse rule (e.g.
    ``tfl.optim.SparseAdam(lr=1e-3)``) the ps shards apply to the weights of
    ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)``, which they hold as rows,
    and to the embedding tables; default: ``optimizer``'s row-sparse twin (``sgd``,
    ``adagrad``; ``adam`` has none). See docs/sparse.md.

    ``max_gradient_age`` (mode ``async`` only): a push whose gradient was computed on values
    more than this many updates behind the shard (a worker that was stopped or paused while
    the others trained) is dropped, answered with the current values, and logged by the ps;
    ``"auto"`` (None, the default) is 16 updates per worker of the model, at least 64;
    ``"off"`` applies every push. ``sess.cluster_stats()`` reports each shard's push ages
    (``gradient_age``). See :mod:`tensorfleet.ps.gradient_age` and docs/reliability.md.

    ``lost_worker`` (mode ``sync`` only): when a worker stops sending heartbeats for the ps's
    liveness timeout, ``"shrink"`` (the default) goes on with the live workers, ``"fail"``
    stops training with an error naming it. See docs/reliability.md for what happens on each
    kind of failure. Every option's type and range is checked when the session is built,
    with or without a server (``update_modes.check_option_values``).

    Several devices or tasks per step (docs/devices.md): ``replica_devices=["/cpu:0",
    "/cpu:1"]`` (or ``2``: that many CPU replicas) replicates the model in this task
    (in-graph replication), ``stage_devices``
    splits an ``nn.Sequential`` into one stage per device with ``microbatches`` micro-batches
    (GPipe), and a server with ``pipeline_stages`` > 1 makes this worker the leader of a
    pipeline across tasks. ``sess.model`` is then the engine; the gradients are still pushed
    once per step as ``mode`` says. ``soft_placement`` lets a missing GPU fall back to the CPU.

    ``progress_secs``: under ``tensorfleet launch`` the chief prints a progress line (global
    step, bar to the last step, steps/s, time left) every ``progress_secs`` seconds unless
    ``hooks`` holds a :class:`~tensorfleet.session.progress_hook.ProgressHook`; None: no
    default progress line. Outside the launcher nothing is added.
    ``model_name`` (modes ``async`` and ``sync``) trains in that namespace on the ps tasks, so
    that several independent trainings share them, each with its own variables, optimizer,
    global step, checkpoints (``checkpoint_dir/<model_name>/``) and end of training;
    ``model_workers`` (task names such as ``"worker:2"``, or worker indices) are the workers
    that train it, the first of them in cluster order its chief (default: every worker).
    See docs/patterns.md, "Several models on one cluster".

    ``timeline``: a file path; each task then records where its steps' time goes (compute,
    backward, and in the ps modes pack, push, wait, unpack) and writes it when the session
    closes as a Chrome trace named for the task (``trace.json`` -> ``trace.worker-0.json``,
    :attr:`timeline_path`), which Perfetto opens. See docs/timeline.md.

    ``compute``: a :class:`~tensorfleet.worker.compute_options.ComputeOptions` (channels-last
    memory order, ``torch.compile``, bf16 autocast around the closure); ``wire_dtype="bf16"``
    (modes ``async`` and ``sync``): float32 gradients travel as bf16 with error feedback;
    ``values_wire_dtype="bf16"`` (the same modes): the values in the reply to each push too.
    All are off by default; docs/compute.md says what each costs and gains.
    ``overlap`` (mode ``async`` without ``max_staleness``): push the gradients in buckets
    during the backward pass and, with ``Overlap(prefetch=True)``, let the next step's
    forward start before the step's replies (at most one step stale); None: the step is
    sequential. By default buckets of 1 MiB, off when every ps is on this host and the
    worker's threads use every core (one push after the backward then lets each phase use
    all of them: :func:`~tensorfleet.worker.push_overlap.automatic_overlap`). See
    :class:`~tensorfleet.worker.push_overlap.Overlap` and docs/timeline.md.
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
        max_gradient_age: int | str | None = None,
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
        full_checkpoint_every: int = 1,
        restore: bool = True,
        data: DataPosition | None = None,
        lost_worker: str | None = None,
        replica_devices: Sequence[str] | int | None = None,
        stage_devices: Sequence[str] | None = None,
        microbatches: int = 4,
        soft_placement: bool = False,
        progress_secs: float | None = 10.0,
        model_name: str = "",
        model_workers: Iterable[str | int] | None = None,
        timeline: str | os.PathLike[str] | None = None,
        sparse_optimizer: SparseRowRule | None = None,
        compute: ComputeOptions | None = None,
        wire_dtype: str | None = None,
        values_wire_dtype: str | None = None,
        overlap: Overlap | None = DEFAULT_OVERLAP,
    ) -> None:
        settings = UpdateSettings(
            mode=mode,
            replicas_to_aggregate=replicas_to_aggregate,
            max_staleness=max_staleness,
            max_gradient_age=max_gradient_age,
            clip_grad_norm=clip_grad_norm,
            ema_decay=ema_decay,
            placement=placement,
            partition_threshold_bytes=partition_threshold_bytes,
            log_placement=log_placement,
            timeouts=timeouts,
            lost_worker=lost_worker,
            replica_devices=replica_devices,  # UpdateSettings checks them (device_option)
            stage_devices=stage_devices,
            microbatches=microbatches,
            soft_placement=soft_placement,
            model_name=check_model_name(model_name),
            model_workers=None if model_workers is None else tuple(model_workers),
            sparse_optimizer=sparse_optimizer,
            wire_dtype=wire_dtype,
            values_wire_dtype=values_wire_dtype,
            overlap=checked_overlap(overlap),
        )
        update_mode(settings)  # an unknown mode, or an option it does not take, fails first
        if isinstance(optimizer, SparseRowRule) or not (
            sparse_optimizer is None or isinstance(sparse_optimizer, SparseRowRule)
        ):
            raise ConfigTypeError(
                "a row-sparse rule (tfl.optim.SparseAdam(...), tfl.optim.SparseRowRule) goes in "
                "sparse_optimizer=, for the sparse=True embedding weights and the embedding "
                "tables; optimizer= takes a dense rule for the other parameters, e.g. "
                f"tfl.optim.Adam(lr=1e-3); got optimizer={rule_label(optimizer)}, "
                f"sparse_optimizer={rule_label(sparse_optimizer)}"
            )
        if not isinstance(optimizer, UpdateRule):
            raise ConfigTypeError(
                f"optimizer must be a tensorfleet update rule such as tensorfleet.optim.Adam(lr=1e-4), "
                f"got {type(optimizer).__name__}: the parameter servers apply it, so it is described, not instantiated"
            )
        if checkpoint_dir is None and (save_checkpoint_steps or save_checkpoint_secs):
            raise ConfigError("save_checkpoint_steps/secs need a checkpoint_dir to save into")
        self.server = server
        self.rule = optimizer
        self.mode = mode
        self.model_name = model_name
        """The model's namespace on the ps tasks (``""``: the cluster's default model)."""
        self.is_chief = is_chief(server, settings)
        """Whether this task is the chief of its model (saves, declares the end)."""
        self.task_name = str(server.task) if server is not None else "local"
        self.checkpoints = (
            CheckpointDirectory(Path(checkpoint_dir) / model_name, keep_checkpoints)
            if checkpoint_dir is not None
            else None
        )
        self._deltas = DeltaPlan(full_checkpoint_every)
        """Which checkpoints hold the embedding tables as deltas (see delta_checkpoints)."""
        self._restore = restore
        self._log_placement = log_placement
        self._data = checked_data_position(data)
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
        if (progress := default_progress_hook(hooks, progress_secs)) is not None:
            hooks.append(progress)  # under the launcher only: see progress_hook.py
        self.hooks = [h for h in hooks if self.is_chief or not getattr(h, "chief_only", False)]
        self.last_checkpoint: Path | None = None
        """The directory of the newest checkpoint this session saved or restored."""
        self._checkpoint_requested = False
        self._rule_optimizer: RuleOptimizer | None = None
        self._agreed = False  # collective: should_stop() agreed since the last step ended
        self._saved_step: int | None = None  # the global step of the last checkpoint saved
        self._named_params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not self._named_params:
            raise ConfigError("the model has no trainable parameters")
        # Cleared before each step (Module.zero_grad's walk: 400 us at 150 modules, this 21)
        self._all_params = list(model.parameters())
        self._clip_on_worker = (
            clip_grad_norm if server is None or update_mode(settings).clips_on_worker else None
        )
        self.model: nn.Module = model
        """What the step closure must call: the model, or its DDP wrapper in allreduce mode
        (compiled when ``compute`` asks for it)."""
        engines = wanted_engines(server, settings)
        self._compute = ComputeSetup(compute, engines[0] if engines else None)
        self._updater = build_updater(server, self._named_params, settings)
        self._timeline, self.timeline_path = task_timeline(timeline, self.task_name)
        """Where this task's timeline goes (``timeline`` with the task's name), or None."""
        if self._timeline.enabled and hasattr(self._updater, "trace"):
            self._updater.trace(self._timeline)  # modes that can show their exchange do
        # Buckets may go during the backward only when nothing after it changes or vetoes them.
        self._overlap = step_overlap(
            self._updater,
            during_backward=self._clip_on_worker is None and not any(map(can_veto, self.hooks)),
        )
        self.discipline = self._updater.discipline
        """The rule the parameter servers apply (None in modes without them)."""
        self._global_step = 0
        self._stop_requested = False
        self._started = False
        self._closed = False
        self._released = False
        self._busy = False  # inside step() or should_stop(): see session/preemption.py
        self._preemption = PreemptionNotice(busy=lambda: self._busy)

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> TrainingSession:
        self.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._preemption.leaving()  # a child's death is not raised into the exit's own work
        if isinstance(exc, Preempted) and not self._closed:  # the ps unreachable: see the module
            end_without_the_ps(self)
            return
        if isinstance(exc, Exception) and ended_by_the_preemption(self, exc):
            leave_after_the_error(self)  # Preempted (status 143), with the error as context
        self.close(failed=exc is not None)

    def start(self) -> None:
        """Connect, initialize (chief) or wait for initialization (others), restore the newest
        checkpoint where the mode resumes from one, pull the values, run the hooks' ``begin``."""
        if self._started:
            raise UsageError("the session has already started")
        self._started = True
        self._preemption.__enter__()
        try:
            self._updater.connect(next(self.model.parameters()).device)
            model = self._compute.prepare(self.model)
            self.model = self._compute.wrap(self._updater.wrap(model))
            if self._log_placement and self.is_chief:
                heading = f"placement of model {self.model_name!r}:\n" if self.model_name else ""
                print(heading + placement_table(self._updater, model, self.task_name), flush=True)
            self._updater.register(self._named_params, self.rule)
            restored = self._updater.restore(
                SessionCheckpoints(self) if self.checkpoints is not None else None,
                resume=self._restore,
            )
            self._global_step = restored.global_step
            if self._data is not None and restored.data is not None:
                self._data.load_state_dict(restored.data)
                log.info("%s: resuming its data at %s", self.task_name, restored.data)
            progress = self._updater.pull()
            self._global_step = progress.global_step
            self._stop_requested = progress.stop
        except BaseException:
            self._updater.close()
            self._compute.release()
            self._closed = self._released = True
            self._preemption.__exit__(None, None, None)
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
            final = self._save if self.checkpoints is not None else None
            self._updater.finish(final, failed=failed)
        except TensorfleetError as exc:
            if not failed:
                raise
            log.warning(
                "%s: could not tell the others that this worker stopped: %s", self.task_name, exc
            )
        finally:
            self._release()

    def _release(self) -> None:
        self._released = True
        self._updater.close()
        self._compute.release()
        self._preemption.__exit__(None, None, None)
        if self.timeline_path is not None:
            self._timeline.write(self.timeline_path)

    # -- training -------------------------------------------------------------------------------

    @property
    def global_step(self) -> int:
        """The global step as of this worker's last exchange."""
        return self._global_step

    def should_stop(self) -> bool:
        """Whether training should end: a hook asked, or the chief declared it over. In
        ``allreduce`` mode every worker gets the same answer (they must leave together):
        ask it once per step on every worker, or never (a step that no ``should_stop()``
        preceded agrees at its start, so a preemption still takes every worker along)."""
        if not self._closed:
            self._busy = True
            try:
                self._agree_whether_to_stop()
            finally:
                self._busy = False
        return self._stop_requested

    def _agree_whether_to_stop(self) -> None:
        """should_stop()'s agreement (collective in allreduce), and a preemption's exit; in
        a collective mode also made at the start of a step that no should_stop() preceded,
        so that a loop that never asks still leaves with the others after a SIGTERM."""
        self._agreed = True
        # In allreduce mode a preempted worker's checkpoint is collective: asked for here,
        # and every worker leaves after it (the group restarts together).
        preempted = self._preemption.received.is_set() and self._updater.collective
        agreed = self._updater.agree(self._stop_requested, self._checkpoint_requested, preempted)
        self._stop_requested = agreed.stop
        saved = self._save() if agreed.checkpoint or agreed.preempted else None
        if agreed.preempted:
            leave_preempted(self, saved, by_another_worker=not preempted)

    def request_stop(self) -> None:
        """Ask the loop to end after the current step."""
        self._stop_requested = True

    def step(self, closure: StepClosure) -> StepResult:
        """One training step: ``closure()`` computes the loss (or ``(loss, aux)``) on the
        current parameters, then the gradients are exchanged and the update applied as the
        mode says, and the updated parameters are in the model."""
        self._busy = True
        try:
            result = self._step(closure)
        finally:
            self._busy = False
        if self._preemption.deferred:  # a child died of the SIGTERM during it: raised now
            raise self._preemption.deferred.pop(0)
        return result

    def _step(self, closure: StepClosure) -> StepResult:
        require_open("step()", started=self._started, closed=self._closed)
        if self._updater.collective and not self._agreed:  # no should_stop() since the last
            self._agree_whether_to_stop()  # step: agreed here, at the same point everywhere
        started_ns = time.perf_counter_ns()
        for hook in self.hooks:
            hook.before_step(self)
        for param in self._all_params:
            param.grad = None
        if self._rule_optimizer is not None:  # before the backward: its buckets may go then
            self._rule_optimizer.step()  # a scheduler attached to it counts the step
            if (hyperparameters := self._rule_optimizer.due()) is not None:
                self._updater.retune(hyperparameters)
        self._overlap.before_forward()
        with self._timeline.span("compute"), self._compute.autocast():
            out = closure()
        loss, aux = out if isinstance(out, tuple) else (out, None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigTypeError(
                f"the step closure must return a scalar loss tensor (or (loss, aux)), got {type(loss).__name__}"
            )
        with self._timeline.span("backward"), self._overlap.backward():
            loss.backward()
        if self._clip_on_worker is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in self._named_params], self._clip_on_worker)
        if not all(hook.before_update(self, loss) is not False for hook in self.hooks):
            # A hook vetoed the update (e.g. the NaN guard): the mode says what that means.
            progress = self._updater.skip(self._global_step)
        else:
            data = self._data.state_dict() if self._data is not None else None
            with self._timeline.span("exchange"):
                progress = self._updater.exchange(self._global_step, data)
        self._global_step = progress.global_step
        if progress.stop:
            self._stop_requested = True
        if progress.checkpoint_requested and self.is_chief and self.checkpoints is not None:
            self._save()  # a preempted ps waits for this checkpoint before it exits
        result = StepResult(
            loss=float(loss.detach()),
            global_step=progress.global_step,
            aux=aux,
            made_step=progress.made_step,
            dropped=progress.dropped,
        )
        self._timeline.add("step", started_ns, time.perf_counter_ns(), step=result.global_step)
        for hook in self.hooks:
            hook.after_step(self, result)
        self._agreed = False
        if self._preemption.received.is_set() and not self._updater.collective:
            leave_preempted(self)  # collective: at the next agreement, with every worker
        return result

    # -- checkpoints ----------------------------------------------------------------------------

    def request_checkpoint(self) -> None:
        """Save a checkpoint as soon as possible: now, or in ``allreduce`` mode at the next
        ``should_stop()``, where every worker agrees on it (it is collective there)."""
        if self._updater.collective:
            self._checkpoint_requested = True
        else:
            self.save_checkpoint()

    def save_checkpoint(self) -> Path:
        """Save a checkpoint now (the chief; usually the checkpoint hook does it): every
        shard's state, then the manifest. Returns its directory. In ``allreduce`` mode use
        :meth:`request_checkpoint` (every worker must take part)."""
        require_open("save_checkpoint()", started=self._started, closed=self._released)
        if self.checkpoints is None:
            raise CheckpointError("this session has no checkpoint_dir to save into")
        if not self.is_chief:
            raise CheckpointError(f"only the chief saves checkpoints, not {self.task_name}")
        if self._updater.collective:
            raise CheckpointError(
                f"in mode {self.mode!r} a checkpoint is collective: call request_checkpoint()"
            )
        path = self._save()
        assert path is not None  # the chief of a non-collective mode always writes
        return path

    def _save(self) -> Path | None:
        """Take a checkpoint and (the chief) write it. In a collective mode every worker
        calls this at the same step; the others write nothing and get None."""
        self._checkpoint_requested = False
        data = self._data.state_dict() if self._data is not None else None
        saved = self._updater.save(data, tables_since=self._deltas.since(self._global_step))
        if saved is None or self.checkpoints is None:
            return None  # not the chief, or (a collective save asked by another) no directory
        kind = self._deltas.manifest_fields(saved.documents, saved.global_step)
        if kind is None:  # the step of the delta's base: it replaces it, so it needs another
            since = self._deltas.since(saved.global_step)
            saved = self._updater.save(data, tables_since=since)
            kind = self._deltas.manifest_fields(saved.documents, saved.global_step)
            if kind is None:
                raise CheckpointError(
                    f"{self.task_name}: the checkpoint of global step {saved.global_step} "
                    f"cannot be made a delta of an earlier one; fix: full_checkpoint_every=1"
                )
        path = self.checkpoints.write(
            saved.global_step,
            list(saved.documents),
            saved.placement,
            {"mode": self.mode, "task": self.task_name, "model": self.model_name, **kind},
        )
        self._deltas.written(path, saved.documents, saved.global_step)
        self.last_checkpoint = path
        # The shards' global step as saved: newer than this worker's last reply in async
        # mode, when other workers pushed since (a preempted chief's line names this one).
        self._global_step = max(self._global_step, saved.global_step)
        self._saved_step = saved.global_step
        log.info(
            "%s: checkpoint of global step %d saved in %s", self.task_name, saved.global_step, path
        )
        return path

    @property
    def optimizer(self) -> RuleOptimizer:
        """The update rule as a ``torch.optim.Optimizer`` with one parameter group holding its
        hyperparameters: attach a torch learning-rate scheduler to it (``StepLR(sess.optimizer,
        ...)``, ``OneCycleLR``, ``LambdaLR``, ``ReduceLROnPlateau``...) or set
        ``sess.optimizer.param_groups[0]["lr"]``, and every update from the next step on
        uses the new values, in every mode (on the ps shards: sent with each push). The
        model is trained by the session, not by this object's ``step()``."""
        if self._rule_optimizer is None:
            self._rule_optimizer = RuleOptimizer(self.rule)
        return self._rule_optimizer

    def pull(self) -> int:
        """Fetch the newest parameters into the model (e.g. before evaluating); returns the
        global step they belong to."""
        require_open("pull()", started=self._started, closed=self._released)
        progress = self._updater.pull()
        self._global_step = progress.global_step
        return progress.global_step

    def cluster_stats(self) -> list[dict[str, Any]]:
        """Each ps shard's own record, a dict per shard: ``pushes``, ``buckets``, ``refused``,
        ``rejected``, ``dropped`` (sync), ``max_staleness_seen``, ``gradient_age``, ``tables``,
        ``shared_memory``, ``streamed_replies`` / ``streamed_requests`` (payloads on the payload
        stream), ``copies_on_write``, ``peak_rss_bytes``, among others. In one process with
        embedding tables, one record of the rows held here (``mode`` ``local``, ``tables``,
        ``peak_rss_bytes``); otherwise empty in modes without parameter servers."""
        require_open("cluster_stats()", started=self._started, closed=self._released)
        return self._updater.stats()

    def moving_average(self) -> dict[str, torch.Tensor]:
        """The exponential moving average of the parameters (``ema_decay``), by parameter
        name: load it into a copy of the model to evaluate it (``load_state_dict(...,
        strict=False)``)."""
        require_open("moving_average()", started=self._started, closed=self._released)
        return self._updater.moving_average()
