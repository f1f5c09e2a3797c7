"""Warm spare workers: a worker process started ahead of time that takes over the identity of
a worker that dies, for :class:`~tensorfleet.launch.supervisor.ClusterSupervisor` (a mixin).

Why. A worker killed during training was back at its next step 24 s after its restart began
on the shared test machine: the interpreter, ``import torch``, the data, the model, then its
hello and first pull. All but the last two can be done before anyone dies. So the launcher
keeps ``spares`` processes of the worker command waiting: each runs the user's script up to
:func:`tensorfleet.resolve_task`, which blocks reading a named pipe
(:mod:`tensorfleet.cluster.warm_spare`); when a worker is restarted, its identity (every
variable it was started with, ``TENSORFLEET_PREDECESSOR_DEAD=1`` included) goes down the pipe
of a spare, which becomes that worker, and a new spare is started behind it.

Rules.

- Only the local backend, and only workers: a ps task runs another command (the built-in
  server) and is restored from a checkpoint whatever starts it.
- A spare is not a task: it is not in ``tasks``, ``pids`` or the run's status, and has no
  output prefix. Its lines before the handover are kept (the last ``history``) and shown under
  the task's prefix once it becomes one (or in the warning if it dies unused); the line that
  says it waits (:data:`~tensorfleet.cluster.warm_spare.READY_LINE`) is not shown.
- A restart uses a spare when one is there and the command has shown that it waits in
  ``resolve_task`` (this spare, or an earlier one of this run, printed the ready line): a
  script that never calls ``resolve_task`` would otherwise train without an identity. The
  restart's back-off is the policy's (none after a long run, a crash loop's otherwise).
- A spare that ends unused is replaced when it had said that it waits (its wait passed,
  someone killed it); otherwise (the command failed as a spare: a bad flag, no
  ``resolve_task``, killed while it started) spares are off for the run, with a warning and
  its lines (a message, not a warning: the run goes on): a spare that cannot start must not
  be started again and again;
  so they are when no spare of the run said it waits within :data:`SPARE_READY_S`.
- Spares are killed (SIGKILL: they hold nothing) as soon as the run is no longer running
  (draining, failing, stopping) and in the final sweep: nothing is left running. A spare
  whose launcher dies exits by itself (the pipe's end, the launcher's pid gone).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tensorfleet import environment
from tensorfleet.cluster.warm_spare import READY_LINE
from tensorfleet.errors import LaunchError
from tensorfleet.launch.backends.process_group import READER_DRAIN_TIMEOUT
from tensorfleet.launch.restart_policy import describe_returncode
from tensorfleet.launch.task import Task

if TYPE_CHECKING:
    from tensorfleet.launch.backends.base import Backend, TaskProcess
    from tensorfleet.launch.output import Output
    from tensorfleet.task_markers import TaskMarkers

#: Warm spares of ``tensorfleet launch`` on the local backend (``--spares``).
DEFAULT_SPARES = 1
#: Seconds a spare waits unused before it exits and a fresh one replaces it.
DEFAULT_SPARE_WAIT_S = 3600.0
#: Seconds the first spare of a run gets to say that it waits in ``resolve_task``; one that
#: has not by then runs a script that does not call it (or an older tensorfleet), and would
#: otherwise go on running as something else: spares are turned off.
SPARE_READY_S = 120.0


@dataclass(eq=False)
class Spare:
    """One warm spare process and what the launcher knows about it."""

    number: int
    pipe: Path
    #: The launcher's end of the pipe (read and write, so that the pipe exists while the
    #: spare opens it, and keeps what is written until the spare reads it).
    fd: int
    history: int
    process: TaskProcess | None = None
    started_at: float = 0.0
    #: The spare printed that it waits in ``resolve_task``.
    ready: bool = False
    #: The task it became; None while it waits.
    task: Task | None = None
    #: Its lines before the handover (the last ``history``).
    lines: deque[str] = field(default_factory=deque)
    #: The ``recent`` deque of the task it became (its lines after the handover).
    recent: deque[str] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.lines = deque(maxlen=self.history)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def close_pipe(self) -> None:
        """Close the launcher's end and remove the pipe (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.pipe.unlink(missing_ok=True)


class WarmSpares:
    """Keeps warm spare workers and hands a restarted worker's identity to one (mixed into
    ``ClusterSupervisor``, which provides the attributes below, ``task_variables``,
    ``_restarts_allowed`` and ``_on_exit``)."""

    _tasks: list[Task]
    _events: queue.SimpleQueue[tuple[str, object]]
    _cwd: str | None
    _env: dict[str, str]
    _task_env: dict[str, dict[str, str]]
    _markers: TaskMarkers
    backend: Backend
    output: Output
    #: How many warm spares the run keeps (0: none).
    spares: int
    spare_wait_s: float

    def _init_spares(self, spares: int, spare_wait_s: float, history: int) -> None:
        """Check the options; called by the supervisor's constructor."""
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise LaunchError(
                f"spares must be an integer >= 0, got {spares!r} (--spares): the worker "
                "processes kept waiting to take over a worker that dies; 0 keeps none"
            )
        if spares and self.backend.name != "local":
            raise LaunchError(
                f"warm spares need the local backend, got --backend {self.backend.name} with "
                f"--spares {spares}; pass --spares 0"
            )
        if not spare_wait_s > 0:
            raise LaunchError(
                f"spare_wait_s must be > 0 seconds, got {spare_wait_s:g}: how long a warm "
                "spare waits unused before a fresh one replaces it"
            )
        self.spares = spares
        self.spare_wait_s = float(spare_wait_s)
        self._spare_history = history
        self._spare_pool: list[Spare] = []
        self._spares_adopted: list[Spare] = []
        self._spares_made = 0
        self._spares_open = spares > 0
        #: Some spare of this run printed the ready line: the command waits in resolve_task.
        self._spare_command_waits = False
        #: Notified when a spare says that it waits (for :meth:`wait_spare_ready`).
        self._spare_ready = threading.Condition()

    # ------------------------------------------------------------------ the pool

    def _fill_spares(self) -> None:
        """Start spares until the pool holds ``spares`` (while spares are open)."""
        while self._spares_open and len(self._spare_pool) < self.spares:
            if not self._start_spare():
                return

    def _start_spare(self) -> bool:
        """Start one spare; False (and spares off, with a warning) when it cannot be."""
        directory = self._markers.directory
        assert directory is not None, "spares need the run's directory (local backend)"
        self._spares_made += 1
        number = self._spares_made
        pipe = directory / f"spare-{number}.fifo"
        try:
            os.mkfifo(pipe, 0o600)
            fd = os.open(pipe, os.O_RDWR)
        except OSError as exc:
            self._close_spares(f"cannot create the pipe of a warm spare ({pipe}: {exc})")
            return False
        spare = Spare(number, pipe, fd, self._spare_history)
        worker = next(t for t in self._tasks if t.job == "worker")
        try:
            spare.process = self.backend.spawn(
                f"spare:{number}",
                worker.command,
                self._spare_variables(spare),
                self._cwd,
                lambda text: self._on_spare_line(spare, text),
                lambda: self._events.put(("spare-exit", spare)),
            )
        except OSError as exc:
            spare.close_pipe()
            self._close_spares(f"cannot start a warm spare with {worker.command!r}: {exc}")
            return False
        spare.started_at = time.monotonic()
        self._spare_pool.append(spare)
        self.output.message(f"started warm spare {number} for the workers as pid {spare.pid}")
        return True

    def _spare_variables(self, spare: Spare) -> dict[str, str]:
        """A spare's variables: the run's, those every worker shares (threads), and where it
        waits; no identity and no secret (those come down the pipe)."""
        variables = dict(self._env)
        workers = [self._task_env.get(t.name, {}) for t in self._tasks if t.job == "worker"]
        variables.update(
            {k: v for k, v in workers[0].items() if all(w.get(k) == v for w in workers)}
        )
        variables[environment.LAUNCHER_VAR] = "1"
        variables["PYTHONUNBUFFERED"] = "1"
        if self._markers.directory is not None:
            variables[environment.TASK_MARKERS_VAR] = str(self._markers.directory)
        variables[environment.SPARE_PIPE_VAR] = str(spare.pipe)
        variables[environment.SPARE_WAIT_VAR] = f"{self.spare_wait_s:g}"
        variables[environment.SPARE_LAUNCHER_VAR] = str(os.getpid())
        return variables

    def _on_spare_line(self, spare: Spare, text: str) -> None:
        """A line of a spare (from its reader thread): kept while it waits, the task's after."""
        with spare.lock:
            if spare.task is None:
                if text.startswith(READY_LINE):
                    with self._spare_ready:
                        spare.ready = True
                        self._spare_ready.notify_all()
                    return
                spare.lines.append(text)
                return
            assert spare.recent is not None
            spare.recent.append(text)
            name = spare.task.name
        self.output.line(name, text)

    # ------------------------------------------------------------------ the handover

    def _take_spare(self, task: Task, variables: dict[str, str]) -> Spare | None:
        """Hand ``task``'s identity (``variables``) to a waiting spare, which becomes its
        process; None when no spare can take it (the caller starts a new process)."""
        if task.job != "worker" or not self._spares_open:
            return None
        if any(s.ready for s in self._spare_pool):
            self._spare_command_waits = True  # the command waits in resolve_task
        usable = [s for s in self._spare_pool if s.ready or self._spare_command_waits]
        if not usable:
            return None
        spare = usable[0]
        self._spare_pool.remove(spare)
        message = json.dumps({"variables": variables}).encode() + b"\n"
        try:
            os.write(spare.fd, message)
        except OSError as exc:
            self.output.message(
                f"cannot hand {task.name} to warm spare {spare.number} (pid {spare.pid}): "
                f"{exc}; starting {task.name} afresh",
                "warning",
            )
            self._kill_spare(spare)
            return None
        assert spare.process is not None
        with spare.lock:
            spare.task, spare.recent = task, task.recent
            early = list(spare.lines)
        for text in early:  # what it printed while it waited, now under its task's prefix
            task.recent.append(text)
            self.output.line(task.name, text)
        task.process, task.started_at = spare.process, time.monotonic()
        self._spares_adopted.append(spare)
        self.output.task_started(task.name, spare.process.pid)
        self._fill_spares()
        return spare

    def _on_spare_exit(self, spare: Spare) -> None:
        """A spare's process ended: the task's exit when it had become one, else replace it
        (or turn spares off when the command cannot wait as a spare)."""
        if spare.task is not None:
            spare.close_pipe()  # read long ago: the process that read it has ended
            if spare.task.process is spare.process:
                self._on_exit(spare.task)
            return
        if spare not in self._spare_pool:
            return  # killed by the launcher: spares closed, or a failed handover
        self._spare_pool.remove(spare)
        spare.close_pipe()
        assert spare.process is not None and spare.process.returncode is not None
        spare.process.finish_output(READER_DRAIN_TIMEOUT)
        rc = spare.process.returncode
        ran = time.monotonic() - spare.started_at
        lines = list(spare.lines)
        tail = "".join(f"\n    [spare {spare.number}] {line}" for line in lines)
        if not self._restarts_allowed():
            return
        if spare.ready:
            self.output.message(
                f"warm spare {spare.number} (pid {spare.pid}) ended unused "
                f"({describe_returncode(rc)} after {ran:.1f} s); starting another"
                + (f". Its last line: {lines[-1]}" if lines else ""),
                "info" if rc == 0 else "warning",
            )
            self._spare_command_waits = True
            self._fill_spares()
            return
        self._close_spares(
            f"warm spare {spare.number} (pid {spare.pid}) ended with "
            f"{describe_returncode(rc)} after {ran:.1f} s before it waited for an identity: "
            "the worker command must call tensorfleet.resolve_task() to run as a spare "
            f"(docs/launcher.md, 'Warm spares'); --spares 0 turns them off. Its last "
            f"{len(lines)} line(s):{tail}"
            if lines
            else f"warm spare {spare.number} (pid {spare.pid}) ended with "
            f"{describe_returncode(rc)} after {ran:.1f} s before it waited for an identity, "
            "printing nothing: the worker command must call tensorfleet.resolve_task() to "
            "run as a spare (docs/launcher.md, 'Warm spares'); --spares 0 turns them off"
        )

    def _spare_deadlines(self) -> list[float]:
        """When the waiting spares must have said that they wait (while no spare of the run
        has): deadlines the supervising loop wakes up for."""
        if self._spare_command_waits or not self._spares_open:
            return []
        return [s.started_at + SPARE_READY_S for s in self._spare_pool if not s.ready]

    def _on_spare_deadlines(self, now: float) -> None:
        """Turn spares off when a spare ran :data:`SPARE_READY_S` without saying that it
        waits in ``resolve_task`` (and no spare of the run ever did)."""
        if any(s.ready for s in self._spare_pool):
            self._spare_command_waits = True
        for spare in list(self._spare_pool):
            if self._spare_command_waits or not self._spares_open:
                return
            if not spare.ready and now >= spare.started_at + SPARE_READY_S:
                lines = list(spare.lines)
                last = f" Its last line: {lines[-1]}" if lines else " It printed nothing."
                self._close_spares(
                    f"warm spare {spare.number} (pid {spare.pid}) did not reach "
                    f"tensorfleet.resolve_task() within {SPARE_READY_S:g} s: the worker command "
                    "must call it (with this tensorfleet) to run as a spare (docs/launcher.md, "
                    f"'Warm spares'); --spares 0 turns them off.{last}"
                )

    # ------------------------------------------------------------------ the end

    def _close_spares(self, why: str | None = None) -> None:
        """No more spares this run: kill those waiting (SIGKILL: they hold nothing)."""
        if why is not None and self._spares_open:
            # info, not a warning: the run itself is fine, its restarts start afresh
            self.output.message(f"warm spares are off for this run: {why}")
        self._spares_open = False
        for spare in list(self._spare_pool):
            self._kill_spare(spare)

    def _kill_spare(self, spare: Spare) -> None:
        if spare in self._spare_pool:
            self._spare_pool.remove(spare)
        if spare.process is not None:
            spare.process.signal_group(signal.SIGKILL)
        spare.close_pipe()

    def _sweep_spares(self) -> None:
        """The final sweep: kill every spare still waiting and whatever the process groups
        of the adopted ones left, and close every pipe."""
        self._close_spares()
        for spare in self._spares_adopted:
            if spare.process is not None:
                spare.process.signal_group(signal.SIGKILL)
            spare.close_pipe()

    def wait_spare_ready(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds until a spare waits for an identity; its pid, or
        None when none did in time (for tests and drills that must kill a worker only once a
        spare can take it over). Safe from any thread."""

        def ready() -> Spare | None:
            return next((s for s in list(self._spare_pool) if s.ready), None)

        with self._spare_ready:
            spare = self._spare_ready.wait_for(ready, timeout)
        return None if spare is None else spare.pid

    @property
    def spare_pids(self) -> list[int]:
        """Process ids of the spares waiting now (not yet any task's)."""
        return [s.pid for s in self._spare_pool if s.pid is not None]
