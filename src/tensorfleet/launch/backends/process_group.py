"""A task's command as a child process in its own process group, and its output as lines.

Shared by the local backend (children of the launcher) and the Ray backend (children of a
Ray actor on some node): the child starts in a new session, so that signalling its process
group reaches whatever it started too; its stdout and stderr are merged into one pipe read
line by line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from tensorfleet import process_forks

#: Longest chunk read as one line, so a child printing without newlines cannot eat memory.
MAX_LINE_BYTES = 64 * 1024
#: Seconds to wait for a reader thread to drain a pipe after its process exited. Short: a
#: grandchild that inherited the pipe can hold it open long after the task is gone.
READER_DRAIN_TIMEOUT = 0.5


def start_process_group(
    command: Sequence[str],
    env: Mapping[str, str],
    cwd: str | os.PathLike[str] | None,
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``command`` in a new session (its own process group) with stdout and stderr
    merged into one pipe and no stdin. Raises ``OSError`` when it cannot be started.

    ``die_with_parent`` (Linux): the kernel sends the child SIGKILL when its parent dies, so
    a task started by a Ray actor cannot outlive a killed actor."""
    return subprocess.Popen(
        list(command),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
        preexec_fn=(
            process_forks.die_with_parent(signal.SIGKILL)
            if die_with_parent and sys.platform == "linux"
            else None
        ),
    )


def pump_lines(pipe: IO[bytes], on_line: Callable[[str], None]) -> None:
    """Call ``on_line`` with every line read from ``pipe`` until its end, then close it."""
    try:
        for raw in iter(lambda: pipe.readline(MAX_LINE_BYTES), b""):
            on_line(clean_line(raw))
    except (OSError, ValueError):
        pass  # pipe closed under us during shutdown; nothing more to read
    finally:
        pipe.close()


def clean_line(raw: bytes) -> str:
    """Decode one output line and drop its ending; keep what a terminal would show of a line
    redrawn with carriage returns (progress bars)."""
    text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
    if "\r" in text:
        parts = [part for part in text.split("\r") if part]
        text = parts[-1] if parts else ""
    return text


def killpg(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        # PermissionError: on some systems a group of only zombies answers EPERM.
        return False
    return True
