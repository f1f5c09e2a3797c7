"""The shard's buffer bank: creation (the chief's values, a checkpoint's winning), async and
sync combining, pushes that made no step, a checkpoint's buffers listed in another order than
the model's, a restored shard serving before any create, requests held until the create of a
shard that has no buffers, and refusals that name what is wrong."""

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
        self.refusals: dict[int, str] = {}

    def fail(self, request: Request, error_type: str, text: str) -> None:
        self.refusals[request.request_id] = text

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
    bank.take_checkpoint({"m": torch.full((2,), 7.0)}, "async")
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
    with pytest.raises(
        ConfigError, match=r"buffers \['x'\] are not on this shard \(it holds \['m'\]\)"
    ):
        bank.handlers()["buffers_pull"](_request("buffers_pull", {"names": ["x"]}))
    with pytest.raises(ProtocolError, match="shape"):
        _push(bank, "worker:0", [1.0, 2.0, 3.0])
    with pytest.raises(ProtocolError, match="needs lists"):
        bank.handlers()["buffers_create"](_request("buffers_create", {"names": "m"}))


def _pull(bank: BufferBank, names: list[str]) -> Request:
    request = _request("buffers_pull", {"task": "worker:1", "names": names})
    bank.handlers()["buffers_pull"](request)
    return request


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_checkpoint_in_another_order_serves_the_models_order(mode: str) -> None:
    """A checkpoint lists its buffers in its own order; every request is answered in the
    order of the names it gives, and sync combines each buffer with its own pushes."""
    socket = RecordingSocket()
    bank = BufferBank(socket, 2, set)
    bank.take_checkpoint({"b": torch.full((2,), 2.0), "a": torch.full((2,), 1.0)}, mode)
    model = {"a": torch.zeros(2), "b": torch.zeros(2)}
    create = _request(
        "buffers_create", {"chief": True, "mode": mode, **describe(model)}, list(model.values())
    )
    bank.handlers()["buffers_create"](create)
    assert [t.tolist() for t in socket.replies[create.request_id]] == [[1.0, 1.0], [2.0, 2.0]]
    if mode == "sync":
        bank.step_made(0, ["worker:0", "worker:1"])
    pushes = [
        _request(
            "buffers_push",
            {"task": task, "step": 0, "names": ["a", "b"]},
            [torch.full((2,), 10.0 + k), torch.full((2,), 20.0 + k)],
        )
        for k, task in enumerate(["worker:0", "worker:1"])
    ]
    for push in pushes:
        bank.handlers()["buffers_push"](push)
    a, b = ([10.5, 10.5], [20.5, 20.5]) if mode == "sync" else ([11.0, 11.0], [21.0, 21.0])
    assert [t.tolist() for t in socket.replies[pushes[1].request_id]] == [a, b]
    assert [t.tolist() for t in socket.replies[_pull(bank, ["b", "a"]).request_id]] == [b, a]


def test_a_shard_restored_from_a_checkpoint_serves_its_buffers_before_any_create() -> None:
    """A ps restarted and restored (its chief sends no create until its recovery ends)
    answers the workers' pulls and pushes with the checkpoint's buffers at once."""
    socket = RecordingSocket()
    bank = BufferBank(socket, 2, set)
    bank.take_checkpoint({"m": torch.full((2,), 7.0)}, "async")
    assert torch.equal(socket.replies[_pull(bank, ["m"]).request_id][0], torch.full((2,), 7.0))
    push = _push(bank, "worker:1", [3.0, 4.0])
    assert torch.equal(socket.replies[push.request_id][0], torch.tensor([3.0, 4.0]))


def test_requests_to_a_shard_without_buffers_wait_for_the_chiefs_create() -> None:
    """A ps restarted without a checkpoint holds a worker's pull and push until the chief
    creates the buffers again (its recovery does), then answers them in order."""
    socket = RecordingSocket()
    bank = BufferBank(socket, 2, set)
    pull = _pull(bank, ["m"])
    push = _push(bank, "worker:1", [3.0, 4.0])
    assert pull.request_id not in socket.replies and push.request_id not in socket.replies
    chiefs = {"m": torch.ones(2)}
    create = _request("buffers_create", {"chief": True, **describe(chiefs)}, list(chiefs.values()))
    bank.handlers()["buffers_create"](create)
    assert torch.equal(socket.replies[pull.request_id][0], torch.ones(2))
    assert torch.equal(socket.replies[push.request_id][0], torch.tensor([3.0, 4.0]))


def test_a_held_request_that_does_not_fit_is_refused_and_the_others_are_served() -> None:
    socket = RecordingSocket()
    bank = BufferBank(socket, 2, set)
    wrong, right = _pull(bank, ["x"]), _pull(bank, ["m"])
    chiefs = {"m": torch.ones(2)}
    create = _request("buffers_create", {"chief": True, **describe(chiefs)}, list(chiefs.values()))
    bank.handlers()["buffers_create"](create)
    assert "buffers ['x'] are not on this shard" in socket.refusals[wrong.request_id]
    assert torch.equal(socket.replies[right.request_id][0], torch.ones(2))
    assert create.request_id in socket.replies and create.request_id not in socket.refusals
