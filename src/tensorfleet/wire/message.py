"""The message format: an authenticated envelope, a msgpack header, raw buffers.

A message travels as ZeroMQ frames::

    [envelope (48 bytes)] [header (msgpack map)] [buffer 0] [buffer 1] ...

The envelope is fixed-size binary so that it can be checked before anything is parsed::

    magic "TF" | protocol u8 | kind u8 | session id (16) | counter u64 | header length u32 | tag (16)

The MAC covers the envelope up to the tag, the header and every buffer. The header's own
length is in the envelope and the buffers' lengths are in the header, so the concatenation
is unambiguous. Buffers are raw tensor bytes, sent and received without copies; their
dtypes and shapes are described in the header by whoever defines the operation.

Nothing is parsed before the MAC verifies: bytes from someone without the secret never
reach msgpack. Even then, msgpack runs with limits and the header must be a map with
string keys (see :func:`decode`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tensorfleet.errors import AuthenticationError, ConfigError, ProtocolError
from tensorfleet.wire.auth import Buffer, MessageSigner, MessageVerifier

#: Version of the framing and of the operations; both sides must speak the same one.
PROTOCOL_VERSION = 1
MAGIC = b"TF"
KIND_REQUEST = 0
KIND_REPLY = 1
_ENVELOPE = struct.Struct(">2sBB16sQI16s")
ENVELOPE_BYTES = _ENVELOPE.size
_SIGNED_ENVELOPE_BYTES = ENVELOPE_BYTES - 16

#: Unauthenticated notices a server sends to a peer it cannot talk to (wrong secret, other
#: protocol version), so that the peer can fail with a clear error instead of timing out.
NOTICE_MAGIC = b"TF-NOTICE"


@dataclass(frozen=True)
class Limits:
    """Bounds on what a receiver accepts; anything larger is refused before it is parsed."""

    max_message_bytes: int = 1 << 31
    """Total size of all frames of one message (default 2 GiB)."""
    max_buffers: int = 1024
    """Number of raw buffers in one message."""
    max_header_bytes: int = 1 << 20
    """Size of the msgpack header (names and shapes of thousands of variables fit)."""

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_buffers", "max_header_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"Limits.{name} must be positive, got {getattr(self, name)}")


@dataclass
class Message:
    """One decoded message: who sent it, its header map, and its raw buffers."""

    kind: int
    session_id: bytes
    counter: int
    header: dict[str, Any]
    buffers: list[Buffer] = field(default_factory=list)


def encode(
    kind: int, header: dict[str, Any], buffers: list[Buffer], signer: MessageSigner
) -> list[Buffer]:
    """Frames for one message, signed by ``signer``. Buffers are not copied."""
    header = dict(header, sizes=[memoryview(b).nbytes for b in buffers])
    header_bytes = msgpack.packb(header, use_bin_type=True)
    counter = signer.next_counter()
    signed = _ENVELOPE.pack(
        MAGIC, PROTOCOL_VERSION, kind, signer.session_id, counter, len(header_bytes), b"\0" * 16
    )
    signed_part = signed[:_SIGNED_ENVELOPE_BYTES]
    tag = signer.tag(counter, [signed_part, header_bytes, *buffers])
    return [signed_part + tag, header_bytes, *buffers]


def peek_protocol(frames: list[Buffer]) -> int | None:
    """The protocol version a message claims, or None if it is not one of ours at all."""
    if not frames:
        return None
    first = memoryview(frames[0])
    if first.nbytes != ENVELOPE_BYTES or bytes(first[:2]) != MAGIC:
        return None
    return first[2]


def decode(
    frames: list[Buffer], expected_kind: int, verifier: MessageVerifier, limits: Limits
) -> Message:
    """Check and decode one message; raise :class:`ProtocolError` or
    :class:`AuthenticationError` (never anything else) if it is not acceptable."""
    if len(frames) < 2:
        raise ProtocolError(f"a message has at least 2 frames, got {len(frames)}")
    if len(frames) - 2 > limits.max_buffers:
        raise ProtocolError(
            f"{len(frames) - 2} buffers in one message; the limit is {limits.max_buffers}"
        )
    views = [memoryview(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > limits.max_message_bytes:
        raise ProtocolError(f"message of {total} bytes; the limit is {limits.max_message_bytes}")
    envelope = views[0]
    if envelope.nbytes != ENVELOPE_BYTES:
        raise ProtocolError(f"envelope of {envelope.nbytes} bytes, expected {ENVELOPE_BYTES}")
    magic, protocol, kind, session_id, counter, header_len, tag = _ENVELOPE.unpack(envelope)
    if magic != MAGIC:
        raise ProtocolError("not a tensorfleet message (bad magic)")
    if protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {protocol} received, this tensorfleet speaks {PROTOCOL_VERSION}: "
            "run the same tensorfleet version on every task"
        )
    if kind != expected_kind:
        raise ProtocolError(f"message kind {kind} where {expected_kind} was expected")
    if header_len != views[1].nbytes or header_len > limits.max_header_bytes:
        raise ProtocolError(
            f"header of {views[1].nbytes} bytes (declared {header_len}, limit {limits.max_header_bytes})"
        )
    verifier.verify(session_id, counter, tag, [envelope[:_SIGNED_ENVELOPE_BYTES], *views[1:]])
    try:
        header = msgpack.unpackb(
            views[1],
            raw=False,
            strict_map_key=True,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable header: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    sizes = header.get("sizes")
    buffers = views[2:]
    if not isinstance(sizes, list) or [b.nbytes for b in buffers] != sizes:
        raise ProtocolError(
            f"buffer sizes {[b.nbytes for b in buffers]} do not match the header's {sizes!r}"
        )
    return Message(
        kind=kind, session_id=session_id, counter=counter, header=header, buffers=list(buffers)
    )


def encode_notice(reason: str, message: str) -> list[bytes]:
    """An unauthenticated notice (``reason`` is ``auth`` or ``protocol``)."""
    return [
        NOTICE_MAGIC,
        msgpack.packb({"reason": reason, "message": message, "protocol": PROTOCOL_VERSION}),
    ]


def decode_notice(frames: list[Buffer]) -> dict[str, Any] | None:
    """The notice in ``frames``, or None if they are not a well-formed notice."""
    if (
        len(frames) != 2
        or bytes(memoryview(frames[0])) != NOTICE_MAGIC
        or memoryview(frames[1]).nbytes > 4096
    ):
        return None
    try:
        notice = msgpack.unpackb(frames[1], raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if not isinstance(notice, dict) or not isinstance(notice.get("message"), str):
        return None
    return notice


def notice_error(notice: dict[str, Any], peer: str) -> Exception:
    """The exception a client raises for a notice received from ``peer``."""
    text = f"{peer} refused our messages: {notice['message']}"
    if notice.get("reason") == "auth":
        return AuthenticationError(
            f"secret mismatch: {text}. Every task must use the same cluster secret "
            "(TENSORFLEET_SECRET or --secret-file)"
        )
    return ProtocolError(text)
