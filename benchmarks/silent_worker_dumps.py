"""Stack dumps of workers that stop making steps during a chaos run, taken when it happens.

A worker that runs, is not SIGSTOPped by the storm and not being restarted, and whose ps is
neither stopped nor restarting, yet prints no step for ``silent_s`` seconds, waits somewhere.
``py-spy dump --pid`` of it (every Python thread's stack, read from outside) shows where.
The 10-minute storm of seed 6 (docs/reliability.md) had such a worker: silent for 70 s after
a SIGSTOP while its heartbeat was heard, deaf to a SIGTERM, and a rerun of the same schedule
did not reproduce it. Such a wait depends on timing, so the dump must be taken the moment the
silence is seen, not in a later run: :class:`SilentWorkerDumps` watches in a thread of the
chaos run and keeps each dump's text for the report.

The alternative, ``faulthandler`` in the workers (a signal that prints every thread's stack),
needs the worker's cooperation and its main thread back in Python, which a thread blocked in
a C call never is; py-spy reads the stacks from outside.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: A worker is silent after this many seconds without a step line (a stopped ps's SIGSTOP
#: lasts 15 s in the storm, and its workers' first step after it follows within seconds).
SILENT_S = 25.0
#: A silent process is dumped again at most this often.
REDUMP_S = 60.0
#: Seconds one ``py-spy dump`` may take.
DUMP_TIMEOUT_S = 20.0
#: Lines of each dump kept in the report.
KEPT_LINES = 80

#: What the watched run tells about each worker it may dump: task name -> (pid, seconds since
#: its last step line, or since it started or came back when it has made none since).
Candidates = Callable[[], dict[str, tuple[int, float]]]


def py_spy() -> str | None:
    """The ``py-spy`` executable: on ``PATH``, or beside this Python (a virtual environment)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else None


@dataclass
class SilentWorkerDumps:
    """Watches ``candidates`` every ``every_s`` seconds and dumps each worker silent for
    ``silent_s`` seconds (at most once every :data:`REDUMP_S` per process)."""

    silent_s: float = SILENT_S
    every_s: float = 2.0
    spy: str | None = field(default_factory=py_spy)
    dumps: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_dump: dict[int, float] = {}

    def start(self, candidates: Candidates) -> None:
        """Begin watching (nothing happens without py-spy: the report says so)."""
        if self.spy is None:
            print("chaos: py-spy not found: silent workers will not be dumped", flush=True)
            return
        self._thread = threading.Thread(
            target=self._watch, args=(candidates,), name="silent-worker-dumps", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; a dump under way ends within its own timeout."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(DUMP_TIMEOUT_S + self.every_s)

    def _watch(self, candidates: Candidates) -> None:
        while not self._stop.wait(self.every_s):
            for task, (pid, silent) in candidates().items():
                if silent < self.silent_s:
                    continue
                if time.monotonic() - self._last_dump.get(pid, -REDUMP_S) < REDUMP_S:
                    continue
                self._last_dump[pid] = time.monotonic()
                self.dumps.append(self.dump(task, pid, silent))

    def dump(self, task: str, pid: int, silent: float) -> dict:
        """One dump of ``pid``: its first :data:`KEPT_LINES` lines, or why there is none."""
        print(f"chaos: {task} (pid {pid}) made no step for {silent:.0f} s: py-spy dump", flush=True)
        assert self.spy is not None
        try:
            done = subprocess.run(
                [self.spy, "dump", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=DUMP_TIMEOUT_S,
            )
            text = done.stdout if done.returncode == 0 else f"py-spy failed: {done.stderr}"
        except subprocess.TimeoutExpired:
            text = f"py-spy dump took more than {DUMP_TIMEOUT_S:g} s"
        return {
            "task": task,
            "pid": pid,
            "silent_s": round(silent, 1),
            "lines": text.splitlines()[:KEPT_LINES],
        }
