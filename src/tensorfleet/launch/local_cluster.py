"""A whole tensorfleet cluster as processes on this machine, started and supervised together.

:class:`LocalCluster` is what ``tensorfleet launch`` runs, and what tests and benchmarks use
from Python. It picks a free loopback port per task, builds the cluster spec and a fresh
secret, and starts every task as its own process (in its own process group, so that a task's
children are stopped with it) with ``TF_CONFIG``, ``TENSORFLEET_SECRET``,
``TENSORFLEET_LAUNCHER=1`` and ``PYTHONUNBUFFERED=1`` in its environment.

Supervision, in the spirit of Horovod's runner:

- the run succeeds when every worker exits 0. The ps tasks then learn that training is over
  and exit by themselves; those still running after ``grace_period`` seconds get SIGTERM,
  then SIGKILL ``kill_timeout`` seconds later, with a warning naming each;
- the first task that exits non-zero (or dies from a signal) on its own is reported with its
  last lines; the others get ``grace_period`` seconds to notice and finish, then SIGTERM,
  then SIGKILL. The run's status is that task's exit code (128 + signal number for a signal);
- with ``max_restarts`` N > 0, a task that fails on its own (non-zero exit, or a signal the
  launcher did not send) while the run is still running is first restarted in place, up to
  N times per task: same command, same environment (same ``TF_CONFIG``, hence the same
  address, and the same secret), same output prefix, in a new process group; what its old
  process group left behind is killed first. The restart waits a back-off (1 s, doubling up
  to 10 s) that the supervising thread keeps as one more deadline, never by sleeping. A task
  that exits 0 is never restarted. Once the run drains, fails, or is stopped or interrupted,
  nothing is restarted: a restart still waiting is cancelled and that task counts as failed.
  When a task's restarts are used up, its next failure is handled by the rule above, and
  the report says how many restarts it used;
- :meth:`LocalCluster.interrupt` (the CLI's SIGINT/SIGTERM handler) sends SIGTERM to every
  task at once, then SIGKILL; a second interrupt sends SIGKILL at once;
- :meth:`LocalCluster.stop` (also run on leaving the ``with`` block) stops whatever still runs
  and kills what is left in every task's process group: no child is left behind.

Every wait has a deadline. Process exits and interrupts arrive on one queue (a
``SimpleQueue``, whose ``put`` is safe in signal handlers) from one waiter thread per task,
so the supervising thread sleeps until something happens or a deadline passes.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO

from tensorfleet import environment
from tensorfleet.errors import DeadlineExceeded, LaunchError
from tensorfleet.launch.output import Output, PlainOutput
from tensorfleet.launch.ports import LOOPBACK, free_ports
from tensorfleet.wire.secret import generate_secret

#: How many of a task's latest output lines are kept for failure reports.
DEFAULT_HISTORY = 20
#: Seconds the other tasks get to finish after a failure, and ps tasks after the workers.
DEFAULT_GRACE_PERIOD = 15.0
#: Seconds between SIGTERM and SIGKILL.
DEFAULT_KILL_TIMEOUT = 5.0
#: Seconds to wait for a reader thread to drain a pipe after its process exited. Short: a
#: grandchild that inherited the pipe can hold it open long after the task is gone.
READER_DRAIN_TIMEOUT = 0.5
#: Longest chunk read as one line, so a child printing without newlines cannot eat memory.
MAX_LINE_BYTES = 64 * 1024
#: Seconds before the first restart of a failed task; each further restart of the same task
#: waits twice as long, up to :data:`MAX_RESTART_BACKOFF`. A task that fails at once (its
#: port still taken, a dependency not up yet) should not be restarted in a tight loop.
RESTART_BACKOFF = 1.0
#: The longest back-off before a restart, in seconds.
MAX_RESTART_BACKOFF = 10.0

# Phases of a run. Each phase after RUNNING ends at a deadline (``_phase_deadline``).
_RUNNING = "running"
_DRAINING = "draining"  # every worker exited 0; the ps tasks are expected to exit
_FAILING = "failing"  # a task failed; the others get the grace period
_TERMINATING = "terminating"  # SIGTERM sent
_KILLING = "killing"  # SIGKILL sent
_DONE = "done"


def default_ps_command() -> list[str]:
    """The command of a ps task by default: the built-in parameter server, no user code."""
    return [sys.executable, "-m", "tensorfleet", "server"]


def describe_returncode(returncode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL"``, from a ``Popen.returncode``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def exit_status(returncode: int) -> int:
    """A shell-style exit status for a ``Popen.returncode``: the code, or 128 + signal."""
    return returncode if returncode >= 0 else 128 - returncode


@dataclass(eq=False)
class Task:
    """One task of the cluster, its process, and what the launcher knows about it."""

    job: str
    index: int
    command: list[str]
    #: The latest output lines of its current process (a fresh deque at each restart).
    recent: deque[str]
    #: The running process; None before :meth:`LocalCluster.start`.
    process: subprocess.Popen[bytes] | None = None
    #: ``Popen.returncode`` once the launcher has handled the exit (negative: signal).
    returncode: int | None = None
    #: The last signal the launcher sent; a task it stopped is not reported as failed.
    stop_signal: int | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    reader: threading.Thread | None = field(default=None, repr=False)
    #: How many times the launcher restarted this task after a failure.
    restarts: int = 0
    #: ``time.monotonic()`` at which a scheduled restart is due; None when none is pending.
    restart_at: float | None = None
    #: Process ids (and process group ids) of the processes this task ran before its latest
    #: restart, so that whatever their groups still hold is killed at the end of the run.
    previous_pids: list[int] = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        """``"worker:1"``: the prefix of the task's output lines."""
        return f"{self.job}:{self.index}"

    @property
    def pid(self) -> int | None:
        """The process id (also its process group id), once started."""
        return None if self.process is None else self.process.pid

    @property
    def running(self) -> bool:
        """Started and its exit not yet handled."""
        return self.process is not None and self.returncode is None

    @property
    def restart_pending(self) -> bool:
        """Failed, and waiting for its back-off to pass before the launcher restarts it."""
        return self.restart_at is not None


class LocalCluster:
    """Start ``num_ps`` ps tasks and ``num_workers`` worker tasks on this machine, supervise them.

    Args:
        num_ps: ps tasks (0 for all-reduce training without parameter servers).
        num_workers: worker tasks, at least 1; worker 0 is the chief.
        worker_command: argv of every worker task, e.g. ``["python", "train.py"]``.
        ps_command: argv of every ps task; ``None`` runs the built-in parameter server
            (``python -m tensorfleet server``). Pass ``worker_command`` to run the user's
            script for ps tasks too (TensorFlow style, where the script calls
            ``server.join()``).
        env: variables added to (and overriding) this process's environment for every task.
        task_env: variables for one task each, by task name (``"worker:1"``), applied after
            ``env``: e.g. each task's thread budget and GPUs
            (:func:`tensorfleet.cluster.resources.plan_resources`).
        grace_period: seconds the ps tasks get to exit after every worker exited 0, and the
            other tasks get to finish after one failed, before SIGTERM.
        kill_timeout: seconds between SIGTERM and SIGKILL.
        output: where lines and messages go; by default :class:`PlainOutput` on
            stdout/stderr. ``Output()`` shows nothing.
        host: the address every task listens on; local clusters use loopback.
        cwd: working directory of the tasks (default: this process's).
        secret: the cluster secret; a fresh random one by default.
        history: how many latest output lines are kept per task.
        max_restarts: how many times each task that fails on its own while the run is still
            running is restarted in place (same command and environment, same TF_CONFIG and
            secret) before its failure stops the cluster; 0 (the default): never, the first
            failure stops the cluster with a report.

    The ports, the cluster spec (:attr:`cluster`) and the secret (:attr:`secret`) are chosen
    here, so they can be read before :meth:`start`. Raises :class:`LaunchError` for an
    invalid argument.
    """

    def __init__(
        self,
        num_ps: int,
        num_workers: int,
        worker_command: Sequence[str],
        *,
        ps_command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        task_env: Mapping[str, Mapping[str, str]] | None = None,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        kill_timeout: float = DEFAULT_KILL_TIMEOUT,
        output: Output | None = None,
        host: str = LOOPBACK,
        cwd: str | os.PathLike[str] | None = None,
        secret: str | None = None,
        history: int = DEFAULT_HISTORY,
        max_restarts: int = 0,
    ):
        if num_ps < 0:
            raise LaunchError(f"the number of ps tasks must be >= 0, got {num_ps}")
        if num_workers < 1:
            raise LaunchError(
                f"the number of workers must be >= 1, got {num_workers}: worker 0 is the chief "
                "that runs the training"
            )
        worker_argv = _as_argv(worker_command, "worker command")
        ps_argv = default_ps_command() if ps_command is None else _as_argv(ps_command, "ps command")
        if grace_period < 0:
            raise LaunchError(f"the grace period must be >= 0 seconds, got {grace_period}")
        if kill_timeout <= 0:
            raise LaunchError(f"the kill timeout must be > 0 seconds, got {kill_timeout}")
        if history < 1:
            raise LaunchError(f"history must keep at least 1 line, got {history}")
        if max_restarts < 0:
            raise LaunchError(
                f"max_restarts must be >= 0, got {max_restarts}: the number of times a failed "
                "task is restarted (0: a failure stops the cluster)"
            )

        self.grace_period = float(grace_period)
        self.kill_timeout = float(kill_timeout)
        self.max_restarts = int(max_restarts)
        self.output = PlainOutput() if output is None else output
        self.secret = generate_secret() if secret is None else secret
        self._env = dict(env or {})
        self._task_env = {name: dict(values) for name, values in (task_env or {}).items()}
        self._cwd = cwd

        try:
            ports = free_ports(num_ps + num_workers, host)
        except OSError as exc:
            raise LaunchError(f"cannot find free ports on {host}: {exc}") from exc
        addresses = [f"[{host}]:{p}" if ":" in host else f"{host}:{p}" for p in ports]
        #: The cluster spec every task gets in TF_CONFIG: ``{"ps": [...], "worker": [...]}``.
        self.cluster: dict[str, list[str]] = {
            "ps": addresses[:num_ps],
            "worker": addresses[num_ps:],
        }
        self._tasks: list[Task] = [
            Task("ps", i, list(ps_argv), deque(maxlen=history)) for i in range(num_ps)
        ] + [
            Task("worker", i, list(worker_argv), deque(maxlen=history)) for i in range(num_workers)
        ]
        unknown = sorted(set(self._task_env) - {t.name for t in self._tasks})
        if unknown:
            raise LaunchError(
                f"task_env names task(s) {unknown} that this cluster does not have; its tasks "
                f"are {', '.join(t.name for t in self._tasks)}"
            )

        self._events: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._started = False
        self._phase = _RUNNING
        self._phase_deadline: float | None = None
        self._failure: Task | None = None
        self._interrupt: int | None = None
        self._abandoned = False
        self._result: int | None = None
        self._start_time = 0.0

    # ------------------------------------------------------------------ public API

    @property
    def tasks(self) -> tuple[Task, ...]:
        """Every task: the ps tasks in index order, then the workers."""
        return tuple(self._tasks)

    def task(self, name: str) -> Task:
        """The task called ``name`` (``"worker:1"``); :class:`LaunchError` if there is none."""
        for task in self._tasks:
            if task.name == name:
                return task
        known = ", ".join(t.name for t in self._tasks)
        raise LaunchError(f"no task {name!r} in this cluster; its tasks are {known}")

    def recent_lines(self, name: str) -> list[str]:
        """The latest output lines of task ``name`` (at most ``history``), oldest first: those
        of its current process, so of its latest run after a restart."""
        return list(self.task(name).recent)

    @property
    def pids(self) -> dict[str, int]:
        """Process id of every started task's current process, by name (after a restart: the
        new process)."""
        return {t.name: t.pid for t in self._tasks if t.pid is not None}

    @property
    def restarts(self) -> dict[str, int]:
        """How many times each task was restarted after a failure, by name (a fresh dict)."""
        return {t.name: t.restarts for t in self._tasks}

    @property
    def returncodes(self) -> dict[str, int | None]:
        """``Popen.returncode`` of every task whose exit was handled (None: not yet)."""
        return {t.name: t.returncode for t in self._tasks}

    @property
    def result(self) -> int | None:
        """The run's exit status once :meth:`wait` returned it, else None."""
        return self._result

    def task_environment(self, task: Task) -> dict[str, str]:
        """The complete environment ``task`` is started with."""
        env = dict(environment.environ())
        env.update(self._env)
        env.update(self._task_env.get(task.name, {}))
        env[environment.TF_CONFIG_VAR] = json.dumps(
            {"cluster": self.cluster, "task": {"type": task.job, "index": task.index}}
        )
        env[environment.SECRET_VAR] = self.secret
        env[environment.LAUNCHER_VAR] = "1"
        # Children write into pipes; without this Python would buffer their output in blocks.
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self) -> None:
        """Start every task (ps tasks first). Raises :class:`LaunchError` when one cannot be
        started (the ones already started are stopped first)."""
        if self._started:
            raise LaunchError("this LocalCluster was already started; create a new one")
        self._started = True
        self._start_time = time.monotonic()
        num_ps, num_workers = len(self.cluster["ps"]), len(self.cluster["worker"])
        restarts = (
            f" (a failed task is restarted up to {self.max_restarts} time(s))"
            if self.max_restarts
            else ""
        )
        self.output.message(
            f"starting {num_ps} ps and {num_workers} worker task(s){restarts}: "
            f"{json.dumps(self.cluster)}"
        )
        for task in self._tasks:
            try:
                self._spawn(task)
            except OSError as exc:
                self.stop()
                raise LaunchError(
                    f"cannot start {task.name} with command {task.command!r}: {exc}. Check "
                    "that the program exists and is executable (with --ps-command for ps tasks)"
                ) from exc

    def wait(self, timeout: float | None = None) -> int:
        """Supervise the tasks until every one has exited; return the run's exit status.

        0 when every worker exited 0; the exit status of the first task that failed on its
        own otherwise (128 + signal number for a signal); 128 + signal number after
        :meth:`interrupt`. ``timeout`` bounds this call (None: as long as training runs);
        when it passes, :class:`DeadlineExceeded` is raised and the tasks keep running, so
        calling ``wait`` again continues the supervision.
        """
        if not self._started:
            raise LaunchError("call start() before wait()")
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            now = time.monotonic()
            self._on_deadline(now)
            self._on_restarts_due(now)
            if self._abandoned or all(not (t.running or t.restart_pending) for t in self._tasks):
                return self._finish()
            if deadline is not None and now >= deadline:
                running = ", ".join(
                    t.name + (" (restart pending)" if t.restart_pending else "")
                    for t in self._tasks
                    if t.running or t.restart_pending
                )
                raise DeadlineExceeded(
                    f"the local cluster was still running after {timeout} s (tasks {running}); "
                    "call wait() again to keep supervising, or stop() to stop them"
                )
            deadlines = [self._phase_deadline, deadline]
            deadlines += [t.restart_at for t in self._tasks]
            wake = min((d for d in deadlines if d is not None), default=None)
            try:
                event = self._events.get(timeout=None if wake is None else max(0.0, wake - now))
            except queue.Empty:
                continue
            self._handle(event)
        return self._result

    def interrupt(self, signum: int = signal.SIGTERM) -> None:
        """Ask the cluster to stop all tasks now, as if the launcher received ``signum``.

        Safe to call from a signal handler or another thread: it only queues the request,
        which the thread in :meth:`wait` acts on (SIGTERM to every task, SIGKILL after
        ``kill_timeout``; a second request sends SIGKILL at once).
        """
        self._events.put(("signal", int(signum)))

    def kill_task(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process group of task ``name``'s current process, as if it died
        on its own: for fault-injection tests and chaos drills.

        The launcher handles the exit like any other failure (a restart when ``max_restarts``
        allows one, else a report and the others stopped). Safe to call from any thread: it
        only sends a signal. Raises :class:`LaunchError` for an unknown task, an unknown
        signal, or a task that is not running (not started, exited, or waiting for a restart).
        """
        task = self.task(name)
        try:
            sig_name = signal.Signals(sig).name
        except ValueError:
            raise LaunchError(
                f"cannot send signal {sig!r} to {name}: not a signal number; "
                "use one of signal.Signals, e.g. signal.SIGKILL"
            ) from None
        process = task.process
        if process is None:
            raise LaunchError(f"{name} is not running: the cluster was not started; call start()")
        if task.restart_pending:
            raise LaunchError(f"{name} is not running: it failed and waits to be restarted")
        returncode = process.returncode  # set by its waiter thread once the process is reaped
        if returncode is not None or not task.running:
            how = "" if returncode is None else f" ({describe_returncode(returncode)})"
            raise LaunchError(f"{name} is not running: it already ended{how}")
        if not _killpg(process.pid, sig):
            raise LaunchError(f"cannot send {sig_name} to {name} (pid {process.pid}): it is gone")

    def stop(self) -> int | None:
        """Stop every task still running (SIGTERM, then SIGKILL after ``kill_timeout``), kill
        what is left in every task's process group, and return the run's exit status (None
        when it was never started). Idempotent. Call it from the thread that calls
        :meth:`wait`; other threads and signal handlers use :meth:`interrupt`."""
        if not self._started:
            return None
        if self._result is None:
            if self._phase not in (_TERMINATING, _KILLING):
                self._signal_running(signal.SIGTERM)
                self._enter(_TERMINATING, self.kill_timeout)
            try:
                self.wait()
            finally:
                self._kill_process_groups(quiet=True)
        self._kill_process_groups(quiet=True)
        return self._result

    def __enter__(self) -> LocalCluster:
        """Start the cluster (unless already started); leaving the block calls :meth:`stop`."""
        if not self._started:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ processes

    def _spawn(self, task: Task) -> None:
        """Start ``task`` in a new session (its own process group) with a reader and a waiter."""
        process = subprocess.Popen(
            task.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.task_environment(task),
            cwd=self._cwd,
            start_new_session=True,
        )
        task.process, task.started_at = process, time.monotonic()
        self.output.task_started(task.name, process.pid)
        assert process.stdout is not None  # stdout=PIPE above
        task.reader = threading.Thread(
            target=self._read_output,
            args=(task, process.stdout, task.recent),
            name=f"tensorfleet-output-{task.name}",
            daemon=True,
        )
        task.reader.start()
        threading.Thread(
            target=self._await_exit,
            args=(task, process),
            name=f"tensorfleet-wait-{task.name}",
            daemon=True,
        ).start()

    def _read_output(self, task: Task, pipe: IO[bytes], recent: deque[str]) -> None:
        """Reader thread: every line of the process's merged stdout/stderr to ``recent`` (the
        deque of that process, so a late line of a restarted task's old process does not mix
        into the new one's) and to the output."""
        try:
            for raw in iter(lambda: pipe.readline(MAX_LINE_BYTES), b""):
                text = _clean_line(raw)
                recent.append(text)
                self.output.line(task.name, text)
        except (OSError, ValueError):
            pass  # pipe closed under us during shutdown; nothing more to read
        finally:
            pipe.close()

    def _await_exit(self, task: Task, process: subprocess.Popen[bytes]) -> None:
        """Waiter thread: block until the process exits, then tell the supervising thread.

        Untimed on purpose: it only reports, and every process is killed by ``stop()``."""
        process.wait()
        self._events.put(("exit", task))

    def _signal_running(self, sig: int) -> list[Task]:
        """Send ``sig`` to the process group of every task still running; return those tasks."""
        signalled = []
        for task in self._tasks:
            if not task.running or task.process is None:
                continue
            if task.process.returncode is None:  # not yet reaped by its waiter thread
                task.stop_signal = sig
                signalled.append(task)
            _killpg(task.process.pid, sig)
        return signalled

    def _kill_process_groups(self, quiet: bool) -> None:
        """SIGKILL whatever is left in each task's process group (children of a task that
        outlived it), those of its processes before a restart too. Warns about the current
        groups that still had members unless ``quiet``."""
        for task in self._tasks:
            for pid in task.previous_pids:  # already killed at the restart; this is a sweep
                _killpg(pid, signal.SIGKILL)
            if task.process is None:
                continue
            if not quiet and _killpg(task.process.pid, 0):
                self.output.message(
                    f"{task.name} left processes behind in its process group; killing them",
                    "warning",
                )
            _killpg(task.process.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ supervision

    def _enter(self, phase: str, seconds: float | None) -> None:
        self._phase = phase
        self._phase_deadline = None if seconds is None else time.monotonic() + seconds

    def _handle(self, event: tuple[str, object]) -> None:
        kind, payload = event
        if kind == "exit":
            assert isinstance(payload, Task)
            self._on_exit(payload)
        elif kind == "signal":
            assert isinstance(payload, int)
            self._on_interrupt(payload)

    def _on_exit(self, task: Task) -> None:
        assert task.process is not None
        task.returncode = task.process.returncode
        task.ended_at = time.monotonic()
        if task.reader is not None:
            # The last lines must be read before they can be reported.
            task.reader.join(READER_DRAIN_TIMEOUT)
        rc = task.returncode
        assert rc is not None
        failed = rc != 0 and task.stop_signal is None
        restart = failed and self._may_restart(task)
        if task.stop_signal is not None and rc != 0:
            status = f"stopped ({_signal_name(task.stop_signal)})"
        elif rc >= 0:
            status = f"exited {rc}"
        else:
            status = f"killed by {_signal_name(-rc)}"
        if restart:
            status += "; restarting"
        self.output.task_exited(task.name, status, not failed)
        if restart:
            self._schedule_restart(task)
        elif failed:
            self._on_failure(task)
        elif self._phase == _RUNNING and all(
            t.returncode == 0 for t in self._tasks if t.job == "worker"
        ):
            ps_left = [t.name for t in self._tasks if t.running]
            if ps_left:
                self.output.message(
                    f"all workers finished; waiting up to {self.grace_period:g} s for "
                    f"{', '.join(ps_left)} to exit"
                )
            self._enter(_DRAINING, self.grace_period)

    def _on_failure(self, task: Task) -> None:
        assert task.returncode is not None
        ran = (task.ended_at or task.started_at) - task.started_at
        lines = list(task.recent)
        tail = "\n".join(f"    [{task.name}] {line}" for line in lines)
        used = (
            f"; restarts used: {task.restarts} of {self.max_restarts}" if self.max_restarts else ""
        )
        if self._failure is not None or self._interrupt is not None:
            last = f"; last line: {lines[-1]}" if lines else ""
            self.output.message(
                f"{task.name} also failed ({describe_returncode(task.returncode)}{used}){last}",
                "warning",
            )
            return
        self._failure = task
        head = (
            f"{task.name} failed with {describe_returncode(task.returncode)} "
            f"(pid {task.pid}, after {ran:.1f} s{used}). "
        )
        if lines:
            self.output.message(head + f"Its last {len(lines)} line(s):\n{tail}", "error")
        else:
            self.output.message(head + "It printed nothing.", "error")
        if self._phase in (_RUNNING, _DRAINING):
            others = [t.name for t in self._tasks if t.running]
            if others:
                self.output.message(
                    f"giving {', '.join(others)} up to {self.grace_period:g} s to finish, "
                    "then stopping them"
                )
            self._enter(_FAILING, self.grace_period)

    def _restarts_allowed(self) -> bool:
        """Tasks are restarted only while the run is running: not once every worker is done
        (draining), a task failed for good, or the run is being stopped or interrupted."""
        return self._phase == _RUNNING and self._interrupt is None and self._failure is None

    def _may_restart(self, task: Task) -> bool:
        """Whether ``task``, which just failed on its own, is restarted rather than reported:
        only while restarts are allowed, and while the task has restarts left."""
        return self._restarts_allowed() and task.restarts < self.max_restarts

    def _schedule_restart(self, task: Task) -> None:
        """Announce the failure of ``task``, kill what its process group left behind (it
        could hold the task's port or files), and set the restart's deadline: the supervising
        loop wakes up for it like for a phase deadline."""
        assert task.process is not None and task.returncode is not None
        if _killpg(task.process.pid, 0):
            self.output.message(
                f"{task.name} left processes behind in its process group; killing them "
                "before restarting it",
                "warning",
            )
        _killpg(task.process.pid, signal.SIGKILL)
        delay = min(RESTART_BACKOFF * 2**task.restarts, MAX_RESTART_BACKOFF)
        task.restart_at = time.monotonic() + delay
        ran = (task.ended_at or task.started_at) - task.started_at
        lines = list(task.recent)
        last = f" Its last line: {lines[-1]}" if lines else " It printed nothing."
        self.output.message(
            f"{task.name} failed with {describe_returncode(task.returncode)}; restarting it "
            f"(restart {task.restarts + 1} of {self.max_restarts}) in {delay:g} s "
            f"(pid {task.pid} ran {ran:.1f} s).{last}",
            "warning",
        )

    def _on_restarts_due(self, now: float) -> None:
        """Restart the tasks whose back-off has passed, or, once the run is no longer
        running (draining, failing, stopping, interrupted), cancel every pending restart:
        such a task then counts as failed."""
        pending = [t for t in self._tasks if t.restart_at is not None]
        if not pending:
            return
        for task in pending:
            if not self._restarts_allowed():
                why = "interrupted" if self._interrupt is not None else self._phase
                task.restart_at = None
                self.output.message(f"not restarting {task.name}: the run is {why}", "warning")
                self._on_failure(task)
            elif task.restart_at is not None and now >= task.restart_at:
                task.restart_at = None
                self._restart(task)  # on failure to start, restarts are no longer allowed

    def _restart(self, task: Task) -> None:
        """Start ``task`` again with the same command and environment (its identity)."""
        assert task.process is not None
        old_pid, old_recent = task.process.pid, task.recent
        # The new process's lines; a failure report must not show the old process's lines
        # as if the new one printed them (the log keeps them all).
        task.recent = deque(maxlen=old_recent.maxlen)
        try:
            self._spawn(task)
        except OSError as exc:
            task.recent = old_recent
            self.output.message(
                f"cannot restart {task.name} with command {task.command!r}: {exc}", "error"
            )
            self._on_failure(task)
            return
        task.previous_pids.append(old_pid)
        task.restarts += 1
        task.returncode = task.stop_signal = task.ended_at = None
        self.output.message(
            f"restarted {task.name} (restart {task.restarts} of {self.max_restarts}) as pid "
            f"{task.pid}"
        )

    def _on_interrupt(self, signum: int) -> None:
        name = _signal_name(signum)
        if self._interrupt is None:
            self._interrupt = signum
            if self._phase in (_TERMINATING, _KILLING):
                return
            self.output.message(
                f"received {name}: stopping every task (SIGTERM, SIGKILL after "
                f"{self.kill_timeout:g} s; {name} again kills them at once)",
                "warning",
            )
            self._signal_running(signal.SIGTERM)
            self._enter(_TERMINATING, self.kill_timeout)
        else:
            self.output.message(f"received {name} again: killing every task now", "warning")
            self._signal_running(signal.SIGKILL)
            self._enter(_KILLING, self.kill_timeout)

    def _on_deadline(self, now: float) -> None:
        """Move to the next phase when the current one's deadline has passed."""
        if self._phase_deadline is None or now < self._phase_deadline:
            return
        running = [t for t in self._tasks if t.running]
        if self._phase == _DRAINING:
            for task in running:
                self.output.message(
                    f"{task.name} did not exit within {self.grace_period:g} s after all workers "
                    "finished; stopping it with SIGTERM (a ps task should learn from the chief "
                    "that training is over and exit by itself)",
                    "warning",
                )
            self._signal_running(signal.SIGTERM)
            self._enter(_TERMINATING, self.kill_timeout)
        elif self._phase == _FAILING:
            if running:
                self.output.message(
                    f"stopping {', '.join(t.name for t in running)} with SIGTERM",
                    "warning",
                )
            self._signal_running(signal.SIGTERM)
            self._enter(_TERMINATING, self.kill_timeout)
        elif self._phase == _TERMINATING:
            for task in running:
                self.output.message(
                    f"{task.name} did not exit within {self.kill_timeout:g} s of SIGTERM; "
                    "killing it with SIGKILL",
                    "warning",
                )
            self._signal_running(signal.SIGKILL)
            self._enter(_KILLING, self.kill_timeout)
        elif self._phase == _KILLING:
            names = ", ".join(f"{t.name} (pid {t.pid})" for t in running)
            self.output.message(
                f"{names} did not exit within {self.kill_timeout:g} s of SIGKILL (stuck in the "
                "kernel?); giving up on them",
                "error",
            )
            self._abandoned = True

    def _finish(self) -> int:
        """Compute the run's status once every task has exited (or been given up on)."""
        # Kill leftovers first: a leftover that inherited a task's pipe keeps its reader from
        # reaching the end; what it already wrote stays in the pipe and is still read.
        self._kill_process_groups(quiet=False)
        for task in self._tasks:
            if task.reader is not None:
                task.reader.join(READER_DRAIN_TIMEOUT)
        workers = [t for t in self._tasks if t.job == "worker"]
        if self._failure is not None and self._failure.returncode is not None:
            result = exit_status(self._failure.returncode)
        elif self._interrupt is not None:
            result = 128 + self._interrupt
        elif all(t.returncode == 0 for t in workers):
            result = 0
        else:
            # Stopped by stop() before the workers finished: the first worker's signal status
            # (143 for SIGTERM), or 1 for a worker that could not even be reaped.
            codes = [t.returncode for t in workers if t.returncode != 0]
            result = exit_status(codes[0]) if codes[0] is not None else 1
        elapsed = time.monotonic() - self._start_time
        if result == 0:
            self.output.message(f"all {len(workers)} worker(s) finished in {elapsed:.1f} s")
        else:
            self.output.message(f"exit status {result} after {elapsed:.1f} s")
        self._phase, self._phase_deadline, self._result = _DONE, None, result
        return result


def _as_argv(command: Sequence[str], what: str) -> list[str]:
    if isinstance(command, (str, bytes)):
        raise LaunchError(
            f"the {what} must be a list of arguments, got the string {command!r}; "
            "split it with shlex.split()"
        )
    argv = [os.fspath(arg) for arg in command]
    if not argv:
        raise LaunchError(f"the {what} is empty; give the program to run and its arguments")
    return argv


def _clean_line(raw: bytes) -> str:
    """Decode one output line and drop its ending; keep what a terminal would show of a line
    redrawn with carriage returns (progress bars)."""
    text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    if "\r" in text:
        parts = [part for part in text.split("\r") if part]
        text = parts[-1] if parts else ""
    return text


def _killpg(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        # PermissionError: on some systems a group of only zombies answers EPERM.
        return False
    return True


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
