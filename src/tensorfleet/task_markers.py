"""Facts a task leaves for the launcher that supervises it, read when the task has ended.

The launcher decides what a task's death means (restart it, retire it, fail the run) from
what it sees: the exit status and, for some deaths, a fact only the task knows. The one fact
so far: **this worker passed the end of all-reduce training** (the final checkpoint, then the
barrier every worker reaches: ``AllReduceUpdater.finish``). A worker killed by a signal after
that has nothing left to add to the model, and its restart could never rejoin the group (the
others have left it; all-reduce mode has no partial restart): the launcher retires it. torch's
gloo backend can abort a process at interpreter exit (SIGABRT, "terminate called without an
active exception", when its threads still hold work while the interpreter shuts down); the
restart that followed waited 60 s for a group that had ended and failed the run.

The second: **this process of the task got to work** (:data:`SERVING`: a ps whose shard
holds its variables, created or restored; a worker past its first training step). The
launcher's crash-loop back-off (:mod:`tensorfleet.launch.restart_policy`) is for a task that
dies before it gets anywhere; a process that got to work and was then killed (a fault storm
kills a ps 20 s after its last restart) is restarted at once, however short its run. The
marker holds the process id, so a marker of an earlier process of the task says nothing.

The third: **this process of the task left the cluster** (:data:`LEFT`: a worker preempted
by SIGTERM whose last push was applied, whose checkpoint (the chief's) was written and whose
shards were told it left; :mod:`tensorfleet.session.preemption`). All that process still does
is end its interpreter, which took 1.8-2.9 s on the loaded 2-core test machine (torch's
teardown), twice the rest of its recovery with a warm spare; the launcher hands the task's
identity to its restart as soon as it sees this marker instead of after the exit
(:mod:`tensorfleet.launch.preempted_handover`). The marker holds the process id, as
:data:`SERVING` does.

The choice: one empty file per fact and task in a directory the launcher creates for the run
and names in ``TENSORFLEET_TASK_MARKERS`` (removed when the run ends). The alternatives: a
line on the task's output, which the user's own output could imitate or interleave with; the
exit status, which a death by a signal replaces. A task started by anything else (no
variable) writes nothing, and nothing changes for it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path

from tensorfleet import environment

MARKERS_VAR = environment.TASK_MARKERS_VAR

#: The worker passed the final barrier of all-reduce training.
COLLECTIVE_END = "collective-end"
#: This process of the task got to work (its text: the process id).
SERVING = "serving"
#: This process of the task left the cluster and only ends its interpreter now (its text: the
#: process id).
LEFT = "left"


def mark_serving(task_name: str) -> None:
    """Leave :data:`SERVING` for ``task_name`` with this process's id (see the module's
    docstring)."""
    mark(SERVING, task_name, text=str(os.getpid()))


def mark_left(task_name: str) -> None:
    """Leave :data:`LEFT` for ``task_name`` with this process's id (see the module's
    docstring): call it once the process is done with the cluster, nothing sent after it."""
    mark(LEFT, task_name, text=str(os.getpid()))


def _file(directory: Path, task_name: str, fact: str) -> Path:
    return directory / f"{task_name.replace(':', '-')}.{fact}"


def markers_directory(environ_: Mapping[str, str] | None = None) -> str | None:
    """The run's marker directory, when a launcher supervises this process (else None)."""
    return (environment.environ() if environ_ is None else environ_).get(MARKERS_VAR) or None


def mark(
    fact: str, task_name: str, environ_: Mapping[str, str] | None = None, text: str = ""
) -> None:
    """Leave ``fact`` about ``task_name`` (e.g. ``"worker:1"``) for the launcher, when one
    supervises this process (``text``: what the fact says, e.g. a number; empty: the file's
    existence is the fact); a marker that cannot be written is reported, not raised (the
    launcher then treats the task as before)."""
    directory = markers_directory(environ_)
    if not directory:
        return
    try:
        _file(Path(directory), task_name, fact).write_text(text, encoding="ascii")
    except OSError as exc:
        warnings.warn(
            f"could not leave the marker {fact!r} for the launcher in {directory}: {exc}",
            stacklevel=2,
        )


class TaskMarkers:
    """The launcher's side: the run's marker directory, created on :meth:`create` and
    removed on :meth:`remove`."""

    def __init__(self) -> None:
        self.directory: Path | None = None

    def create(self) -> str:
        """Create the directory; its path, for ``TENSORFLEET_TASK_MARKERS``."""
        self.directory = Path(tempfile.mkdtemp(prefix="tensorfleet-markers-"))
        return str(self.directory)

    def has(self, task_name: str, fact: str) -> bool:
        """Whether the task ``task_name`` left ``fact``."""
        return self.directory is not None and _file(self.directory, task_name, fact).exists()

    def read(self, task_name: str, fact: str) -> str | None:
        """What task ``task_name`` wrote for ``fact`` (None: it left no such marker)."""
        if self.directory is None:
            return None
        try:
            return _file(self.directory, task_name, fact).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError):
            return None

    def remove(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
