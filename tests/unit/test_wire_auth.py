"""Message authentication: per-session AES-GMAC tags, replay counters, role separation and the
bounded session memory of :class:`~tensorfleet.wire.auth.MessageVerifier`."""

from __future__ import annotations

import pytest

from tensorfleet.errors import AuthenticationError, ConfigTypeError
from tensorfleet.wire.auth import (
    REPLY_ROLE,
    REQUEST_ROLE,
    SESSION_ID_BYTES,
    TAG_BYTES,
    MessageSigner,
    MessageVerifier,
    derive_session_key,
)

SECRET = b"unit-test-cluster-secret-0123456789"
OTHER_SECRET = b"another-cluster-secret-9876543210"
PARTS = [b"envelope-part", b"\x81\xa2op\xa4push", b"", b"\x00\x01\x02\x03" * 4]


def _signed(signer: MessageSigner, parts: list[bytes]) -> tuple[int, bytes]:
    counter = signer.next_counter()
    return counter, signer.tag(counter, parts)


def test_sign_then_verify_round_trip() -> None:
    signer = MessageSigner(SECRET, REQUEST_ROLE)
    verifier = MessageVerifier(SECRET, REQUEST_ROLE)
    for _ in range(3):
        counter, tag = _signed(signer, PARTS)
        assert len(tag) == TAG_BYTES
        verifier.verify(signer.session_id, counter, tag, PARTS)


def test_counters_strictly_increase_and_session_ids_are_random() -> None:
    signer = MessageSigner(SECRET, REQUEST_ROLE)
    assert [signer.next_counter() for _ in range(4)] == [1, 2, 3, 4]
    assert len(signer.session_id) == SESSION_ID_BYTES
    assert MessageSigner(SECRET, REQUEST_ROLE).session_id != signer.session_id


def test_tag_is_deterministic_per_session_and_counter() -> None:
    signer = MessageSigner(SECRET, REQUEST_ROLE)
    assert signer.tag(7, PARTS) == signer.tag(7, PARTS)
    assert signer.tag(7, PARTS) != signer.tag(8, PARTS)
    assert MessageSigner(SECRET, REQUEST_ROLE).tag(7, PARTS) != signer.tag(7, PARTS)


def test_wrong_secret_is_rejected() -> None:
    signer = MessageSigner(OTHER_SECRET, REQUEST_ROLE)
    verifier = MessageVerifier(SECRET, REQUEST_ROLE)
    counter, tag = _signed(signer, PARTS)
    with pytest.raises(AuthenticationError, match="does not hold this cluster's secret"):
        verifier.verify(signer.session_id, counter, tag, PARTS)


def test_any_flipped_byte_in_any_part_is_rejected() -> None:
    signer = MessageSigner(SECRET, REQUEST_ROLE)
    verifier = MessageVerifier(SECRET, REQUEST_ROLE)
    counter, tag = _signed(signer, PARTS)
    for index, part in enumerate(PARTS):
        for position in range(len(part)):
            altered = bytearray(part)
            altered[position] ^= 0x01
            parts = [*PARTS[:index], bytes(altered), *PARTS[index + 1 :]]
            with pytest.raises(AuthenticationError):
                verifier.verify(signer.session_id, counter, tag, parts)
    # Still acceptable unaltered: failures were not remembered as "seen".
    verifier.verify(signer.session_id, counter, tag, PARTS)


def test_flipped_byte_in_tag_or_session_id_or_counter_is_rejected() -> None:
    signer = MessageSigner(SECRET, REQUEST_ROLE)
    verifier = MessageVerifier(SECRET, REQUEST_ROLE)
    counter, tag = _signed(signer, PARTS)
    for position in range(TAG_BYTES):
        bad_tag = bytearray(tag)
        bad_tag[position] ^= 0x80
        with pytest.raises(AuthenticationError):
            verifier.verify(signer.session_id, counter, bytes(bad_tag), PARTS)
    for position in range(SESSION_ID_BYTES):
        bad_session = bytearray(signer.session_id)
        bad_session[position] ^= 0x80
        with pytest.raises(AuthenticationError):
            verifier.verify(bytes(bad_session), counter, tag, PARTS)
    with pytest.raises(AuthenticationError):
        verifier.verify(signer.session_id, counter + 1, tag, PARTS)


def test_appended_or_dropped_bytes_are_rejected() -> None:
    signer = MessageSigner(SECRET, REQUEST_ROLE)
    verifier = MessageVerifier(SECRET, REQUEST_ROLE)
    counter, tag = _signed(signer, PARTS)
    with pytest.raises(AuthenticationError):
        verifier.verify(signer.session_id, counter, tag, [*PARTS, b"x"])
    with pytest.raises(AuthenticationError):
        verifier.verify(signer.session_id, counter, tag, PARTS[:-1])


def test_replayed_message_is_rejected_and_older_counters_too() -> None:
    signer = MessageSigner(SECRET, REQUEST_ROLE)
    verifier = MessageVerifier(SECRET, REQUEST_ROLE)
    first = _signed(signer, PARTS)
    second = _signed(signer, PARTS)
    third = _signed(signer, PARTS)
    verifier.verify(signer.session_id, *third, PARTS)
    with pytest.raises(AuthenticationError, match="replayed"):
        verifier.verify(signer.session_id, *third, PARTS)
    with pytest.raises(AuthenticationError, match="counter 2 is not above 3"):
        verifier.verify(signer.session_id, *second, PARTS)
    with pytest.raises(AuthenticationError, match="replayed"):
        verifier.verify(signer.session_id, *first, PARTS)
    # Gaps are fine (lost messages); only "not above the last one" is refused.
    signer.next_counter()
    verifier.verify(signer.session_id, *_signed(signer, PARTS), PARTS)


def test_counter_zero_from_an_unknown_session_is_an_authentication_error() -> None:
    # Regression: this used to raise KeyError while formatting the error message.
    verifier = MessageVerifier(SECRET, REQUEST_ROLE)
    with pytest.raises(AuthenticationError, match="counter 0 is not above 0"):
        verifier.verify(b"s" * SESSION_ID_BYTES, 0, b"t" * TAG_BYTES, PARTS)


def test_malformed_authentication_fields_are_rejected() -> None:
    signer = MessageSigner(SECRET, REQUEST_ROLE)
    verifier = MessageVerifier(SECRET, REQUEST_ROLE)
    counter, tag = _signed(signer, PARTS)
    with pytest.raises(AuthenticationError, match="malformed"):
        verifier.verify(signer.session_id[:-1], counter, tag, PARTS)
    with pytest.raises(AuthenticationError, match="malformed"):
        verifier.verify(signer.session_id, counter, tag[:-1], PARTS)
    with pytest.raises(AuthenticationError, match="malformed"):
        verifier.verify(signer.session_id, counter, tag + b"\0", PARTS)


def test_request_cannot_verify_as_reply_nor_reply_as_request() -> None:
    request_signer = MessageSigner(SECRET, REQUEST_ROLE)
    reply_signer = MessageSigner(SECRET, REPLY_ROLE)
    counter, tag = _signed(request_signer, PARTS)
    with pytest.raises(AuthenticationError):
        MessageVerifier(SECRET, REPLY_ROLE).verify(request_signer.session_id, counter, tag, PARTS)
    counter, tag = _signed(reply_signer, PARTS)
    with pytest.raises(AuthenticationError):
        MessageVerifier(SECRET, REQUEST_ROLE).verify(reply_signer.session_id, counter, tag, PARTS)
    MessageVerifier(SECRET, REPLY_ROLE).verify(reply_signer.session_id, counter, tag, PARTS)


def test_session_keys_differ_by_role_session_and_secret() -> None:
    session = b"\x07" * SESSION_ID_BYTES
    request_key = derive_session_key(SECRET, session, REQUEST_ROLE)
    assert len(request_key) == 32
    assert request_key == derive_session_key(SECRET, session, REQUEST_ROLE)
    assert request_key != derive_session_key(SECRET, session, REPLY_ROLE)
    assert request_key != derive_session_key(SECRET, b"\x08" * SESSION_ID_BYTES, REQUEST_ROLE)
    assert request_key != derive_session_key(OTHER_SECRET, session, REQUEST_ROLE)


@pytest.mark.parametrize("role", ["", "requests", "REPLY", "server"])
def test_unknown_role_is_a_value_error(role: str) -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        derive_session_key(SECRET, b"\0" * SESSION_ID_BYTES, role)
    with pytest.raises(ValueError, match="role must be one of"):
        MessageSigner(SECRET, role)
    with pytest.raises(ValueError, match="role must be one of"):
        MessageVerifier(SECRET, role)


def test_sessions_beyond_max_sessions_are_forgotten_least_recently_used_first() -> None:
    verifier = MessageVerifier(SECRET, REQUEST_ROLE, max_sessions=2)
    signers = [MessageSigner(SECRET, REQUEST_ROLE) for _ in range(3)]
    messages = [_signed(s, PARTS) for s in signers]
    verifier.verify(signers[0].session_id, *messages[0], PARTS)
    verifier.verify(signers[1].session_id, *messages[1], PARTS)
    # Session 0 is used again, so session 1 is now the least recently used one.
    verifier.verify(signers[0].session_id, *_signed(signers[0], PARTS), PARTS)
    verifier.verify(signers[2].session_id, *messages[2], PARTS)

    # Session 1 was evicted: its replay counter is forgotten, so its old message passes again.
    verifier.verify(signers[1].session_id, *messages[1], PARTS)
    # Remembering session 1 evicted session 0 (LRU), while session 2 is still remembered.
    with pytest.raises(AuthenticationError, match="replayed"):
        verifier.verify(signers[2].session_id, *messages[2], PARTS)
    verifier.verify(signers[0].session_id, *messages[0], PARTS)


def test_failed_verifications_do_not_occupy_session_slots() -> None:
    verifier = MessageVerifier(SECRET, REQUEST_ROLE, max_sessions=1)
    good = MessageSigner(SECRET, REQUEST_ROLE)
    message = _signed(good, PARTS)
    verifier.verify(good.session_id, *message, PARTS)
    for _ in range(5):
        intruder = MessageSigner(OTHER_SECRET, REQUEST_ROLE)
        with pytest.raises(AuthenticationError):
            verifier.verify(intruder.session_id, *_signed(intruder, PARTS), PARTS)
    # The good session is still remembered: its replay is refused.
    with pytest.raises(AuthenticationError, match="replayed"):
        verifier.verify(good.session_id, *message, PARTS)


def test_a_text_secret_is_refused_with_the_fix() -> None:
    """A secret given as str (easy from the docs' snippets) fails naming the type and the fix,
    not deep in the key derivation."""
    with pytest.raises(ConfigTypeError, match=r"must be bytes, got str; fix: pass secret.encode"):
        MessageSigner("my-secret", REQUEST_ROLE)  # type: ignore[arg-type]
    with pytest.raises(ConfigTypeError, match="must be bytes"):
        MessageVerifier("my-secret", REQUEST_ROLE).verify(  # type: ignore[arg-type]
            b"s" * SESSION_ID_BYTES, 1, b"t" * 16, [b"x"]
        )
