"""When the launcher restarts a task that ended on its own, and after what back-off.

Clusters end tasks with signals: a preemption sends SIGTERM (then SIGKILL), the OOM killer
and ``kill -9`` send SIGKILL, a lost node is a SIGKILL by another name. None of these is the
task's fault, and tensorfleet recovers from each (a restarted worker rejoins at the current
global step; a restarted ps is restored from the newest checkpoint). A task that *exits* with
an error is different: a Python exception exits 1, a bad flag 2, and running the same command
again fails the same way, so the run should stop at once and show the traceback.

So the default policy (:data:`DEFAULT_POLICY`) is:

- a task killed by a signal (``Popen.returncode < 0``, or an exit status >= 128, which is how
  a shell or a wrapper reports a signal) is restarted, up to :data:`DEFAULT_SIGNAL_RESTARTS`
  times per task within a sliding window of :data:`DEFAULT_WINDOW_S` seconds; a task that is
  killed more often than that (a crash loop: the OOM killer at every start) stops the run;
- a task that exits with an error (1 to 127) is not restarted: the cluster stops and the
  report shows its last lines;
- a task that ran at least :data:`DEFAULT_CRASH_LOOP_S` seconds (``--crash-loop-seconds``)
  before it died is restarted at once: a preemption or a ``kill -9`` of a task that was
  training is no crash loop, and every second of back-off is a second the cluster trains
  without it;
- a task that died sooner after it started waits a back-off first: :data:`DEFAULT_BACKOFF_S`
  seconds, doubling with each quick death of the same task in a row (its *crash streak*; a
  run longer than the threshold ends it), up to :data:`DEFAULT_MAX_BACKOFF_S`. A task that
  fails at once (its port still held, a dependency not up) is not restarted in a tight loop.
  The restart limit counts every restart of a task that did not get to work, so a task that
  flaps forever, quickly or not, still stops the cluster with its last lines;
- a task killed by a signal **while it worked** (it left ``task_markers.SERVING``: a ps
  holding its variables, a worker past its first step) after a run of at least
  :data:`DEFAULT_CRASH_LOOP_S` seconds is restarted and *not counted* toward the limit
  (:data:`AT_WORK` in its history): it was taken from a run that worked, by a preemption, an
  operator or a failing machine, which a cluster that loses machines must ride out however
  often it comes. A fault storm of this project's chaos benchmark (a fault every 10 s on one
  of 4 tasks for 10 minutes) killed one worker 10 times in 390 s and, counted, ended the run;
  Kubernetes restarts such a pod forever. What still counts: deaths before the process got
  to work (a crash loop: the OOM killer at start, a missing library) and deaths sooner than
  the threshold after the start (a process that dies a few seconds into its work every
  time), so such a task still stops the run. ``--max-restarts N`` (uniform) counts every
  restart, as it always did;
- a worker that was **preempted and left cleanly** (it handled the SIGTERM: its last push
  applied, the chief's checkpoint written, the shards told, ``task_markers.LEFT`` left with
  its pid) is restarted at once and *not counted* either, however short its run: a crash
  loop cannot end that way (the OOM killer and a failing start kill, they do not preempt), so
  counting it protects against nothing. Measured reason: in the 10-minute storm of seed 5
  one worker used all 10 of its restarts, 6 of them clean preemptions of processes that had
  worked 10-29 s; one more fault would have stopped a run that was training.

Why 10 per hour rather than a lifetime count: preemptions arrive at a rate, not a total; a
run of several days may be preempted more than 10 times, while a task killed 10 times in one
hour is crash-looping. The alternative, Kubernetes' "always restart with a capped back-off",
never gives up on a crash loop; the alternative of torchelastic and Ray (no restarts unless
asked) ends a preemptible run at its first preemption.

Every limit can be changed (``tensorfleet launch --signal-restarts N --error-restarts N
--restart-window S``); ``--max-restarts N``, from before this policy, restarts every failure,
signal or error, up to N times per task over the whole run (:meth:`RestartPolicy.uniform`).

A restarted task gets ``TENSORFLEET_PREDECESSOR_DEAD=1`` in its environment: the launcher
reaped the previous process and killed its process group, so the parameter servers may let
the new process take over the task's identity at once instead of waiting for the heartbeat
timeout.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from tensorfleet import environment
from tensorfleet.errors import LaunchConfigError

#: Set to "1" in the environment of a restarted task: its predecessor is known dead.
PREDECESSOR_DEAD_VAR = environment.PREDECESSOR_DEAD_VAR

#: Restarts of one task killed by signals, within :data:`DEFAULT_WINDOW_S`.
DEFAULT_SIGNAL_RESTARTS = 10
#: Restarts of one task that exited with an error: none, the run stops with a report.
DEFAULT_ERROR_RESTARTS = 0
#: The sliding window in which restarts are counted, in seconds.
DEFAULT_WINDOW_S = 3600.0
#: Seconds before the first restart of a task; doubles with each further one in the window.
DEFAULT_BACKOFF_S = 1.0
#: The longest back-off before a restart, in seconds.
DEFAULT_MAX_BACKOFF_S = 10.0
#: A task that ran at least this many seconds before it died is restarted without back-off;
#: one that died sooner is treated as a crash loop (back-off doubling per quick death).
DEFAULT_CRASH_LOOP_S = 30.0

#: The two kinds of failure the policy tells apart.
SIGNAL = "signal"
ERROR = "error"
#: In a task's restart history: a signal death of a process that worked at least
#: ``crash_loop_s`` (not counted toward the limit, see the module docstring).
AT_WORK = "signal at work"
#: The ``tensorfleet launch`` option that sets the limit for each kind of failure
#: (``--max-restarts`` sets both).
LIMIT_FLAGS = {SIGNAL: "--signal-restarts", ERROR: "--error-restarts"}


def failure_kind(returncode: int) -> str | None:
    """:data:`SIGNAL`, :data:`ERROR`, or None (exit 0) for a ``Popen.returncode``.

    Negative: killed by that signal. 128 and above: an exit status that reports a signal
    (``sh -c`` and most wrappers exit 128 + n when their child was killed by signal n).
    """
    if returncode == 0:
        return None
    if returncode < 0 or returncode >= 128:
        return SIGNAL
    return ERROR


def describe_returncode(returncode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL"``, from a ``Popen.returncode``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    return f"signal {signal_name(-returncode)}"


def exit_status(returncode: int) -> int:
    """A shell-style exit status for a ``Popen.returncode``: the code, or 128 + signal."""
    return returncode if returncode >= 0 else 128 - returncode


def signal_name(signum: int) -> str:
    """``"SIGKILL"`` for 9; ``"signal 99"`` for a number that names no signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass(frozen=True)
class RestartDecision:
    """What the policy says about one failure: restart after ``delay_s``, or not."""

    restart: bool
    #: The kind of the failure (:data:`SIGNAL` or :data:`ERROR`).
    kind: str
    #: Restarts of this kind already counted in the window, before this failure.
    used: int
    #: The limit for this kind.
    limit: int
    #: Back-off before the restart, in seconds (0 when not restarting, or restarting at once).
    delay_s: float = 0.0
    #: How long the process that died ran, in seconds (None: not known to the policy).
    ran_s: float | None = None
    #: Whether the death counts as a crash loop's: it came less than the policy's
    #: ``crash_loop_s`` after the process started (or its run time is not known).
    crash_loop: bool = True
    #: The crash-loop threshold of the policy that decided, in seconds.
    crash_loop_s: float = DEFAULT_CRASH_LOOP_S
    #: The process got to work before it died (``task_markers.SERVING``): no crash loop.
    served: bool = False
    #: Whether this restart counts toward the limit (False: a signal death of a process that
    #: worked at least ``crash_loop_s``, or that was preempted and left cleanly; recorded as
    #: :data:`AT_WORK` in the history).
    counted: bool = True
    #: The process was preempted and left cleanly (``task_markers.LEFT`` with its pid).
    left: bool = False
    #: The launcher killed the process, which had got to work, because it stayed stopped
    #: (:mod:`tensorfleet.launch.stopped_ps`): not counted, as ``left``.
    replaced: bool = False

    def describe_count(self) -> str:
        """Where this restart stands against the limit, for the launcher's restart lines:
        ``"restart 2 of 10"``, or for one not counted ``"not counted: it worked 41.3 s;
        1 of 10 used"``."""
        if self.counted:
            return f"restart {self.used + 1} of {self.limit}"
        if self.left:
            return (
                f"not counted: preempted, it left cleanly after {self.ran_s or 0.0:.1f} s; "
                f"{self.used} of {self.limit} used"
            )
        if self.replaced:
            return (
                f"not counted: the launcher replaced it, stopped after it got to work; "
                f"{self.used} of {self.limit} used"
            )
        return f"not counted: it worked {self.ran_s or 0.0:.1f} s; {self.used} of {self.limit} used"

    @property
    def history_kind(self) -> str:
        """The kind this restart is recorded as in the task's restart history."""
        return self.kind if self.counted else AT_WORK

    def describe_wait(self) -> str:
        """Why the restart waits as long as it does, for the launcher's restart line:
        ``"at once (it ran 84.2 s, at least the crash-loop threshold of 30 s)"`` or
        ``"in 2 s (crash-loop back-off: it ran 3.1 s, under 30 s)"``."""
        if self.left:
            return "at once (preempted: no crash loop)"
        if not self.crash_loop and self.served and (self.ran_s or 0.0) < self.crash_loop_s:
            return (
                f"at once (it ran {self.ran_s or 0.0:.1f} s, under the crash-loop threshold of "
                f"{self.crash_loop_s:g} s, but got to work first: no crash loop)"
            )
        if not self.crash_loop:
            return (
                f"at once (it ran {self.ran_s:.1f} s, at least the crash-loop threshold of "
                f"{self.crash_loop_s:g} s)"
            )
        ran = (
            ""
            if self.ran_s is None
            # rounded down: 29.97 s reads 29.9, not a confusing "30.0 s, under 30 s"
            else f": it ran {math.floor(self.ran_s * 10) / 10:.1f} s, under {self.crash_loop_s:g} s"
        )
        return f"in {self.delay_s:g} s (crash-loop back-off{ran})"

    def describe_used(self) -> str:
        """``"restarts used: 1 of 1"``, and, once the limit is reached, the option that sets
        it: ``", all that --error-restarts / --max-restarts allow"``."""
        text = f"restarts used: {self.used} of {self.limit}"
        if self.used >= self.limit:
            text += f", all that {LIMIT_FLAGS[self.kind]} / --max-restarts allow"
        return text


@dataclass(frozen=True)
class RestartPolicy:
    """How many times a task that ended on its own is restarted in place, and when.

    Args:
        signal_restarts: restarts per task after it was killed by a signal (SIGKILL,
            SIGTERM, the OOM killer; exit status >= 128), counted within ``window_s``.
        error_restarts: restarts per task after it exited with an error (1 to 127),
            counted within ``window_s``; 0 stops the run at the first one.
        window_s: the sliding window in which restarts are counted, in seconds; None counts
            them over the whole run.
        backoff_s: seconds before the first restart of a task that died quickly (a crash
            loop); doubled for each quick death of it in a row.
        max_backoff_s: the longest back-off.
        crash_loop_s: a task whose process ran at least this many seconds before it died is
            restarted at once, without back-off (``--crash-loop-seconds``; 0 never backs
            off); one that died sooner waits the back-off.
        count_work: count toward ``signal_restarts`` also the signal deaths of processes
            that got to work and ran at least ``crash_loop_s`` (False by default: those are
            restarted whatever the count; True in :meth:`uniform`, ``--max-restarts``).

    Raises :class:`~tensorfleet.errors.LaunchConfigError` (a ``ValueError``) for a negative limit or a window or
    back-off that is not positive, naming the value and the flag that sets it.
    """

    signal_restarts: int = DEFAULT_SIGNAL_RESTARTS
    error_restarts: int = DEFAULT_ERROR_RESTARTS
    window_s: float | None = DEFAULT_WINDOW_S
    backoff_s: float = DEFAULT_BACKOFF_S
    max_backoff_s: float = DEFAULT_MAX_BACKOFF_S
    crash_loop_s: float = DEFAULT_CRASH_LOOP_S
    count_work: bool = False

    def __post_init__(self) -> None:
        for name, flag in (
            ("signal_restarts", "--signal-restarts"),
            ("error_restarts", "--error-restarts"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LaunchConfigError(
                    f"{name} must be an integer >= 0, got {value!r} ({flag}): the number of "
                    "times a task is restarted in place; 0 never restarts it"
                )
        if self.window_s is not None and not self.window_s > 0:
            raise LaunchConfigError(
                f"the restart window must be > 0 seconds, got {self.window_s} "
                "(--restart-window; 0 on the command line counts restarts over the whole run)"
            )
        if not self.backoff_s > 0 or not self.max_backoff_s >= self.backoff_s:
            raise LaunchConfigError(
                f"the restart back-off must satisfy 0 < backoff_s <= max_backoff_s, got "
                f"backoff_s={self.backoff_s}, max_backoff_s={self.max_backoff_s}"
            )
        if not self.crash_loop_s >= 0:
            raise LaunchConfigError(
                f"the crash-loop threshold must be >= 0 seconds, got {self.crash_loop_s} "
                "(--crash-loop-seconds: a task that ran at least this long before it died is "
                "restarted at once; 0 never backs off)"
            )

    @classmethod
    def uniform(cls, max_restarts: int) -> RestartPolicy:
        """Every failure, signal or error, restarted up to ``max_restarts`` times per task
        over the whole run: what ``max_restarts=N`` / ``--max-restarts N`` always meant."""
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise LaunchConfigError(
                f"max_restarts must be >= 0, got {max_restarts!r}: the number of times a "
                "failed task is restarted (0: a failure stops the cluster)"
            )
        return cls(
            signal_restarts=max_restarts,
            error_restarts=max_restarts,
            window_s=None,
            count_work=True,
        )

    @classmethod
    def never(cls) -> RestartPolicy:
        """No restarts: the first task that ends on its own with a failure stops the run."""
        return cls(signal_restarts=0, error_restarts=0)

    def limit(self, kind: str) -> int:
        """The restart limit for failures of ``kind``."""
        return self.signal_restarts if kind == SIGNAL else self.error_restarts

    def decide(
        self,
        returncode: int,
        history: Sequence[tuple[float, str]],
        now: float,
        ran_s: float | None = None,
        streak: int | None = None,
        served: bool = False,
        left: bool = False,
        replaced: bool = False,
    ) -> RestartDecision:
        """Whether a task that just ended with ``returncode`` (not 0) is restarted, and after
        how long.

        ``history`` holds ``(time, kind)`` of the task's earlier restarts (``time.monotonic``
        seconds); those older than the window do not count toward the limit. ``ran_s``: how
        long the process that died ran; at least ``crash_loop_s`` restarts it at once, less
        (or None: unknown) waits the back-off, doubled ``streak`` times (the quick deaths of
        the task in a row before this one; None: every restart in the window). ``served``:
        the process got to work before it died (a ps serving its variables, a worker past
        its first step: ``task_markers.SERVING``), so it is no crash loop however short its
        run, and is restarted at once; a signal death after it worked at least
        ``crash_loop_s`` is restarted whatever the limit and not counted (unless
        ``count_work``: the decision's ``counted``). ``left``: the process was preempted and
        left cleanly (``task_markers.LEFT``), so it is restarted at once and not counted
        either (unless ``count_work``). Entries of kind :data:`AT_WORK` in ``history`` do not
        count toward the limit. ``replaced``: the launcher itself killed the process because it
        stayed stopped (:mod:`tensorfleet.launch.stopped_ps`); one that had got to work
        (``served``) is no crash loop, restarted at once and not counted (unless
        ``count_work``), as a clean leave; one that had not is counted as any kill, so a
        process that is stopped again at every start ends at the limit.
        """
        kind = failure_kind(returncode)
        if kind is None:
            raise LaunchConfigError("exit 0 is not a failure; nothing to decide")
        recent = [k for t, k in history if self.window_s is None or now - t < self.window_s]
        used = sum(1 for k in recent if k == kind)
        limit = self.limit(kind)
        left = left and kind == SIGNAL  # a clean leave ends in 143, a signal's status
        replaced = replaced and kind == SIGNAL and served
        crash_loop = not served and not left and (ran_s is None or ran_s < self.crash_loop_s)
        worked = served and ran_s is not None and ran_s >= self.crash_loop_s
        counted = not (kind == SIGNAL and (worked or left or replaced) and not self.count_work)
        facts = {
            "ran_s": ran_s,
            "crash_loop": crash_loop,
            "crash_loop_s": self.crash_loop_s,
            "served": served,
            "counted": counted,
            "left": left,
            "replaced": replaced,
        }
        if used >= limit and counted:
            return RestartDecision(False, kind, used, limit, **facts)
        if not crash_loop:
            return RestartDecision(True, kind, used, limit, 0.0, **facts)
        doublings = len(recent) if streak is None else streak
        delay = min(self.backoff_s * 2 ** min(doublings, 32), self.max_backoff_s)
        return RestartDecision(True, kind, used, limit, delay, **facts)

    def describe(self) -> str:
        """One sentence for the launcher's first message."""
        window = (
            "over the whole run" if self.window_s is None else f"per {_duration(self.window_s)}"
        )
        back_off = (
            f"at once after a run of {self.crash_loop_s:g} s or more, else back-off "
            f"{self.backoff_s:g} s doubling to {self.max_backoff_s:g} s"
        )
        if self.signal_restarts == self.error_restarts:
            if self.signal_restarts == 0:
                return "a task that fails stops the cluster"
            return (
                f"a failed task is restarted up to {self.signal_restarts} time(s) {window} "
                f"({back_off})"
            )
        signals = (
            f"a task killed by a signal is run again up to {self.signal_restarts} time(s) "
            f"{window} ({back_off})"
            if self.signal_restarts
            else "a task killed by a signal stops the cluster"
        )
        errors = (
            f"a task that exits with a code from 1 to 127 is run again up to "
            f"{self.error_restarts} time(s) {window}"
            if self.error_restarts
            else "a task that exits with a code from 1 to 127 stops the cluster"
        )
        return f"{signals}; {errors}"


def _duration(seconds: float) -> str:
    if seconds % 3600 == 0:
        hours = int(seconds // 3600)
        return "hour" if hours == 1 else f"{hours} hours"
    if seconds % 60 == 0:
        return f"{int(seconds // 60)} min"
    return f"{seconds:g} s"


#: What ``tensorfleet launch`` and a cluster created without a policy use.
DEFAULT_POLICY = RestartPolicy()
