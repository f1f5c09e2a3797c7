"""The shard's buffer bank: creation (the chief's values, a checkpoint's winning), async and
sync combining, pushes that made no step, and refusals that name what is wrong."""

from __future__ import annotations

import pytest
import torch

from tensorfleet.errors import ConfigError, ProtocolError
from tensorfleet.ps.buffer_bank import BufferBank, describe
from tensorfleet.wire.service_socket import Request
from tensorfleet.wire.tensors import as_buffer, from_buffer


class RecordingSocket:
    def __init__(self) -> None:
        self.replies: dict[int, list[torch.Tensor]] = {}

    def reply(self, request: Request, body: dict, buffers: list) -> None:
        self.replies[request.request_id] = [
            from_buffer(b, torch.float32).clone() if len(b) % 4 == 0 else b for b in buffers
        ]


_ids = iter(range(1, 10_000))


def _request(op: str, body: dict, tensors: list[torch.Tensor] | None = None) -> Request:
    buffers = [as_buffer(t.contiguous()) for t in tensors or []]
    return Request(b"peer", op, next(_ids), body, buffers, 1e18, b"session")


def _bank(mode: str, departed: set[str] | None = None) -> tuple[BufferBank, RecordingSocket]:
    socket = RecordingSocket()
    bank = BufferBank(socket, 2, lambda: departed or set())
    start = {"m": torch.zeros(2)}
    request = _request(
        "buffers_create", {"chief": True, "mode": mode, **describe(start)}, list(start.values())
    )
    bank.handlers()["buffers_create"](request)
    return bank, socket


def _push(bank: BufferBank, task: str, value: list[float], step: int = 0) -> Request:
    request = _request(
        "buffers_push", {"task": task, "step": step, "names": ["m"]}, [torch.tensor(value)]
    )
    bank.handlers()["buffers_push"](request)
    return request


def test_async_keeps_the_latest_push():
    bank, socket = _bank("async")
    _push(bank, "worker:0", [1.0, 2.0])
    last = _push(bank, "worker:1", [3.0, 4.0])
    assert torch.equal(bank.values["m"], torch.tensor([3.0, 4.0]))
    assert torch.equal(socket.replies[last.request_id][0], torch.tensor([3.0, 4.0]))


def test_sync_waits_for_every_worker_of_the_step_then_answers_all_with_the_mean():
    bank, socket = _bank("sync")
    bank.step_made(0, ["worker:0", "worker:1"])
    first = _push(bank, "worker:0", [1.0, 2.0])
    assert first.request_id not in socket.replies  # held until worker:1's push
    second = _push(bank, "worker:1", [3.0, 6.0])
    for request in (first, second):
        assert torch.equal(socket.replies[request.request_id][0], torch.tensor([2.0, 4.0]))


def test_sync_push_of_a_worker_that_made_no_step_changes_nothing():
    bank, socket = _bank("sync")
    bank.step_made(0, ["worker:0"])
    stale = _push(bank, "worker:1", [9.0, 9.0])
    assert torch.equal(socket.replies[stale.request_id][0], torch.zeros(2))
    _push(bank, "worker:0", [1.0, 1.0])
    assert torch.equal(bank.values["m"], torch.tensor([1.0, 1.0]))


def test_sync_does_not_wait_for_a_departed_worker():
    bank, socket = _bank("sync", departed={"worker:1"})
    bank.step_made(0, ["worker:0", "worker:1"])
    only = _push(bank, "worker:0", [4.0, 4.0])
    assert torch.equal(socket.replies[only.request_id][0], torch.tensor([4.0, 4.0]))


def test_a_worker_other_than_the_chief_waits_for_the_chiefs_values():
    socket = RecordingSocket()
    bank = BufferBank(socket, 2, set)
    mine, chiefs = {"m": torch.full((2,), 5.0)}, {"m": torch.ones(2)}
    early = _request("buffers_create", {"chief": False, **describe(mine)}, list(mine.values()))
    bank.handlers()["buffers_create"](early)
    assert early.request_id not in socket.replies
    chief = _request("buffers_create", {"chief": True, **describe(chiefs)}, list(chiefs.values()))
    bank.handlers()["buffers_create"](chief)
    assert torch.equal(socket.replies[early.request_id][0], torch.ones(2))


def test_a_checkpoints_values_win_over_the_chiefs():
    socket = RecordingSocket()
    bank = BufferBank(socket, 2, set)
    bank.take_checkpoint({"m": torch.full((2,), 7.0)})
    start = {"m": torch.zeros(2)}
    request = _request("buffers_create", {"chief": True, **describe(start)}, list(start.values()))
    bank.handlers()["buffers_create"](request)
    assert torch.equal(socket.replies[request.request_id][0], torch.full((2,), 7.0))


def test_mismatches_are_refused_naming_the_buffer():
    bank, _ = _bank("async")
    other = {"m": torch.zeros(3)}
    with pytest.raises(ConfigError, match=r"buffer 'm' is torch.float32 \[2\] on this shard"):
        bank.handlers()["buffers_create"](
            _request("buffers_create", {"chief": True, **describe(other)}, [torch.zeros(3)])
        )
    with pytest.raises(ConfigError, match="do not match this shard's"):
        bank.handlers()["buffers_pull"](_request("buffers_pull", {"names": ["x"]}))
    with pytest.raises(ProtocolError, match="shape"):
        _push(bank, "worker:0", [1.0, 2.0, 3.0])
    with pytest.raises(ProtocolError, match="needs lists"):
        bank.handlers()["buffers_create"](_request("buffers_create", {"names": "m"}))
