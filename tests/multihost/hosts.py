"""What the multi-host tests share: the processes of a cluster spread over network namespaces,
their output with arrival times (for the failure messages), and each task's environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .netns import NetworkNamespaces

T = TypeVar("T")


@dataclass
class Child:
    """One task's process and every line it printed, with the time each line arrived."""

    name: str
    process: subprocess.Popen[str]
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None


class Children:
    """The cluster's processes, their output (one reader thread each), and the test's own
    events, all kept in arrival order for the failure messages."""

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        self.children: dict[str, Child] = {}
        self._events: list[tuple[float, str, str]] = []
        self._changed = threading.Condition()

    def start(self, name: str, argv: Sequence[str], env: dict[str, str]) -> Child:
        """Start ``argv`` in a session (and process group) of its own, output captured."""
        process = subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )
        child = Child(name, process)
        self.children[name] = child
        child.reader = threading.Thread(
            target=self._read, args=(child,), name=f"reader-{name}", daemon=True
        )
        child.reader.start()
        self.note(f"started {name} as pid {process.pid}: {' '.join(argv)}")
        return child

    def note(self, text: str) -> float:
        """Record an event of the test in the transcript; return its time."""
        now = time.monotonic()
        with self._changed:
            self._events.append((now, "test", text))
            self._changed.notify_all()
        return now

    def lines_of(self, name: str) -> list[tuple[float, str]]:
        """A copy of the lines ``name`` printed so far, with their arrival times."""
        with self._changed:
            return list(self.children[name].lines)

    def wait_for(self, found: Callable[[], T | None], timeout_s: float) -> T | None:
        """Wait until ``found()`` returns something (re-checked on every new line or exit),
        at most ``timeout_s``; return it, or ``None`` at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                result = found()
                remaining = deadline - time.monotonic()
                if result is not None or remaining <= 0:
                    return result
                self._changed.wait(min(remaining, 0.5))

    def wait_all(self, timeout_s: float) -> dict[str, int | None]:
        """Wait for every process to exit, at most ``timeout_s`` in all; their exit codes
        (``None``: still running at the deadline)."""
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int | None] = {}
        for name, child in self.children.items():
            try:
                codes[name] = child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
            else:
                self.note(f"{name} exited with {codes[name]}")
        for child in self.children.values():
            if child.reader is not None and child.process.poll() is not None:
                child.reader.join(2.0)
        return codes

    def dump_stacks(self, names: Sequence[str], wait_s: float = 2.0) -> None:
        """Ask the (worker) processes ``names`` that still run to print their threads' stacks
        (SIGUSR1, see ``link_worker.py``) into their output, and give them ``wait_s`` to."""
        asked = False
        for name in names:
            child = self.children[name]
            if child.process.poll() is None:
                try:
                    os.kill(child.process.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    continue
                self.note(f"asked {name} for its stacks (SIGUSR1)")
                asked = True
        if asked:
            time.sleep(wait_s)

    def kill_all(self) -> None:
        """SIGKILL the process group of every process still running, and reap them."""
        for child in self.children.values():
            if child.process.poll() is None:
                try:
                    os.killpg(child.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.note(f"killed {child.name}")
        for child in self.children.values():
            try:
                child.process.wait(10.0)
            except subprocess.TimeoutExpired:
                pass
            if child.process.stdout is not None and child.reader is not None:
                child.reader.join(2.0)

    def transcript(self) -> str:
        """Every line and event so far, in arrival order, with seconds since the start."""
        with self._changed:
            entries = list(self._events)
            for child in self.children.values():
                entries.extend((at, child.name, text) for at, text in child.lines)
        entries.sort(key=lambda entry: entry[0])
        return "\n".join(
            f"{at - self.started_at:7.2f}s [{name}] {text}" for at, name, text in entries
        )

    def _read(self, child: Child) -> None:
        assert child.process.stdout is not None
        for line in child.process.stdout:
            with self._changed:
                child.lines.append((time.monotonic(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()


def free_port(net: NetworkNamespaces, ns: int) -> int:
    """A TCP port free on namespace ``ns``'s address (asked inside the namespace)."""
    code = (
        "import socket; s = socket.socket(); "
        f"s.bind(({net.address(ns)!r}, 0)); print(s.getsockname()[1])"
    )
    done = subprocess.run(
        net.exec_argv(ns, [sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return int(done.stdout.strip())


def task_env(cluster: dict[str, list[str]], job: str, index: int, secret: str) -> dict[str, str]:
    """The environment of task ``job:index``: this one's, without tensorfleet settings, plus
    its TF_CONFIG, the cluster secret, unbuffered output and this interpreter's import path."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("TENSORFLEET_") and key != "TF_CONFIG"
    }
    env.update(
        TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": job, "index": index}}),
        TENSORFLEET_SECRET=secret,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(sys.path),
    )
    return env
