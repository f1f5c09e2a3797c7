"""A ps task whose process stays stopped is replaced: the launcher kills it and a new process
(a warm spare) serves its shard, instead of every worker waiting until someone resumes it
(a mixin of :class:`~tensorfleet.launch.supervisor.ClusterSupervisor`).

What. On the local backend the supervising loop reads the state of every running ps task's
process from ``/proc/<pid>/stat`` every :data:`POLL_S`. A ps seen stopped (state ``T``: a
``SIGSTOP``, or a job-control stop such as ``SIGTSTP``) at every look for ``after_s``
seconds gets ``SIGKILL`` on its process group and is restarted as any ps killed by a signal
is: its identity goes to a warm spare ps when one waits, the chief restores the shard from
the newest checkpoint, and with the ps update log (``--ps-update-log``, on by default) the
restored shard replays every update the stopped process acknowledged, so nothing is lost.
The line that says so names the process, how long it was stopped, what the replacement loses
and the option.

The rule, and its invariant: **only a process that was not running is replaced.** A ps busy
with a long piece of work (a checkpoint of a large shard, a restore, a swap storm, a slow
disk) is running or waiting in the kernel (``R``, ``S``, ``D``), never ``T``; a ps under a
debugger is traced (``t``), not stopped, and is left to the user. ``SIGKILL`` ends a stopped
process at once, so the stopped process and its replacement never serve the shard together.

When (``--replace-stopped-ps``, default ``auto``):

* **with the update log, after** :data:`AFTER_WITH_LOG_S` (2 s): the replacement loses
  nothing, so there is no reason to wait;
* **without it, after** :data:`AFTER_WITHOUT_LOG_S` (30 s): the replacement trains again the
  steps since the newest checkpoint, so a short pause is waited out, but a ps stopped for
  good no longer holds every worker until their recovery deadline (300 s) fails them all;
* ``off`` (or ``0``): never; other backends (Ray) never: the launcher cannot see a remote
  process's state.

A replacement is a restart: it needs restarts to be allowed (the run is running, the restart
policy would restart a task killed by a signal); when they are not, the launcher says once
why it leaves the stopped ps alone. A ps replaced after it got to work (it served its shard)
is not counted toward the restart limit, as a preempted task that left cleanly is not: the
launcher killed it, it did not crash (a storm that stops the ps every half minute must not
use up its restarts); one stopped before it got to work is counted, so a process stopped
again at every start ends at the limit instead of being replaced forever.

Why. In the 10-minute fault storms of ``benchmarks/chaos.py`` (a fault every 10 s, a
``SIGSTOP`` lasting 15 s), every worker recovery slower than 1.5 s came inside a stop of the
ps: one process holds each shard, so no worker trains while it is stopped. Without the update
log the cost of replacing it is steps trained again, hence the longer default there.

The alternative: a liveness heartbeat from the ps's loop would catch hangs of every kind (a
deadlock too), but cannot tell a hung loop from a long legitimate piece of work without the ps
reporting its own progress through every such piece; a false positive without the update log
throws away the shard's steps since its checkpoint. The process state has no false positive.
"""

from __future__ import annotations

import signal
from functools import cached_property
from typing import TYPE_CHECKING

from tensorfleet import environment
from tensorfleet.errors import LaunchConfigError

if TYPE_CHECKING:
    from tensorfleet.launch.backends.base import Backend
    from tensorfleet.launch.output import Output
    from tensorfleet.launch.restart_policy import RestartDecision
    from tensorfleet.launch.task import Task

#: Seconds between two looks at the ps tasks' process states.
POLL_S = 0.25
#: ``auto`` with the ps update log: a stopped ps is replaced after this many seconds.
AFTER_WITH_LOG_S = 2.0
#: ``auto`` without the update log: the replacement trains the steps since the newest
#: checkpoint again, so a stop is waited out this long first.
AFTER_WITHOUT_LOG_S = 30.0
#: The choice that picks one of the two above.
AUTO = "auto"
#: The process state of a process stopped by a signal (``/proc/<pid>/stat``).
STOPPED = "T"
#: The launcher's option, named in messages.
FLAG = "--replace-stopped-ps"


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``D``, ``T``, ``t``, ``Z``, ...),
    read from ``/proc/<pid>/stat``; None when it cannot be read (the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses, so take the last ")".
    end = stat.rfind(b")")
    if end < 0 or end + 2 >= len(stat):
        return None
    return chr(stat[end + 2])


def parse_after(value: str) -> float | str | None:
    """``--replace-stopped-ps``'s value: ``auto``, ``off`` (None) or seconds (``0``: off).
    Anything else is a :class:`~tensorfleet.errors.LaunchConfigError` naming it."""
    choice = value.strip().lower()
    if choice == AUTO:
        return AUTO
    if choice == "off":
        return None
    choices = (
        f"give auto (the default: {AFTER_WITH_LOG_S:g} s with the update log, "
        f"{AFTER_WITHOUT_LOG_S:g} s with --ps-update-log off), off (or 0), or seconds such as 5"
    )
    try:
        seconds = float(choice)
    except ValueError:
        seconds = float("nan")
    if seconds != seconds or seconds == float("inf"):
        raise LaunchConfigError(f"{FLAG} {value!r} is not a number of seconds: {choices}")
    if seconds < 0:
        raise LaunchConfigError(f"{FLAG} {value!r}: the seconds must be 0 or more; {choices}")
    return None if seconds == 0 else seconds


class StoppedPsReplacement:
    """Replaces ps tasks whose process stays stopped (mixed into ``ClusterSupervisor``,
    which provides the attributes below, ``task_environment``, ``_restarts_allowed`` and
    ``_decide_restart``)."""

    _tasks: list[Task]
    backend: Backend
    output: Output

    def _init_stopped_ps(self, after: float | str | None) -> None:
        """``after``: seconds a ps stays stopped before it is replaced, :data:`AUTO`, or None
        (never)."""
        if (
            after is not None
            and after != AUTO
            and not (isinstance(after, (int, float)) and 0 < after < float("inf"))
        ):
            raise LaunchConfigError(
                f"replace_stopped_ps={after!r}: give seconds > 0, {AUTO!r} or None (never)"
            )
        self._stopped_ps_choice = after
        #: task name -> (pid, when it was first seen stopped), for ps tasks stopped now.
        self._stopped_since: dict[str, tuple[int, float]] = {}
        #: pids left alone (restarts not allowed): said once each.
        self._stopped_left: set[int] = set()

    def stopped_ps_after(self) -> float | None:
        """Seconds after which a stopped ps is replaced in this run; None: never (the option
        is off, or the backend is not local, or there is no ps)."""
        return self._stopped_ps_plan[0]

    @cached_property
    def _stopped_ps_plan(self) -> tuple[float | None, bool]:
        """``(stopped_ps_after(), whether the ps tasks log their updates)``, worked out once
        from the choice, the backend and the first ps task's command and environment."""
        ps_tasks = [t for t in self._tasks if t.job == "ps"]
        choice = self._stopped_ps_choice
        if choice is None or not ps_tasks or self.backend.name != "local":
            return None, False
        log_on = self._update_log_on(ps_tasks[0])
        if choice == AUTO:
            return (AFTER_WITH_LOG_S if log_on else AFTER_WITHOUT_LOG_S), log_on
        return float(choice), log_on

    def _update_log_on(self, task: Task) -> bool:
        """Whether ps ``task`` logs its updates: the launcher's ``--ps-update-log`` (the
        variable in its environment) or ``--update-log`` in its command."""
        variables = self.task_environment(task)  # type: ignore[attr-defined]
        if variables.get(environment.PS_UPDATE_LOG_VAR, "").strip():
            return True
        return any(a == "--update-log" or a.startswith("--update-log=") for a in task.command)

    def _stopped_ps_deadlines(self, now: float) -> list[float]:
        """When the supervising loop must look at the ps tasks' states next (none when
        nothing is watched)."""
        if self.stopped_ps_after() is None or not self._restarts_allowed():  # type: ignore[attr-defined]
            return []
        if not any(t.job == "ps" and t.running for t in self._tasks):
            return []
        return [now + POLL_S]

    def _replace_stopped_ps(self, now: float) -> None:
        """Look at every running ps task's process; kill those stopped for the set time."""
        after = self.stopped_ps_after()
        if after is None or not self._restarts_allowed():  # type: ignore[attr-defined]
            self._stopped_since.clear()
            return
        for task in self._tasks:
            if task.job != "ps" or not task.running or task.process is None:
                self._stopped_since.pop(task.name, None)
                continue
            pid = task.process.pid
            if process_state(pid) != STOPPED:
                self._stopped_since.pop(task.name, None)
                continue
            seen_pid, since = self._stopped_since.setdefault(task.name, (pid, now))
            if seen_pid != pid:  # a new process of the task, stopped too: count afresh
                self._stopped_since[task.name] = (pid, now)
                continue
            if now - since >= after and pid not in self._stopped_left:
                self._replace(task, now - since, after)

    def _replace(self, task: Task, stopped_s: float, after: float) -> None:
        assert task.process is not None
        pid = task.process.pid
        decision: RestartDecision = self._decide_restart(task, -signal.SIGKILL, replaced=True)  # type: ignore[attr-defined]
        if not decision.restart:
            self._stopped_left.add(pid)
            self.output.message(
                f"{task.name} (pid {pid}) has been stopped for {stopped_s:.1f} s; not "
                f"replacing it: the restart policy would not restart it "
                f"({decision.describe_count()}). It serves its shard again when resumed "
                "(SIGCONT)",
                "warning",
            )
            return
        loses = (
            "the update log replays every update it acknowledged: nothing is lost"
            if self._stopped_ps_plan[1]
            else "the steps since its newest checkpoint are trained again; the update log "
            "(--ps-update-log, on by default under tensorfleet launch) would keep them"
        )
        self.output.message(
            f"{task.name} (pid {pid}) has been stopped for {stopped_s:.1f} s (process state "
            f"T: SIGSTOP or a job-control stop): killing it so that a new process serves its "
            f"shard ({loses}; {FLAG} {after:g})",
            "warning",
        )
        task.replaced_because = f"was stopped for {stopped_s:.1f} s and killed by the launcher"
        self._stopped_since.pop(task.name, None)
        task.process.signal_group(signal.SIGKILL)
