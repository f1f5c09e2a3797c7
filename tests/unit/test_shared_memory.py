"""The same-host fast path (tensorfleet.wire.shared_memory): payloads in shared memory named
by authenticated headers, replies handed out without a copy, chosen automatically (and
given up, with one line, where the service cannot reach the memory), nothing left behind."""

from __future__ import annotations

import gc
import mmap
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch

from tensorfleet.errors import (
    AuthenticationError,
    ConfigError,
    ConnectionLost,
    DeadlineExceeded,
    ProtocolError,
    RemoteError,
)
from tensorfleet.launch.ports import free_port
from tensorfleet.wire import memfd_segment, reply_regions
from tensorfleet.wire import message as wire
from tensorfleet.wire import shared_memory as shm
from tensorfleet.wire.auth import REQUEST_ROLE, MessageSigner, MessageVerifier
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.service_request import Request
from tensorfleet.wire.service_socket import ServiceSocket
from tests.unit import echo_service

SECRET = b"shared-memory-unit-test-secret-0001"
TIMEOUT_S = 10.0
BIG = shm.MIN_BYTES * 3 + 5  # not a multiple of the alignment

pytestmark = pytest.mark.skipif(not shm.enabled({}), reason="needs memfd_create and /proc")


def _tensorfleet_memfds() -> list[str]:
    """This process's open or mapped tensorfleet segments."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:tensorfleet-" in link:
            found.append(link)
    maps = Path("/proc/self/maps").read_text()
    return found + [line for line in maps.splitlines() if "memfd:tensorfleet-" in line]


class EchoService(echo_service.EchoService):
    """An echo service (``tests/unit/echo_service.py``) under this file's secret, with the
    same-host path on, recording where each request's buffers came from: ``requests`` holds
    ``(op, in_memory)``, ``in_memory`` True when they were not ZeroMQ frames."""

    def __init__(self, shared_memory: bool | None = True) -> None:
        self.requests: list[tuple[str, bool]] = []
        super().__init__(None, SECRET, shared_memory=shared_memory)

    def record(self, request: Request) -> None:
        super().record(request)
        in_memory = any(
            not isinstance(b, memoryview) or b.obj.__class__.__name__ != "Frame"
            for b in request.buffers
        )
        self.requests.append((request.op, in_memory))


@pytest.fixture
def service() -> Iterator[EchoService]:
    running = EchoService()
    try:
        yield running
    finally:
        running.close()


def _fail_descriptor_opens(monkeypatch: pytest.MonkeyPatch, error: OSError) -> None:
    """Make every open of another process's descriptor (``/proc/PID/fd/N``) fail with
    ``error``, as a hardened /proc or a file retired meanwhile would."""
    real_open = os.open

    def failing(path: str, flags: int, *args: object) -> int:
        if path.startswith("/proc/") and "/fd/" in path:
            raise error
        return real_open(path, flags, *args)

    monkeypatch.setattr(shm.os, "open", failing)


def _connected(address: str, shared_memory: bool | None = True) -> Channel:
    channel = Channel(address, SECRET, "ps:0", shared_memory=shared_memory)
    channel.call("hello", {}, timeout_s=TIMEOUT_S)
    return channel


def test_large_payloads_round_trip_through_shared_memory(service: EchoService) -> None:
    channel = _connected(service.address)
    try:
        assert channel.uses_shared_memory
        payloads = [os.urandom(BIG), b"", os.urandom(1000), os.urandom(shm.MIN_BYTES)]
        for _ in range(3):  # the segments are reused
            reply = channel.call("echo", {}, payloads, timeout_s=TIMEOUT_S)
            assert [bytes(b) for b in reply.buffers] == payloads
        small = channel.call("echo", {}, [b"tiny"], timeout_s=TIMEOUT_S)
        assert [bytes(b) for b in small.buffers] == [b"tiny"]
        assert service.requests[1:] == [("echo", True)] * 3 + [("echo", False)]
        # The request segment and one reply segment, with two regions in it: while the loop
        # asks for the next reply, `reply` still holds the previous one's region, which is
        # then not offered.
        assert service.socket._peer_segments.mapped == 2
        assert channel._segments.reply_segments == 1
        assert channel._segments.reply_regions == 2
    finally:
        channel.close()


def _region_of(buffer: memoryview, segments: shm.ClientSegments) -> tuple[int, int] | None:
    """(segment token, offset) of the reply region of ``segments`` that holds ``buffer``, or
    None when it lies in none (it came in a frame)."""
    address = memfd_segment.as_bytes_tensor(buffer).data_ptr()
    for regions in segments._replies._by_size.values():
        for region in regions:
            start = region.bytes.data_ptr()
            if start <= address < start + region.size:
                return region.segment.token, region.start
    return None


def test_a_reply_is_handed_out_where_it_lies_and_its_segment_waits_until_released(
    service: EchoService,
) -> None:
    """No copy out of the reply segment: the buffers are views of a region of it. The
    service is never offered a region whose memory the caller still references, and is
    offered it again once the caller lets go (e.g. the parameters adopted a newer reply)."""
    channel = _connected(service.address)
    try:
        first_payload, second_payload = os.urandom(BIG), os.urandom(BIG)
        first = channel.call("echo", {}, [first_payload], timeout_s=TIMEOUT_S)
        held = _region_of(first.buffers[0], channel._segments)
        assert held is not None  # a view of the reply segment, not a private copy
        second = channel.call("echo", {}, [second_payload], timeout_s=TIMEOUT_S)
        other = _region_of(second.buffers[0], channel._segments)
        assert other is not None and other != held
        assert bytes(first.buffers[0]) == first_payload  # not overwritten by the second
        del first
        third = channel.call("echo", {}, [first_payload], timeout_s=TIMEOUT_S)
        assert _region_of(third.buffers[0], channel._segments) == held  # released: reused
        assert bytes(second.buffers[0]) == second_payload
        assert channel._segments.reply_regions == 2
    finally:
        channel.close()


def test_free_regions_of_a_size_no_longer_asked_for_give_their_pages_back(
    service: EchoService,
) -> None:
    """A worker's first reply is the whole model, later ones its buckets: once the whole-
    model region is free and a reply of another size needs a new region, its pages go back
    to the OS (they read as zeros: the memory was dropped, for the service's mapping too),
    and the region still serves a later reply of its size correctly."""
    channel = _connected(service.address)
    try:
        whole = os.urandom(4 * BIG)
        first = channel.call("echo", {}, [whole], timeout_s=TIMEOUT_S)
        replies = channel._segments._replies
        (whole_region,) = [r for regions in replies._by_size.values() for r in regions]
        assert bytes(first.buffers[0]) == whole
        del first  # the parameters moved on to the buckets' regions
        kept = [channel.call("echo", {}, [os.urandom(BIG)], timeout_s=TIMEOUT_S) for _ in range(2)]
        assert replies.reclaimed_bytes == 0  # not yet: taken too recently
        for _ in range(
            2 * reply_regions.RECLAIM_AFTER_ROUNDS * 3
        ):  # replies of one size, no new region
            channel.call("echo", {}, [os.urandom(BIG)], timeout_s=TIMEOUT_S)
        assert replies.reclaimed_bytes == 0  # nothing is given back while no region is carved
        for _ in range(2):  # the free region, then a new one (the others are referenced)
            kept.append(channel.call("echo", {}, [os.urandom(BIG)], timeout_s=TIMEOUT_S))
        assert replies.reclaimed_bytes >= 4 * BIG - 2 * mmap.PAGESIZE
        assert whole_region.reclaimed
        assert not any(whole_region.bytes[mmap.PAGESIZE : 4 * BIG - mmap.PAGESIZE].tolist())
        assert all(not r.reclaimed for r in replies._by_size[-(-BIG // shm.ALIGN) * shm.ALIGN])
        again = channel.call("echo", {}, [whole], timeout_s=TIMEOUT_S)  # the same region, refilled
        assert bytes(again.buffers[0]) == whole
        assert _region_of(again.buffers[0], channel._segments) == (
            whole_region.segment.token,
            whole_region.start,
        )
        assert not whole_region.reclaimed
        assert all(len(bytes(r.buffers[0])) == BIG for r in kept)
    finally:
        channel.close()


def test_referenced_reply_regions_at_their_limit_send_the_reply_in_frames(
    service: EchoService,
) -> None:
    channel = _connected(service.address)
    try:
        region_bytes = -(-BIG // shm.ALIGN) * shm.ALIGN
        channel._segments._replies.max_bytes = 2 * region_bytes
        kept = [channel.call("echo", {}, [os.urandom(BIG)], timeout_s=TIMEOUT_S) for _ in range(2)]
        payload = os.urandom(BIG)
        reply = channel.call("echo", {}, [payload], timeout_s=TIMEOUT_S)
        assert bytes(reply.buffers[0]) == payload
        assert _region_of(reply.buffers[0], channel._segments) is None  # came in a frame
        assert all(_region_of(r.buffers[0], channel._segments) is not None for r in kept)
    finally:
        channel.close()


def test_a_service_that_cannot_open_the_shared_memory_makes_the_client_use_tcp(
    service: EchoService, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A hardened /proc (or a ptrace policy) that forbids opening another process's
    descriptors: the hello's probe fails on the service, the client says so once and sends
    its payloads over the socket; nothing fails."""
    _fail_descriptor_opens(monkeypatch, PermissionError(13, "Permission denied"))
    with caplog.at_level("WARNING", logger="tensorfleet.wire"):
        channel = _connected(service.address)
    try:
        assert not channel.uses_shared_memory
        assert "Permission denied" in (channel.shared_memory_refused or "")
        lines = [r.getMessage() for r in caplog.records if "shared memory" in r.getMessage()]
        assert len(lines) == 1 and "payloads to it go over TCP" in lines[0], lines
        payload = os.urandom(BIG)
        reply = channel.call("echo", {}, [payload], timeout_s=TIMEOUT_S)
        assert bytes(reply.buffers[0]) == payload
        assert service.requests[-1] == ("echo", False)
        channel.call("hello", {}, timeout_s=TIMEOUT_S)  # a second hello: no second line
        assert len([r for r in caplog.records if "shared memory" in r.getMessage()]) == 1
    finally:
        channel.close()


def test_reply_buffers_stay_valid_after_the_next_reply(service: EchoService) -> None:
    channel = _connected(service.address)
    try:
        first_payload, second_payload = os.urandom(BIG), os.urandom(BIG)
        first = channel.call("echo", {}, [first_payload], timeout_s=TIMEOUT_S)
        second = channel.call("echo", {}, [second_payload], timeout_s=TIMEOUT_S)
        assert bytes(first.buffers[0]) == first_payload  # not overwritten by the second
        assert bytes(second.buffers[0]) == second_payload
    finally:
        channel.close()


def test_a_payload_built_in_the_staging_buffers_goes_without_a_copy(service: EchoService) -> None:
    channel = _connected(service.address)
    try:
        sizes = [BIG, 1000]
        for _ in range(3):  # the segment is reused
            staged = channel.staging(sizes)
            assert staged is not None and [b.nbytes for b in staged] == sizes
            payloads = [os.urandom(n) for n in sizes]
            for view, payload in zip(staged, payloads, strict=True):
                view[:] = payload
            request_id = channel.send("echo", {}, staged, timeout_s=TIMEOUT_S)
            other = channel.staging(sizes)  # the segment is held until the answer: another one
            assert other is not None and _address(other[0]) != _address(staged[0])
            reply = channel.wait(request_id, TIMEOUT_S)
            assert [bytes(b) for b in reply.buffers] == payloads
            assert service.requests[-1] == ("echo", True)
        assert channel.staging([100]) is None  # too small to go through shared memory
    finally:
        channel.close()


def _address(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr()


def test_requests_in_flight_together_each_hold_a_segment_of_their_own_up_to_the_limit(
    service: EchoService,
) -> None:
    """A worker's buckets of one step are in flight together: each payload goes through a
    request segment of its own (none written while the service may still read it), up to
    MAX_REQUEST_SEGMENTS; one more goes through ZeroMQ; every answer is its own request's."""
    channel = _connected(service.address)
    try:
        payloads = [os.urandom(BIG + i) for i in range(shm.MAX_REQUEST_SEGMENTS + 1)]
        staged_addresses = set()
        request_ids = []
        for index, payload in enumerate(payloads):
            staged = channel.staging([len(payload)])
            if index < shm.MAX_REQUEST_SEGMENTS:
                assert staged is not None
                staged_addresses.add(_address(staged[0]))
                staged[0][:] = payload
                request_ids.append(channel.send("echo", {}, staged, timeout_s=TIMEOUT_S))
            else:
                assert staged is None  # every segment is held by a request in flight
                request_ids.append(channel.send("echo", {}, [payload], timeout_s=TIMEOUT_S))
        assert len(staged_addresses) == shm.MAX_REQUEST_SEGMENTS
        for request_id, payload in zip(reversed(request_ids), reversed(payloads), strict=True):
            assert bytes(channel.wait(request_id, TIMEOUT_S).buffers[0]) == payload
        through_memory = [in_memory for _, in_memory in service.requests[-len(payloads) :]]
        assert through_memory == [True] * shm.MAX_REQUEST_SEGMENTS + [False]
        # Answered, the segments are free again, and one that fits is reused (no new one).
        again = channel.staging([BIG])
        assert again is not None and _address(again[0]) in staged_addresses
    finally:
        channel.close()


def test_buffers_already_in_place_are_not_copied_again(monkeypatch: pytest.MonkeyPatch) -> None:
    segments = shm.ClientSegments()
    try:
        staged = segments.staging([BIG, 7], {})
        staged[0][:4], staged[1][:] = b"abcd", b"1234567"
        copies: list[torch.Tensor] = []
        original_copy = torch.Tensor.copy_
        monkeypatch.setattr(
            torch.Tensor, "copy_", lambda t, *a, **k: copies.append(t) or original_copy(t, *a, **k)
        )
        _, placed = segments.headers(1, "echo", staged, {})
        monkeypatch.undo()
        assert copies == []
        addresses = [memfd_segment.as_bytes_tensor(b).data_ptr() for b in (*staged, *placed)]
        assert addresses[:2] == addresses[2:]
        assert bytes(placed[0][:4]) == b"abcd" and bytes(placed[1]) == b"1234567"
        # Request 1 still in flight: its segment is not offered, another one is.
        other = segments.staging([BIG], {1: "echo"})
        assert other is not None and _address(other[0]) != addresses[0]
        assert segments.retired == 0
        assert segments.staging([BIG], {}) is not None  # abandoned: fresh segments
        assert segments.retired == 1
    finally:
        segments.close()


def test_a_channel_to_another_host_offers_no_staging(service: EchoService) -> None:
    channel = _connected(service.address, shared_memory=False)
    try:
        assert channel.staging([BIG]) is None
    finally:
        channel.close()


def test_turned_off_it_uses_frames(service: EchoService) -> None:
    channel = _connected(service.address, shared_memory=False)
    try:
        assert not channel.uses_shared_memory
        reply = channel.call("echo", {}, [b"x" * BIG], timeout_s=TIMEOUT_S)
        assert bytes(reply.buffers[0]) == b"x" * BIG
        assert service.requests[-1] == ("echo", False)
    finally:
        channel.close()


def test_the_counts_read_zero_when_nothing_went_through_shared_memory(
    service: EchoService,
) -> None:
    # cluster_stats() shows them as they are: a reader of ["shared_memory"]["requests"]
    # gets 0 over TCP rather than a KeyError
    channel = _connected(service.address, shared_memory=False)
    try:
        channel.call("echo", {}, [b"x" * BIG], timeout_s=TIMEOUT_S)
        assert dict(service.socket.shared_memory) == {"requests": 0, "replies": 0}
    finally:
        channel.close()


def test_a_service_on_another_host_is_not_treated_as_local(
    service: EchoService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm, "host_identity", lambda: "another-boot/1/0")
    channel = _connected(service.address)
    try:
        assert not channel.uses_shared_memory
    finally:
        channel.close()


def test_environment_variable_turns_it_off() -> None:
    assert not shm.enabled({"TENSORFLEET_SHARED_MEMORY": "0"})
    assert shm.enabled({}) and shm.enabled({"TENSORFLEET_SHARED_MEMORY": "1"})


def test_an_environment_value_that_is_neither_on_nor_off_is_refused() -> None:
    with pytest.raises(ConfigError, match="TENSORFLEET_SHARED_MEMORY='of' is neither on nor off"):
        shm.enabled({"TENSORFLEET_SHARED_MEMORY": "of"})


# -- authentication and bad descriptions -------------------------------------------------------


def _signed_in_memory(
    segment: shm.Segment, payloads: list[bytes]
) -> tuple[list, MessageVerifier, shm.PeerSegments]:
    signer = MessageSigner(SECRET, REQUEST_ROLE)
    placed = segment.write(payloads)
    header = {"op": "push", "shm": segment.describe()}
    frames = wire.encode(wire.KIND_REQUEST, header, placed, signer, in_frames=False)
    return frames, MessageVerifier(SECRET, REQUEST_ROLE), shm.PeerSegments()


def _resolver(peers: shm.PeerSegments):
    return lambda header, sizes: peers.buffers(header["shm"], sizes)


def test_payload_in_shared_memory_verifies_and_is_not_copied() -> None:
    segment = shm.Segment(BIG)
    frames, verifier, peers = _signed_in_memory(segment, [b"a" * BIG])
    message = None
    try:
        assert len(frames) == wire.FIXED_FRAMES  # headers and tags only on the wire
        message = wire.decode(frames, wire.KIND_REQUEST, verifier, wire.Limits(), _resolver(peers))
        assert bytes(message.buffers[0]) == b"a" * BIG
        segment.bytes[0] = ord("b")  # the same memory: the service reads it in place
        assert bytes(message.buffers[0][:1]) == b"b"
    finally:
        del message
        peers.close()
        segment.close()


def test_a_payload_in_shared_memory_carries_no_chunk_tags_and_its_header_is_authentic() -> None:
    """The payload is not authenticated byte by byte (only the peer's own user can reach
    it: docs/security.md); the header that names the segment and the sizes is, so nobody
    without the secret can point a service at other memory or other sizes."""
    segment = shm.Segment(BIG)
    frames, verifier, peers = _signed_in_memory(segment, [b"a" * BIG])
    try:
        assert memoryview(frames[2]).nbytes == 0  # no chunk tags
        header = bytearray(memoryview(frames[1]))
        header[-3] ^= 1  # a size or the segment's name, altered on the way
        with pytest.raises(AuthenticationError, match="message authentication failed"):
            wire.decode(
                [frames[0], bytes(header), frames[2]],
                wire.KIND_REQUEST,
                verifier,
                wire.Limits(),
                _resolver(peers),
            )
        signer = MessageSigner(SECRET, REQUEST_ROLE)
        header_bytes = msgpack.packb(
            {"op": "push", "shm": segment.describe(), "sizes": [BIG]}, use_bin_type=True
        )
        with_tags = wire.sign_frames(
            signer, wire.KIND_REQUEST, signer.next_counter(), header_bytes, b"t" * 16
        )
        with pytest.raises(ProtocolError, match="chunk tags for a payload in shared memory"):
            wire.decode(with_tags, wire.KIND_REQUEST, verifier, wire.Limits(), _resolver(peers))
    finally:
        peers.close()
        segment.close()


def test_a_message_with_its_payload_in_memory_is_refused_without_a_resolver() -> None:
    segment = shm.Segment(BIG)
    frames, verifier, _ = _signed_in_memory(segment, [b"a" * BIG])
    try:
        with pytest.raises(ProtocolError, match="where none is set up"):
            wire.decode(frames, wire.KIND_REQUEST, verifier, wire.Limits())
    finally:
        segment.close()


def test_truncated_segment_or_oversized_buffers_are_refused() -> None:
    segment = shm.Segment(BIG)
    peers = shm.PeerSegments()
    try:
        with pytest.raises(ProtocolError, match="buffers of .* bytes in a shared-memory segment"):
            peers.buffers(segment.describe(), [segment.size + 1])
        with pytest.raises(ProtocolError, match="the header says"):
            peers.buffers({**segment.describe(), "size": segment.size + 64}, [10])
    finally:
        peers.close()
        segment.close()


@pytest.mark.parametrize(
    "description",
    [None, {}, {"pid": 1, "fd": 1, "token": "../x", "size": 1}, {"pid": True, "fd": 1}],
)
def test_malformed_descriptions_are_protocol_errors(description: object) -> None:
    with pytest.raises(ProtocolError):
        shm.PeerSegments().buffers(description, [1])


def test_stale_segment_is_a_clear_error() -> None:
    segment = shm.Segment(BIG)
    description = segment.describe()
    segment.close()
    replacement = shm.Segment(BIG)  # may reuse the same descriptor number
    try:
        with pytest.raises(ProtocolError, match="stale shared-memory segment"):
            shm.PeerSegments().buffers(description, [10])
    finally:
        replacement.close()


def test_a_segment_retired_between_the_name_check_and_the_open_is_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client may close its descriptor at any moment (an abandoned request): an open
    that fails after the name matched is a stale segment, not an OSError out of the loop."""
    segment = shm.Segment(BIG)
    _fail_descriptor_opens(monkeypatch, FileNotFoundError(2, "No such file or directory"))
    try:
        with pytest.raises(ProtocolError, match="stale shared-memory segment: .* cannot be opened"):
            shm.PeerSegments().buffers(segment.describe(), [10])
    finally:
        segment.close()


def test_a_service_answers_a_request_naming_a_stale_segment(service: EchoService) -> None:
    channel = _connected(service.address)
    try:
        gone = shm.Segment(BIG)
        description = gone.describe()
        gone.close()
        signer = channel._signer
        header = {
            "op": "echo",
            "id": 999,
            "srv": channel.server_session,
            "timeout_ms": 5000,
            "body": {},
            "shm": description,
        }
        channel._pending[999] = "echo"
        channel._socket.send_multipart(
            wire.encode(wire.KIND_REQUEST, header, [b"x" * 100], signer, in_frames=False)
        )
        with pytest.raises(RemoteError, match="stale shared-memory segment"):
            channel.wait(999, TIMEOUT_S)
        assert service.socket.rejected["shm"] == 1
    finally:
        channel.close()


def test_an_abandoned_request_retires_the_segments(service: EchoService) -> None:
    channel = _connected(service.address)
    try:
        request_id = channel.send("echo", {}, [b"x" * BIG], timeout_s=TIMEOUT_S)
        channel.forget_pending()  # e.g. after a failure: its answer will be ignored
        reply = channel.call("echo", {}, [b"y" * BIG], timeout_s=TIMEOUT_S)
        assert bytes(reply.buffers[0]) == b"y" * BIG
        assert channel._segments.retired == 1
        assert request_id != 0
    finally:
        channel.close()


# -- nothing left behind -------------------------------------------------------------------------

CHILD = r"""
import sys, time
from tensorfleet.wire.channel import Channel
channel = Channel(sys.argv[1], b"shared-memory-unit-test-secret-0001", "ps:0", shared_memory=True)
channel.call("hello", {}, timeout_s=10)
reply = channel.call("echo", {}, [b"z" * 300000], timeout_s=10)
assert channel.uses_shared_memory and bytes(reply.buffers[0]) == b"z" * 300000
print("ready", flush=True)
time.sleep(60)
"""


def test_a_killed_client_leaves_nothing_in_dev_shm_and_its_memory_goes_with_the_service(
    service: EchoService,
) -> None:
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, service.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = child.stdout.readline()
        assert line.strip() == "ready", f"child said {line!r}; stderr: {child.stderr.read()}"
        assert service.socket._peer_segments.mapped == 2
        os.kill(child.pid, signal.SIGKILL)
        child.wait(TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(TIMEOUT_S)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after == before  # memfd segments never have a name there
    assert _tensorfleet_memfds() != []  # the service still maps the dead client's memory...
    service.socket._peer_segments.close()
    gc.collect()
    assert _tensorfleet_memfds() == []  # ...and once it unmaps, nothing of it is left


HOLDING_SERVICE = r"""
import sys
from tensorfleet.wire.service_request import Request
from tensorfleet.wire.service_socket import ServiceSocket
from tests.unit import echo_service
service = ServiceSocket(sys.argv[1], b"shared-memory-unit-test-secret-0001", shared_memory=True)
while True:
    if not service.poll(1.0):
        continue
    request = service.receive()
    if request is None:
        continue
    if request.op == "hold":  # mid-exchange: the payload mapped, no answer yet
        print("holding", bytes(request.buffers[0][:4]).decode(), flush=True)
        continue
    service.reply(request, {}, list(request.buffers))
"""


def _start_holding_service(address: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-c", HOLDING_SERVICE, address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_a_service_killed_in_the_middle_of_an_exchange_is_recovered_like_over_tcp() -> None:
    """A ps killed (SIGKILL) while it holds a request whose payload lies in shared memory:
    the client's wait ends (the connection dropped), its segments are retired at the next
    request, and once a new service runs at the address the same channel says hello and
    sends through shared memory again, with the right bytes; the dead process's mapping
    went with it."""
    address = f"127.0.0.1:{free_port()}"
    first = _start_holding_service(address)
    second = None
    channel = Channel(address, SECRET, "ps:0", shared_memory=True)
    try:
        channel.call("hello", {}, timeout_s=TIMEOUT_S)
        assert channel.uses_shared_memory
        request_id = channel.send("hold", {}, [b"held" + b"x" * BIG], timeout_s=TIMEOUT_S)
        line = first.stdout.readline()
        assert line.split() == ["holding", "held"], f"{line!r}; stderr: {first.stderr.read()}"
        os.kill(first.pid, signal.SIGKILL)
        first.wait(TIMEOUT_S)
        with pytest.raises((ConnectionLost, DeadlineExceeded)):
            channel.wait(request_id, TIMEOUT_S)
        second = _start_holding_service(address)
        channel.forget_pending()  # what the client does after a failure, before its hello
        channel.call("hello", {}, timeout_s=TIMEOUT_S)
        payload = os.urandom(BIG)
        reply = channel.call("echo", {}, [payload], timeout_s=TIMEOUT_S)
        assert bytes(reply.buffers[0]) == payload
        assert channel.uses_shared_memory and channel._segments.retired == 1
    finally:
        channel.close()
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(TIMEOUT_S)


def test_many_replies_held_at_once_share_a_few_segments(service: EchoService) -> None:
    """A large model pushed in buckets of 1 MiB has hundreds of replies adopted as its
    parameters at once: each gets a region of its own, carved out of segments of
    REPLY_SEGMENT_BYTES, not a file and a mapping each."""
    channel = _connected(service.address)
    try:
        payloads = [os.urandom(1 << 20) for _ in range(80)]
        held = [channel.call("echo", {}, [p], timeout_s=TIMEOUT_S) for p in payloads]
        assert [bytes(r.buffers[0]) for r in held] == payloads  # none overwritten
        assert all(_region_of(r.buffers[0], channel._segments) is not None for r in held)
        assert channel._segments.reply_regions == 80
        assert channel._segments.reply_segments == 2  # 80 MiB in segments of 64 MiB
        assert service.socket._peer_segments.mapped == 3
        del held
        again = [channel.call("echo", {}, [p], timeout_s=TIMEOUT_S) for p in payloads[:10]]
        assert [bytes(r.buffers[0]) for r in again] == payloads[:10]
        assert channel._segments.reply_regions == 80  # released regions reused
    finally:
        channel.close()


@pytest.mark.parametrize(
    ("offset", "length"), [(-64, 100), (1, 100), (0, 1 << 40), ("0", 10), (True, 10)]
)
def test_a_reply_range_outside_the_segment_is_refused(offset: object, length: object) -> None:
    segment = shm.Segment(BIG)
    peers = shm.PeerSegments()
    try:
        description = {**segment.describe(), "offset": offset, "length": length}
        with pytest.raises(ProtocolError, match="does not lie in the"):
            peers.write(description, [b"x" * 10])
    finally:
        peers.close()
        segment.close()


def test_an_encrypted_channel_sends_its_payloads_through_shared_memory_too() -> None:
    """With --encrypt the headers go sealed and the payloads through shared memory, neither
    encrypted nor tagged (they never leave the host: docs/security.md)."""
    address = f"127.0.0.1:{free_port()}"
    socket = ServiceSocket(address, SECRET, encrypt=True, shared_memory=True)
    stop, failures = threading.Event(), []

    def serve() -> None:
        try:
            while not stop.is_set():
                if socket.poll(0.05):
                    request = socket.receive()
                    if request is not None:
                        socket.reply(request, {}, list(request.buffers))
        except BaseException as exc:  # surfaced below
            failures.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    channel = Channel(address, SECRET, "ps:0", encrypt=True, shared_memory=True)
    try:
        channel.call("hello", {}, timeout_s=TIMEOUT_S)
        payload = os.urandom(BIG)
        for _ in range(2):
            reply = channel.call("echo", {}, [payload], timeout_s=TIMEOUT_S)
            assert bytes(reply.buffers[0]) == payload
        assert channel.uses_shared_memory
        assert dict(socket.shared_memory) == {"requests": 2, "replies": 2}
    finally:
        channel.close()
        stop.set()
        thread.join(TIMEOUT_S)
        socket.close()
    assert not failures, failures
