"""The wire format: envelope + msgpack header + raw buffers, the checks :func:`decode` makes
before and after authentication, :class:`Limits`, and the unauthenticated notices.

Messages whose header is not what :func:`encode` would write are built by hand here, from
the envelope layout documented in :mod:`tensorfleet.wire.message`, and signed properly, so
that the checks after authentication are reached."""

from __future__ import annotations

import os
import struct

import msgpack
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorfleet.errors import AuthenticationError, ProtocolError
from tensorfleet.wire.auth import REPLY_ROLE, REQUEST_ROLE, MessageSigner, MessageVerifier
from tensorfleet.wire.message import (
    ENVELOPE_BYTES,
    KIND_REPLY,
    KIND_REQUEST,
    MAGIC,
    NOTICE_MAGIC,
    PROTOCOL_VERSION,
    Limits,
    decode,
    decode_notice,
    encode,
    encode_notice,
    notice_error,
    peek_protocol,
)

SECRET = b"unit-test-cluster-secret-0123456789"
#: magic | protocol | kind | session id | counter | header length | tag  (see message.py)
ENVELOPE = struct.Struct(">2sBB16sQI16s")
PROPERTY_SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _request_pair() -> tuple[MessageSigner, MessageVerifier]:
    return MessageSigner(SECRET, REQUEST_ROLE), MessageVerifier(SECRET, REQUEST_ROLE)


def _hand_signed(
    signer: MessageSigner,
    header_bytes: bytes,
    buffers: list[bytes],
    *,
    kind: int = KIND_REQUEST,
    protocol: int = PROTOCOL_VERSION,
    magic: bytes = MAGIC,
    declared_header_len: int | None = None,
) -> list[bytes]:
    """A message with exactly these header bytes, signed like :func:`encode` signs."""
    counter = signer.next_counter()
    header_len = len(header_bytes) if declared_header_len is None else declared_header_len
    signed = ENVELOPE.pack(magic, protocol, kind, signer.session_id, counter, header_len, b"")
    signed = signed[: ENVELOPE_BYTES - 16]
    tags = signer.chunk_tags(counter, buffers)
    tag = signer.tag(counter, [signed, header_bytes, tags])
    return [signed + tag, header_bytes, tags, *buffers]


def _total(frames: list) -> int:
    return sum(memoryview(f).nbytes for f in frames)


# -- round trips ------------------------------------------------------------------------------


def test_round_trip_with_several_buffers_including_empty_ones() -> None:
    signer, verifier = _request_pair()
    buffers = [b"abc", b"", bytearray(b"\x00" * 1000), memoryview(b"xyz"), b""]
    header = {"op": "push", "id": 7, "body": {"names": ["w", "b"], "nested": {"x": 1.5}}}
    frames = encode(KIND_REQUEST, header, buffers, signer)
    assert len(frames) == 3 + len(buffers)
    assert memoryview(frames[0]).nbytes == ENVELOPE_BYTES

    message = decode(frames, KIND_REQUEST, verifier, Limits())
    assert message.kind == KIND_REQUEST
    assert message.session_id == signer.session_id
    assert message.counter == 1
    assert message.header == {**header, "sizes": [3, 0, 1000, 3, 0]}
    assert [bytes(b) for b in message.buffers] == [bytes(b) for b in buffers]


def test_round_trip_without_buffers_and_as_reply() -> None:
    signer = MessageSigner(SECRET, REPLY_ROLE)
    verifier = MessageVerifier(SECRET, REPLY_ROLE)
    frames = encode(KIND_REPLY, {"ok": True}, [], signer)
    message = decode(frames, KIND_REPLY, verifier, Limits())
    assert message.header == {"ok": True, "sizes": []}
    assert message.buffers == []


def test_buffers_are_not_copied_on_either_side() -> None:
    signer, verifier = _request_pair()
    payload = bytearray(b"\x01" * 64)
    frames = encode(KIND_REQUEST, {}, [payload], signer)
    assert frames[3] is payload
    message = decode(frames, KIND_REQUEST, verifier, Limits())
    payload[0] = 0xFF  # the decoded buffer is a view of the received frame
    assert message.buffers[0][0] == 0xFF


def test_successive_messages_carry_increasing_counters() -> None:
    signer, verifier = _request_pair()
    counters = [
        decode(encode(KIND_REQUEST, {}, [], signer), KIND_REQUEST, verifier, Limits()).counter
        for _ in range(3)
    ]
    assert counters == [1, 2, 3]


def test_decoding_the_same_frames_twice_is_a_replay() -> None:
    signer, verifier = _request_pair()
    frames = encode(KIND_REQUEST, {"op": "push"}, [b"grad"], signer)
    decode(frames, KIND_REQUEST, verifier, Limits())
    with pytest.raises(AuthenticationError, match="replayed"):
        decode(frames, KIND_REQUEST, verifier, Limits())


# -- checks before authentication ------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 2])
def test_fewer_than_three_frames_is_a_protocol_error(count: int) -> None:
    _, verifier = _request_pair()
    with pytest.raises(ProtocolError, match="at least 3 frames"):
        decode([b"x" * ENVELOPE_BYTES, b"", b""][:count], KIND_REQUEST, verifier, Limits())


def test_buffer_count_exactly_at_the_limit_is_accepted_one_more_is_not() -> None:
    signer, verifier = _request_pair()
    limits = Limits(max_buffers=3)
    too_many = encode(KIND_REQUEST, {}, [b"a", b"b", b"c", b"d"], signer)
    with pytest.raises(ProtocolError, match="4 buffers in one message; the limit is 3"):
        decode(too_many, KIND_REQUEST, verifier, limits)
    just_right = encode(KIND_REQUEST, {}, [b"a", b"b", b"c"], signer)
    assert len(decode(just_right, KIND_REQUEST, verifier, limits).buffers) == 3


def test_message_one_byte_over_the_limit_is_rejected_exactly_at_the_limit_accepted() -> None:
    signer, verifier = _request_pair()
    frames = encode(KIND_REQUEST, {"op": "push"}, [b"\x00" * 100, b"\x01" * 28], signer)
    size = _total(frames)
    with pytest.raises(ProtocolError, match=f"message of {size} bytes; the limit is {size - 1}"):
        decode(frames, KIND_REQUEST, verifier, Limits(max_message_bytes=size - 1))
    message = decode(frames, KIND_REQUEST, verifier, Limits(max_message_bytes=size))
    assert [bytes(b) for b in message.buffers] == [b"\x00" * 100, b"\x01" * 28]


def test_header_one_byte_over_its_limit_is_rejected_exactly_at_the_limit_accepted() -> None:
    signer, verifier = _request_pair()
    frames = encode(KIND_REQUEST, {"op": "pull", "body": {}}, [], signer)
    header_size = memoryview(frames[1]).nbytes
    with pytest.raises(ProtocolError, match="header of"):
        decode(frames, KIND_REQUEST, verifier, Limits(max_header_bytes=header_size - 1))
    decode(frames, KIND_REQUEST, verifier, Limits(max_header_bytes=header_size))


@pytest.mark.parametrize("field", ["max_message_bytes", "max_buffers", "max_header_bytes"])
@pytest.mark.parametrize("value", [0, -1])
def test_limits_must_be_positive(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"Limits.{field} must be positive"):
        Limits(**{field: value})


@pytest.mark.parametrize("size", [0, ENVELOPE_BYTES - 1, ENVELOPE_BYTES + 1])
def test_envelope_of_the_wrong_size_is_a_protocol_error(size: int) -> None:
    signer, verifier = _request_pair()
    frames = encode(KIND_REQUEST, {}, [], signer)
    envelope = (bytes(frames[0]) + b"\0")[:size]
    with pytest.raises(ProtocolError, match=f"envelope of {size} bytes, expected {ENVELOPE_BYTES}"):
        decode([envelope, frames[1], frames[2]], KIND_REQUEST, verifier, Limits())


def test_bad_magic_is_a_protocol_error() -> None:
    signer, verifier = _request_pair()
    frames = _hand_signed(signer, msgpack.packb({"sizes": []}), [], magic=b"XX")
    with pytest.raises(ProtocolError, match="bad magic"):
        decode(frames, KIND_REQUEST, verifier, Limits())


@pytest.mark.parametrize("protocol", [0, PROTOCOL_VERSION + 1, 255])
def test_other_protocol_version_is_refused_with_a_clear_message(protocol: int) -> None:
    signer, verifier = _request_pair()
    frames = _hand_signed(signer, msgpack.packb({"sizes": []}), [], protocol=protocol)
    assert peek_protocol(frames) == protocol
    with pytest.raises(ProtocolError) as excinfo:
        decode(frames, KIND_REQUEST, verifier, Limits())
    text = str(excinfo.value)
    assert f"protocol version {protocol} received" in text
    assert f"speaks {PROTOCOL_VERSION}" in text
    assert "same tensorfleet version on every task" in text


def test_wrong_kind_is_a_protocol_error() -> None:
    signer, verifier = _request_pair()
    frames = encode(KIND_REPLY, {}, [], signer)
    with pytest.raises(ProtocolError, match=f"kind {KIND_REPLY} where {KIND_REQUEST}"):
        decode(frames, KIND_REQUEST, verifier, Limits())


def test_declared_header_length_must_match_the_header_frame() -> None:
    signer, verifier = _request_pair()
    header = msgpack.packb({"sizes": []})
    frames = _hand_signed(signer, header, [], declared_header_len=len(header) + 1)
    with pytest.raises(ProtocolError, match=f"header of {len(header)} bytes"):
        decode(frames, KIND_REQUEST, verifier, Limits())


def test_peek_protocol() -> None:
    signer, _ = _request_pair()
    assert peek_protocol(encode(KIND_REQUEST, {}, [], signer)) == PROTOCOL_VERSION
    assert peek_protocol([]) is None
    assert peek_protocol([b"TF" + b"\x01" * (ENVELOPE_BYTES - 3)]) is None  # wrong size
    assert peek_protocol([b"XX" + b"\x01" * (ENVELOPE_BYTES - 2)]) is None  # not ours


# -- checks after authentication --------------------------------------------------------------


@pytest.mark.parametrize(
    "header", [[1, 2, 3], "text", 42, None, b"bytes"], ids=["list", "str", "int", "nil", "bin"]
)
def test_header_that_is_not_a_map_is_a_protocol_error(header: object) -> None:
    signer, verifier = _request_pair()
    frames = _hand_signed(signer, msgpack.packb(header, use_bin_type=True), [])
    with pytest.raises(ProtocolError, match="header must be a map"):
        decode(frames, KIND_REQUEST, verifier, Limits())


@pytest.mark.parametrize(
    "header_bytes",
    [b"\xc1", b"\x81", msgpack.packb({"sizes": []}) + b"\x00", msgpack.packb({1: 2})],
    ids=["reserved-byte", "truncated", "extra-data", "int-key"],
)
def test_undecodable_header_is_a_protocol_error(header_bytes: bytes) -> None:
    signer, verifier = _request_pair()
    frames = _hand_signed(signer, header_bytes, [])
    with pytest.raises(ProtocolError, match="undecodable header"):
        decode(frames, KIND_REQUEST, verifier, Limits())


@pytest.mark.parametrize(
    ("sizes", "buffers"),
    [
        ([3], [b"abcd"]),  # wrong length
        ([4, 0], [b"abcd"]),  # one size too many
        ([4], [b"abcd", b""]),  # one buffer too many
        (None, [b"abcd"]),  # missing
        ("4", [b"abcd"]),  # not a list
    ],
)
def test_buffer_sizes_that_do_not_match_the_header_are_a_protocol_error(
    sizes: object, buffers: list[bytes]
) -> None:
    signer, verifier = _request_pair()
    header = {"op": "push"} if sizes is None else {"op": "push", "sizes": sizes}
    frames = _hand_signed(signer, msgpack.packb(header), buffers)
    with pytest.raises(ProtocolError, match="do not match the header|the header's sizes must be"):
        decode(frames, KIND_REQUEST, verifier, Limits())


def test_bytes_moved_between_buffers_are_caught_by_the_sizes_check() -> None:
    # The MAC covers the concatenation; the authenticated sizes make the split unambiguous.
    signer, verifier = _request_pair()
    frames = encode(KIND_REQUEST, {}, [b"abc", b"de"], signer)
    resplit = [frames[0], frames[1], frames[2], b"ab", b"cde"]
    with pytest.raises(ProtocolError, match=r"buffer sizes \[2, 3\] do not match"):
        decode(resplit, KIND_REQUEST, verifier, Limits())


def test_message_from_another_secret_is_an_authentication_error() -> None:
    frames = encode(KIND_REQUEST, {}, [b"x"], MessageSigner(b"some-other-secret-xxxxxx", "request"))
    with pytest.raises(AuthenticationError):
        decode(frames, KIND_REQUEST, MessageVerifier(SECRET, REQUEST_ROLE), Limits())


# -- decode never raises anything else ---------------------------------------------------------

_envelopes = st.tuples(
    st.sampled_from([MAGIC, b"XX"]),
    st.sampled_from([PROTOCOL_VERSION, 0, PROTOCOL_VERSION + 1]),
    st.sampled_from([KIND_REQUEST, KIND_REPLY, 9]),
    st.binary(min_size=16, max_size=16),
    st.sampled_from([0, 1, 2**64 - 1]) | st.integers(0, 2**64 - 1),
    st.binary(min_size=16, max_size=16),
)


@st.composite
def _plausible_frames(draw: st.DrawFn) -> list[bytes]:
    """Frames with an envelope that passes the pre-authentication checks most of the time."""
    header = draw(st.binary(max_size=64))
    buffers = draw(st.lists(st.binary(max_size=32), max_size=4))
    magic, protocol, kind, session, counter, tag = draw(_envelopes)
    envelope = ENVELOPE.pack(magic, protocol, kind, session, counter, len(header), tag)
    tags = draw(st.binary(max_size=48))
    return [envelope, header, tags, *buffers]


@PROPERTY_SETTINGS
@given(frames=st.lists(st.binary(max_size=80), max_size=6) | _plausible_frames())
def test_decode_raises_only_protocol_or_authentication_errors(frames: list[bytes]) -> None:
    verifier = MessageVerifier(SECRET, REQUEST_ROLE)
    with pytest.raises((ProtocolError, AuthenticationError)):
        decode(frames, KIND_REQUEST, verifier, Limits(max_buffers=8))


@PROPERTY_SETTINGS
@given(data=st.data())
def test_any_single_mutated_byte_of_a_valid_message_is_refused(data: st.DataObject) -> None:
    signer, verifier = _request_pair()
    buffers = data.draw(st.lists(st.binary(max_size=16), max_size=3), label="buffers")
    body = data.draw(
        st.dictionaries(st.text(max_size=4), st.integers(-(2**63), 2**64 - 1), max_size=3)
    )
    frames = [bytes(f) for f in encode(KIND_REQUEST, {"body": body}, buffers, signer)]
    candidates = [i for i, frame in enumerate(frames) if frame]
    index = data.draw(st.sampled_from(candidates), label="frame")
    position = data.draw(st.integers(0, len(frames[index]) - 1), label="position")
    delta = data.draw(st.integers(1, 255), label="xor")
    mutated = bytearray(frames[index])
    mutated[position] ^= delta
    frames[index] = bytes(mutated)
    with pytest.raises((ProtocolError, AuthenticationError)):
        decode(frames, KIND_REQUEST, verifier, Limits())


# -- notices ------------------------------------------------------------------------------------


def test_notice_round_trip() -> None:
    frames = encode_notice("auth", "wrong secret, says ps:0")
    assert frames[0] == NOTICE_MAGIC
    assert decode_notice(frames) == {
        "reason": "auth",
        "message": "wrong secret, says ps:0",
        "protocol": PROTOCOL_VERSION,
    }
    assert decode_notice([memoryview(f) for f in frames])["reason"] == "auth"


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [NOTICE_MAGIC],
        [NOTICE_MAGIC, msgpack.packb({"message": "x"}), b""],
        [b"TF-NOTICe", msgpack.packb({"message": "x"})],
        [NOTICE_MAGIC, b"\xc1"],
        [NOTICE_MAGIC, b"\x81"],
        [NOTICE_MAGIC, msgpack.packb(["message", "x"])],
        [NOTICE_MAGIC, msgpack.packb({"message": 3})],
        [NOTICE_MAGIC, msgpack.packb({"reason": "auth"})],
        [NOTICE_MAGIC, msgpack.packb({1: "x", "message": "x"})],
        [NOTICE_MAGIC, msgpack.packb({"message": "x" * 5000})],
    ],
    ids=[
        "empty",
        "one-frame",
        "three-frames",
        "bad-magic",
        "reserved-byte",
        "truncated",
        "not-a-map",
        "message-not-str",
        "no-message",
        "int-key",
        "too-long",
    ],
)
def test_garbage_notices_decode_to_none(frames: list[bytes]) -> None:
    assert decode_notice(frames) is None


@PROPERTY_SETTINGS
@given(first=st.binary(max_size=12), second=st.binary(max_size=64))
def test_decode_notice_never_raises(first: bytes, second: bytes) -> None:
    for frames in ([first, second], [NOTICE_MAGIC, second], [first]):
        notice = decode_notice(frames)
        assert notice is None or isinstance(notice["message"], str)


def test_a_message_is_not_a_notice() -> None:
    signer, _ = _request_pair()
    assert decode_notice(encode(KIND_REQUEST, {"message": "x"}, [], signer)) is None


def test_notice_errors_explain_what_to_do() -> None:
    auth = notice_error(decode_notice(encode_notice("auth", "bad tag")), "ps:0 at h:1")
    assert isinstance(auth, AuthenticationError)
    assert "secret mismatch" in str(auth)
    assert "ps:0 at h:1 refused our messages: bad tag" in str(auth)
    assert "TENSORFLEET_SECRET" in str(auth)
    protocol = notice_error(decode_notice(encode_notice("protocol", "v2 here")), "ps:1")
    assert isinstance(protocol, ProtocolError)
    assert str(protocol) == "ps:1 refused our messages: v2 here"


# -- chunk tags ------------------------------------------------------------------------------


def test_large_payloads_are_authenticated_chunk_by_chunk_on_two_threads() -> None:
    from tensorfleet.wire.auth import CHUNK_BYTES, PARALLEL_MIN_BYTES, TAG_BYTES

    signer, verifier = _request_pair()
    payload = bytearray(os.urandom(PARALLEL_MIN_BYTES + CHUNK_BYTES + 7))  # 4 chunks
    frames = encode(KIND_REQUEST, {"op": "push"}, [payload, b"tail"], signer)
    assert memoryview(frames[2]).nbytes == 5 * TAG_BYTES  # 4 chunks + the small buffer
    message = decode(frames, KIND_REQUEST, verifier, Limits())
    assert bytes(message.buffers[0]) == bytes(payload)

    tampered = [bytes(f) for f in encode(KIND_REQUEST, {"op": "push"}, [payload], signer)]
    changed = bytearray(tampered[3])
    changed[2 * CHUNK_BYTES + 1] ^= 0x40  # in the third chunk
    with pytest.raises(AuthenticationError, match="chunk 3 of 4"):
        decode([*tampered[:3], bytes(changed)], KIND_REQUEST, verifier, Limits())


def test_small_payloads_are_tagged_and_checked_in_one_loop_as_the_chunks_say() -> None:
    """Below the two-thread size, the tags come from one plain loop over the buffers: the same
    tags, chunk for chunk, as the chunk jobs give, and a tampered chunk named by its index."""
    from tensorfleet.wire.auth import (
        CHUNK_BYTES,
        PARALLEL_MIN_BYTES,
        chunk_jobs,
        gmac,
        nonce,
    )

    signer, verifier = _request_pair()
    buffers = [b"ids", b"", os.urandom(CHUNK_BYTES + 5), os.urandom(100)]  # 4 chunks
    assert sum(len(b) for b in buffers) < PARALLEL_MIN_BYTES
    counter = signer.counter + 1
    jobs, _ = chunk_jobs(buffers)
    aead = AESGCM(signer._key)
    expected = b"".join(gmac(aead, nonce(counter, index), data) for index, data in jobs)
    frames = [bytes(f) for f in encode(KIND_REQUEST, {"op": "push"}, buffers, signer)]
    assert frames[2] == expected and len(jobs) == 4
    changed = bytearray(frames[5])  # the third buffer: chunks 2 and 3
    changed[CHUNK_BYTES + 1] ^= 0x01  # in chunk 3
    with pytest.raises(AuthenticationError, match="chunk 3 of 4"):
        decode([*frames[:5], bytes(changed), frames[6]], KIND_REQUEST, verifier, Limits())
    message = decode(frames, KIND_REQUEST, verifier, Limits())  # untouched: accepted
    assert [bytes(b) for b in message.buffers] == buffers


def test_chunk_tags_swapped_between_chunks_are_refused() -> None:
    from tensorfleet.wire.auth import CHUNK_BYTES, TAG_BYTES

    signer, verifier = _request_pair()
    same = b"\x07" * CHUNK_BYTES  # two identical chunks: only the index tells them apart
    frames = [bytes(f) for f in encode(KIND_REQUEST, {}, [same * 2], signer)]
    tags = frames[2]
    assert tags[:TAG_BYTES] != tags[TAG_BYTES:]  # the nonce includes the chunk's index


def test_truncated_chunk_tags_are_a_protocol_error() -> None:
    signer, verifier = _request_pair()
    frames = _hand_signed(signer, msgpack.packb({"sizes": [3]}), [b"abc"])
    short = [frames[0], frames[1], frames[2][:-1], frames[3]]
    with pytest.raises((ProtocolError, AuthenticationError)):
        decode(short, KIND_REQUEST, verifier, Limits())
