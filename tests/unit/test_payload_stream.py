"""The payload stream (wire/payload_stream.py): openings only for holders of the secret, once,
and for this service; payloads arriving whole, verified, in order; and each failure (a
chunk altered, of another message, a stream cut short, late, a receiver that stops
reading) raised as the module says, never a hang."""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tensorfleet.errors import (
    AuthenticationError,
    ConnectionLost,
    DeadlineExceeded,
    ProtocolError,
)
from tensorfleet.wire import payload_stream as ps_stream
from tensorfleet.wire.auth import (
    CHUNK_BYTES,
    REPLY_ROLE,
    REQUEST_ROLE,
    MessageSigner,
    MessageVerifier,
    derive_session_key,
)

SECRET = b"s" * 32
TIMEOUT_S = 10.0


class Service:
    """A listener and the connections it accepted, by client session."""

    def __init__(self, secret: bytes = SECRET) -> None:
        self.signer = MessageSigner(secret, REPLY_ROLE)
        self.opened: queue.Queue[tuple[bytes, ps_stream.PayloadSender]] = queue.Queue()
        self.listener = ps_stream.StreamListener(
            "127.0.0.1",
            MessageVerifier(secret, REQUEST_ROLE),
            self.signer.session_id,
            lambda session, conn: self.opened.put(
                (session, ps_stream.PayloadSender(conn, self.signer, greeting=ps_stream.OPENED))
            ),
        )

    def accepted(self) -> tuple[bytes, ps_stream.PayloadSender]:
        return self.opened.get(timeout=TIMEOUT_S)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def service() -> Iterator[Service]:
    svc = Service()
    try:
        yield svc
    finally:
        svc.close()


def connected(service: Service) -> tuple[ps_stream.PayloadSender, ps_stream.PayloadReceiver]:
    client = MessageSigner(SECRET, REQUEST_ROLE)
    conn = ps_stream.open_stream(
        "127.0.0.1", service.listener.port, client, service.signer.session_id, TIMEOUT_S
    )
    session, sender = service.accepted()
    assert session == client.session_id
    peer_key = derive_session_key(SECRET, service.signer.session_id, REPLY_ROLE)
    return sender, ps_stream.PayloadReceiver(conn, peer_key)


def sent(sender: ps_stream.PayloadSender, counter: int, buffers: list) -> queue.Queue:
    done: queue.Queue[bool] = queue.Queue()
    sender.send(counter, buffers, done.put)
    return done


def test_payloads_arrive_whole_verified_and_in_order(service: Service) -> None:
    sender, receiver = connected(service)
    try:
        first = [os.urandom(3 * CHUNK_BYTES + 5), b"", os.urandom(100)]
        second = [os.urandom(CHUNK_BYTES)]
        done = [sent(sender, 7, first), sent(sender, 8, second)]
        deadline = time.monotonic() + TIMEOUT_S
        got = receiver.receive(7, [len(b) for b in first], deadline)
        assert [bytes(b) for b in got] == first
        assert [bytes(b) for b in receiver.receive(8, [CHUNK_BYTES], deadline)] == second
        assert [d.get(timeout=TIMEOUT_S) for d in done] == [True, True]
        assert all(not b.readonly for b in got)  # memory the caller owns (tensors adopt it)
    finally:
        sender.close()
        receiver.close()


def test_a_payload_nobody_waits_for_is_skipped_and_the_next_one_read(service: Service) -> None:
    sender, receiver = connected(service)
    try:
        abandoned, wanted = [os.urandom(2 * CHUNK_BYTES + 1)], [os.urandom(10)]
        sent(sender, 3, abandoned)
        sent(sender, 4, wanted)
        deadline = time.monotonic() + TIMEOUT_S
        receiver.skip(3, [len(abandoned[0])], deadline)
        assert bytes(receiver.receive(4, [10], deadline)[0]) == wanted[0]
    finally:
        sender.close()
        receiver.close()


def test_a_lingering_close_lets_the_queued_payloads_leave_whole(service: Service) -> None:
    # A ps that ends right after its reply to the chief's save: the reply's payload, larger
    # than the socket buffers, is still leaving when the close begins.
    sender, receiver = connected(service)
    try:
        payload = [os.urandom(16 * 1024 * 1024)]
        done = sent(sender, 5, payload)
        closing = threading.Thread(target=sender.close, args=(TIMEOUT_S,))
        closing.start()
        got = receiver.receive(5, [len(payload[0])], time.monotonic() + TIMEOUT_S)
        closing.join(TIMEOUT_S)
        assert not closing.is_alive()
        assert bytes(got[0]) == payload[0] and done.get(timeout=TIMEOUT_S) is True
    finally:
        sender.close(0)
        receiver.close()


def test_a_close_without_linger_cuts_a_payload_nobody_reads(service: Service) -> None:
    sender, receiver = connected(service)
    try:
        done = sent(sender, 5, [os.urandom(16 * 1024 * 1024)])
        started = time.monotonic()
        sender.close(0)
        assert done.get(timeout=TIMEOUT_S) is False  # told it did not leave
        assert time.monotonic() - started < TIMEOUT_S
    finally:
        receiver.close()


def test_an_opening_without_the_secret_is_refused_and_the_listener_goes_on(
    service: Service,
) -> None:
    stranger = MessageSigner(b"x" * 32, REQUEST_ROLE)
    with pytest.raises(AuthenticationError, match="refused its opening"):
        ps_stream.open_stream(
            "127.0.0.1", service.listener.port, stranger, service.signer.session_id, TIMEOUT_S
        )
    assert service.listener.rejected == 1 and service.opened.empty()
    sender, receiver = connected(service)  # a holder of the secret still gets in
    sender.close()
    receiver.close()


def test_an_opening_for_another_service_session_is_refused(service: Service) -> None:
    client = MessageSigner(SECRET, REQUEST_ROLE)
    earlier_process = os.urandom(16)  # the session of the service before a restart
    with pytest.raises(AuthenticationError, match="restarted since the hello"):
        ps_stream.open_stream("127.0.0.1", service.listener.port, client, earlier_process, 5)
    assert service.listener.rejected == 1


def test_an_opening_is_accepted_once(service: Service) -> None:
    client = MessageSigner(SECRET, REQUEST_ROLE)
    counter = client.next_counter()
    signed = ps_stream._signed_opening(client.session_id, counter)
    opening = signed + client.tag(counter, [signed, service.signer.session_id])
    answers = []
    for _ in range(2):  # the same bytes twice: a replay
        with socket.create_connection(("127.0.0.1", service.listener.port), timeout=5) as conn:
            conn.sendall(opening)
            answers.append(conn.recv(1))
    assert answers == [ps_stream.OPENED, b""]  # the second is closed unanswered
    assert service.listener.rejected == 1


def test_garbage_and_silence_are_closed_without_stopping_the_listener(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ps_stream, "OPENING_TIMEOUT_S", 0.5)
    with socket.create_connection(("127.0.0.1", service.listener.port), timeout=5) as junk:
        junk.sendall(os.urandom(ps_stream.OPENING_BYTES))
        assert junk.recv(1) == b""
    with socket.create_connection(("127.0.0.1", service.listener.port), timeout=5) as silent:
        assert silent.recv(1) == b""  # closed after the opening's deadline
    assert service.listener.rejected == 2
    sender, receiver = connected(service)
    sender.close()
    receiver.close()


def test_nothing_listening_is_a_lost_connection_naming_the_address() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: connections are refused
        client = MessageSigner(SECRET, REQUEST_ROLE)
        with pytest.raises(ConnectionLost, match=f"127.0.0.1:{port}"):
            ps_stream.open_stream("127.0.0.1", port, client, os.urandom(16), 5)


def raw_pair(service: Service) -> tuple[socket.socket, ps_stream.PayloadReceiver]:
    """A receiver whose other end the test writes by hand."""
    sender, receiver = connected(service)
    return sender._conn, receiver


def chunk(counter: int, index: int, data: bytes, signer: MessageSigner) -> bytes:
    tag = signer.chunk_tag(counter, index, data)
    return ps_stream._CHUNK_HEADER.pack(counter, index, len(data), tag) + data


def test_an_altered_chunk_fails_authentication_and_closes_the_stream(service: Service) -> None:
    conn, receiver = raw_pair(service)
    data = bytearray(os.urandom(1000))
    frame = bytearray(chunk(5, 1, bytes(data), service.signer))
    frame[-1] ^= 1  # one bit of the payload flipped on the way
    conn.sendall(frame)
    with pytest.raises(AuthenticationError, match="chunk 1 of 1"):
        receiver.receive(5, [1000], time.monotonic() + TIMEOUT_S)
    with pytest.raises(ConnectionLost, match="closed after an error"):
        receiver.receive(6, [1], time.monotonic() + TIMEOUT_S)
    conn.close()


def test_a_chunk_of_another_message_is_refused_before_its_bytes_are_read(
    service: Service,
) -> None:
    conn, receiver = raw_pair(service)
    conn.sendall(chunk(9, 1, b"abc", service.signer))  # a genuine chunk, of message 9
    with pytest.raises(ProtocolError, match="chunk 1 of message 9 .* message 8"):
        receiver.receive(8, [3], time.monotonic() + TIMEOUT_S)
    conn.close()


def test_a_chunk_signed_by_another_key_fails(service: Service) -> None:
    conn, receiver = raw_pair(service)
    impostor = MessageSigner(SECRET, REPLY_ROLE)  # the secret, but another session's key
    conn.sendall(chunk(2, 1, b"hello", impostor))
    with pytest.raises(AuthenticationError):
        receiver.receive(2, [5], time.monotonic() + TIMEOUT_S)
    conn.close()


def test_a_stream_cut_short_is_a_lost_connection_naming_the_bytes(service: Service) -> None:
    conn, receiver = raw_pair(service)
    data = os.urandom(CHUNK_BYTES + 10)
    conn.sendall(chunk(1, 1, data[:CHUNK_BYTES], service.signer))
    conn.sendall(chunk(1, 2, data[CHUNK_BYTES:], service.signer)[:-4])  # 4 bytes short
    conn.close()
    with pytest.raises(ConnectionLost, match=f"ended after {CHUNK_BYTES + 6} of the"):
        receiver.receive(1, [len(data)], time.monotonic() + TIMEOUT_S)


def test_a_payload_that_does_not_come_ends_at_its_deadline(service: Service) -> None:
    conn, receiver = raw_pair(service)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="did not arrive in time"):
        receiver.receive(1, [10], started + 0.3)
    assert time.monotonic() - started < 5
    conn.close()


def test_a_sender_whose_receiver_stops_reading_gives_up_and_says_so(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ps_stream, "SEND_TIMEOUT_S", 0.5)
    sender, receiver = connected(service)  # the receiver never reads
    try:
        big = [bytes(64 * CHUNK_BYTES)]  # more than the kernel's buffers hold
        first, second = sent(sender, 1, big), sent(sender, 2, [b"x"])
        assert first.get(timeout=TIMEOUT_S) is False
        assert second.get(timeout=TIMEOUT_S) is False  # queued behind it: told too
        assert sender.failure is not None and "failed" in sender.failure
        late: queue.Queue[bool] = queue.Queue()
        sender.send(3, [b"y"], late.put)
        assert late.get_nowait() is False  # at once, once the stream failed
    finally:
        sender.close()
        receiver.close()


def test_the_sender_leaves_the_servers_thread_free(service: Service) -> None:
    """send() only queues: the thread that calls it (the service's loop) goes on while the
    payload travels, and learns from on_done when its buffers may change."""
    sender, receiver = connected(service)
    try:
        payload = [os.urandom(16 * CHUNK_BYTES)]  # more than the kernel's buffers hold
        done: queue.Queue[bool] = queue.Queue()
        sender.send(1, payload, done.put)
        assert done.empty()  # nothing read yet: the payload cannot have left entirely
        got = receiver.receive(1, [len(payload[0])], time.monotonic() + TIMEOUT_S)
        assert done.get(timeout=TIMEOUT_S) is True and bytes(got[0]) == payload[0]
    finally:
        sender.close()
        receiver.close()


def test_a_payload_queued_after_close_is_told_at_once_it_was_not_sent(service: Service) -> None:
    sender, receiver = connected(service)
    try:
        sender.close()
        late: queue.Queue[bool] = queue.Queue()
        sender.send(1, [b"z"], late.put)
        assert late.get_nowait() is False  # no lent memory waits for a sender that stopped
    finally:
        receiver.close()
