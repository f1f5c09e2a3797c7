"""Whether a shard's update log has room where it is kept: the most bytes the log can hold,
against what its file system has free.

The rule. A shard starts (or goes on) logging after a checkpoint or a restore only when its
log's *bound* (:func:`log_bound`) fits in :data:`ROOM_SHARE` of the space its file system has
free, counting the space the shard's own segments hold now as free (a checkpoint or snapshot
deletes them). Otherwise it logs nothing until the next checkpoint, where the rule is asked
again, and says so once, with the figures and the fixes (:func:`missing_room`).

The invariant: a shard whose log started never holds more than its bound, so with the rule a
log cannot fill its file system from a healthy start; a file system that fills anyway (other
writers) is met by the log's own rule for a failed write (it stops until the next checkpoint,
the push is answered: :mod:`tensorfleet.ps.update_log`).

Why. ``tensorfleet launch`` keeps the log in ``/dev/shm`` by default, which is memory: the
log of a shard with a large state (a BERT-base-sized model with Adam holds 1.3 GB of state,
so its log up to 13 GB with the default snapshots) would take the memory the tasks need.
Refusing at the start, in one line that says what it would take, is better than a host
swapping or a tmpfs full in the middle of a run. Why half: two shards on one host each see
the room the other left, so a second shard cannot take all of what the first left; and the
rest of the host's shared memory (the same-host path's segments, the workers' data) needs
room too.

The bound. With snapshots (the default), a shard's log holds at most a snapshot and
``snapshot_after_bytes`` of records since it, twice over around a checkpoint (the segments of
the checkpoint before are kept until a snapshot after the newer one is whole), plus the space
allocated ahead of the current segment's records (:mod:`tensorfleet.ps.space_ahead`).
Without snapshots (``0``: never), the log grows until the next checkpoint with no bound the
shard can tell, and the rule does not apply (the setting is the user's choice).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tensorfleet.ps.space_ahead import AHEAD_BYTES

#: The share of its file system's free space a shard's log may take at most (module
#: docstring: why half).
ROOM_SHARE = 0.5


def log_bound(dense_state_bytes: int, snapshot_after_bytes: int | None) -> int | None:
    """The most bytes the log of a shard whose dense state (values, moving average, optimizer
    state) takes ``dense_state_bytes`` holds when it writes a snapshot after
    ``snapshot_after_bytes`` of records; None without snapshots (no bound)."""
    if not snapshot_after_bytes:
        return None
    return 2 * (dense_state_bytes + snapshot_after_bytes) + AHEAD_BYTES


def bytes_on_disk(paths: Iterable[Path]) -> int:
    """The bytes the files ``paths`` take on their file system (allocated blocks: the space a
    log allocated ahead of its records counts, a file's unwritten holes do not); a file gone
    meanwhile (a deleting thread) counts nothing."""
    held = 0
    for path in paths:
        try:
            held += path.stat().st_blocks * 512
        except FileNotFoundError:
            pass
    return held


def free_bytes(directory: Path) -> int:
    """The bytes an unprivileged writer may still write on ``directory``'s file system."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def missing_room(
    directory: Path,
    state_bytes: int,
    snapshot_after_bytes: int | None,
    held_bytes: int,
    shard_name: str,
) -> str | None:
    """Why the log of ``shard_name`` may not start in ``directory``, or None when it has
    room: the :func:`log_bound` of its ``state_bytes`` and ``snapshot_after_bytes`` against
    :data:`ROOM_SHARE` of the free space, the ``held_bytes`` of the shard's own segments
    counted as free. The reason spells the bound out and names the largest snapshot interval
    that would fit, if one would."""
    bound = log_bound(state_bytes, snapshot_after_bytes)
    if bound is None or snapshot_after_bytes is None:
        return None
    room = ROOM_SHARE * (free_bytes(directory) + held_bytes)
    if bound <= room:
        return None
    fitting = int((room - AHEAD_BYTES) / 2 - state_bytes) >> 20 << 20  # whole MiB
    fix = (
        f"or write snapshots more often (--ps-update-log-snapshot {fitting >> 20}MiB or less "
        "fits there)"
        if fitting >= 1 << 20
        else "(more frequent snapshots would not fit there either)"
    )
    return (
        f"{shard_name}: no update log in {directory}: it could hold up to {_size(bound)} "
        f"(twice this shard's state of {_size(state_bytes)} and the {_size(snapshot_after_bytes)} "
        f"of updates logged between snapshots, plus {_size(AHEAD_BYTES)} allocated ahead), more "
        f"than {ROOM_SHARE:.0%} of the {_size(int(room / ROOM_SHARE))} free there; a ps killed "
        "with SIGKILL comes back at its newest checkpoint. Give the log a directory with room "
        f"(tensorfleet launch --ps-update-log DIR, tensorfleet server --update-log DIR) {fix}; "
        "asked again at the next checkpoint"
    )


def _size(count: int) -> str:
    """``count`` bytes for a person: MiB below a GiB, else GiB."""
    if count < 1 << 30:
        return f"{count / (1 << 20):.0f} MiB"
    return f"{count / (1 << 30):.1f} GiB"
