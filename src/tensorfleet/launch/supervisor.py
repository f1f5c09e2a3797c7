"""Supervision of a whole tensorfleet cluster: start every task, watch it, restart or stop it.

:class:`ClusterSupervisor` is what ``tensorfleet launch`` runs, for every backend (processes
on this machine, or on the nodes of a Ray cluster). It asks its backend for one address per
task, builds the cluster spec and a fresh secret, and starts every task in its own process
group with ``TF_CONFIG``, ``TENSORFLEET_SECRET``, ``TENSORFLEET_LAUNCHER=1`` and
``PYTHONUNBUFFERED=1`` added to its environment.

Supervision, in the spirit of Horovod's runner:

- the run succeeds when every worker exits 0. The ps tasks then learn that training is over
  and exit by themselves; those still running after ``grace_period`` seconds get SIGTERM,
  then SIGKILL ``kill_timeout`` seconds later, with a warning naming each;
- a task that ends on its own with a failure while the run is still running is first
  offered to the restart policy (:mod:`tensorfleet.launch.restart_policy`: by default a task
  killed by a signal is restarted, up to 10 times an hour, and one that exits with an error
  is not). A restart runs the same command with the same environment (same ``TF_CONFIG``,
  hence the same address, and the same secret) plus ``TENSORFLEET_PREDECESSOR_DEAD=1``, with
  the same output prefix, in a new process group; what its old process group left behind is
  killed first. It waits the policy's back-off, which the supervising thread keeps as one
  more deadline, never by sleeping. A task that exits 0 is never restarted. Once the run
  drains, fails, or is stopped or interrupted, nothing is restarted: a restart still waiting
  is cancelled and that task counts as failed;
- once training is complete (the chief and every ps task exited 0), a worker killed by a
  signal is *retired*: never restarted, not a failure, and a restart still waiting is
  cancelled
  (:mod:`tensorfleet.launch.training_completion`); the workers still running get
  ``grace_period`` seconds to exit, then SIGTERM;
- a failure that is not restarted is reported with the task's last lines (its traceback);
  the others get ``grace_period`` seconds to notice and finish, then SIGTERM, then SIGKILL;
  once no worker is left, the ps tasks get SIGTERM at once
  (:mod:`tensorfleet.launch.failure_grace`).
  The run's status is that task's exit code (128 + signal number for a signal);
- with ``spares`` (``tensorfleet launch`` keeps 1 on the local backend), warm spare workers,
  started once the run is at work (:mod:`tensorfleet.launch.spare_start`), wait in
  ``resolve_task``; a worker's restart hands its identity to one
  (:mod:`tensorfleet.launch.warm_spares`), which is killed with the run if unused;
- a ps task whose process stays stopped (SIGSTOP) is killed and restarted, so that a new
  process serves its shard (:mod:`tensorfleet.launch.stopped_ps`: after 2 s with the ps
  update log, 30 s without);
- :meth:`ClusterSupervisor.interrupt` (the CLI's SIGINT/SIGTERM handler) sends SIGTERM to
  every task at once, then SIGKILL; a second interrupt sends SIGKILL at once;
- :meth:`ClusterSupervisor.stop` (also run on leaving the ``with`` block) stops whatever
  still runs and kills what is left in every task's process group: no child is left behind.

Every wait has a deadline. Process exits and interrupts arrive on one queue (a
``SimpleQueue``, whose ``put`` is safe in signal handlers) from the backend's threads, so the
supervising thread sleeps until something happens or a deadline passes.

This module holds the supervising loop and the decisions on each task's exit; moving a
stopping run from phase to phase (an interrupt, each phase's deadline) is
:mod:`tensorfleet.launch.run_phases`'s, starting and signalling the tasks' processes
:mod:`tensorfleet.launch.process_groups`'s, restarting a failed task in place
:mod:`tensorfleet.launch.task_restarts`'s, keeping warm spare workers
:mod:`tensorfleet.launch.warm_spares`', handing a preempted worker's identity to its restart
:mod:`tensorfleet.launch.preempted_handover`'s (all mixed into :class:`ClusterSupervisor`).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType

from tensorfleet import environment
from tensorfleet.cluster.spec import ClusterSpec
from tensorfleet.errors import DeadlineExceeded, LaunchError
from tensorfleet.launch.backends.base import Backend
from tensorfleet.launch.backends.process_group import READER_DRAIN_TIMEOUT
from tensorfleet.launch.failure_grace import FailureGrace
from tensorfleet.launch.output import Output, PlainOutput
from tensorfleet.launch.peak_memory import peak_memory_line
from tensorfleet.launch.preempted_handover import PreemptedHandover
from tensorfleet.launch.process_groups import ProcessGroups
from tensorfleet.launch.restart_policy import (
    PREDECESSOR_DEAD_VAR,
    RestartPolicy,
    describe_returncode,
    signal_name,
)
from tensorfleet.launch.run_outcome import ending_line, run_status
from tensorfleet.launch.run_phases import (
    DONE,
    DRAINING,
    FAILING,
    KILLING,
    RUNNING,
    TERMINATING,
    RunPhases,
)
from tensorfleet.launch.stopped_ps import AUTO, StoppedPsReplacement
from tensorfleet.launch.supervisor_options import DEFAULT_KILL_TIMEOUT, check_timings, chosen_policy
from tensorfleet.launch.task import Task, as_argv
from tensorfleet.launch.task_restarts import TaskRestarts
from tensorfleet.launch.training_completion import TrainingCompletion, retired_after_completion
from tensorfleet.launch.warm_spares import DEFAULT_SPARE_WAIT_S, Spare, WarmSpares
from tensorfleet.task_markers import TaskMarkers
from tensorfleet.wire.secret import generate_secret

#: How many of a task's latest output lines are kept for failure reports.
DEFAULT_HISTORY = 20
#: Seconds the other tasks get to finish after a failure, and ps tasks after the workers.
DEFAULT_GRACE_PERIOD = 15.0
#: Seconds between SIGTERM and SIGKILL (DEFAULT_KILL_TIMEOUT, from supervisor_options). A task
#: takes SIGTERM as a preemption and saves what it can first (session/preemption.py): a ps
#: waits up to its ``preempt_grace_s`` (10 s) for the chief's checkpoint, so this must be longer.


def default_ps_command() -> list[str]:
    """The command of a ps task by default: the built-in parameter server, no user code."""
    return [sys.executable, "-m", "tensorfleet", "server"]


class ClusterSupervisor(
    ProcessGroups,
    TaskRestarts,
    TrainingCompletion,
    FailureGrace,
    WarmSpares,
    PreemptedHandover,
    StoppedPsReplacement,
    RunPhases,
):
    """Start ``num_ps`` ps tasks and ``num_workers`` worker tasks through ``backend``, and
    supervise them.

    Args:
        num_ps: ps tasks (0 for all-reduce training without parameter servers).
        num_workers: worker tasks, at least 1; worker 0 is the chief.
        worker_command: argv of every worker task, e.g. ``["python", "train.py"]``.
        backend: where the processes run (:class:`~tensorfleet.launch.backends.local.LocalBackend`,
            :class:`~tensorfleet.launch.backends.ray.RayBackend`).
        ps_command: argv of every ps task; ``None`` runs the built-in parameter server
            (``python -m tensorfleet server``). Pass ``worker_command`` to run the user's
            script for ps tasks too (TensorFlow style, where the script calls
            ``server.join()``).
        env: variables added to (and overriding) the environment of every task.
        task_env: variables for one task each, by task name (``"worker:1"``), applied after
            ``env``: e.g. each task's thread budget and GPUs
            (:func:`tensorfleet.cluster.resources.plan_resources`).
        grace_period: seconds the ps tasks get to exit after every worker exited 0, and the
            other tasks get to finish after one failed, before SIGTERM.
        kill_timeout: seconds between SIGTERM and SIGKILL.
        output: where lines and messages go; by default :class:`PlainOutput` on
            stdout/stderr. ``Output()`` shows nothing.
        cwd: working directory of the tasks (default: this process's).
        secret: the cluster secret; a fresh random one by default.
        history: how many latest output lines are kept per task.
        restart_policy: when a task that ends on its own with a failure is restarted in
            place (:class:`RestartPolicy`); default :data:`DEFAULT_POLICY` (signals: up to
            10 times an hour; errors: never).
        max_restarts: kept from before the restart policy: when given, every failure,
            signal or error, is restarted up to N times per task over the whole run
            (``RestartPolicy.uniform(N)``); cannot be combined with ``restart_policy``.
        spares: warm spare workers kept waiting to take over a worker that dies
            (:mod:`tensorfleet.launch.warm_spares`; local backend only). 0 here by default;
            ``tensorfleet launch`` keeps 1 (``--spares``).
        spare_wait_s: seconds a spare waits unused before a fresh one replaces it.
        ps_spares: warm spare ps processes (the ps command waiting, past its imports, to take
            over a ps task that dies; local backend only). 0 here by default;
            ``tensorfleet launch`` keeps 1 with the built-in ps (``--ps-spares``).
        replace_stopped_ps: seconds a ps task's process may stay stopped (state ``T``:
            SIGSTOP) before the launcher kills it and restarts it (a spare takes over);
            ``"auto"`` (default): 2 s with the ps update log, 30 s without; None: never
            (:mod:`tensorfleet.launch.stopped_ps`; local backend only).

    The addresses, the cluster spec (:attr:`cluster`) and the secret (:attr:`secret`) are
    chosen here, so they can be read before :meth:`start`. Raises :class:`LaunchError` for
    an invalid argument (:class:`~tensorfleet.errors.LaunchConfigError` for a restart limit).
    """

    def __init__(
        self,
        num_ps: int,
        num_workers: int,
        worker_command: Sequence[str],
        *,
        backend: Backend,
        ps_command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        task_env: Mapping[str, Mapping[str, str]] | None = None,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        kill_timeout: float = DEFAULT_KILL_TIMEOUT,
        output: Output | None = None,
        cwd: str | os.PathLike[str] | None = None,
        secret: str | None = None,
        history: int = DEFAULT_HISTORY,
        restart_policy: RestartPolicy | None = None,
        max_restarts: int | None = None,
        spares: int = 0,
        spare_wait_s: float = DEFAULT_SPARE_WAIT_S,
        ps_spares: int = 0,
        replace_stopped_ps: float | str | None = AUTO,
    ):
        if num_ps < 0:
            raise LaunchError(f"the number of ps tasks must be >= 0, got {num_ps}")
        if num_workers < 1:
            raise LaunchError(
                f"the number of workers must be >= 1, got {num_workers}: worker 0 is the chief "
                "that runs the training"
            )
        worker_argv = as_argv(worker_command, "worker command")
        ps_argv = default_ps_command() if ps_command is None else as_argv(ps_command, "ps command")
        check_timings(grace_period, kill_timeout, history)

        self.grace_period = float(grace_period)
        self.kill_timeout = float(kill_timeout)
        #: When a failed task is restarted in place.
        self.restart_policy = chosen_policy(restart_policy, max_restarts)
        self.output = PlainOutput() if output is None else output
        self.secret = generate_secret() if secret is None else secret
        self.backend = backend
        self._init_spares(spares, spare_wait_s, history, ps_spares)
        self._init_handover()
        self._init_stopped_ps(replace_stopped_ps)
        self._env = dict(env or {})
        self._task_env = {name: dict(values) for name, values in (task_env or {}).items()}
        self._cwd = None if cwd is None else os.fspath(cwd)

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
        own_server = ps_command is None  # tensorfleet's own server binds with SO_REUSEADDR
        addresses = backend.allocate(
            [t.name for t in self._tasks],
            held=[t.name for t in self._tasks if t.job == "ps" and own_server],
        )
        #: The cluster spec every task gets in TF_CONFIG: ``{"ps": [...], "worker": [...]}``.
        self.cluster: dict[str, list[str]] = {
            "ps": addresses[:num_ps],
            "worker": addresses[num_ps:],
        }

        self._events: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        #: What tasks tell the launcher (on this host only: a directory the tasks can reach).
        self._markers = TaskMarkers()
        self._started = False
        self._phase = RUNNING
        self._phase_deadline: float | None = None
        self._failure: Task | None = None
        self._interrupt: int | None = None
        self._abandoned = False
        self._result: int | None = None
        self._start_time = 0.0

    # ------------------------------------------------------------------ public API

    @property
    def max_restarts(self) -> int:
        """How many times a task that exits with an error is restarted (the name is kept
        from before the restart policy; :attr:`restart_policy` has every limit)."""
        return self.restart_policy.error_restarts

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

    def task_variables(self, task: Task, restarted: bool = False) -> dict[str, str]:
        """The variables the launcher adds to ``task``'s environment (a restarted task's
        also say that its predecessor is dead)."""
        variables = dict(self._env)
        variables.update(self._task_env.get(task.name, {}))
        variables[environment.TF_CONFIG_VAR] = json.dumps(
            {"cluster": self.cluster, "task": {"type": task.job, "index": task.index}}
        )
        variables[environment.SECRET_VAR] = self.secret
        variables[environment.LAUNCHER_VAR] = "1"
        # Children write into pipes; without this Python would buffer their output in blocks.
        variables["PYTHONUNBUFFERED"] = "1"
        if restarted:
            variables[PREDECESSOR_DEAD_VAR] = "1"
        if self._markers.directory is not None:
            variables[environment.TASK_MARKERS_VAR] = str(self._markers.directory)
        return variables

    def task_environment(self, task: Task) -> dict[str, str]:
        """The complete environment ``task`` is first started with (as far as the backend
        can tell from here)."""
        return self.backend.environment(self.task_variables(task))

    def start(self) -> None:
        """Start every task (ps tasks first). Raises :class:`LaunchError` when one cannot be
        started (the ones already started are stopped first)."""
        if self._started:
            raise LaunchError("this cluster was already started; create a new one")
        self._started = True
        self._start_time = time.monotonic()
        if self.backend.name == "local":
            self._markers.create()
        num_ps, num_workers = len(self.cluster["ps"]), len(self.cluster["worker"])
        self.output.message(
            f"starting {num_ps} ps and {num_workers} worker task(s)"
            + ("" if self.backend.name == "local" else f" on {self.backend.name}")
            + f" ({self.restart_policy.describe()}): {json.dumps(self.cluster)}"
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
        # each task's process, to signal or watch (a restart's line names the new one)
        pids = [f"{task.name} as pid {task.pid}" for task in self._tasks if task.pid is not None]
        if pids:
            self.output.message("started " + ", ".join(pids))
        # no spare yet: they start once the run is at work (launch/spare_start.py)

    def wait(self, timeout: float | None = None) -> int:
        """Supervise the tasks until every one has exited; return the run's exit status.

        0 when every worker exited 0; the exit status of the first task that failed on its
        own and was not restarted otherwise (128 + signal number for a signal); 128 + signal
        number after :meth:`interrupt`. ``timeout`` bounds this call (None: as long as
        training runs); when it passes, :class:`DeadlineExceeded` is raised and the tasks keep
        running, so calling ``wait`` again continues the supervision.
        """
        if not self._started:
            raise LaunchError("call start() before wait()")
        with self._supervision:  # only this thread starts the spares while it supervises
            return self._supervise(timeout)

    def _supervise(self, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            now = time.monotonic()
            self._start_spares_when_at_work(now)
            self._hand_over_left_workers(now)  # a preempted worker's restart is due at once
            # restarts first: a cancelled one lets the deadline see no worker is left, at once
            self._on_restarts_due(now)
            self._replace_stopped_ps(now)  # its kill comes back as an exit event
            self._on_spare_deadlines(now)
            self._on_departing_deadlines(now)
            self._on_deadline(now)
            if self._abandoned or (
                not self._departing
                and all(not (t.running or t.restart_pending) for t in self._tasks)
            ):
                return self._finish()
            if deadline is not None and now >= deadline:
                running = ", ".join(
                    t.name + (" (restart pending)" if t.restart_pending else "")
                    for t in self._tasks
                    if t.running or t.restart_pending
                )
                raise DeadlineExceeded(
                    f"the cluster was still running after {timeout} s (tasks {running}); "
                    "call wait() again to keep supervising, or stop() to stop them"
                )
            deadlines = [self._phase_deadline, deadline]
            deadlines += [t.restart_at for t in self._tasks] + self._spare_deadlines()
            deadlines += self._spare_start_deadlines(now) + self._handover_deadlines(now)
            deadlines += self._stopped_ps_deadlines(now)
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

    def stop(self) -> int | None:
        """Stop every task still running (SIGTERM, then SIGKILL after ``kill_timeout``), kill
        what is left in every task's process group, and return the run's exit status (None
        when it was never started). Idempotent. Call it from the thread that calls
        :meth:`wait`; other threads and signal handlers use :meth:`interrupt`."""
        if not self._started:
            self.backend.close()
            return None
        if self._result is None:
            if self._phase not in (TERMINATING, KILLING):
                self._signal_running(signal.SIGTERM)
                self._enter(TERMINATING, self.kill_timeout)
            try:
                self.wait()
            finally:
                self._kill_process_groups(quiet=True)
        self._kill_process_groups(quiet=True)
        self._sweep_spares()
        self.backend.close()
        return self._result

    def __enter__(self) -> ClusterSupervisor:
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

    # ------------------------------------------------------------------ supervision

    def _enter(self, phase: str, seconds: float | None) -> None:
        if phase != RUNNING:
            self._close_spares()  # the run is ending: no worker will be restarted
        self._phase = phase
        self._phase_deadline = None if seconds is None else time.monotonic() + seconds

    def _handle(self, event: tuple[str, object]) -> None:
        kind, payload = event
        # a task that got to work and exited at once: its marker is seen before its exit
        self._start_spares_when_at_work(time.monotonic())
        if kind == "exit":
            assert isinstance(payload, tuple)
            task, process = payload
            if not self._departed_exit(process):  # a process that left is not its task's exit
                self._on_exit(task)
        elif kind == "signal":
            assert isinstance(payload, int)
            self._on_interrupt(payload)
        elif kind == "spare-exit":
            assert isinstance(payload, Spare)
            if self._departed_exit(payload.process):
                payload.close_pipe()
            else:
                self._on_spare_exit(payload)

    def _on_exit(self, task: Task) -> None:
        assert task.process is not None
        task.returncode = task.process.returncode
        task.ended_at = time.monotonic()
        # The last lines must be read before they can be reported.
        task.process.finish_output(READER_DRAIN_TIMEOUT)
        rc = task.returncode
        assert rc is not None
        retired = retired_after_completion(
            task, self._tasks, ClusterSpec(self.cluster), self._markers
        )
        failed = rc != 0 and task.stop_signal is None and not retired
        restart_delay = self._restart_delay(task) if failed else None
        if task.stop_signal is not None and rc != 0:
            status = f"stopped ({signal_name(task.stop_signal)})"
        elif rc >= 0:
            status = f"exited {rc}"
        else:
            status = f"killed by {signal_name(-rc)}"
        if restart_delay is not None:
            status += "; restarting"
        if retired:
            status += " after training was complete"
        self.output.task_exited(task.name, status, not failed)
        if retired:
            self._retire(task, status)
        if restart_delay is not None:
            self._schedule_restart(task, restart_delay)
        elif failed:
            self._on_failure(task)
        elif self._phase == RUNNING and self._run_is_over():
            self._enter(DRAINING, self.grace_period)

    def _on_failure(self, task: Task) -> None:
        assert task.returncode is not None
        ran = (task.ended_at or task.started_at) - task.started_at
        lines = list(task.recent)
        tail = "\n".join(f"    [{task.name}] {line}" for line in lines)
        decision = self.restart_policy.decide(
            task.returncode, task.restart_history, time.monotonic()
        )
        used = f"; {decision.describe_used()}" if decision.limit else ""
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
        if self._phase in (RUNNING, DRAINING):
            self._announce_grace_period()
            self._enter(FAILING, self.grace_period)

    def _restarts_allowed(self) -> bool:
        """Tasks are restarted only while the run is running: not once every worker is done
        (draining), a task failed for good, or the run is being stopped or interrupted."""
        return self._phase == RUNNING and self._interrupt is None and self._failure is None

    def _finish(self) -> int:
        """Compute the run's status once every task has exited (or been given up on)."""
        # Kill leftovers first: a leftover that inherited a task's pipe keeps its reader from
        # reaching the end; what it already wrote stays in the pipe and is still read.
        self._sweep_spares()
        self._kill_process_groups(quiet=False)
        for task in self._tasks:
            if task.process is not None:
                task.process.finish_output(READER_DRAIN_TIMEOUT)
        workers = [t for t in self._tasks if t.job == "worker"]
        failed = self._failure.returncode if self._failure is not None else None
        result = run_status(workers, failed, self._interrupt)
        self.output.message(ending_line(result, workers, time.monotonic() - self._start_time))
        self._phase, self._phase_deadline, self._result = DONE, None, result
        memory = peak_memory_line([t.name for t in self._tasks], self._markers, self.returncodes)
        if memory is not None:
            self.output.message(memory)
        self._markers.remove()
        return result
