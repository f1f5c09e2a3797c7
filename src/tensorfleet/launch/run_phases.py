"""The phases of a stopping run and their deadlines: a mixin of
:class:`~tensorfleet.launch.supervisor.ClusterSupervisor`.

A run is ``running`` until every worker exited 0 (then ``draining``: the ps tasks are
expected to exit by themselves within ``grace_period``), a task failed for good (``failing``:
the others get ``grace_period``), or the launcher was interrupted. Each phase after
``running`` ends at a deadline (``_phase_deadline``), and the next one is harsher:
``terminating`` (SIGTERM sent; ``kill_timeout`` to exit), ``killing`` (SIGKILL sent;
``kill_timeout`` more), then the tasks still there are given up on (stuck in the kernel), so
the run always ends. An interrupt (the CLI's SIGINT/SIGTERM) jumps to ``terminating``, a
second one to ``killing``. Every step is said in one line naming the tasks and the signal.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from tensorfleet.launch.restart_policy import signal_name
from tensorfleet.launch.task import Task

if TYPE_CHECKING:
    from tensorfleet.launch.output import Output

#: Phases of a run. Each phase after RUNNING ends at a deadline (``_phase_deadline``).
RUNNING = "running"
DRAINING = "draining"  # every worker exited 0; the ps tasks are expected to exit
FAILING = "failing"  # a task failed; the others get the grace period
TERMINATING = "terminating"  # SIGTERM sent
KILLING = "killing"  # SIGKILL sent
DONE = "done"


class RunPhases:
    """Moves a stopping run to its next phase (mixed into ``ClusterSupervisor``, which
    provides the attributes below, ``_enter``, ``_signal_running`` and
    ``_skip_grace_period``)."""

    _tasks: list[Task]
    _phase: str
    _phase_deadline: float | None
    _interrupt: int | None
    _abandoned: bool
    grace_period: float
    kill_timeout: float
    output: Output

    if TYPE_CHECKING:

        def _enter(self, phase: str, seconds: float | None) -> None: ...
        def _signal_running(self, sig: int) -> list[Task]: ...
        def _skip_grace_period(self) -> bool: ...

    def _on_interrupt(self, signum: int) -> None:
        name = signal_name(signum)
        if self._interrupt is None:
            self._interrupt = signum
            if self._phase in (TERMINATING, KILLING):
                return
            self.output.message(
                f"received {name}: stopping every task (SIGTERM, SIGKILL after "
                f"{self.kill_timeout:g} s; {name} again kills them at once)",
                "warning",
            )
            self._signal_running(signal.SIGTERM)
            self._enter(TERMINATING, self.kill_timeout)
        else:
            self.output.message(f"received {name} again: killing every task now", "warning")
            self._signal_running(signal.SIGKILL)
            self._enter(KILLING, self.kill_timeout)

    def _on_deadline(self, now: float) -> None:
        """Move to the next phase when the current one's deadline has passed."""
        if self._phase == FAILING and self._skip_grace_period():
            self._phase_deadline = now  # the grace period is the workers'; none is left
        if self._phase_deadline is None or now < self._phase_deadline:
            return
        running = [t for t in self._tasks if t.running]
        if self._phase == DRAINING:
            for task in running:
                why = (
                    "a ps task should learn from the chief that training is over and exit by itself"
                    if task.job == "ps"
                    else "training was complete"
                )
                self.output.message(
                    f"{task.name} did not exit within {self.grace_period:g} s after "
                    f"{'all workers finished' if task.job == 'ps' else 'training was complete'}"
                    f"; stopping it with SIGTERM ({why})",
                    "warning",
                )
            self._signal_running(signal.SIGTERM)
            self._enter(TERMINATING, self.kill_timeout)
        elif self._phase == FAILING:
            if running:
                self.output.message(
                    f"stopping {', '.join(t.name for t in running)} with SIGTERM",
                    "warning",
                )
            self._signal_running(signal.SIGTERM)
            self._enter(TERMINATING, self.kill_timeout)
        elif self._phase == TERMINATING:
            for task in running:
                self.output.message(
                    f"{task.name} did not exit within {self.kill_timeout:g} s of SIGTERM; "
                    "killing it with SIGKILL",
                    "warning",
                )
            self._signal_running(signal.SIGKILL)
            self._enter(KILLING, self.kill_timeout)
        elif self._phase == KILLING:
            names = ", ".join(f"{t.name} (pid {t.pid})" for t in running)
            self.output.message(
                f"{names} did not exit within {self.kill_timeout:g} s of SIGKILL (stuck in the "
                "kernel?); giving up on them",
                "error",
            )
            self._abandoned = True
