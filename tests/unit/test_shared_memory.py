"""The same-host fast path (tensorfleet.wire.shared_memory): payloads in shared memory,
authenticated like frames, chosen automatically, and nothing left behind."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorfleet.errors import AuthenticationError, ProtocolError, RemoteError
from tensorfleet.launch.ports import free_port
from tensorfleet.wire import message as wire
from tensorfleet.wire import shared_memory as shm
from tensorfleet.wire.auth import REQUEST_ROLE, MessageSigner, MessageVerifier
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.service_socket import ServiceSocket

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


class EchoService:
    """A ServiceSocket in a thread that answers every request with its own buffers
    (``b"mark"`` prepended to none: the same bytes), recording where they came from."""

    def __init__(self, shared_memory: bool | None = True) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.socket = ServiceSocket(self.address, SECRET, shared_memory=shared_memory)
        self.stop = threading.Event()
        self.requests: list[tuple[str, bool]] = []
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while not self.stop.is_set():
                if not self.socket.poll(0.05):
                    continue
                request = self.socket.receive()
                if request is None:
                    continue
                in_memory = any(
                    not isinstance(b, memoryview) or b.obj.__class__.__name__ != "Frame"
                    for b in request.buffers
                )
                self.requests.append((request.op, in_memory))
                self.socket.reply(request, {"n": len(request.buffers)}, list(request.buffers))
        except BaseException as exc:  # surfaced by close()
            self.failure = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT_S)
        self.socket.close()
        assert self.failure is None, self.failure


@pytest.fixture
def service() -> Iterator[EchoService]:
    running = EchoService()
    try:
        yield running
    finally:
        running.close()


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
        assert service.socket._peer_segments.mapped == 2  # the request and the reply segment
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
            assert channel.staging(sizes) is None  # the segment is held until the answer
            reply = channel.wait(request_id, TIMEOUT_S)
            assert [bytes(b) for b in reply.buffers] == payloads
            assert service.requests[-1] == ("echo", True)
        assert channel.staging([100]) is None  # too small to go through shared memory
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
        _, placed = segments.headers(1, staged, {})
        monkeypatch.undo()
        assert copies == []
        addresses = [shm._as_bytes_tensor(b).data_ptr() for b in (*staged, *placed)]
        assert addresses[:2] == addresses[2:]
        assert bytes(placed[0][:4]) == b"abcd" and bytes(placed[1]) == b"1234567"
        assert segments.staging([BIG], {1: "echo"}) is None  # request 1 still in flight
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
    assert shm.enabled({})


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


def test_payload_altered_in_shared_memory_fails_authentication() -> None:
    segment = shm.Segment(BIG)
    frames, verifier, peers = _signed_in_memory(segment, [b"a" * BIG])
    try:
        segment.bytes[BIG - 1] ^= 1  # after signing: someone changed the payload
        with pytest.raises(AuthenticationError, match="payload authentication failed in chunk"):
            wire.decode(frames, wire.KIND_REQUEST, verifier, wire.Limits(), _resolver(peers))
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
    real_open = os.open

    def retired_meanwhile(path: str, flags: int, *args: object) -> int:
        if path.startswith("/proc/") and "/fd/" in path:
            raise FileNotFoundError(2, "No such file or directory")
        return real_open(path, flags, *args)

    monkeypatch.setattr(shm.os, "open", retired_meanwhile)
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
