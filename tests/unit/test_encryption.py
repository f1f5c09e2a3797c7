"""``--encrypt`` over real sockets: nothing of the model crosses the network in the clear
(a recording TCP relay between a client and the ps shows it), every altered or replayed
sealed message is dropped while the service keeps serving, and peers that disagree about
encryption, or about the secret, are told so at once with an error naming the fix.

The sealing itself (each part authenticated, nonces, key derivation) is tested without
sockets in ``test_wire_encryption.py``."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import torch
import zmq

from tensorfleet.errors import (
    AuthenticationError,
    ConnectionLost,
    DeadlineExceeded,
    EncryptionMismatch,
    ServiceRestarted,
)
from tensorfleet.launch.ports import free_port
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service import ParameterService, ServiceConfig
from tensorfleet.ps.update_rules import SGD
from tensorfleet.wire import message as wire
from tensorfleet.wire.auth import (
    CHUNK_BYTES,
    REPLY_ROLE,
    REQUEST_ROLE,
    MessageSigner,
    MessageVerifier,
)
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.encryption import KEY_EXCHANGE_OP, ChannelEncryption
from tensorfleet.wire.service_socket import ServiceSocket
from tensorfleet.worker.client import ClientTimeouts, ParameterClient
from tests.unit import echo_service

pytestmark = pytest.mark.timeout(60)
SECRET = b"encryption-test-secret-0123456789"
MARKER = b"TENSORFLEET-PLAINTEXT-MARKER!!!!"  # 32 bytes = 8 float32 values
NAME = "secret.weight"
TIMEOUT_S = 10.0


class RecordingRelay:
    """A TCP relay between a client and a service that keeps every byte it forwards, and
    can flip one byte of what the client sends (:meth:`tamper_at`)."""

    def __init__(self, target_port: int) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        self.recorded = bytearray()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = [self.listener]
        self.sent_by_client = 0
        self.flip_at: int | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def tamper_at(self, offset: int) -> None:
        """Flip the byte ``offset`` bytes after everything the client has sent so far."""
        with self.lock:
            self.flip_at = self.sent_by_client + offset

    def _accept(self) -> None:
        try:
            while True:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target_port))
                self.sockets += [client, server]
                for a, b, upstream in ((client, server, True), (server, client, False)):
                    threading.Thread(target=self._pump, args=(a, b, upstream), daemon=True).start()
        except OSError:
            return  # closed

    def _pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while data := source.recv(65536):
                with self.lock:
                    self.recorded += data
                    if upstream:
                        start, self.sent_by_client = (
                            self.sent_by_client,
                            self.sent_by_client + len(data),
                        )
                        if self.flip_at is not None and start <= self.flip_at < self.sent_by_client:
                            data = bytearray(data)
                            data[self.flip_at - start] ^= 0x40
                            self.flip_at = None
                sink.sendall(data)
        except OSError:
            return

    def seen(self) -> bytes:
        with self.lock:
            return bytes(self.recorded)

    def close(self) -> None:
        for s in self.sockets:
            s.close()


# -- a ps, and the model as a client pushes it ------------------------------------------------


def _serve_ps(encrypt: bool, secret: bytes = SECRET):
    port = free_port()
    sock = ServiceSocket(f"127.0.0.1:{port}", secret, encrypt=encrypt)
    service = ParameterService(sock, ServiceConfig(0, ("worker:0",)))
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop,), daemon=True)
    thread.start()
    return port, sock, stop, thread


def _stop_ps(sock: ServiceSocket, stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    thread.join(10)
    sock.close()


def _exchange(
    address: str,
    encrypt: bool,
    timeouts: ClientTimeouts | None = None,
    repeats: int = 64,
    secret: bytes = SECRET,
) -> torch.Tensor:
    """Register a variable made of MARKER, pull, push+pull; the values it ends with."""
    weight = torch.nn.Parameter(
        torch.frombuffer(bytearray(MARKER * repeats), dtype=torch.float32).clone()
    )
    weight.grad = torch.zeros_like(weight)
    plan = plan_placement([VariableSpec(NAME, tuple(weight.shape), "float32", 4)], 1)
    client = ParameterClient([address], secret, "worker:0", timeouts, encrypt=encrypt)
    try:
        client.connect()
        client.register([(NAME, weight)], plan, SGD(lr=0.0), is_chief=True)
        client.pull()
        client.push_pull()
    finally:
        client.close()
    return weight.detach().clone()


@pytest.mark.parametrize("repeats", [64, CHUNK_BYTES // len(MARKER) * 2 + 3], ids=["2KB", "2MB"])
@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "plain"])
def test_the_model_crosses_the_network_in_the_clear_only_without_encryption(
    encrypt: bool, repeats: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORFLEET_SHARED_MEMORY", "0")  # every payload through the relay
    # ... and none on the payload stream, which connects to the ps's own stream port, past the
    # relay (the stream is plain text too without --encrypt: docs/security.md)
    monkeypatch.setenv("TENSORFLEET_PAYLOAD_STREAM", "0")
    port, sock, stop, thread = _serve_ps(encrypt)
    relay = RecordingRelay(port)
    try:
        values = _exchange(f"127.0.0.1:{relay.port}", encrypt, repeats=repeats)
    finally:
        _stop_ps(sock, stop, thread)
        relay.close()
    assert bytes(values.numpy().tobytes()) == MARKER * repeats  # lr 0: the values came back
    seen = relay.seen()
    assert len(seen) > 3 * len(MARKER) * repeats, "the relay saw the traffic"
    assert (MARKER in seen) is (not encrypt)
    assert (NAME.encode() in seen) is (not encrypt)


# -- peers that disagree ------------------------------------------------------------------------


def test_a_client_that_does_not_encrypt_is_told_to_set_the_flag() -> None:
    port, sock, stop, thread = _serve_ps(encrypt=True)
    try:
        with pytest.raises(EncryptionMismatch, match="encrypts its traffic.*TENSORFLEET_ENCRYPT=1"):
            _exchange(f"127.0.0.1:{port}", encrypt=False)
        assert sock.rejected["unencrypted"] >= 1
        _exchange(f"127.0.0.1:{port}", encrypt=True)  # still serving those who encrypt
    finally:
        _stop_ps(sock, stop, thread)


def test_an_encrypting_client_of_a_service_that_does_not_is_told_which_end_to_change() -> None:
    port, sock, stop, thread = _serve_ps(encrypt=False)
    try:
        with pytest.raises(EncryptionMismatch, match="does not encrypt its traffic.*--encrypt"):
            _exchange(f"127.0.0.1:{port}", encrypt=True)
        assert sock.rejected["unencrypted"] == 1
        _exchange(f"127.0.0.1:{port}", encrypt=False)
    finally:
        _stop_ps(sock, stop, thread)


def test_a_client_without_the_secret_fails_the_key_exchange_with_secret_mismatch() -> None:
    port, sock, stop, thread = _serve_ps(encrypt=True)
    try:
        with pytest.raises(AuthenticationError, match="secret mismatch"):
            _exchange(
                f"127.0.0.1:{port}",
                encrypt=True,
                secret=b"not-the-cluster-secret-0123456789",
                timeouts=ClientTimeouts(connect_s=5.0),
            )
        assert sock.rejected["auth"] >= 1 and sock.encrypted_connections == 0
    finally:
        _stop_ps(sock, stop, thread)


# -- an echo service and a raw peer that seals by hand ------------------------------------------


class EchoService(echo_service.EchoService):
    """An encrypting echo service (``tests/unit/echo_service.py``) under this file's secret."""

    def __init__(self, port: int | None = None) -> None:
        super().__init__(port, SECRET, encrypt=True)


@pytest.fixture
def echo() -> Iterator[EchoService]:
    service = EchoService()
    try:
        yield service
    finally:
        service.close()


class SealingPeer:
    """A DEALER that exchanges keys and seals requests itself, so that a test can send the
    same frames twice or alter them."""

    def __init__(self, address: str, service_session: bytes) -> None:
        self.context = zmq.Context(io_threads=1)
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://{address}")
        self.signer = MessageSigner(SECRET, REQUEST_ROLE)
        self.verifier = MessageVerifier(SECRET, REPLY_ROLE)
        self.encryption = ChannelEncryption(SECRET, self.signer.session_id)
        self.service_session = service_session
        self.next_id = 0
        body = self.encryption.start()
        frames = self.frames(KEY_EXCHANGE_OP, body, [], sealed=False)
        self.socket.send_multipart(frames)
        answer = self.receive()
        assert answer is not None and answer.header["ok"], answer
        self.encryption.finish(answer.header["body"], answer.session_id)

    def frames(self, op: str, body: dict, buffers: list, sealed: bool = True) -> list[bytes]:
        self.next_id += 1
        header = {
            "op": op,
            "id": self.next_id,
            "srv": self.service_session,
            "timeout_ms": 10_000,
            "body": body,
        }
        sealer = self.encryption.sealer if sealed else None
        return [
            bytes(memoryview(f))
            for f in wire.encode(wire.KIND_REQUEST, header, buffers, self.signer, True, sealer)
        ]

    def receive(self, timeout_s: float = TIMEOUT_S) -> wire.Message | None:
        """The next reply (notices skipped), or None after ``timeout_s``."""
        while self.socket.poll(int(timeout_s * 1000)):
            frames = self.socket.recv_multipart()
            if wire.decode_notice(frames) is None:
                return wire.decode(
                    frames,
                    wire.KIND_REPLY,
                    self.verifier,
                    wire.Limits(),
                    openers=self.encryption.opener,
                )
        return None

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def _flip(frames: list[bytes], frame: int, position: int) -> list[bytes]:
    altered = [bytearray(f) for f in frames]
    altered[frame][position] ^= 0x01
    return [bytes(f) for f in altered]


@pytest.mark.parametrize(
    ("frame", "position"),
    [(0, 47), (1, 3), (2, 5), (3, 0), (3, CHUNK_BYTES + 9)],
    ids=["envelope tag", "header", "chunk tags", "first chunk", "second chunk"],
)
def test_an_altered_sealed_request_is_dropped_and_the_connection_goes_on(
    echo: EchoService, frame: int, position: int
) -> None:
    peer = SealingPeer(echo.address, echo.socket.session_id)
    try:
        payload = MARKER * (CHUNK_BYTES // len(MARKER) + 10)
        frames = peer.frames("echo", {}, [payload])
        peer.socket.send_multipart(_flip(frames, frame, position))
        assert peer.receive(timeout_s=0.5) is None, "an altered request was answered"
        assert echo.socket.rejected["auth"] == 1 and not echo.served
        peer.socket.send_multipart(frames)  # the genuine one: its counter was not used up
        reply = peer.receive()
        assert reply is not None and reply.sealed and bytes(reply.buffers[0]) == payload
        assert len(echo.served) == 1 and echo.thread.is_alive()
    finally:
        peer.close()


def test_a_replayed_sealed_request_is_dropped(echo: EchoService) -> None:
    peer = SealingPeer(echo.address, echo.socket.session_id)
    try:
        frames = peer.frames("echo", {}, [b"once"])
        peer.socket.send_multipart(frames)
        assert bytes(peer.receive().buffers[0]) == b"once"
        peer.socket.send_multipart(frames)
        assert peer.receive(timeout_s=0.5) is None, "a replay was answered"
        assert echo.socket.rejected["replayed"] == 1 and len(echo.served) == 1
        assert "auth" not in echo.socket.rejected  # not counted as a wrong secret
        peer.socket.send_multipart(peer.frames("echo", {}, [b"twice"]))
        assert bytes(peer.receive().buffers[0]) == b"twice"
    finally:
        peer.close()


def test_an_unsealed_request_from_a_keyed_connection_is_refused(echo: EchoService) -> None:
    peer = SealingPeer(echo.address, echo.socket.session_id)
    try:
        peer.socket.send_multipart(peer.frames("echo", {}, [MARKER], sealed=False))
        refusal = peer.receive()
        assert refusal.header["error_type"] == EncryptionMismatch.code and not refusal.buffers
        assert not echo.served
    finally:
        peer.close()


# -- Channel over a relay that alters one byte; a service that restarts -----------------------


def test_a_request_altered_on_the_way_is_dropped_and_the_next_one_served(
    echo: EchoService,
) -> None:
    relay = RecordingRelay(int(echo.address.rsplit(":", 1)[1]))
    channel = Channel(f"127.0.0.1:{relay.port}", SECRET, "ps:0", encrypt=True, shared_memory=False)
    try:
        channel.call("hello", {}, timeout_s=TIMEOUT_S)
        payload = MARKER * (3 * CHUNK_BYTES // len(MARKER))
        relay.tamper_at(CHUNK_BYTES)  # inside the payload's ciphertext (its frames come last)
        with pytest.raises(DeadlineExceeded):
            channel.call("echo", {}, [payload], timeout_s=1.0)
        assert echo.socket.rejected["auth"] == 1
        reply = channel.call("echo", {}, [payload], timeout_s=TIMEOUT_S)
        assert bytes(reply.buffers[0]) == payload
        assert MARKER not in relay.seen()
    finally:
        channel.close()
        relay.close()


def test_a_restarted_service_refuses_old_keys_and_the_client_exchanges_new_ones() -> None:
    first = EchoService()
    port = int(first.address.rsplit(":", 1)[1])
    channel = Channel(first.address, SECRET, "ps:0", encrypt=True, shared_memory=False)
    second = None
    try:
        channel.call("hello", {}, timeout_s=TIMEOUT_S)
        assert bytes(channel.call("echo", {}, [b"1"], timeout_s=TIMEOUT_S).buffers[0]) == b"1"
        first.close()
        second = EchoService(port)  # a new process on the same address: no keys for us
        with pytest.raises(ServiceRestarted, match="restarted"):
            channel.call("echo", {}, [b"2"], timeout_s=TIMEOUT_S)
        assert second.socket.rejected["unknown_connection"] == 1
        channel.call("hello", {}, timeout_s=TIMEOUT_S)  # exchanges keys again first
        assert bytes(channel.call("echo", {}, [b"3"], timeout_s=TIMEOUT_S).buffers[0]) == b"3"
        assert second.socket.encrypted_connections == 1
    finally:
        channel.close()
        if second is not None:
            second.close()


# -- requests that wait for the keys -------------------------------------------------------------


def test_send_does_not_wait_for_the_key_exchange_and_requests_behind_it_all_leave(
    echo: EchoService,
) -> None:
    channel = Channel(echo.address, SECRET, "ps:0", encrypt=True, shared_memory=False)
    try:
        # Hellos (a request before the first hello's answer names no service session): the
        # first starts the exchange, all three wait for it.
        ids = [channel.send("hello", {}, [bytes([n]) * 10], TIMEOUT_S) for n in range(3)]
        assert not echo.served  # nothing sealed can leave before the service's key is in
        replies = [channel.wait(i, TIMEOUT_S) for i in reversed(ids)]
        assert [bytes(r.buffers[0]) for r in replies] == [bytes([n]) * 10 for n in (2, 1, 0)]
        assert len(echo.served) == 3 and echo.socket.encrypted_connections == 1
    finally:
        channel.close()


def test_a_key_exchange_nobody_answers_ends_with_the_request_deadline_and_is_retried() -> None:
    address = f"127.0.0.1:{free_port()}"
    silent = ServiceSocket(address, SECRET, encrypt=True, shared_memory=False)  # never polled
    channel = Channel(address, SECRET, "ps:0", encrypt=True, shared_memory=False)
    service = None
    try:
        request = channel.send("hello", {}, timeout_s=0.5)  # returns at once: deferred
        with pytest.raises(DeadlineExceeded, match="agrees on encryption"):
            channel.wait(request, 0.5)
        # The silent service goes away while a second exchange waits on it: the channel sees
        # the drop (an event, not a sleep), so it cannot land on the retry below, which it
        # would mark lost (the drop might have taken it: the caller retries again).
        in_flight = channel.send("hello", {}, timeout_s=TIMEOUT_S)
        silent.close()
        with pytest.raises(ConnectionLost, match="dropped while 'hello' was in flight"):
            channel.wait(in_flight, TIMEOUT_S)
        service = EchoService(int(address.rsplit(":", 1)[1]))
        channel.forget_pending()
        reply = channel.call("hello", {}, timeout_s=TIMEOUT_S)  # a fresh key exchange
        assert reply.body == {"op": "hello"} and service.socket.encrypted_connections == 1
    finally:
        channel.close()
        if service is not None:
            service.close()


def test_a_sealed_reply_with_buffers_returns_a_tracker_that_says_when_it_left() -> None:
    """Publishers pace slow subscribers by the tracker (patterns/broadcast.py): a sealed
    reply returns one like a plain reply, although its buffers were already copied."""
    address = f"127.0.0.1:{free_port()}"
    service = ServiceSocket(address, SECRET, encrypt=True, shared_memory=False)
    channel = Channel(address, SECRET, "ps:0", encrypt=True, shared_memory=False)
    answers: list = []
    client = threading.Thread(
        target=lambda: answers.append(channel.call("hello", {}, timeout_s=TIMEOUT_S))
    )
    client.start()
    try:
        request = None
        for _ in range(int(TIMEOUT_S / 0.1)):
            if request is None and service.poll(0.1):
                request = service.receive()  # None for the key exchange, answered inside
            if request is not None:
                break
        assert request is not None and request.sealer is not None
        assert service.reply_copies_buffers(request)
        tracker = service.reply(request, {}, [MARKER * 4096])
        assert tracker is not None
        tracker.wait(TIMEOUT_S)
        client.join(TIMEOUT_S)
        assert bytes(answers[0].buffers[0]) == MARKER * 4096
    finally:
        client.join(TIMEOUT_S)
        channel.close()
        service.close()
