"""Sealed messages (``--encrypt``) without sockets: the key exchange, what a sealed message
hides, that every part is authenticated, replays, and that no (key, nonce) pair is ever used
twice. The end-to-end behaviour over ZeroMQ (what a relay sees, the refusals between peers
that disagree) is in ``test_encryption.py``."""

from __future__ import annotations

import os

import pytest

from tensorfleet.errors import AuthenticationError, ProtocolError
from tensorfleet.wire import encryption
from tensorfleet.wire.auth import (
    CHUNK_BYTES,
    REPLY_ROLE,
    REQUEST_ROLE,
    MessageSigner,
    MessageVerifier,
    nonce,
)
from tensorfleet.wire.buffer_pool import BufferPool
from tensorfleet.wire.encryption import (
    ChannelEncryption,
    ServiceEncryption,
    answer_key_exchange,
    message_key,
)
from tensorfleet.wire.message import (
    ENVELOPE_BYTES,
    KIND_REPLY,
    KIND_REQUEST,
    SEALED,
    Limits,
    UnknownConnection,
    decode,
    encode,
)

SECRET = b"unit-test-encryption-secret-0123456789"
MARKER = b"PLAINTEXT-MARKER-0123456789abcdef"
NAME = "layer.secret_weight_name"


class Connection:
    """Both ends of one encrypted connection, keys exchanged as the transport does."""

    def __init__(self, client_secret: bytes = SECRET, service_secret: bytes = SECRET) -> None:
        self.client_signer = MessageSigner(client_secret, REQUEST_ROLE)
        self.service_signer = MessageSigner(service_secret, REPLY_ROLE)
        self.client = ChannelEncryption(client_secret, self.client_signer.session_id)
        self.service = ServiceEncryption(service_secret, self.service_signer.session_id)
        public = self.service.answer(
            self.client_signer.session_id, self.client.start()["public_key"]
        )
        self.client.finish({"public_key": public}, self.service_signer.session_id)
        # Unused for sealed messages (they carry no secret-keyed MAC); decode needs one.
        self.request_verifier = MessageVerifier(service_secret, REQUEST_ROLE)
        self.reply_verifier = MessageVerifier(client_secret, REPLY_ROLE)

    def request(self, header: dict, buffers: list, in_frames: bool = True) -> list:
        return encode(
            KIND_REQUEST, header, buffers, self.client_signer, in_frames, self.client.sealer
        )

    def open_request(self, frames: list, resolve=None):
        return decode(
            frames,
            KIND_REQUEST,
            self.request_verifier,
            Limits(),
            resolve=resolve,
            openers=self.service.opener,
        )

    def reply(self, header: dict, buffers: list) -> list:
        sealer = self.service.sealer(self.client_signer.session_id)
        return encode(KIND_REPLY, header, buffers, self.service_signer, True, sealer)

    def open_reply(self, frames: list):
        return decode(frames, KIND_REPLY, self.reply_verifier, Limits(), openers=self.client.opener)


def _payload(size: int) -> bytes:
    return (MARKER * (size // len(MARKER) + 1))[:size]


def _wire_bytes(frames: list) -> bytes:
    return b"".join(bytes(memoryview(f)) for f in frames)


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 5, CHUNK_BYTES, 3 * CHUNK_BYTES + 17])
def test_sealed_request_and_reply_round_trip_and_hide_names_and_values(size: int) -> None:
    connection = Connection()
    buffers = [_payload(size), b"", bytearray(_payload(1000))]
    header = {"op": "push", "id": 1, "body": {"names": [NAME]}}
    frames = connection.request(header, buffers)
    assert len(frames) == 3 + len(buffers)
    assert memoryview(frames[0])[3] == KIND_REQUEST | SEALED
    on_the_wire = _wire_bytes(frames)
    assert NAME.encode() not in on_the_wire
    assert MARKER[:16] not in on_the_wire
    message = connection.open_request(frames)
    assert message.sealed
    assert message.header == {**header, "sizes": [size, 0, 1000]}
    assert [bytes(b) for b in message.buffers] == [bytes(b) for b in buffers]

    reply = connection.reply({"re": 1, "ok": True, "body": {"names": [NAME]}}, buffers)
    assert NAME.encode() not in _wire_bytes(reply) and MARKER[:16] not in _wire_bytes(reply)
    answered = connection.open_reply(reply)
    assert answered.header["body"] == {"names": [NAME]}
    assert [bytes(b) for b in answered.buffers] == [bytes(b) for b in buffers]


def test_decrypted_buffers_belong_to_the_receiver_and_are_not_reused_while_held() -> None:
    connection = Connection()
    first = connection.open_request(connection.request({}, [_payload(4096)])).buffers[0]
    second = connection.open_request(connection.request({}, [b"\x00" * 4096])).buffers[0]
    assert bytes(first) == _payload(4096)  # the second message did not overwrite the first
    assert bytes(second) == b"\x00" * 4096


def test_payload_in_shared_memory_goes_as_it_is_under_a_sealed_header() -> None:
    """Same-host payloads are neither encrypted nor tagged (they never leave the host, and
    only the peer's own user can reach them); the header that names them is sealed."""
    connection = Connection()
    segment = bytearray(_payload(CHUNK_BYTES + 100))
    frames = connection.request({"shm": {}}, [segment], in_frames=False)
    assert len(frames) == 3 and NAME.encode() not in _wire_bytes(frames)
    assert memoryview(frames[2]).nbytes == 0  # no chunk tags
    message = connection.open_request(frames, resolve=lambda header, sizes: [segment])
    assert message.sealed and bytes(message.buffers[0]) == bytes(segment)


# -- tampering, replay, wrong keys -------------------------------------------------------------


def _flipped(frames: list, frame: int, position: int) -> list:
    copy = [bytearray(memoryview(f)) for f in frames]
    copy[frame][position] ^= 0x01
    return [bytes(f) for f in copy]


@pytest.mark.parametrize(
    ("frame", "position", "what"),
    [
        (0, 4, "session id"),  # the connection's keys are looked up by it: unknown session
        (0, 20, "counter"),
        (0, ENVELOPE_BYTES - 1, "envelope tag"),
        (1, 0, "header ciphertext"),
        (2, 0, "first chunk tag"),
        (2, 3 * 16 + 7, "last chunk tag"),
        (3, 0, "first chunk of the payload"),
        (3, 3 * CHUNK_BYTES + 5, "last chunk of the payload"),
        (4, 2, "second buffer"),
    ],
)
def test_any_altered_part_is_refused_and_changes_nothing(
    frame: int, position: int, what: str
) -> None:
    connection = Connection()
    frames = connection.request({"op": "push"}, [_payload(3 * CHUNK_BYTES + 10), b"abcd"])
    with pytest.raises((AuthenticationError, UnknownConnection)):
        connection.open_request(_flipped(frames, frame, position))
    # Nothing was recorded: the genuine message (same counter) is still accepted, once.
    assert bytes(connection.open_request(frames).buffers[1]) == b"abcd", what
    with pytest.raises(AuthenticationError, match="replayed"):
        connection.open_request(frames)


def test_the_kind_byte_and_version_are_checked_before_any_key_is_used() -> None:
    connection = Connection()
    frames = connection.request({"op": "pull"}, [])
    with pytest.raises(ProtocolError, match="kind"):
        decode(
            frames,
            KIND_REPLY,
            connection.reply_verifier,
            Limits(),
            openers=connection.client.opener,
        )
    unsealed = [bytearray(memoryview(f)) for f in frames]
    unsealed[0][3] = KIND_REQUEST  # SEALED cleared: checked as a signed message, and fails
    with pytest.raises(AuthenticationError):
        connection.open_request([bytes(f) for f in unsealed])


def test_replayed_and_reordered_messages_are_refused() -> None:
    connection = Connection()
    first = connection.request({"n": 1}, [b"x"])
    second = connection.request({"n": 2}, [b"y"])
    assert connection.open_request(second).header["n"] == 2
    with pytest.raises(AuthenticationError, match="counter 1 is not above 2"):
        connection.open_request(first)
    with pytest.raises(AuthenticationError, match="replayed"):
        connection.open_request(second)


def test_a_chunk_moved_to_another_place_or_message_is_refused() -> None:
    connection = Connection()
    a = connection.request({}, [_payload(2 * CHUNK_BYTES)])
    b = connection.request({}, [_payload(2 * CHUNK_BYTES)])
    swapped = [bytes(memoryview(f)) for f in b]
    body = bytearray(swapped[3])
    body[:CHUNK_BYTES], body[CHUNK_BYTES:] = body[CHUNK_BYTES:], body[:CHUNK_BYTES]
    with pytest.raises(AuthenticationError, match="chunk 1 of 2"):
        connection.open_request([*swapped[:3], bytes(body)])
    from_a = [*swapped[:3], bytes(memoryview(a[3]))]
    with pytest.raises(AuthenticationError, match="chunk 1 of 2"):
        connection.open_request(from_a)


def test_a_message_sealed_for_another_connection_is_refused() -> None:
    first, second = Connection(), Connection()
    frames = first.request({"op": "pull"}, [])
    with pytest.raises(UnknownConnection):
        second.open_request(frames)  # second's service holds no keys for first's session


def test_a_request_cannot_be_reflected_as_a_reply() -> None:
    connection = Connection()
    frames = connection.request({"re": 1}, [b"x"])
    reflected = [bytearray(memoryview(f)) for f in frames]
    reflected[0][3] = KIND_REPLY | SEALED
    reflected[0][4:20] = connection.service_signer.session_id
    with pytest.raises(AuthenticationError):
        connection.open_reply([bytes(f) for f in reflected])


def test_ends_with_different_secrets_derive_different_keys() -> None:
    connection = Connection(service_secret=b"another-secret-of-the-right-length")
    with pytest.raises(AuthenticationError, match="sealed message failed authentication"):
        connection.open_request(connection.request({"op": "hello"}, []))


# -- the key exchange ---------------------------------------------------------------------------


def test_both_ends_derive_the_same_keys_and_each_exchange_new_ones() -> None:
    client, service = os.urandom(16), os.urandom(16)
    first = ChannelEncryption(SECRET, client)
    public, service_keys = answer_key_exchange(SECRET, first.start()["public_key"], client, service)
    first.finish({"public_key": public}, service)
    assert first.sealer is not None and first.opener(service) is not None
    assert first.opener(os.urandom(16)) is None  # replies only from the keyed service session
    assert first.sealer._key == service_keys.request
    assert service_keys.request != service_keys.reply
    again, more_keys = answer_key_exchange(SECRET, first.start()["public_key"], client, service)
    assert {more_keys.request, more_keys.reply}.isdisjoint(
        {service_keys.request, service_keys.reply}
    )
    assert again != public


@pytest.mark.parametrize(
    "public", [None, "text", b"short", b"\x00" * 32, b"\x01" + b"\x00" * 31], ids=str
)
def test_an_unusable_public_key_is_a_protocol_error(public: object) -> None:
    with pytest.raises(ProtocolError, match="X25519 public key"):
        answer_key_exchange(SECRET, public, os.urandom(16), os.urandom(16))


def test_a_key_exchange_answer_without_an_exchange_in_flight_is_refused() -> None:
    channel = ChannelEncryption(SECRET, os.urandom(16))
    with pytest.raises(ProtocolError, match="without a key exchange in flight"):
        channel.finish({"public_key": b"\x09" * 32}, os.urandom(16))


def test_a_service_forgets_the_least_recently_used_connections() -> None:
    service = ServiceEncryption(SECRET, os.urandom(16), max_connections=2)
    sessions = [os.urandom(16) for _ in range(3)]
    for session in sessions:
        service.answer(session, ChannelEncryption(SECRET, session).start()["public_key"])
    assert service.connections == 2
    assert service.opener(sessions[0]) is None and service.sealer(sessions[0]) is None
    assert service.opener(sessions[2]) is not None


# -- nonces ------------------------------------------------------------------------------------


def test_no_key_and_nonce_pair_is_ever_sealed_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every encryption of many messages both ways, over two connections to one service
    (whose counter all its connections share), of payloads of several chunks: the (key,
    nonce) pairs are all different."""
    used: list[tuple[bytes, bytes]] = []
    real_cipher = encryption.Cipher

    class RecordingCipher:
        def __init__(self, algorithm, mode) -> None:
            self._cipher = real_cipher(algorithm, mode)
            self._pair = (bytes(algorithm.key), bytes(mode.initialization_vector))

        def encryptor(self):
            used.append(self._pair)
            return self._cipher.encryptor()

        def decryptor(self):
            return self._cipher.decryptor()

    monkeypatch.setattr(encryption, "Cipher", RecordingCipher)
    first = Connection()
    second = Connection()
    second.service_signer = first.service_signer  # one service, one reply counter
    second.service = first.service
    public = first.service.answer(
        second.client_signer.session_id, second.client.start()["public_key"]
    )
    second.client.finish({"public_key": public}, first.service_signer.session_id)
    payload = [_payload(2 * CHUNK_BYTES + 3), b"tail"]
    for round_ in range(40):
        for connection in (first, second):
            connection.open_request(connection.request({"n": round_}, payload))
            connection.open_reply(connection.reply({"n": round_}, payload))
    sealed_per_message = 1 + 3 + 1  # the header, three chunks of the first buffer, the second
    assert len(used) == 40 * 2 * 2 * sealed_per_message
    assert len(set(used)) == len(used)


def test_message_keys_and_nonces_are_distinct_by_construction() -> None:
    key = os.urandom(32)
    assert len({message_key(key, counter) for counter in range(1, 2000)}) == 1999
    assert message_key(key, 7) != message_key(os.urandom(32), 7)
    nonces = {nonce(counter, index) for counter in range(1, 200) for index in range(0, 40)}
    assert len(nonces) == 199 * 40
    assert all(len(n) == 12 for n in nonces)


def test_the_pool_never_hands_out_a_buffer_that_is_still_viewed() -> None:
    pool = BufferPool(keep=2)
    held = pool.views([1000])[0]
    held[:4] = b"held"
    for _ in range(5):
        other = pool.views([1000])[0]
        other[:4] = b"next"
    assert bytes(held[:4]) == b"held"
    del held, other
    assert pool.take(1000).numel() == 1000
