"""The local backend: every task a process on this machine, forked from the run's task fork
server or started fresh as a child of the launcher.

Addresses are free loopback ports, so a local cluster is never reachable from other machines;
those of tasks running tensorfleet's own server are held until the backend is closed
(:class:`~tensorfleet.launch.ports.PortReservation`: no other process is handed such a port
between its choice and the task's bind, or while the task is restarted on it). A task whose
command is this interpreter running a script or a module is forked from one interpreter that
imported torch and tensorfleet once (:mod:`tensorfleet.launch.backends.task_forks`: why, and
which tasks); any other starts fresh, as every task does with ``TENSORFLEET_TASK_FORKS=0``.
Each task runs in its own session (process group); one reader thread per process relays its
merged stdout/stderr line by line; its exit is reported by a waiter thread (a fresh child) or
by the fork server.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import IO

from tensorfleet import environment
from tensorfleet.errors import LaunchError
from tensorfleet.launch.backends.base import Backend, ExitCallback, LineCallback, TaskProcess
from tensorfleet.launch.backends.process_group import killpg, pump_lines, start_process_group
from tensorfleet.launch.backends.task_forks import (
    NOT_THIS_INTERPRETER,
    READY_TIMEOUT_S,
    TaskForkServer,
    forkable,
    forks_enabled,
    group_has_live_member,
)
from tensorfleet.launch.ports import LOOPBACK, PortReservation


class LocalProcess(TaskProcess):
    """A task's child process on this machine, with its reader and waiter threads."""

    host = "local"

    def __init__(self, process: subprocess.Popen[bytes], reader: threading.Thread):
        self.process = process
        self.pid = process.pid
        self._reader = reader

    @property
    def returncode(self) -> int | None:
        # Set by the waiter thread's wait() once the process is reaped; never polled here,
        # so that the supervisor learns of the exit from the waiter's event first.
        return self.process.returncode

    def signal_group(self, sig: int) -> bool:
        return killpg(self.pid, sig)

    def finish_output(self, timeout: float) -> None:
        self._reader.join(timeout)


class ForkedProcess(TaskProcess):
    """A task forked from the run's task fork server, with its reader thread."""

    host = "local"

    def __init__(self, pid: int, server: TaskForkServer, reader: threading.Thread):
        self.pid = pid
        self._server = server
        self._reader = reader

    @property
    def returncode(self) -> int | None:
        return self._server.returncode(self.pid)

    def signal_group(self, sig: int) -> bool:
        if not killpg(self.pid, sig):
            return False
        if sig == 0 and self.returncode is not None:
            # a task of a dead server is a zombie until init reaps it: not a member left
            return group_has_live_member(self.pid)
        return True

    def finish_output(self, timeout: float) -> None:
        self._reader.join(timeout)


class LocalBackend(Backend):
    """Runs every task on this machine, listening on ``host`` (loopback): forked from the run's
    task fork server where it can be, else as a fresh child process of this one.

    ``fork_tasks``: None (the default) forks unless ``TENSORFLEET_TASK_FORKS=0``; False starts
    every task fresh; True forks where it can whatever the variable says."""

    name = "local"

    def __init__(self, host: str = LOOPBACK, fork_tasks: bool | None = None):
        self.host = host
        self.fork_tasks = forks_enabled() if fork_tasks is None else fork_tasks
        self._server: TaskForkServer | None = None
        self._server_lock = threading.Lock()
        self._said: set[str] = set()  # why tasks started fresh, each said once
        self._reservations: list[PortReservation] = []  # released by close()

    def allocate(self, names: Sequence[str], held: Collection[str] = ()) -> list[str]:
        """One loopback address per name; the ports of ``held`` kept bound until
        :meth:`close`, the others free again once chosen (a program that binds its port
        without ``SO_REUSEADDR``, a ``--ps-command`` of the user's, would be refused)."""
        try:
            reservation = PortReservation(len(names), self.host)
        except OSError as exc:
            raise LaunchError(f"cannot find free ports on {self.host}: {exc}") from exc
        reservation.release(
            [p for n, p in zip(names, reservation.ports, strict=True) if n not in held]
        )
        self._reservations.append(reservation)
        host = f"[{self.host}]" if ":" in self.host else self.host
        return [f"{host}:{port}" for port in reservation.ports]

    def environment(self, variables: Mapping[str, str]) -> dict[str, str]:
        env = dict(environment.environ())
        env.update(variables)
        return env

    def spawn(
        self,
        name: str,
        command: Sequence[str],
        variables: Mapping[str, str],
        cwd: str | None,
        on_line: LineCallback,
        on_exit: ExitCallback,
    ) -> TaskProcess:
        env = self.environment(variables)
        if self.fork_tasks:
            forked = self._fork(name, command, env, cwd, on_line, on_exit)
            if isinstance(forked, ForkedProcess):
                return forked
            if forked is not None and forked not in self._said:
                self._said.add(forked)
                on_line(f"tensorfleet: this task starts in a fresh interpreter: {forked}")
        return self._start_fresh(name, command, env, cwd, on_line, on_exit)

    def _fork(
        self,
        name: str,
        command: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        on_line: LineCallback,
        on_exit: ExitCallback,
    ) -> ForkedProcess | str | None:
        """Fork the task from the run's server (started at the first task, with its
        environment but the secret): the process; or why not (said to the user); or None for
        a command that is no Python program of this interpreter (it never could be)."""
        target = forkable(command, path=env.get("PATH"), cwd=cwd)
        if isinstance(target, str):
            return None if NOT_THIS_INTERPRETER in target else f"its command: {target}"
        with self._server_lock:
            if self._server is None:
                self._server = TaskForkServer(
                    {k: v for k, v in env.items() if k != environment.SECRET_VAR}
                )
            server = self._server
        unready = server.wait_ready(READY_TIMEOUT_S)
        if unready is not None:
            return unready
        read_end, write_end = os.pipe()
        try:
            pid = server.fork(target, env, os.path.abspath(cwd or os.getcwd()), write_end, on_exit)
        finally:
            os.close(write_end)
        if isinstance(pid, str):
            os.close(read_end)
            return pid
        reader = self._start_reader(name, os.fdopen(read_end, "rb"), on_line)
        return ForkedProcess(pid, server, reader)

    @staticmethod
    def _start_reader(
        name: str, pipe: IO[bytes], on_line: Callable[[str], None]
    ) -> threading.Thread:
        """Relay ``pipe``'s lines to ``on_line`` from a thread of their own."""
        reader = threading.Thread(
            target=pump_lines, args=(pipe, on_line), name=f"tensorfleet-output-{name}", daemon=True
        )
        reader.start()
        return reader

    @property
    def fork_server(self) -> TaskForkServer | None:
        """The run's task fork server, once the first task asked for it (else None)."""
        with self._server_lock:
            return self._server

    def close(self) -> None:
        """End the run's task fork server, if one started, and release the tasks' ports.
        Idempotent."""
        with self._server_lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()
        reservations, self._reservations = self._reservations, []
        for reservation in reservations:
            reservation.release()

    def _start_fresh(
        self,
        name: str,
        command: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        on_line: LineCallback,
        on_exit: ExitCallback,
    ) -> LocalProcess:
        process = start_process_group(command, env, cwd)
        assert process.stdout is not None  # stdout=PIPE
        reader = self._start_reader(name, process.stdout, on_line)

        def await_exit() -> None:
            # Untimed on purpose: it only reports, and every process is killed by stop().
            process.wait()
            on_exit()

        threading.Thread(target=await_exit, name=f"tensorfleet-wait-{name}", daemon=True).start()
        return LocalProcess(process, reader)
