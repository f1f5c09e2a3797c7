"""Multipart messages sent and received through pyzmq's compiled calls
(:mod:`tensorfleet.wire.zmq_frames`): the same frames, trackers and errors as pyzmq's own
``send_multipart`` / ``recv_multipart``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from tensorfleet.errors import UsageError
from tensorfleet.wire.zmq_frames import NOBLOCK, readable, receive_frames, send_frames


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    router.bind("inproc://frames")
    dealer.setsockopt(zmq.IDENTITY, b"worker")
    dealer.connect("inproc://frames")
    try:
        yield router, dealer
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        context.term()


def test_frames_arrive_whole_and_in_order_both_ways(pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    router, dealer = pair
    big = bytes(range(256)) * 1024  # above pyzmq's copy threshold: sent without a copy
    assert send_frames(dealer, [b"envelope", memoryview(b"header"), b"", big]) is None
    assert router.poll(5000)
    frames = receive_frames(router)
    assert [f.bytes for f in frames] == [b"worker", b"envelope", b"header", b"", big]
    tracker = send_frames(router, [b"worker", b"reply", big], NOBLOCK, track=True)
    assert isinstance(tracker, zmq.MessageTracker)
    assert dealer.poll(5000)
    assert [bytes(f.buffer) for f in receive_frames(dealer)] == [b"reply", big]
    tracker.wait(5)
    assert tracker.done


def test_nothing_waiting_is_zmq_again_without_blocking(
    pair: tuple[zmq.Socket, zmq.Socket],
) -> None:
    router, dealer = pair
    assert not readable(router)
    with pytest.raises(zmq.Again):
        receive_frames(router, NOBLOCK)
    send_frames(dealer, [b"one"])
    assert router.poll(5000) and readable(router)  # still there: asking took nothing
    receive_frames(router, NOBLOCK)
    assert not readable(router)


def test_a_part_that_is_not_a_buffer_is_refused_before_any_part_leaves(
    pair: tuple[zmq.Socket, zmq.Socket],
) -> None:
    router, dealer = pair
    with pytest.raises(UsageError, match="frame 1 of a message is a dict"):
        send_frames(dealer, [b"first", {"not": "a buffer"}, b"last"])
    send_frames(dealer, [b"next"])  # the socket is not left half way through a message
    assert router.poll(5000)
    assert [f.bytes for f in receive_frames(router)] == [b"worker", b"next"]
