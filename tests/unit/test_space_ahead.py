"""Space allocated ahead of an update-log segment's records (:mod:`tensorfleet.ps.space_ahead`):
the blocks exist past the last record while the file's size stays the records' end (a reader
and the torn-tail rule see nothing of it), the records read back as written, a failed
allocation says why once and the log goes on, and closing stops the thread."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorfleet.ps.space_ahead import AHEAD_BYTES, LOW_WATER_BYTES, SpaceAhead
from tensorfleet.ps.update_log import UpdateLog
from tensorfleet.ps.update_log_segment import Base, Segment

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def log_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory in memory (tmpfs allocates with ``fallocate``), as ``--log-root /dev/shm``."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        yield tmp_path
        return
    directory = shm / f"tensorfleet-test-space-ahead-{os.getpid()}-{tmp_path.name}"
    directory.mkdir()
    yield directory
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()


def test_space_is_allocated_past_the_records_and_the_size_stays_theirs(log_dir: Path) -> None:
    log = UpdateLog(log_dir, "ps-0")
    log.start(Base(document_crc=1, version=0, global_step=0))
    gradients = [torch.arange(250_000, dtype=torch.float32)]  # 1 MB a record
    for step in range(3):
        log.append(gradients, None, True, step + 1, step + 1)
    assert log.current is not None and log.space_ahead is not None
    assert log.space_ahead.settled(30), "the allocation did not finish in 30 s"
    assert log.space_ahead.failed is None, log.space_ahead.failed
    stat = os.stat(log.current)
    records_end = stat.st_size
    assert records_end > 3_000_000
    assert stat.st_blocks * 512 >= records_end + LOW_WATER_BYTES  # allocated ahead
    segment = Segment(log.current)
    updates = list(segment.updates())
    assert [u.version for u in updates] == [1, 2, 3] and segment.error is None
    assert segment.valid_bytes == records_end  # nothing past the records is read as one
    assert all(torch.equal(u.gradients[0], gradients[0]) for u in updates)
    log.close()
    assert log.space_ahead is None
    stat = os.stat(segment.path)
    assert stat.st_size == records_end  # the records stay
    assert stat.st_blocks * 512 < records_end + LOW_WATER_BYTES  # the space ahead is given back


def test_more_is_asked_for_when_the_records_come_near_its_end(tmp_path: Path) -> None:
    path = tmp_path / "segment"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        space = SpaceAhead(fd, path, end=0)
        assert space.settled(30) and space._allocated == AHEAD_BYTES
        space.wrote_to(AHEAD_BYTES - LOW_WATER_BYTES - 1)  # still above the low water mark
        assert space.settled(30) and space._allocated == AHEAD_BYTES
        space.wrote_to(AHEAD_BYTES - LOW_WATER_BYTES + 1)
        assert space.settled(30)
        assert space._allocated == 2 * AHEAD_BYTES - LOW_WATER_BYTES + 1
        assert os.stat(path).st_size == 0  # the file's size never moves
        space.close()
    finally:
        os.close(fd)


def test_a_failed_allocation_is_said_once_and_stops_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two segments in one directory failing alike (a read-only descriptor: EBADF, as a
    filesystem without fallocate would fail each segment of a run): one warning."""
    with caplog.at_level(logging.WARNING, logger="tensorfleet.ps"):
        for name in ("segment-1", "segment-2"):
            path = tmp_path / name
            path.write_bytes(b"")
            fd = os.open(path, os.O_RDONLY)
            try:
                space = SpaceAhead(fd, path, end=0)
                assert space.settled(30)
                assert isinstance(space.failed, OSError), space.failed
                space.wrote_to(10 * AHEAD_BYTES)  # asks for nothing more
                assert space.settled(1)
                space.close()
            finally:
                os.close(fd)
    lines = [r.getMessage() for r in caplog.records if "space allocated ahead" in r.getMessage()]
    assert len(lines) == 1 and str(tmp_path / "segment-1") in lines[0], lines
