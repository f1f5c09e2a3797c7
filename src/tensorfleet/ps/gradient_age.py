"""How old an asynchronous push's gradient is when it arrives, and the bound past which it is
dropped instead of applied.

A worker computes its gradient on the values it last received from the shard; every reply
carries the shard's ``version`` (the worker steps applied so far), and every push names the
version of the values its gradient was computed on (``based_on``). The push's **age** is
``version - based_on`` when it arrives: how many updates of other workers (and of this
worker's own prefetched step) the shard applied since those values left it. In plain
asynchronous training the age is about the number of workers; it is large only when a
worker stood still while the others trained: a process stopped mid-step (``SIGSTOP``, a
swapped-out or descheduled machine, a long pause of the garbage collector, a network
partition that healed) finishes its step on its return and pushes a gradient computed on
values hundreds of updates old, which async mode would apply like any other.

Rule. In ``async`` mode a push whose age is above the limit is **dropped**: not applied, not
counted as a step (the global step counts only applied updates), answered ``dropped`` with
the shard's current values, so the worker's next step starts from fresh values; the ps logs
a line naming the worker, the age and the limit (at most one per worker per 10 s, the next
saying how many it did not log). The limit (``max_gradient_age``, a
session option) is ``"auto"`` by default, :data:`AUTO_PER_WORKER` updates per worker of the
model and at least :data:`AUTO_MINIMUM` (64 for 1-4 workers: a step-time spread of 16x
between workers stays below it); an int sets it; ``"off"`` applies every push. A push
without ``based_on`` (a client of its own) and a push based on a version above the shard's
(values of a shard that was restored from a checkpoint since: its version went back) are
applied, their age counted as unknown or 0.

Invariant. No push older than the limit changes the shard; every push is counted once in
:meth:`GradientAge.stats` (its age in one of the power-of-two bins, or unknown), and every
drop in ``dropped`` and in the log.

Why drop rather than scale it down: the staleness-aware rules of the literature divide the
learning rate by the age (Zhang et al., 2016); at the ages this bound catches (hundreds of
updates, with a limit of at least 64) that keeps less than a sixtieth of the gradient, so
dropping loses almost nothing more, keeps the rule one comparison, and leaves the step
count equal to the updates applied. The alternative kept is ``off``: every push applied, as
TensorFlow's asynchronous training does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tensorfleet.errors import ConfigError, ProtocolError

log = logging.getLogger("tensorfleet.ps")

AUTO_PER_WORKER = 16
"""``"auto"``: the limit is this many updates per worker of the model ..."""
AUTO_MINIMUM = 64
"""... and at least this many."""
LOG_EVERY_S = 10.0
"""At most one line about a worker's dropped pushes per this many seconds."""
SETTINGS = ("auto", "off")
"""The words ``max_gradient_age`` takes beside a whole number >= 1."""


def check_setting(value: object, option: str = "max_gradient_age") -> None:
    """ConfigError unless ``value`` is ``"auto"``, ``"off"`` or an int >= 1 (naming ``option``,
    the value seen and the fix)."""
    if value in SETTINGS and isinstance(value, str):
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return
    raise ConfigError(
        f"{option} must be 'auto', 'off' or a whole number >= 1 (the most updates a pushed "
        f"gradient's values may be behind the shard), got {value!r}: leave it out for 'auto' "
        f"({AUTO_PER_WORKER} per worker, at least {AUTO_MINIMUM}), or give e.g. {option}=200"
    )


def resolve_limit(setting: int | str, workers: int) -> int | None:
    """The limit in updates for ``setting`` with ``workers`` workers (None: ``off``)."""
    check_setting(setting)
    if setting == "off":
        return None
    if setting == "auto":
        return max(AUTO_MINIMUM, AUTO_PER_WORKER * workers)
    assert isinstance(setting, int)
    return setting


def read_based_on(body: dict) -> int | None:
    """The push's ``based_on`` (None when absent); ProtocolError unless a whole number >= 0."""
    based_on = body.get("based_on")
    if based_on is None:
        return None
    if isinstance(based_on, bool) or not isinstance(based_on, int) or based_on < 0:
        raise ProtocolError(
            f"'based_on' must be the version of the values the gradient was computed on, a "
            f"whole number >= 0, got {based_on!r}"
        )
    return based_on


def age_bin(age: int) -> str:
    """The histogram bin of ``age``: ``"0"``, ``"1"``, ``"2-3"``, ``"4-7"``, ... (powers of 2)."""
    if age <= 1:
        return str(age)
    low = 1 << (age.bit_length() - 1)
    return f"{low}-{2 * low - 1}"


@dataclass
class GradientAge:
    """The ages of one shard's async pushes, and the rule that drops those above ``limit``."""

    limit: int | None
    """The most updates a push's values may be behind (None: no limit, ``off``)."""
    shard: str = "ps"
    bins: dict[str, int] = field(default_factory=dict)
    """Pushes per age bin (:func:`age_bin`), applied and dropped alike."""
    unknown: int = 0
    """Pushes that named no ``based_on``."""
    oldest_applied: int = 0
    dropped: int = 0
    dropped_by_worker: dict[str, int] = field(default_factory=dict)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    """Seconds, for the log's rate limit (a test gives its own)."""
    _logged_at: dict[str, float] = field(default_factory=dict, repr=False)
    _unlogged: dict[str, int] = field(default_factory=dict, repr=False)

    def admit(self, version: int, based_on: int | None, task: str) -> bool:
        """Count the push of ``task`` that arrives at the shard's ``version``, computed on
        values of version ``based_on``; False when it is too old to apply (logged)."""
        if based_on is None:
            self.unknown += 1
            return True
        age = max(0, version - based_on)
        key = age_bin(age)
        self.bins[key] = self.bins.get(key, 0) + 1
        if self.limit is not None and age > self.limit:
            self.dropped += 1
            self.dropped_by_worker[task] = self.dropped_by_worker.get(task, 0) + 1
            self._log_drop(task, age, based_on, version)
            return False
        self.oldest_applied = max(self.oldest_applied, age)
        return True

    def _log_drop(self, task: str, age: int, based_on: int, version: int) -> None:
        """One line per drop, but at most one per worker per :data:`LOG_EVERY_S` (a worker
        always too slow for the limit would fill the log): the next line says how many
        drops it did not log."""
        now = self.clock()
        if now - self._logged_at.get(task, -LOG_EVERY_S) < LOG_EVERY_S:
            self._unlogged[task] = self._unlogged.get(task, 0) + 1
            return
        self._logged_at[task] = now
        unlogged = self._unlogged.pop(task, 0)
        log.warning(
            "%s: dropped %s's push: its gradient was computed on values %d updates old "
            "(version %d, the shard is at %d), over max_gradient_age=%d; it is answered with "
            "the current values (the worker stood still while the others trained: stopped, "
            "paused or cut off)%s",
            self.shard,
            task,
            age,
            based_on,
            version,
            self.limit,
            f"; {unlogged} more of its pushes dropped since the last such line" if unlogged else "",
        )

    def summary(self) -> str:
        """The ages in a few words, for the shard's end-of-training line: the oldest push
        applied and the drops (by worker), or that none was dropped, and the limit."""
        limit = f"max_gradient_age={'off' if self.limit is None else self.limit}"
        if not self.dropped:
            return f"pushes up to {self.oldest_applied} updates old applied, none dropped ({limit})"
        by_worker = ", ".join(f"{t} {n}" for t, n in sorted(self.dropped_by_worker.items()))
        return (
            f"pushes up to {self.oldest_applied} updates old applied, {self.dropped} dropped as "
            f"older ({by_worker}; {limit})"
        )

    def stats(self) -> dict[str, object]:
        """What ``stats`` reports: the limit, the bins in increasing age, the unknown, the
        oldest applied, the drops in all and by worker."""
        ordered = sorted(self.bins.items(), key=lambda item: int(item[0].split("-")[0]))
        return {
            "limit": self.limit,
            "bins": dict(ordered),
            "unknown": self.unknown,
            "oldest_applied": self.oldest_applied,
            "dropped": self.dropped,
            "dropped_by_worker": dict(self.dropped_by_worker),
        }
