"""Running a real local cluster in a test: every task a process, all output kept for the
failure message, every process gone afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tensorfleet.launch.local_cluster import LocalCluster
from tensorfleet.launch.output import Output
from tensorfleet.launch.ports import free_port
from tests.processes import process_alive

PROGRAMS = Path(__file__).parent / "programs"


class RecordingOutput(Output):
    """Keeps every line of every task, and the launcher's messages, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.lines: list[tuple[str, str]] = []

    def line(self, task: str, text: str) -> None:
        with self._changed:
            self.lines.append((task, text))
            self._changed.notify_all()

    def task_exited(self, task: str, status: str, ok: bool) -> None:
        self.message(f"{task} ended: {status}")

    def message(self, text: str, level: str = "info") -> None:
        with self._changed:
            self.lines.append(("launcher", f"{level}: {text}"))
            self._changed.notify_all()

    def wait_for(
        self, predicate: Callable[[list[tuple[str, str]]], bool], what: str, timeout_s: float
    ) -> None:
        """Wait (woken by each new line, not polling) until ``predicate(lines)``; an
        AssertionError naming ``what``, with the transcript, after ``timeout_s``."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self.lines), timeout_s):
                raise AssertionError(
                    f"not seen within {timeout_s} s: {what}\n{self._transcript_unlocked()}"
                )

    def of(self, task: str) -> list[str]:
        with self._lock:
            return [text for name, text in self.lines if name == task]

    def transcript(self) -> str:
        with self._lock:
            return self._transcript_unlocked()

    def _transcript_unlocked(self) -> str:
        return "\n".join(f"[{name}] {text}" for name, text in self.lines[-400:])


@dataclass
class ClusterRun:
    returncode: int
    output: RecordingOutput
    pids: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"exit status {self.returncode}; output:\n{self.output.transcript()}"


def run_local_cluster(
    num_ps: int,
    num_workers: int,
    worker_command: Sequence[str],
    timeout_s: float,
    grace_period: float = 10.0,
    env: dict[str, str] | None = None,
    ps_command: Sequence[str] | None = None,
) -> ClusterRun:
    """Run a cluster to the end (or ``timeout_s``); always stop every process. ``env``: more
    variables for every task; ``ps_command``: the ps tasks' program (default: the built-in
    parameter server). The cluster's ports are held from their choice to the run's end
    (``launch/ports.py``), so no other test process can take one before its task binds it."""
    output = RecordingOutput()
    cluster = LocalCluster(
        num_ps,
        num_workers,
        list(worker_command),
        ps_command=ps_command,
        output=output,
        grace_period=grace_period,
        env={"PYTHONPATH": os.pathsep.join(sys.path), **(env or {})},
    )
    try:
        cluster.start()
        returncode = cluster.wait(timeout=timeout_s)
    except BaseException as exc:
        cluster.stop()
        raise AssertionError(f"cluster run failed: {exc!r}\n{output.transcript()}") from exc
    finally:
        cluster.stop()
    run = ClusterRun(returncode, output, dict(cluster.pids))
    leftovers = [name for name, pid in run.pids.items() if process_alive(pid)]
    assert not leftovers, f"processes left behind: {leftovers}\n{run}"
    return run


@pytest.fixture
def python() -> str:
    return sys.executable


@dataclass
class GlooRanks:
    """The ranks' exit codes and outputs, by rank."""

    codes: list[int | None]
    outputs: list[str]

    @property
    def transcript(self) -> str:
        return "\n".join(f"--- rank {k} ---\n{out}" for k, out in enumerate(self.outputs))


def run_gloo_ranks(
    program: Path, world: int, timeout_s: float, extra_env: dict[str, str] | None = None
) -> GlooRanks:
    """Run ``program`` as ``world`` ranks of a gloo group on a free loopback port (``RANK``,
    ``WORLD_SIZE``, ``MASTER_PORT`` in their environment, one thread each); their exit
    codes and outputs. A rank still running after ``timeout_s`` is killed (its output reads
    ``(timed out)``); none outlives the call."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, str(program)],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in ranks:
            try:
                out, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                out = "(timed out)"
            outputs.append(out)
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return GlooRanks([proc.returncode for proc in ranks], outputs)
