"""A chief-only hook that records training curves: TensorBoard events and ``metrics.jsonl``.

Every time the global step crosses a multiple of ``every_n_steps``, the chief writes one
point at that global step with:

* ``loss``: the mean of the chief's own losses since the previous point (the chief sees
  only its batches; a mean over many steps is a fair sample of the cluster's);
* each tag of ``metrics(result)`` (e.g. batch accuracy from ``result.aux``), averaged the
  same way;
* ``global_steps_per_sec``: the global-step delta over the wall time since the previous
  point, i.e. the whole cluster's throughput;
* from the parameter servers (one ``cluster_stats()`` call per point, not per step):
  ``dropped_gradients``, the sync-mode gradients that came too late, counted on ps shard 0
  (where sync steps are decided), ``max_staleness``, the largest staleness gap applied
  (async mode with ``max_staleness``), over all shards, and ``stale_pushes_dropped``, the
  async pushes dropped as computed on values too old (``max_gradient_age``,
  :mod:`tensorfleet.ps.gradient_age`), the most any shard dropped (each shard judges its
  part of a push). Absent without parameter servers.

Crossing, not equality: other workers advance the global step too, so between two of the
chief's steps it may jump past a multiple. ``end()`` writes a last point, so the curve
reaches the final step. Read the curves with ``tensorboard --logdir LOGDIR`` or
``tensorfleet plot LOGDIR``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tensorfleet.errors import ConfigError, ConfigTypeError, UsageError
from tensorfleet.session.hooks import Hook, StepResult
from tensorfleet.summaries.summary_writer import SummaryWriter

if TYPE_CHECKING:
    from tensorfleet.session.training_session import TrainingSession

#: Tags the hook writes itself; ``metrics`` may not use them.
BUILTIN_TAGS = frozenset(
    {
        "loss",
        "global_steps_per_sec",
        "dropped_gradients",
        "max_staleness",
        "stale_pushes_dropped",
    }
)


class SummaryHook(Hook):
    """Write averaged training scalars to ``logdir`` every ``every_n_steps`` global steps.

    ``metrics(result)`` returns extra scalars for one step (tag -> number), e.g.::

        def batch_accuracy(result):
            logits, labels = result.aux
            return {"accuracy": (logits.argmax(1) == labels).float().mean().item()}

        hooks = [SummaryHook("runs/cnn", every_n_steps=100, metrics=batch_accuracy)]

    ``clock`` (seconds, monotonic) is for tests.
    """

    chief_only = True

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        every_n_steps: int = 100,
        metrics: Callable[[StepResult], Mapping[str, float]] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
            raise ConfigTypeError(f"every_n_steps must be an int, got {every_n_steps!r}")
        if every_n_steps <= 0:
            raise ConfigError(f"every_n_steps must be positive, got {every_n_steps}")
        if metrics is not None and not callable(metrics):
            raise ConfigTypeError(
                f"metrics must be a function of the StepResult, got {type(metrics).__name__}"
            )
        self.logdir = Path(logdir)
        self.every_n_steps = every_n_steps
        self.metrics = metrics
        self._clock = clock
        self._writer: SummaryWriter | None = None
        self._last_step = 0
        self._last_time = 0.0
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def begin(self, session: TrainingSession) -> None:
        self._writer = SummaryWriter(self.logdir)
        self._last_step = session.global_step
        self._last_time = self._clock()
        self._sums.clear()
        self._counts.clear()

    def after_step(self, session: TrainingSession, result: StepResult) -> None:
        if self._writer is None:
            raise UsageError("SummaryHook.after_step() before begin(): the session calls begin")
        self._add("loss", result.loss)
        if self.metrics is not None:
            extra = self.metrics(result)
            clash = BUILTIN_TAGS & extra.keys()
            if clash:
                raise ConfigError(
                    f"metrics returned tag(s) {sorted(clash)}, which SummaryHook writes itself; "
                    "rename them"
                )
            for tag, value in extra.items():
                try:
                    self._add(tag, float(value))
                except (TypeError, ValueError) as exc:
                    raise ConfigTypeError(
                        f"metrics returned {value!r} for {tag!r}; give a number "
                        "(e.g. tensor.item())"
                    ) from exc
        n = self.every_n_steps
        if result.global_step // n > self._last_step // n:
            self._write(session, result.global_step)

    def end(self, session: TrainingSession) -> None:
        if self._writer is None:
            return
        try:
            if self._counts:
                self._write(session, max(session.global_step, self._last_step))
        finally:
            self._writer.close()
            self._writer = None

    def _add(self, tag: str, value: float) -> None:
        self._sums[tag] = self._sums.get(tag, 0.0) + value
        self._counts[tag] = self._counts.get(tag, 0) + 1

    def _write(self, session: TrainingSession, global_step: int) -> None:
        assert self._writer is not None
        values = {tag: self._sums[tag] / self._counts[tag] for tag in self._sums}
        now = self._clock()
        if now > self._last_time:
            values["global_steps_per_sec"] = (global_step - self._last_step) / (
                now - self._last_time
            )
        stats = session.cluster_stats()
        if stats:
            dropped = stats[0].get("dropped")
            if isinstance(dropped, Mapping):
                values["dropped_gradients"] = float(sum(dropped.values()))
            seen = [
                s["max_staleness_seen"] for s in stats if s.get("max_staleness_seen") is not None
            ]
            if seen:
                values["max_staleness"] = float(max(seen))
            ages = [s["gradient_age"] for s in stats if isinstance(s.get("gradient_age"), Mapping)]
            if ages:
                values["stale_pushes_dropped"] = float(max(a.get("dropped", 0) for a in ages))
        self._writer.scalars(global_step, values)
        self._last_step = global_step
        self._last_time = now
        self._sums.clear()
        self._counts.clear()
