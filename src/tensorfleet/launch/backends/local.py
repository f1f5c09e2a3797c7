"""The local backend: every task a child process of the launcher, on this machine.

Addresses are free loopback ports (:func:`~tensorfleet.launch.ports.free_ports`), so a local
cluster is never reachable from other machines. Each task runs in its own session (process
group); one reader thread per process relays its merged stdout/stderr line by line, one
waiter thread per process reaps it and reports the exit.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Mapping, Sequence

from tensorfleet import environment
from tensorfleet.errors import LaunchError
from tensorfleet.launch.backends.base import Backend, ExitCallback, LineCallback, TaskProcess
from tensorfleet.launch.backends.process_group import killpg, pump_lines, start_process_group
from tensorfleet.launch.ports import LOOPBACK, free_ports


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


class LocalBackend(Backend):
    """Runs every task as a child process of this one, listening on ``host`` (loopback)."""

    name = "local"

    def __init__(self, host: str = LOOPBACK):
        self.host = host

    def allocate(self, names: Sequence[str]) -> list[str]:
        try:
            ports = free_ports(len(names), self.host)
        except OSError as exc:
            raise LaunchError(f"cannot find free ports on {self.host}: {exc}") from exc
        host = f"[{self.host}]" if ":" in self.host else self.host
        return [f"{host}:{port}" for port in ports]

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
    ) -> LocalProcess:
        process = start_process_group(command, self.environment(variables), cwd)
        assert process.stdout is not None  # stdout=PIPE
        reader = threading.Thread(
            target=pump_lines,
            args=(process.stdout, on_line),
            name=f"tensorfleet-output-{name}",
            daemon=True,
        )
        reader.start()

        def await_exit() -> None:
            # Untimed on purpose: it only reports, and every process is killed by stop().
            process.wait()
            on_exit()

        threading.Thread(target=await_exit, name=f"tensorfleet-wait-{name}", daemon=True).start()
        return LocalProcess(process, reader)
