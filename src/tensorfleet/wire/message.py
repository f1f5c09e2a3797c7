"""The message format: an authenticated envelope, a msgpack header, raw buffers.

A message travels as ZeroMQ frames::

    [envelope (48 bytes)] [header (msgpack map)] [chunk tags] [buffer 0] [buffer 1] ...

The envelope is fixed-size binary so that it can be checked before anything is parsed::

    magic "TF" | protocol u8 | kind u8 | session id (16) | counter u64 | header length u32 | tag (16)

The envelope's tag covers the envelope up to the tag, the header and the chunk tags; each
chunk of the buffers (:data:`~tensorfleet.wire.auth.CHUNK_BYTES`) has its own tag (see
:mod:`tensorfleet.wire.auth`). A *sealed* message (kind with :data:`SEALED` set: ``--encrypt``)
has the same frames, its header and buffers encrypted: the envelope's tag is the header's
GCM tag, the chunk tags are the chunks' (see :mod:`tensorfleet.wire.encryption`). The header's own length is in the envelope and the buffers'
lengths are in the header (``sizes``), so the chunks are unambiguous. Buffers are raw tensor
bytes, sent and received without copies; their dtypes and shapes are described in the header
by whoever defines the operation. A header with a ``shm`` key carries no buffer frames and
no chunk tags: its buffers lie in shared memory (:mod:`tensorfleet.wire.shared_memory`),
found by the transport's resolver. They are not authenticated byte by byte: the header that
names them is, and only processes of the peer's own user can reach that memory, which could
read the secret out of either task anyway (the threat model is in docs/security.md).

Nothing is parsed before the envelope's tag verifies (for a sealed message: before the
header decrypts and its tag verifies): bytes from someone without the secret never reach
msgpack. Even then, msgpack runs with limits and the header must be a map with
string keys (see :func:`decode`). No buffer is handed out before its chunks verify.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tensorfleet.errors import AuthenticationError, ConfigError, ProtocolError
from tensorfleet.wire.auth import (
    TAG_BYTES,
    Buffer,
    MessageSigner,
    MessageVerifier,
    chunk_count,
)
from tensorfleet.wire.encryption import Opener, Sealer

#: Version of the framing and of the operations; both sides must speak the same one.
#: 2: chunk tags (version 1 had one tag over everything). 3: sealed messages and the key
#: exchange (``--encrypt`` used ZeroMQ CURVE before). 4: payloads in shared memory carry no
#: chunk tags (the peer was authenticated by its hello; see docs/security.md).
PROTOCOL_VERSION = 4
#: The header key that names the shared-memory segment holding a message's buffers.
SHARED_MEMORY_KEY = "shm"
#: The header key of a message (a large reply or request) whose payload follows on the
#: client's payload stream (:mod:`tensorfleet.wire.payload_stream`): no buffer frames, no
#: chunk tags here.
STREAM_KEY = "stream"
MAGIC = b"TF"
KIND_REQUEST = 0
KIND_REPLY = 1
#: Set in the kind of a sealed (encrypted) message.
SEALED = 0x10
_ENVELOPE = struct.Struct(">2sBB16sQI16s")
ENVELOPE_BYTES = _ENVELOPE.size
_SIGNED_ENVELOPE_BYTES = ENVELOPE_BYTES - 16
#: Frames before the buffers: envelope, header, chunk tags.
FIXED_FRAMES = 3

#: Finds the buffers of a message whose header has ``shm`` (the header is verified, the
#: buffers not yet); raises ProtocolError when it cannot.
Resolver = Callable[[dict[str, Any], list[int]], list[Buffer]]
#: The opener of sealed messages from a session id, or None when this end holds no keys
#: for it.
Openers = Callable[[bytes], Opener | None]
#: Reads the payload of a message whose header has ``stream`` (the header is verified):
#: called with the header, the message's counter and the buffers' sizes; returns the
#: buffers, each chunk verified (:class:`~tensorfleet.wire.payload_stream.PayloadReceiver`).
StreamReader = Callable[[dict[str, Any], int, list[int]], list[Buffer]]


class UnknownConnection(ProtocolError):
    """A sealed message from a session this end holds no keys for (the service restarted or
    forgot the connection; or the message is forged)."""

    def __init__(self, session_id: bytes, counter: int) -> None:
        super().__init__("a sealed message from a connection without keys here")
        self.session_id, self.counter = session_id, counter


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
    sealed: bool = False
    """Whether it came encrypted (see :mod:`tensorfleet.wire.encryption`)."""


def encode(
    kind: int,
    header: dict[str, Any],
    buffers: list[Buffer],
    signer: MessageSigner,
    in_frames: bool = True,
    sealer: Sealer | None = None,
) -> list[Buffer]:
    """Frames for one message, signed by ``signer``, or with ``sealer`` sealed (encrypted
    under its connection's keys, named by ``signer``'s session and counter). Plain buffers
    are not copied; sealed ones are encrypted into buffers the frames keep alive. With
    ``in_frames=False`` the buffers are left out of the frames and carry no chunk tags: the
    header (signed or sealed) says where the receiver finds them, in shared memory that only
    the peer's own user can reach (:data:`SHARED_MEMORY_KEY`)."""
    header = dict(header, sizes=[memoryview(b).nbytes for b in buffers])
    header_bytes = msgpack.packb(header, use_bin_type=True)
    counter = signer.next_counter()
    if sealer is None:
        tags = signer.chunk_tags(counter, buffers) if in_frames else b""
        return [
            *sign_frames(signer, kind, counter, header_bytes, tags),
            *(buffers if in_frames else []),
        ]
    if in_frames:
        tags, sealed_buffers = sealer.seal_payload(counter, buffers)
    else:
        tags, sealed_buffers = b"", []
    envelope = _ENVELOPE.pack(
        MAGIC,
        PROTOCOL_VERSION,
        kind | SEALED,
        signer.session_id,
        counter,
        len(header_bytes),
        b"\0" * 16,
    )[:_SIGNED_ENVELOPE_BYTES]
    ciphertext, tag = sealer.seal_header(counter, header_bytes, [envelope, tags])
    return [envelope + tag, ciphertext, tags, *sealed_buffers]


def sign_frames(
    signer: MessageSigner, kind: int, counter: int, header_bytes: bytes, chunk_tags: bytes
) -> list[bytes]:
    """The envelope, header and chunk-tags frames of a message with these header bytes."""
    signed_part = _ENVELOPE.pack(
        MAGIC, PROTOCOL_VERSION, kind, signer.session_id, counter, len(header_bytes), b"\0" * 16
    )[:_SIGNED_ENVELOPE_BYTES]
    tag = signer.tag(counter, [signed_part, header_bytes, chunk_tags])
    return [signed_part + tag, header_bytes, chunk_tags]


def peek_protocol(frames: list[Buffer]) -> int | None:
    """The protocol version a message claims, or None if it is not one of ours at all."""
    if not frames:
        return None
    first = memoryview(frames[0])
    if first.nbytes != ENVELOPE_BYTES or bytes(first[:2]) != MAGIC:
        return None
    return first[2]


def decode(
    frames: list[Buffer],
    expected_kind: int,
    verifier: MessageVerifier,
    limits: Limits,
    resolve: Resolver | None = None,
    openers: Openers | None = None,
    read_stream: StreamReader | None = None,
) -> Message:
    """Check and decode one message; raise :class:`ProtocolError` or
    :class:`AuthenticationError` (never anything else) if it is not acceptable. ``resolve``
    finds the buffers of a message whose header says they are not in its frames (without
    it, such a message is refused). ``openers`` finds the keys of a sealed message's
    connection (without it, a sealed message is refused; when it has none for the sender,
    :class:`UnknownConnection`). A sealed message's buffers are decrypted into memory that
    the caller then owns. ``read_stream`` reads the payload of a message whose header says it
    follows on the payload stream (without it, such a message is refused)."""
    if len(frames) < FIXED_FRAMES:
        raise ProtocolError(f"a message has at least {FIXED_FRAMES} frames, got {len(frames)}")
    if len(frames) - FIXED_FRAMES > limits.max_buffers:
        raise ProtocolError(
            f"{len(frames) - FIXED_FRAMES} buffers in one message; the limit is {limits.max_buffers}"
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
    sealed = bool(kind & SEALED)
    kind &= ~SEALED
    if kind != expected_kind:
        raise ProtocolError(f"message kind {kind} where {expected_kind} was expected")
    if header_len != views[1].nbytes or header_len > limits.max_header_bytes:
        raise ProtocolError(
            f"header of {views[1].nbytes} bytes (declared {header_len}, limit {limits.max_header_bytes})"
        )
    associated = [envelope[:_SIGNED_ENVELOPE_BYTES], views[2]]
    opener, verified = None, None
    if sealed:
        if openers is None:
            raise ProtocolError(
                "an encrypted message to an end that does not encrypt: every task must agree "
                "on --encrypt / TENSORFLEET_ENCRYPT"
            )
        opener = openers(session_id)
        if opener is None:
            raise UnknownConnection(session_id, counter)
        header_bytes: Buffer = opener.open_header(counter, views[1], tag, associated)
    else:
        verified = verifier.check(session_id, counter, tag, [associated[0], views[1], views[2]])
        header_bytes = views[1]
    try:
        header = msgpack.unpackb(
            header_bytes,
            raw=False,
            strict_map_key=True,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable header: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    sizes = header.get("sizes")
    if (
        not isinstance(sizes, list)
        or len(sizes) > limits.max_buffers
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)
        or sum(sizes) > limits.max_message_bytes
    ):
        raise ProtocolError(
            f"the header's sizes must be a list of at most {limits.max_buffers} non-negative "
            f"ints totalling at most {limits.max_message_bytes} bytes, got {sizes!r:.200}"
        )
    in_memory = SHARED_MEMORY_KEY in header
    in_stream = STREAM_KEY in header
    if in_stream:
        if read_stream is None or sealed or in_memory:
            raise ProtocolError(
                "a message whose payload follows on a payload stream, where none is open "
                "(or sealed, or in shared memory too)"
            )
        if len(views) != FIXED_FRAMES or views[2].nbytes != 0:
            raise ProtocolError(
                "a message whose payload follows on its stream also has buffer frames or chunk tags"
            )
    elif in_memory:
        if resolve is None:
            raise ProtocolError("a message with its buffers in shared memory, where none is set up")
        if len(views) != FIXED_FRAMES:
            raise ProtocolError(
                "a message with its buffers in shared memory also has buffer frames"
            )
        if views[2].nbytes != 0:
            raise ProtocolError(
                f"{views[2].nbytes} bytes of chunk tags for a payload in shared memory, which "
                "carries none"
            )
    else:
        chunks = chunk_count(sizes)
        if views[2].nbytes != TAG_BYTES * chunks:
            raise ProtocolError(
                f"{views[2].nbytes} bytes of chunk tags for {chunks} chunks ({TAG_BYTES} bytes each)"
            )
    # The header (and with it the segment's name and the sizes) is authentic from here on.
    if in_stream:
        buffers = [memoryview(b) for b in read_stream(header, counter, sizes)]  # verified
    elif in_memory:
        buffers = [memoryview(b) for b in resolve(header, sizes)]
    else:
        buffers = views[FIXED_FRAMES:]
    if [b.nbytes for b in buffers] != sizes:
        raise ProtocolError(
            f"buffer sizes {[b.nbytes for b in buffers]} do not match the header's {sizes!r}"
        )
    if opener is not None:
        if not in_memory:
            buffers = opener.open_payload(counter, views[2], buffers)
        opener.accept(counter)
    else:
        outside = in_memory or in_stream  # shared memory, or verified by the stream's reader
        verifier.accept(verified, b"" if outside else views[2], [] if outside else buffers)
    return Message(
        kind=kind,
        session_id=session_id,
        counter=counter,
        header=header,
        buffers=list(buffers),
        sealed=sealed,
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


def notice_error(notice: dict[str, Any], peer: str, secret_source: str | None = None) -> Exception:
    """The exception a client raises for a notice received from ``peer``; ``secret_source``:
    where this task's secret came from (``ClusterSecret.source``), named in a secret
    mismatch."""
    text = f"{peer} refused our messages: {notice['message']}"
    if notice.get("reason") == "auth":
        ours = f"; this task's secret came from {secret_source}" if secret_source else ""
        return AuthenticationError(
            f"secret mismatch: {text}{ours}. Every task must use the same cluster secret "
            "(TENSORFLEET_SECRET / TENSORFLEET_SECRET_FILE, or --secret-file of `tensorfleet "
            "server`, `launch` and the examples)"
        )
    return ProtocolError(text)
