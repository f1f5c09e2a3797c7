"""Copy on write (:mod:`tensorfleet.ps.copy_on_write`): a ps's values go out in replies from
the store's own memory, and a write while such a reply is in flight never changes the bytes
it sends.

The replies here are real ZeroMQ messages over ``inproc``, where the receiving socket holds
the sender's very memory until it has received the message: its tracker stays pending until
then, as a tcp reply's does until ZeroMQ has written it out, and what arrives is read
from the store's memory at receive time, so a write that reached it would show.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import zmq

from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.store import VariableStore
from tensorfleet.ps.update_rules import SGD, Adam
from tensorfleet.wire.tensors import as_buffer

# Frames of 64 KiB and more: pyzmq copies smaller ones itself (zmq.COPY_THRESHOLD).
W = StoredVariable("w", (256, 128), "float32")
B = StoredVariable("b", (128,), "float32")
D = StoredVariable("d", (16384,), "float64")


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    sender.bind("inproc://replies")
    receiver.connect("inproc://replies")
    try:
        yield sender, receiver
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        context.term()


def _store(rule=None) -> VariableStore:
    store = VariableStore()
    layout = FusedLayout.of([W, B, D])
    torch.manual_seed(0)
    store.create(
        layout,
        rule or SGD(lr=0.1, momentum=0.9),
        [torch.randn(group.numel, dtype=getattr(torch, group.dtype)) for group in layout.groups],
    )
    return store


def _gradients(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(256 * 128 + 128, generator=generator),
        torch.randn(16384, dtype=torch.float64, generator=generator),
    ]


def _reply(store: VariableStore, sender: zmq.Socket) -> zmq.MessageTracker:
    """Send the store's values as a reply does (no copy, tracked) and lend them."""
    tracker = sender.send_multipart(
        [as_buffer(t) for t in store.live_values()], copy=False, track=True
    )
    assert not tracker.done  # inproc: the receiver holds the memory until it receives
    store.lent(tracker)
    return tracker


def _received(receiver: zmq.Socket, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    frames = receiver.recv_multipart(copy=False)
    return [
        torch.frombuffer(bytearray(frame.buffer), dtype=dtype)
        for frame, dtype in zip(frames, dtypes, strict=True)
    ]


def test_a_write_while_a_reply_is_in_flight_leaves_the_sent_bytes_unchanged(pair) -> None:
    sender, receiver = pair
    store = _store()
    before = [t.clone() for t in store.live_values()]
    _reply(store, sender)
    store.apply(_gradients(1))
    assert store.copies_on_write == 1
    sent = _received(receiver, [torch.float32, torch.float64])
    assert all(torch.equal(a, b) for a, b in zip(sent, before, strict=True))
    # ...and the store holds the update (the same as a store that never sent anything).
    alone = _store()
    alone.apply(_gradients(1))
    assert all(
        torch.equal(a, b) for a, b in zip(store.live_values(), alone.live_values(), strict=True)
    )


def test_a_write_after_the_reply_has_left_copies_nothing(pair) -> None:
    sender, receiver = pair
    store = _store()
    tracker = _reply(store, sender)
    _received(receiver, [torch.float32, torch.float64])
    del receiver  # the frames are released with the received message
    tracker.wait(5)
    pointers = [t.data_ptr() for t in store.live_values()]
    store.apply(_gradients(1))
    assert store.copies_on_write == 0
    assert [t.data_ptr() for t in store.live_values()] == pointers  # updated in place


def test_the_memory_a_reply_held_becomes_the_spare_of_the_next_copy(pair) -> None:
    """No megabytes mapped per copy: once the first reply has left, its memory takes the
    next copy."""
    sender, receiver = pair
    store = _store()
    first_memory = [t.data_ptr() for t in store.live_values()]
    first = _reply(store, sender)
    store.apply(_gradients(1))  # the store moves off the memory the first reply holds
    second_memory = [t.data_ptr() for t in store.live_values()]
    assert second_memory != first_memory
    _received(receiver, [torch.float32, torch.float64])
    # The first reply has left once pyzmq has released its frames, which its garbage thread
    # reports a moment after the receiver dropped them.
    first.wait(5)
    _reply(store, sender)
    store.apply(_gradients(2))
    assert store.copies_on_write == 2
    assert [t.data_ptr() for t in store.live_values()] == first_memory


@pytest.mark.parametrize("rule", [SGD(lr=0.1, momentum=0.9), Adam(lr=0.01)], ids=["sgd", "adam"])
def test_updates_that_copy_first_end_bit_for_bit_where_updates_in_place_end(pair, rule) -> None:
    """The optimizer's state (momentum, Adam's moments and step) is keyed by the variables'
    view tensors, which move with the values: training through copies loses nothing."""
    sender, receiver = pair
    copied, in_place = _store(rule), _store(rule)
    for step in range(6):
        _reply(copied, sender)
        copied.apply(_gradients(step))
        in_place.apply(_gradients(step))
        _received(receiver, [torch.float32, torch.float64])
    assert copied.copies_on_write == 6 and in_place.copies_on_write == 0
    for mine, theirs in zip(copied.live_values(), in_place.live_values(), strict=True):
        assert torch.equal(mine, theirs)
    values, _, optimizer = copied.checkpoint_parts()
    reference_values, _, reference_optimizer = in_place.checkpoint_parts()
    assert all(torch.equal(values[k], reference_values[k]) for k in values)
    for name, state in optimizer.items():
        assert all(torch.equal(t, reference_optimizer[name][k]) for k, t in state.items())


def test_a_restore_while_a_reply_is_in_flight_leaves_the_sent_bytes_unchanged(pair) -> None:
    sender, receiver = pair
    source, store = _store(), _store()
    source.apply(_gradients(3))
    values, ema, optimizer = source.checkpoint_parts()
    before = [t.clone() for t in store.live_values()]
    _reply(store, sender)
    store.restore(values, ema, optimizer, version=1)
    sent = _received(receiver, [torch.float32, torch.float64])
    assert all(torch.equal(a, b) for a, b in zip(sent, before, strict=True))
    assert all(
        torch.equal(a, b) for a, b in zip(store.live_values(), source.live_values(), strict=True)
    )


def _part_gradients(store: VariableStore, start: int, stop: int, seed: int) -> list[torch.Tensor]:
    slices = store.layout.part_slices(start, stop)
    return [g[lo:hi] for g, (lo, hi) in zip(_gradients(seed), slices, strict=True)]


def test_a_bucket_reply_in_flight_holds_back_only_writes_of_its_own_variables(pair) -> None:
    """The reply to a bucket lends that bucket's slices only: updates of the other variables
    happen in place and leave the bytes in flight unchanged; an update of the bucket's own
    variables moves the store first. Either way the store ends where a store that never
    sent anything ends."""
    sender, receiver = pair
    store, alone = _store(), _store()
    slices = store.layout.part_slices(0, 1)  # W: the float32 group's head, no float64
    (lo, hi), (d_lo, d_hi) = slices
    assert hi > lo and d_lo == d_hi
    before = store.live_values()[0][lo:hi].clone()
    tracker = sender.send_multipart(
        [as_buffer(store.live_values()[0][lo:hi])], copy=False, track=True
    )
    assert not tracker.done
    store.lent(tracker, slices)
    pointers = [t.data_ptr() for t in store.live_values()]
    for start, stop, seed in [(1, 2, 1), (2, 3, 2)]:  # B, then D: not W
        store.apply(_part_gradients(store, start, stop, seed), part=(start, stop))
        alone.apply(_part_gradients(alone, start, stop, seed), part=(start, stop))
    assert store.copies_on_write == 0
    assert [t.data_ptr() for t in store.live_values()] == pointers  # written in place
    store.apply(_part_gradients(store, 0, 1, 3), part=(0, 1))  # W itself: copy first
    alone.apply(_part_gradients(alone, 0, 1, 3), part=(0, 1))
    assert store.copies_on_write == 1
    (sent,) = _received(receiver, [torch.float32])
    assert torch.equal(sent, before)
    assert all(
        torch.equal(a, b) for a, b in zip(store.live_values(), alone.live_values(), strict=True)
    )
