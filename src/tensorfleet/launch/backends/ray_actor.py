"""What runs inside a Ray actor for one task: its process on that node, and its lines.

:class:`TaskRunner` is a plain class; the Ray backend (:mod:`tensorfleet.launch.backends.ray`)
makes it an actor, one per task, placed by Ray on some node of the cluster. The actor picks
its task's address (the node's IP and a free port), starts the task's command there in its
own process group (the same way the local backend does), keeps its output lines in a queue
that the launcher drains with :meth:`TaskRunner.read`, and signals the process group on the
launcher's request. The actor never restarts anything: the launcher's supervisor does (the
same restart policy for every backend). A task process dies with its actor (``prctl``
PR_SET_PDEATHSIG), so killing the actors leaves nothing running.

Only plain values (strings, lists, ints) cross between the launcher and the actor.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import threading
import time

from tensorfleet.errors import LaunchError
from tensorfleet.launch.backends.process_group import (
    READER_DRAIN_TIMEOUT,
    killpg,
    pump_lines,
    start_process_group,
)

#: Most lines returned by one :meth:`TaskRunner.read`.
MAX_LINES_PER_READ = 1000
_EOF = None


class TaskRunner:
    """Runs one task's processes on the node where Ray placed this actor."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._eof = False
        self._exited_at: float | None = None

    def node_address(self) -> str:
        """This node's IP address as it is registered in the Ray cluster (what the other
        nodes reach it by), else the address Ray finds for this machine."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
                return str(node["NodeManagerAddress"])
        return str(ray.util.get_node_ip_address())

    def reserve_address(self) -> str:
        """``ip:port``: this node's IP and a TCP port free on it now, for the task to listen
        on (the same window as :func:`tensorfleet.launch.ports.free_ports`)."""
        ip = self.node_address()
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((ip, 0))
            port = sock.getsockname()[1]
        return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"

    def start(self, command: list[str], variables: dict[str, str], cwd: str | None) -> int:
        """Start ``command`` with ``variables`` added to this node's environment; its pid.
        Raises ``OSError`` (through Ray) when it cannot be started."""
        if self._process is not None and self._process.poll() is None:
            raise LaunchError(f"this task's process {self._process.pid} is still running")
        env = dict(os.environ)
        env.update(variables)
        process = start_process_group(command, env, cwd, die_with_parent=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def read_all() -> None:
            assert process.stdout is not None
            pump_lines(process.stdout, lines.put)
            lines.put(_EOF)

        threading.Thread(target=read_all, name="tensorfleet-task-output", daemon=True).start()
        self._process, self._lines, self._eof, self._exited_at = process, lines, False, None
        return process.pid

    def read(self, max_wait: float) -> tuple[list[str], int | None]:
        """The output lines printed since the last call (waiting up to ``max_wait`` seconds
        for the first), and the process's ``returncode`` once it ended and its output was
        read to the end, or :data:`READER_DRAIN_TIMEOUT` after its exit (a grandchild can
        hold the pipe open); None while it runs."""
        process = self._process
        if process is None:
            raise LaunchError("no process was started by this actor")
        deadline = time.monotonic() + max_wait
        out: list[str] = []
        while not self._eof and len(out) < MAX_LINES_PER_READ:
            remaining = 0.0 if out else deadline - time.monotonic()
            try:
                line = (
                    self._lines.get(timeout=remaining)
                    if remaining > 0
                    else self._lines.get_nowait()
                )
            except queue.Empty:
                break
            if line is _EOF:
                self._eof = True
            else:
                out.append(line)
        if len(out) >= MAX_LINES_PER_READ:
            return out, None  # more to read first
        returncode = process.poll()
        if returncode is None and self._eof:
            # The output is closed; the exit normally follows at once.
            try:
                returncode = process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return out, None
        if returncode is None:
            return out, None
        if self._exited_at is None:
            self._exited_at = time.monotonic()
        if self._eof or time.monotonic() - self._exited_at >= READER_DRAIN_TIMEOUT:
            return out, returncode
        return out, None

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the current process's group; False when it no longer exists."""
        process = self._process
        return process is not None and killpg(process.pid, sig)
