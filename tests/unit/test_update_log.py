"""The ps update log (``ps/update_log.py``, ``ps/update_log_segment.py``,
``ps/save_restore.py``): records round-trip, a torn tail is dropped, a corrupt record is
named with its file and offset, snapshots bound the log, and a shard restored
from a checkpoint and its log holds, bit for bit, what the shard that logged it held (async,
async in buckets, sync; SGD and Adam), driven through real services on loopback sockets."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorfleet.ps import checkpoint_handling
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.shard_checkpoint import decode_shard, encode_shard
from tensorfleet.ps.space_ahead import AHEAD_BYTES
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_log import UpdateLog
from tensorfleet.ps.update_log_room import free_bytes, log_bound, missing_room
from tensorfleet.ps.update_log_segment import (
    CRC32_FORMAT,
    MAGIC,
    RECORD,
    Base,
    Segment,
    UpdateLogCorrupt,
    checkpoint_id,
    encode_record,
)
from tensorfleet.ps.update_rules import SGD, Adam
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.tensors import as_buffer

from .service_harness import RunningService, bits, serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(60)

SECRET = b"update-log-unit-test-secret-00000001"
WORKERS = ("worker:0", "worker:1")
TIMEOUT_S = 10.0
VARIABLES = [
    {"name": "w", "shape": [4, 3], "dtype": "float32"},
    {"name": "b", "shape": [3], "dtype": "float32"},
    {"name": "d", "shape": [5], "dtype": "float64"},
]


def _gradients(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(15, generator=generator),
        torch.randn(5, generator=generator, dtype=torch.float64),
    ]


# -- the file format --------------------------------------------------------------------------


def read_segment(path: Path) -> tuple[Segment, list]:
    """The segment at ``path`` and its updates, read to the end."""
    segment = Segment(path)
    return segment, list(segment.updates())


def _log_with_updates(directory: Path, count: int) -> UpdateLog:
    log = UpdateLog(directory, "ps-0")
    log.start(Base(document_crc=1234, version=7, global_step=70))
    for i in range(count):
        log.append(
            _gradients(i),
            (0, 2) if i % 2 else None,
            i % 3 != 0,
            8 + i,
            71 + i,
            {"worker:0": {"n": i}},
        )
    return log


def test_records_round_trip(tmp_path: Path) -> None:
    log = _log_with_updates(tmp_path, 4)
    log.close()
    segment, updates = read_segment(log.current)
    assert segment.base == Base(1234, 7, 70)
    assert segment.error is None and segment.valid_bytes == log.current.stat().st_size
    assert len(updates) == 4
    for i, update in enumerate(updates):
        assert [bits(g) for g in update.gradients] == [bits(g) for g in _gradients(i)]
        assert [g.dtype for g in update.gradients] == [torch.float32, torch.float64]
        assert update.part == ((0, 2) if i % 2 else None)
        assert update.counts == (i % 3 != 0)
        assert (update.version, update.global_step) == (8 + i, 71 + i)
        assert update.data == {"worker:0": {"n": i}}


def test_a_torn_tail_is_dropped_and_cut_off_before_the_next_append(tmp_path: Path) -> None:
    log = _log_with_updates(tmp_path, 3)
    log.close()
    whole = log.current.stat().st_size
    for cut in (1, RECORD.size - 1, RECORD.size + 5, 100):  # inside the prefix, the payload
        with open(log.current, "r+b") as file:
            file.truncate(whole - cut)
        segment, updates = read_segment(log.current)
        assert len(updates) == 2 and segment.error is None
    reopened = UpdateLog(tmp_path, "ps-0")
    reopened.continue_after([segment], segment)
    reopened.append(_gradients(9), None, True, 99, 199)
    reopened.close()
    _, again = read_segment(log.current)
    assert [u.version for u in again] == [8, 9, 99]


def test_a_corrupt_record_is_named_with_its_file_and_offset(tmp_path: Path) -> None:
    log = _log_with_updates(tmp_path, 3)
    log.close()
    _, first = read_segment(log.current)
    data = bytearray(log.current.read_bytes())
    # the second update record: after the magic, the base record and the first update
    offset = len(MAGIC)
    for _ in range(2):
        offset += RECORD.size + RECORD.unpack_from(data, offset)[1]
    data[offset + RECORD.size + 40] ^= 0x01  # one bit of its payload
    log.current.write_bytes(bytes(data))
    segment, updates = read_segment(log.current)
    assert len(updates) == 1  # the records before it only
    assert segment.valid_bytes == offset
    assert isinstance(segment.error, UpdateLogCorrupt)
    message = str(segment.error)
    assert str(log.current) in message and f"byte offset {offset}" in message, message
    assert "fails its XXH3-64" in message, message
    data[offset : offset + 4] = b"XXXX"
    log.current.write_bytes(bytes(data))
    assert "starts with b'XXXX'" in str(read_segment(log.current)[0].error)
    assert len(first) == 3
    log.current.write_bytes(b"not a log at all")
    with pytest.raises(UpdateLogCorrupt, match=rf"{log.current}.*byte offset 0.*not an update log"):
        read_segment(log.current)


def test_a_segment_of_the_first_format_is_replayed_and_appended_to_in_its_format(
    tmp_path: Path,
) -> None:
    """A segment written before the checksum changed (CRC-32 records, ``TFUPDATELOG1``) by a
    ps upgraded since: its updates come back, appends keep its format, and damage to one of
    its records is named as a CRC-32 failure."""
    path = tmp_path / "ps-0.00000000.updatelog"
    pieces = [CRC32_FORMAT.magic]
    pieces += encode_record(
        {"kind": "base", "document_crc": 5, "version": 1, "global_step": 10}, (), CRC32_FORMAT
    )
    header = {"kind": "update", "part": None, "counts": True, "version": 2, "global_step": 11,
              "data": None, "buffers": [["float32", 60], ["float64", 40]]}  # fmt: skip
    pieces += encode_record(header, [as_buffer(g) for g in _gradients(0)], CRC32_FORMAT)
    path.write_bytes(b"".join(bytes(memoryview(p).cast("B")) for p in pieces))
    segment, updates = read_segment(path)
    assert segment.format is CRC32_FORMAT and segment.error is None
    assert [u.version for u in updates] == [2]
    assert all(torch.equal(a, b) for a, b in zip(updates[0].gradients, _gradients(0), strict=True))
    log = UpdateLog(tmp_path, "ps-0")
    log.continue_after([segment], segment)
    log.append(_gradients(1), None, True, 3, 12)
    log.close()
    segment, updates = read_segment(path)
    assert segment.format is CRC32_FORMAT and [u.version for u in updates] == [2, 3]
    assert all(torch.equal(a, b) for a, b in zip(updates[1].gradients, _gradients(1), strict=True))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # a bit of the last record's gradients
    path.write_bytes(bytes(data))
    segment, updates = read_segment(path)
    assert [u.version for u in updates] == [2]
    assert "fails its CRC-32" in str(segment.error), segment.error
    assert MAGIC != CRC32_FORMAT.magic  # new segments start in the new format


def test_a_save_keeps_the_segment_before_it_and_deletes_the_older_ones(tmp_path: Path) -> None:
    log = UpdateLog(tmp_path, "ps-0")
    other = UpdateLog(tmp_path, "ps-1")
    other.start(Base(1, 0, 0))
    for crc in (10, 11, 12):
        log.start(Base(crc, crc, crc))
    log.close()
    other.close()
    assert [p.name for _, p in log.segments()] == [
        "ps-0.00000001.updatelog",
        "ps-0.00000002.updatelog",
    ]
    assert [s.base.document_crc for s in log.find(11)] == [11, 12]  # and the one after it
    assert log.find(10) == []
    assert len(other.segments()) == 1  # another shard's segments are not touched


def test_a_snapshot_starts_the_replay_of_both_kept_checkpoints_and_ends_the_segments_before_it(
    tmp_path: Path,
) -> None:
    log = UpdateLog(tmp_path, "ps-0")
    log.start(Base(10, 0, 0))
    log.append(_gradients(0), None, True, 1, 1)
    log.snapshot([b"state at ", b"version 1"], 1, 1)
    log.append(_gradients(1), None, True, 2, 2)
    log.start(Base(11, 2, 2))  # checkpoint 11: checkpoint 10's restore still needs the snapshot
    log.append(_gradients(2), None, True, 3, 3)
    assert log.wait_for_deletions(TIMEOUT_S)
    assert [s.base.version for s in log.find(10)] == [1, 2]  # the snapshot, then checkpoint 11's
    assert [s.base.version for s in log.find(11)] == [2]
    log.snapshot([b"state at version 3"], 3, 3)
    log.append(_gradients(3), None, True, 4, 4)
    log.close()
    assert len(log.segments()) == 1  # a restore of either checkpoint starts at the new snapshot
    for crc in (10, 11):
        (snapshot,) = log.find(crc)
        assert bytes(snapshot.snapshot) == b"state at version 3" and snapshot.roots == (11, 10)
        assert [u.version for u in snapshot.updates()] == [4]
    assert log.find(12) == []
    assert log.snapshots == 2


def test_a_snapshot_cut_short_is_passed_over_and_the_segments_before_it_serve(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A process killed while it wrote a snapshot: the segments before it were not deleted
    yet (they go after the snapshot is whole), so the restore starts before it and stops
    there, saying once that the snapshot was cut short (a storm printed a "not the segment's
    base or snapshot record" line twice for it); the next append goes on after the last good
    record."""
    log = UpdateLog(tmp_path, "ps-0")
    log.start(Base(10, 0, 0))
    log.append(_gradients(0), None, True, 1, 1)
    first = log.current
    log._new_segment(  # what snapshot() writes before it deletes the older segments
        {"kind": "snapshot", "roots": [10], "version": 1, "global_step": 1},
        (memoryview(b"x" * 1000),),
    )
    log.close()
    with open(log.current, "r+b") as file:
        file.truncate(log.current.stat().st_size - 10)
    with caplog.at_level(logging.WARNING, logger="tensorfleet.ps"):
        chain = log.find(10)
    said = [r.getMessage() for r in caplog.records if str(log.current) in r.getMessage()]
    assert len(said) == 1 and "its first record (a snapshot" in said[0], said
    assert "was cut short: the process died while writing it" in said[0]
    assert [s.path for s in chain] == [first]
    assert [u.version for u in chain[0].updates()] == [1]
    reopened = UpdateLog(tmp_path, "ps-0")
    reopened.continue_after(chain, chain[0])
    reopened.close()
    assert [p for _, p in reopened.segments()] == [first]  # the torn snapshot deleted


def test_a_record_written_beside_its_update_is_whole_after_wait_and_gone_after_undo(
    tmp_path: Path,
) -> None:
    log = UpdateLog(tmp_path, "ps-0")
    log.start(Base(10, 0, 0))
    log.append_beside(_gradients(0), None, True, 1, 1).wait()
    log.append_beside(_gradients(1), None, True, 2, 2).undo()  # the update raised: not applied
    log.append_beside(_gradients(2), None, True, 2, 2).wait()
    log.close()
    segment, updates = read_segment(log.current)
    assert [u.version for u in updates] == [1, 2] and segment.error is None
    assert [bits(g) for g in updates[1].gradients] == [bits(g) for g in _gradients(2)]
    assert log.appended == 2


def test_a_write_that_fails_part_of_the_way_raises_at_wait_and_leaves_no_torn_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = UpdateLog(tmp_path, "ps-0")
    log.start(Base(10, 0, 0))
    log.append(_gradients(0), None, True, 1, 1)
    whole = log._write

    def half_then_full_disk(pieces: list) -> int:
        os.write(log._fd, bytes(memoryview(pieces[0]).cast("B"))[:7])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(log, "_write", half_then_full_disk)
    pending = log.append_beside(_gradients(1), None, True, 2, 2)
    with pytest.raises(OSError, match="No space left"):
        pending.wait()
    monkeypatch.setattr(log, "_write", whole)
    log.append(_gradients(2), None, True, 2, 2)  # the disk has room again
    log.close()
    segment, updates = read_segment(log.current)
    assert [u.version for u in updates] == [1, 2] and segment.error is None


# -- replay through real services ---------------------------------------------------------------


@pytest.fixture
def services() -> Iterator[list]:
    running: list[RunningService] = []
    channels: list[Channel] = []
    try:
        yield [running, channels]
    finally:
        stop_services(running, channels)


def _start(services: list, log_dir: Path, snapshot_bytes: int | None = None) -> dict[str, Channel]:
    running, channels = services
    config = ServiceConfig(
        0,
        WORKERS,
        idle_timeout_s=60.0,
        end_grace_s=60.0,
        update_log_dir=str(log_dir),
        update_log_snapshot_bytes=snapshot_bytes,
    )
    ps = serve_in_thread(config, SECRET)
    running.append(ps)
    workers = {}
    for task in WORKERS:
        channel = Channel(ps.address, SECRET, "ps:0")
        channels.append(channel)
        hello = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": task}
        channel.call("hello", hello, timeout_s=TIMEOUT_S)
        workers[task] = channel
    return workers


def _create_body(rule: Any, mode: str) -> dict[str, Any]:
    return {
        "task": "worker:0",
        "variables": VARIABLES,
        "rule": rule.to_wire(),
        "owns_global_step": True,
        "discipline": UpdateDiscipline(mode=mode).to_wire(),
        "saves_checkpoints": True,
    }


def _create(chief: Channel, rule: Any, mode: str, seed: int) -> None:
    """The chief creates the shard's variables with ``rule`` in ``mode`` (sync, or async for
    the others), from the values of ``_gradients(seed)``."""
    body = _create_body(rule, "sync" if mode == "sync" else "async")
    chief.call("create", body, [as_buffer(v) for v in _gradients(seed)], TIMEOUT_S)


def _push_round(
    workers: dict[str, Channel], mode: str, seed: int, step: int, rule: Any = None
) -> None:
    """One push per worker (sync: both join the step ``step``); buckets: two parts. With
    ``rule``, each push carries its hyperparameters with a learning rate of this round (a
    worker's schedule: :mod:`tensorfleet.ps.pushed_hyperparameters`)."""
    scheduled = (
        {}
        if rule is None
        else {
            "hyperparameters": {
                **rule.hyperparameters,
                "lr": rule.hyperparameters["lr"] / (1 + step),
            }
        }
    )
    if mode == "buckets":
        for task, channel in workers.items():
            gradients = _gradients(seed + hash(task) % 7)
            w_b = gradients[0]
            parts = [((0, 1), [w_b[:12], torch.empty(0, dtype=torch.float64)]),
                     ((1, 3), [w_b[12:], gradients[1]])]  # fmt: skip
            for i, ((start, stop), buffers) in enumerate(parts):
                last = i == len(parts) - 1
                body = {"task": task, "part": [start, stop], "last": last, "count_step": last,
                        "data": {"n": seed} if last else None, **scheduled}  # fmt: skip
                if not last:
                    del body["data"]
                channel.call("push", body, [as_buffer(b.contiguous()) for b in buffers], TIMEOUT_S)
        return
    sent = []
    for task, channel in workers.items():
        body = {"task": task, "count_step": True, "step": step, "data": {"n": seed}, **scheduled}
        gradients = _gradients(seed + (1 if task == "worker:1" else 0))
        sent.append(
            (channel, channel.send("push", body, [as_buffer(g) for g in gradients], TIMEOUT_S))
        )
        if mode == "async":
            channel.wait(sent.pop()[1], TIMEOUT_S)
    for channel, request in sent:
        channel.wait(request, TIMEOUT_S)


def _id_of(document: bytes) -> int:
    """The id a segment of the update log names the checkpoint of ``document`` by."""
    state = decode_shard(document)
    return checkpoint_id(
        state.shard, state.global_step, state.version, state.values, state.ema, state.optimizer
    )


def _save(channel: Channel) -> bytes:
    reply = channel.call("save", {"task": "worker:0"}, timeout_s=TIMEOUT_S)
    return bytes(reply.buffers[0])


def _state_of(service: Any) -> bytes:
    """The document a save would answer with, read from a stopped service (no log segment
    started: a save would start one, and delete the oldest)."""
    return checkpoint_handling.save_document(
        0, service.store, service.global_step, service.worker_data, service.buffer_bank.values
    )


@pytest.mark.parametrize("snapshot_bytes", [0, 150], ids=["no-snapshot", "snapshots"])
@pytest.mark.parametrize("mode", ["async", "buckets", "sync"])
@pytest.mark.parametrize("rule", [SGD(lr=0.1, momentum=0.9), Adam(lr=0.01)], ids=["sgd", "adam"])
def test_a_restore_replays_the_log_to_the_killed_shards_state_bit_for_bit(
    services: list, tmp_path: Path, mode: str, rule: Any, snapshot_bytes: int
) -> None:
    """``snapshots``: one after every 150 bytes of records (a push's gradients are 100 bytes:
    every second push or so, some between the buckets of a push), so the replay starts at a
    snapshot taken after the newer checkpoint. Every round's pushes carry another learning
    rate (a schedule): the replay applies each record with its own."""
    workers = _start(services, tmp_path, snapshot_bytes)
    chief = workers["worker:0"]
    _create(chief, rule, mode, seed=1000)
    for i in range(3):
        _push_round(workers, mode, seed=i, step=i, rule=rule)
    checkpoint = _save(chief)
    for i in range(3, 6):
        _push_round(workers, mode, seed=i, step=i, rule=rule)
    _save(chief)  # a newer checkpoint, never written (its writer died): the chain goes on
    for i in range(6, 9):
        _push_round(workers, mode, seed=i, step=i, rule=rule)
    stop_services(services[0], services[1])  # the shard is "killed" now; its state:
    service = services[0][0].service
    live = decode_shard(_state_of(service))
    services[0].clear()
    services[1].clear()
    if snapshot_bytes:  # one after the newer checkpoint: the only segment kept serves both
        assert service.update_log.wait_for_deletions(TIMEOUT_S)
        assert service.update_log.snapshots >= 2 and len(service.update_log.segments()) == 1
        assert service.update_log.find(_id_of(checkpoint))[0].snapshot is not None
    else:
        assert service.update_log.snapshots == 0
    workers = _start(services, tmp_path, snapshot_bytes)  # the process that takes over
    body = {**_create_body(rule, "sync" if mode == "sync" else "async"), "restore": True,
            "global_step": decode_shard(checkpoint).global_step}  # fmt: skip
    created = workers["worker:0"].call("create", body, [checkpoint], TIMEOUT_S).body
    assert created["global_step"] == live.global_step
    restored = decode_shard(_save(workers["worker:0"]))
    assert restored.global_step == live.global_step > decode_shard(checkpoint).global_step
    assert restored.version == live.version
    assert restored.worker_data == live.worker_data
    for name in live.values:
        assert bits(restored.values[name]) == bits(live.values[name]), name
    assert live.optimizer.keys() == restored.optimizer.keys()
    for key, state in live.optimizer.items():
        for field, tensor in state.items():
            assert bits(restored.optimizer[key][field]) == bits(tensor), (key, field)


def test_a_restore_of_a_checkpoint_without_its_log_keeps_the_checkpoints_state(
    services: list, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    workers = _start(services, tmp_path / "first")
    chief = workers["worker:0"]
    _create(chief, SGD(lr=0.1), "async", seed=5)
    _push_round(workers, "async", seed=1, step=0)
    checkpoint = _save(chief)
    _push_round(workers, "async", seed=2, step=1)
    stop_services(services[0], services[1])
    services[0].clear()
    services[1].clear()
    workers = _start(services, tmp_path / "elsewhere")  # another directory: no segment
    body = {**_create_body(SGD(lr=0.1), "async"), "restore": True, "global_step": 2}
    with caplog.at_level(logging.INFO, logger="tensorfleet.ps"):
        created = workers["worker:0"].call("create", body, [checkpoint], TIMEOUT_S).body
    assert created["global_step"] == 2  # the checkpoint's, not the 4 the first shard reached
    lines = [r.getMessage() for r in caplog.records]
    assert any("ps:0: 3 dense variables restored (above)" in line for line in lines), lines
    assert len(list((tmp_path / "elsewhere").iterdir())) == 1  # logging again from here


def test_a_snapshot_of_another_shard_is_refused_and_the_restore_keeps_the_checkpoint(
    services: list, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    workers = _start(services, tmp_path / "first")
    chief = workers["worker:0"]
    _create(chief, SGD(lr=0.1), "async", seed=5)
    checkpoint = _save(chief)
    stop_services(services[0], services[1])
    services[0].clear()
    services[1].clear()
    state = decode_shard(checkpoint)
    foreign = encode_shard(  # the same state, as ps:1's
        shard=1, global_step=state.global_step, version=state.version, rule=state.rule,
        layout=state.layout, values=state.values, ema=state.ema, optimizer=state.optimizer,
        worker_data={},
    )  # fmt: skip
    log = UpdateLog(tmp_path / "second", "ps-0")
    log.start(Base(_id_of(checkpoint), state.version, state.global_step))
    log.snapshot([foreign], state.version, state.global_step)
    log.close()
    workers = _start(services, tmp_path / "second")
    body = {**_create_body(SGD(lr=0.1), "async"), "restore": True, "global_step": state.global_step}
    with caplog.at_level(logging.ERROR, logger="tensorfleet.ps"):
        created = workers["worker:0"].call("create", body, [checkpoint], TIMEOUT_S).body
    assert created["global_step"] == state.global_step
    errors = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]
    assert len(errors) == 1 and "it is of ps:1, this is ps:0" in errors[0], errors


def test_the_space_allocated_ahead_is_given_back_when_the_ps_ends(
    services: list, tmp_path: Path
) -> None:
    """A ps that ended used to leave its last segment holding the 64 MiB allocated ahead of
    its records (``du`` showed it, ``ls`` did not: found in a new user's trial)."""
    workers = _start(services, tmp_path)
    chief = workers["worker:0"]
    _create(chief, SGD(lr=0.1), "async", seed=3)
    _save(chief)
    _push_round(workers, "async", seed=1, step=0)
    update_log = services[0][0].service.update_log
    segment = update_log.current
    assert update_log.space_ahead.settled(TIMEOUT_S) and update_log.space_ahead.failed is None
    assert segment.stat().st_blocks * 512 >= 32 << 20  # allocated ahead while it runs
    stop_services(services[0], services[1])
    services[0].clear()
    services[1].clear()
    assert segment.stat().st_blocks * 512 < 1 << 20  # given back at the end


def test_a_log_write_that_fails_answers_the_push_and_logs_again_from_the_next_checkpoint(
    services: list, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk under the log: the update is applied, so its push is answered; the log
    stops (a record after the gap would replay onto a state the shard never had), says so
    once, and starts again at the next checkpoint."""
    workers = _start(services, tmp_path)
    chief = workers["worker:0"]
    _create(chief, SGD(lr=0.1), "async", seed=3)
    _save(chief)
    service = services[0][0].service
    update_log = service.update_log
    _push_round(workers, "async", seed=1, step=0)
    logged = update_log.appended

    def full_disk(pieces: list) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    update_log._write = full_disk
    with caplog.at_level(logging.WARNING, logger="tensorfleet.ps"):
        _push_round(workers, "async", seed=2, step=1)  # answered: no exception here
    del update_log._write
    warnings = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0], warnings
    assert update_log.appended == logged  # nothing after the gap
    _save(chief)
    _push_round(workers, "async", seed=3, step=2)
    assert update_log.appended == logged + len(WORKERS)  # logging again


def test_a_log_without_room_logs_nothing_says_so_once_and_starts_again_when_it_has_room(
    services: list, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A log whose bound (twice the state and the records between snapshots) is more than
    half the free space of its file system does not start: the pushes are answered, nothing
    is written, one warning names the figures and the fixes; the next checkpoint asks again,
    and with room (a smaller snapshot interval) the log starts and says so."""
    workers = _start(services, tmp_path, snapshot_bytes=free_bytes(tmp_path))
    chief = workers["worker:0"]
    _create(chief, SGD(lr=0.1), "async", seed=3)
    service = services[0][0].service
    with caplog.at_level(logging.WARNING, logger="tensorfleet.ps"):
        for seed in (1, 2):
            _save(chief)
            _push_round(workers, "async", seed=seed, step=seed)
        refusals = [r.getMessage() for r in caplog.records if "no update log in" in r.getMessage()]
        assert len(refusals) == 1, refusals  # said once, for both checkpoints
        assert "more than 50% of the" in refusals[0] and "--ps-update-log DIR" in refusals[0]
        assert service.update_log.appended == 0
        assert not list(tmp_path.glob("*.updatelog"))
        service.config = dataclasses.replace(service.config, update_log_snapshot_bytes=1 << 20)
        _save(chief)
        _push_round(workers, "async", seed=3, step=3)
    assert service.update_log.appended == len(WORKERS)
    assert any("has room now: logging again" in r.getMessage() for r in caplog.records)


def test_the_bound_of_a_log_and_the_room_it_needs() -> None:
    assert log_bound(10 << 20, 0) is None and log_bound(10 << 20, None) is None  # no bound
    assert log_bound(10 << 20, 64 << 20) == 2 * (74 << 20) + AHEAD_BYTES
    directory = Path("/")
    free = free_bytes(directory)
    assert missing_room(directory, 1 << 20, None, 0, "ps:0") is None  # no snapshots: no rule
    assert missing_room(directory, 1 << 20, 64 << 20, 0, "ps:0") is None
    state = free // 16
    reason = missing_room(directory, state, free, 0, "ps:0")
    assert reason is not None and "ps:0: no update log in /" in reason, reason
    assert "twice this shard's state of" in reason and "allocated ahead" in reason, reason
    assert missing_room(directory, 1 << 20, free // 8, 4 * free, "ps:0") is None  # own segments
    # the snapshot interval the refusal suggests does fit
    suggested = re.search(r"--ps-update-log-snapshot (\d+)MiB or less fits", reason)
    assert suggested is not None, reason
    assert missing_room(directory, state, int(suggested[1]) << 20, 0, "ps:0") is None
    # a state that alone takes more than the room: no interval would do
    too_big = missing_room(directory, free, 64 << 20, 0, "ps:0")
    assert too_big is not None and "would not fit there either" in too_big, too_big


def test_a_shard_that_kept_running_restored_with_the_others_replays_its_own_log(
    services: list, tmp_path: Path
) -> None:
    """With several ps tasks the chief restores every shard when one restarts: a shard that
    did not restart takes the checkpoint and replays its own log, back to where it was."""
    workers = _start(services, tmp_path)
    chief = workers["worker:0"]
    _create(chief, Adam(lr=0.01), "async", seed=7)
    _push_round(workers, "buckets", seed=1, step=0)
    checkpoint = _save(chief)
    for i in range(2, 5):
        _push_round(workers, "buckets", seed=i, step=i)
    before = decode_shard(_state_of(services[0][0].service))
    step = decode_shard(checkpoint).global_step
    reply = chief.call(
        "restore", {"task": "worker:0", "global_step": step}, [checkpoint], TIMEOUT_S
    )
    assert reply.body["global_step"] == before.global_step > step
    _push_round(workers, "buckets", seed=9, step=9)  # the log goes on after the replay
    stop_services(services[0], services[1])
    service = services[0][0].service
    services[0].clear()
    services[1].clear()
    after = decode_shard(_state_of(service))
    assert after.version == before.version + 2
    _, updates = read_segment(service.update_log.current)
    assert len(updates) == 3 * 2 * 2 + 2 * 2  # (rounds x workers x buckets) then one round


def test_the_snapshot_size_goes_from_the_launcher_to_every_ps_and_a_bad_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorfleet import environment
    from tensorfleet.errors import ConfigError
    from tensorfleet.launch.cli import build_parser, server_config_fields
    from tensorfleet.launch.launch_command import launch_env

    parser = build_parser()
    launch = ["launch", "--ps-update-log", str(tmp_path), "--ps-update-log-snapshot"]
    env = launch_env(parser.parse_args([*launch, "256MiB", "--", "python", "t.py"]))
    assert env[environment.PS_UPDATE_LOG_SNAPSHOT_VAR] == "256MiB"
    with pytest.raises(ConfigError, match="--ps-update-log-snapshot '1Q' is not a size"):
        launch_env(parser.parse_args([*launch, "1Q", "--", "python", "t.py"]))
    monkeypatch.setenv(environment.PS_UPDATE_LOG_VAR, str(tmp_path))
    monkeypatch.setenv(environment.PS_UPDATE_LOG_SNAPSHOT_VAR, "256MiB")
    fields = server_config_fields(parser.parse_args(["server"]))
    assert fields["update_log_snapshot_bytes"] == 256 << 20  # from the launcher's environment
    fields = server_config_fields(parser.parse_args(["server", "--update-log-snapshot", "0"]))
    assert fields["update_log_snapshot_bytes"] == 0  # never; the option wins
    assert ServiceConfig(0, WORKERS, **fields).update_log_snapshot_bytes == 0
    monkeypatch.setenv(environment.PS_UPDATE_LOG_SNAPSHOT_VAR, "1Q")  # named as the variable
    with pytest.raises(ConfigError, match="TENSORFLEET_PS_UPDATE_LOG_SNAPSHOT '1Q' is not a"):
        server_config_fields(parser.parse_args(["server"]))
    with pytest.raises(ConfigError, match="TENSORFLEET_PS_UPDATE_LOG_SNAPSHOT '1Q' is not a"):
        launch_env(parser.parse_args([*launch[:3], "--", "python", "t.py"]))  # before the start
    monkeypatch.delenv(environment.PS_UPDATE_LOG_VAR)
    fields = server_config_fields(parser.parse_args(["server"]))  # no log: the variable unused
    assert "update_log_snapshot_bytes" not in fields
    with pytest.raises(ConfigError, match="--update-log-snapshot 1G has no effect without"):
        server_config_fields(parser.parse_args(["server", "--update-log-snapshot", "1G"]))
