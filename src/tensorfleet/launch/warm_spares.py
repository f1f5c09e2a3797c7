"""Warm spares: a worker (or ps) process started ahead of time that takes over the identity
of a worker (or ps task) that dies, for :class:`~tensorfleet.launch.supervisor.ClusterSupervisor`
(a mixin).

Why. A worker killed during training was back at its next step 24 s after its restart began
on the shared test machine: the interpreter, ``import torch``, the data, the model, then its
hello and first pull. All but the last two can be done before anyone dies. So the launcher
keeps ``spares`` processes of the worker command waiting: each runs the user's script up to
:func:`tensorfleet.resolve_task`, which blocks reading a named pipe
(:mod:`tensorfleet.cluster.warm_spare`); when a worker is restarted, its identity (every
variable it was started with, ``TENSORFLEET_PREDECESSOR_DEAD=1`` included) goes down the pipe
of a spare, which becomes that worker, and a new spare is started behind it.

Rules.

- Only the local backend. Workers (``spares``) and ps tasks (``ps_spares``) each have their
  own pool, started with their own command: a ps spare is the ps command (the built-in
  ``tensorfleet server``) past its imports (torch), waiting in
  :func:`~tensorfleet.launch.task_flags.resolve_server_task` before it listens; when a ps
  task dies its identity goes to it, it listens on the task's address, and the chief
  restores it from the checkpoint as it would a new process. On the 2-core test machine
  that takes the 3-10 s of a new ps process's start out of a ps's recovery.
- Spares start once the run is at work, not beside the tasks at launch: when the first task
  leaves ``task_markers.SERVING``, at the latest 30 s after the start
  (:mod:`tensorfleet.launch.spare_start`). A restart before then starts a new process.
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
from tensorfleet.launch.spare_start import SPARE_START_POLL_S, SpareStart
from tensorfleet.launch.task import Task

if TYPE_CHECKING:
    from tensorfleet.launch.backends.base import Backend, TaskProcess
    from tensorfleet.launch.output import Output
    from tensorfleet.task_markers import TaskMarkers

#: Warm spare workers of ``tensorfleet launch`` on the local backend (``--spares``).
DEFAULT_SPARES = 1
#: Warm spare ps processes of ``tensorfleet launch`` on the local backend (``--ps-spares``),
#: when the cluster has ps tasks.
DEFAULT_PS_SPARES = 1
#: The launcher's option for each job's spares, named in errors.
SPARE_FLAGS = {"worker": "--spares", "ps": "--ps-spares"}
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
    #: The job whose tasks it can take over: "worker" or "ps".
    job: str = "worker"
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

    @property
    def name(self) -> str:
        """Its number, after ``ps-`` for a ps spare (each job numbers its own from 1)."""
        return str(self.number) if self.job == "worker" else f"{self.job}-{self.number}"

    def close_pipe(self) -> None:
        """Close the launcher's end and remove the pipe (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.pipe.unlink(missing_ok=True)


class WarmSpares(SpareStart):
    """Keeps warm spares and hands a restarted task's identity to one of its job (mixed into
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
    #: How many warm spare workers the run keeps (0: none).
    spares: int
    #: How many warm spare ps processes the run keeps (0: none).
    ps_spares: int
    spare_wait_s: float

    def _init_spares(
        self, spares: int, spare_wait_s: float, history: int, ps_spares: int = 0
    ) -> None:
        """Check the options; called by the supervisor's constructor."""
        for job, count in (("worker", spares), ("ps", ps_spares)):
            flag = SPARE_FLAGS[job]
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise LaunchError(
                    f"{flag.lstrip('-').replace('-', '_')} must be an integer >= 0, got "
                    f"{count!r} ({flag}): the {job} processes kept waiting to take over a "
                    f"{job} task that dies; 0 keeps none"
                )
            if count and self.backend.name != "local":
                raise LaunchError(
                    f"warm spares need the local backend, got --backend {self.backend.name} "
                    f"with {flag} {count}; pass {flag} 0"
                )
        if not spare_wait_s > 0:
            raise LaunchError(
                f"spare_wait_s must be > 0 seconds, got {spare_wait_s:g}: how long a warm "
                "spare waits unused before a fresh one replaces it"
            )
        self.spares = spares
        self.ps_spares = ps_spares
        self.spare_wait_s = float(spare_wait_s)
        self._spare_history = history
        #: How many spares each job keeps (a job without tasks keeps none: see _fill_spares).
        self._spare_targets = {"worker": spares, "ps": ps_spares}
        self._spare_pool: list[Spare] = []
        self._spares_adopted: list[Spare] = []
        self._spares_made = {job: 0 for job in self._spare_targets}
        self._spares_open = {job: count > 0 for job, count in self._spare_targets.items()}
        #: Some spare of the job printed the ready line: its command waits in resolve_task.
        self._spare_command_waits = {job: False for job in self._spare_targets}
        #: Notified when a spare says that it waits (for :meth:`wait_spare_ready`).
        self._spare_ready = threading.Condition()
        self._init_spare_start()

    # ------------------------------------------------------------------ the pool

    def _fill_spares(self) -> None:
        """Start spares until each job's pool holds its count (once the run is at work:
        :mod:`tensorfleet.launch.spare_start`; while its spares are open; none for a job
        without tasks, e.g. ps spares in all-reduce training)."""
        if not self._spares_started:
            return
        for job, target in self._spare_targets.items():
            if not any(t.job == job for t in self._tasks):
                continue
            while self._spares_open[job] and self._waiting(job) < target:
                if not self._start_spare(job):
                    break

    def _waiting(self, job: str) -> int:
        return sum(1 for s in self._spare_pool if s.job == job)

    def _start_spare(self, job: str) -> bool:
        """Start one spare of ``job``; False (and its spares off, with a warning) when it
        cannot be."""
        directory = self._markers.directory
        assert directory is not None, "spares need the run's directory (local backend)"
        self._spares_made[job] += 1
        number = self._spares_made[job]
        spare = Spare(number, Path(), -1, self._spare_history, job=job)
        pipe = directory / f"spare-{spare.name}.fifo"
        try:
            os.mkfifo(pipe, 0o600)
            spare.pipe, spare.fd = pipe, os.open(pipe, os.O_RDWR)
        except OSError as exc:
            pipe.unlink(missing_ok=True)
            self._close_spares(f"cannot create the pipe of a warm spare ({pipe}: {exc})", job)
            return False
        model = next(t for t in self._tasks if t.job == job)
        try:
            spare.process = self.backend.spawn(
                f"spare:{spare.name}",
                model.command,
                self._spare_variables(spare),
                self._cwd,
                lambda text: self._on_spare_line(spare, text),
                lambda: self._events.put(("spare-exit", spare)),
            )
        except OSError as exc:
            spare.close_pipe()
            self._close_spares(f"cannot start a warm spare with {model.command!r}: {exc}", job)
            return False
        spare.started_at = time.monotonic()
        self._spare_pool.append(spare)
        jobs = "workers" if job == "worker" else f"{job} tasks"
        self.output.message(f"started warm spare {spare.name} for the {jobs} as pid {spare.pid}")
        return True

    def _spare_variables(self, spare: Spare) -> dict[str, str]:
        """A spare's variables: the run's, those every task of its job shares (threads), and
        where it waits; no identity and no secret (those come down the pipe)."""
        variables = dict(self._env)
        peers = [self._task_env.get(t.name, {}) for t in self._tasks if t.job == spare.job]
        variables.update({k: v for k, v in peers[0].items() if all(w.get(k) == v for w in peers)})
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
        """Hand ``task``'s identity (``variables``) to a waiting spare of its job, which
        becomes its process; None when no spare can take it (the caller starts a new
        process)."""
        job = task.job
        if not self._spares_open.get(job, False):
            return None
        pool = [s for s in self._spare_pool if s.job == job]
        if any(s.ready for s in pool):
            self._spare_command_waits[job] = True  # the command waits in resolve_task
        usable = [s for s in pool if s.ready or self._spare_command_waits[job]]
        if not usable:
            return None
        spare = usable[0]
        self._spare_pool.remove(spare)
        message = json.dumps({"variables": variables}).encode() + b"\n"
        try:
            os.write(spare.fd, message)
        except OSError as exc:
            self.output.message(
                f"cannot hand {task.name} to warm spare {spare.name} (pid {spare.pid}): "
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
                f"warm spare {spare.name} (pid {spare.pid}) ended unused "
                f"({describe_returncode(rc)} after {ran:.1f} s); starting another"
                + (f". Its last line: {lines[-1]}" if lines else ""),
                "info" if rc == 0 else "warning",
            )
            self._spare_command_waits[spare.job] = True
            self._fill_spares()
            return
        must, flag = _must_wait(spare.job), SPARE_FLAGS[spare.job]
        self._close_spares(
            f"warm spare {spare.name} (pid {spare.pid}) ended with "
            f"{describe_returncode(rc)} after {ran:.1f} s before it waited for an identity: "
            f"{must} (docs/launcher.md, 'Warm spares'); {flag} 0 turns them off. Its last "
            f"{len(lines)} line(s):{tail}"
            if lines
            else f"warm spare {spare.name} (pid {spare.pid}) ended with "
            f"{describe_returncode(rc)} after {ran:.1f} s before it waited for an identity, "
            f"printing nothing: {must} (docs/launcher.md, 'Warm spares'); {flag} 0 turns "
            "them off",
            spare.job,
        )

    def _spare_deadlines(self) -> list[float]:
        """When the waiting spares must have said that they wait (while no spare of their
        job has): deadlines the supervising loop wakes up for."""
        return [
            s.started_at + SPARE_READY_S
            for s in self._spare_pool
            if not s.ready and self._spares_open[s.job] and not self._spare_command_waits[s.job]
        ]

    def _on_spare_deadlines(self, now: float) -> None:
        """Turn a job's spares off when one of them ran :data:`SPARE_READY_S` without saying
        that it waits in ``resolve_task`` (and no spare of the job ever did)."""
        for spare in self._spare_pool:
            if spare.ready:
                self._spare_command_waits[spare.job] = True
        for spare in list(self._spare_pool):
            job = spare.job
            if self._spare_command_waits[job] or not self._spares_open[job]:
                continue
            if not spare.ready and now >= spare.started_at + SPARE_READY_S:
                lines = list(spare.lines)
                last = f" Its last line: {lines[-1]}" if lines else " It printed nothing."
                self._close_spares(
                    f"warm spare {spare.name} (pid {spare.pid}) did not reach "
                    f"tensorfleet.resolve_task() within {SPARE_READY_S:g} s: "
                    f"{_must_wait(job)} (with this tensorfleet) (docs/launcher.md, 'Warm "
                    f"spares'); {SPARE_FLAGS[job]} 0 turns them off.{last}",
                    job,
                )

    # ------------------------------------------------------------------ the end

    def _close_spares(self, why: str | None = None, job: str | None = None) -> None:
        """No more spares of ``job`` (None: of any job) this run: kill those waiting
        (SIGKILL: they hold nothing)."""
        jobs = list(self._spares_open) if job is None else [job]
        if why is not None and any(self._spares_open[j] for j in jobs):
            # info, not a warning: the run itself is fine, its restarts start afresh
            which = "" if job is None or job == "worker" else f" of the {job} tasks"
            self.output.message(f"warm spares{which} are off for this run: {why}")
        for j in jobs:
            self._spares_open[j] = False
        for spare in list(self._spare_pool):
            if spare.job in jobs:
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

    def wait_spare_ready(self, timeout: float, job: str = "worker") -> int | None:
        """Wait up to ``timeout`` seconds until a spare of ``job`` waits for an identity; its
        pid, or None when none did in time (for tests and drills that must kill a task only
        once a spare can take it over). Safe from any thread; called while no thread
        supervises (before :meth:`wait`), it starts the spares itself once the run is at work
        (:mod:`tensorfleet.launch.spare_start`)."""

        def ready() -> Spare | None:
            return next((s for s in list(self._spare_pool) if s.ready and s.job == job), None)

        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            self._start_spares_outside_supervision(now)
            pending = self._spares_pending()
            with self._spare_ready:
                spare = ready()
                if spare is not None or now >= deadline:
                    break
                # while the spares have not started, look at the run's markers again soon
                self._spare_ready.wait(
                    min(deadline - now, SPARE_START_POLL_S) if pending else deadline - now
                )
        return None if spare is None else spare.pid

    @property
    def spare_pids(self) -> list[int]:
        """Process ids of the spares waiting now (not yet any task's)."""
        return [s.pid for s in self._spare_pool if s.pid is not None]


def _must_wait(job: str) -> str:
    """What a job's command must do to run as a spare (for the errors)."""
    if job == "worker":
        return "the worker command must call tensorfleet.resolve_task() to run as a spare"
    return (
        "the ps command must wait in tensorfleet.resolve_task() (the built-in `tensorfleet "
        "server` does) to run as a spare"
    )
