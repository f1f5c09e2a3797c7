"""Where the ps tasks of a ``tensorfleet launch`` keep their update log: by default a directory
of this launch in ``/dev/shm``, made when it starts and removed when it ends.

What. ``--ps-update-log`` chooses: ``DIR`` (kept after the run: a later launch restored from
the same checkpoints replays it too), ``off`` (no log), or by default ``auto``: on the local
backend, a new directory ``/dev/shm/tensorfleet-update-log-<pid>-<start>`` named for the
launcher's process, given to every task as ``TENSORFLEET_PS_UPDATE_LOG`` and removed with
everything in it when the launch ends. A relative ``DIR`` is taken from the current
directory; an empty value is refused. A launch whose process was killed before it could
remove its directory leaves it behind; the next local launch of the same user, whatever its
own choice, removes every such directory whose launcher is gone and says so in one line
(:func:`remove_orphans`). Where ``/dev/shm`` is missing or not writable, and on the Ray
backend (its tasks may run on other hosts), ``auto`` is no log, and the launcher's line says
why. Each ps still asks whether its log has room before it
starts it (:mod:`tensorfleet.ps.update_log_room`: a large shard in a small ``/dev/shm``
logs nothing, in one line with the fix).

Why on by default. Without the log, a ps killed with SIGKILL (the OOM killer, a kill from
outside) comes back at its newest checkpoint and every step since is trained again; with it,
at its last acknowledged push. Its cost on a training run, the CNN on 1 ps + 3 workers
sharing 2 cores (``benchmarks/recovery.py --only training``, docs/reliability.md): 0.93x and
0.94x the steps/s without it in two runs of 3 rounds a side, 0.98x in one of 5 (32.1 against
32.8 global steps/s; same-round ratios 0.73x-1.03x, median 1.02x: within the machine's
spread), against up to a checkpoint interval of steps trained again at every ps SIGKILL
without it; its size is bounded by its snapshots (the CNN: under 200 MB). Why ``/dev/shm``: a record is written before its push
is answered, and a write to memory costs the push 2.3 ms for the CNN's 6.5 MB where one to
the disk cost several times that; a killed *process* loses nothing written there (a lost
host does, as it loses the tasks: the checkpoint covers that).

Why a directory per launch, removed at the end: the log serves restarts inside the run; kept
in memory after it, it would hold a few hundred MB per ps until the next reboot. A user who
wants it to outlive the run names a directory.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from tensorfleet import environment
from tensorfleet.errors import LaunchConfigError
from tensorfleet.ps.update_log_room import bytes_on_disk

#: Where ``auto`` puts the launch's directory.
SHARED_MEMORY_ROOT = Path("/dev/shm")
#: The name of every launch's directory starts with this (then the launcher's pid and its
#: start time, so that a directory is known to be orphaned once that process is gone).
PREFIX = "tensorfleet-update-log-"
AUTO = "auto"


@dataclass(frozen=True)
class UpdateLogDirectory:
    """What a launch gives its tasks: ``path`` (None: no log), whether the launch made it
    (and removes it at its end), the line the launcher prints about it, and the line saying
    which orphaned directories it removed (None: none)."""

    path: Path | None
    owned: bool
    line: str
    cleanup: str | None = None

    def remove(self) -> None:
        """Remove the directory and its segments when this launch made it."""
        if self.owned and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


def choose(flag: str | None, backend: str, root: Path = SHARED_MEMORY_ROOT) -> UpdateLogDirectory:
    """The update log the ``--ps-update-log`` value ``flag`` asks for (None: the launcher's
    own ``TENSORFLEET_PS_UPDATE_LOG`` if set, else ``auto``) on ``backend``; ``auto`` makes the
    launch's directory under ``root``. On the local backend, whatever the choice, the
    directories under ``root`` of launchers that are gone are removed first (said in
    ``cleanup``)."""
    cleanup = None
    if backend == "local" and root.is_dir():
        cleanup = _said(root, remove_orphans(root))
    return dataclasses.replace(_chosen(flag, backend, root), cleanup=cleanup)


def _chosen(flag: str | None, backend: str, root: Path) -> UpdateLogDirectory:
    source = "--ps-update-log"
    if flag is None:
        flag, source = environment.ps_update_log_choice() or AUTO, environment.PS_UPDATE_LOG_VAR
    choice = flag.strip()
    if not choice:
        raise LaunchConfigError(f"{source} is empty: give a directory, auto or off")
    if environment.update_log_off(choice):
        return UpdateLogDirectory(
            None,
            False,
            f"ps update log: off ({source} {choice}): a ps killed with SIGKILL "
            "comes back at its newest checkpoint",
        )
    if choice.lower() != AUTO:
        path = Path(choice).expanduser().absolute()
        return UpdateLogDirectory(
            path, False, f"ps update log: {path} ({source}; kept after the run)"
        )
    if backend != "local":
        return UpdateLogDirectory(
            None,
            False,
            f"ps update log: off (the {backend} backend's tasks may run on other "
            "hosts, where this launcher cannot make a directory; give --ps-update-log DIR on "
            "a file system every ps host has)",
        )
    if not (root.is_dir() and os.access(root, os.W_OK | os.X_OK)):
        return UpdateLogDirectory(
            None,
            False,
            f"ps update log: off ({root} is missing or not writable here; give "
            "--ps-update-log DIR to keep it elsewhere)",
        )
    path = root / f"{PREFIX}{os.getpid()}-{process_start(os.getpid())}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    return UpdateLogDirectory(
        path,
        True,
        f"ps update log: {path} (a ps killed with SIGKILL comes back at its last "
        "acknowledged push; removed at the end; --ps-update-log DIR keeps it, off: none)",
    )


def _said(root: Path, removed: list[tuple[Path, int]]) -> str | None:
    """The line that says which orphaned directories were removed (None: none)."""
    if not removed:
        return None
    total = sum(size for _, size in removed)
    names = ", ".join(path.name for path, _ in removed)
    return (
        f"removed {len(removed)} ps update log director{'y' if len(removed) == 1 else 'ies'} "
        f"of launches that are gone from {root} ({total / (1 << 20):.0f} MiB): {names}"
    )


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat``'s 22nd
    field), or None when no such process runs: with the pid, it names one process for good
    (a pid is reused, the pair is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ")"
    return stat.rsplit(")", 1)[1].split()[19]


def remove_orphans(root: Path) -> list[tuple[Path, int]]:
    """Remove the launch directories under ``root`` of this user whose launcher process is
    gone (killed before it could remove its own); the ones removed, with the bytes each
    held."""
    removed = []
    uid = os.getuid()
    for path in root.glob(PREFIX + "*"):
        pid_text, _, rest = path.name[len(PREFIX) :].partition("-")
        start, _, _ = rest.partition("-")
        try:
            if path.stat().st_uid != uid or not path.is_dir():
                continue
        except OSError:
            continue
        if pid_text.isdigit() and process_start(int(pid_text)) == start:
            continue  # its launcher still runs
        size = bytes_on_disk(path.iterdir())
        shutil.rmtree(path, ignore_errors=True)
        removed.append((path, size))
    return removed
