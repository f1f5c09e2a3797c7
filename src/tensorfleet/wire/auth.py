"""Message authentication: every frame of every message is covered by a MAC under the
cluster secret, with a per-sender counter so that a captured message cannot be replayed.

How it works, and why:

* Each sender (a client connection, or a server answering) is a *session* with a random
  16-byte id. Its key is ``HKDF-SHA256(secret, salt=session_id, info=b"tensorfleet/<role>")``
  where role is ``request`` or ``reply``: a request can never be reflected back as a reply,
  and no two sessions share a key.
* Messages carry the session id and a 64-bit counter that the sender increments for every
  message. The MAC is AES-256-GMAC (GCM with everything as associated data) with the counter
  as the nonce. A nonce is never reused under one key because the counter only grows.
* The receiver keeps the highest counter accepted per session and refuses anything not
  above it: a replayed message is rejected.

Why GMAC and not HMAC-SHA256 (the first plan): on a 6.6 MB push+pull the MAC runs four
times (sign and verify, both ways). Measured on this project's machine, HMAC-SHA256 runs at
1.75 GB/s (15 ms per push+pull, more than the whole raw TCP round trip), AES-256-GMAC at
19.6 GB/s (1.4 ms). Both are standard MACs with 128-bit tags; key derivation and the header
use SHA-256 through HKDF.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from collections.abc import Iterable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tensorfleet.errors import AuthenticationError, ConfigError

SESSION_ID_BYTES = 16
TAG_BYTES = 16
REQUEST_ROLE = "request"
REPLY_ROLE = "reply"
_ROLES = (REQUEST_ROLE, REPLY_ROLE)

Buffer = bytes | bytearray | memoryview


def derive_session_key(secret: bytes, session_id: bytes, role: str) -> bytes:
    """The 256-bit key of one sender session in one direction."""
    if role not in _ROLES:
        raise ConfigError(f"role must be one of {_ROLES}, got {role!r}")
    hkdf = HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=session_id,
        info=b"tensorfleet/" + role.encode(),
    )
    return hkdf.derive(secret)


def derive_curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The ps tasks' ZeroMQ CURVE key pair (public, secret; Z85), derived from the cluster
    secret: encryption needs no key files beyond the secret every task already holds.
    Clients use a fresh ephemeral key pair per connection."""
    import zmq  # the transport's dependency; auth itself needs only cryptography
    from zmq.utils import z85

    raw = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=b"tensorfleet/curve-server"
    ).derive(secret)
    secret_key = z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


def _nonce(counter: int) -> bytes:
    return b"\x00\x00\x00\x00" + struct.pack(">Q", counter)


class MessageSigner:
    """The sending side of one session: a fresh session id, its key, and the counter.

    Not thread-safe: one signer belongs to one sending thread (as does a ZeroMQ socket).
    """

    def __init__(self, secret: bytes, role: str) -> None:
        self.session_id = os.urandom(SESSION_ID_BYTES)
        self._key = derive_session_key(secret, self.session_id, role)
        self._counter = 0

    def next_counter(self) -> int:
        """Reserve the counter for the next message (strictly increasing, never reused)."""
        self._counter += 1
        return self._counter

    def tag(self, counter: int, parts: Iterable[Buffer]) -> bytes:
        """The 16-byte GMAC tag of ``parts`` (concatenated) under this session's counter."""
        encryptor = Cipher(algorithms.AES(self._key), modes.GCM(_nonce(counter))).encryptor()
        for part in parts:
            encryptor.authenticate_additional_data(part)
        encryptor.finalize()
        return encryptor.tag


class MessageVerifier:
    """The receiving side: checks tags and refuses replays, for any number of sessions.

    Keeps at most ``max_sessions`` sessions (least recently used are forgotten; a session is
    only remembered after one of its messages verified, so only secret holders can fill it).
    """

    def __init__(self, secret: bytes, role: str, max_sessions: int = 4096) -> None:
        if role not in _ROLES:
            raise ConfigError(f"role must be one of {_ROLES}, got {role!r}")
        self._secret = secret
        self._role = role
        self._max_sessions = max_sessions
        self._keys: OrderedDict[bytes, bytes] = OrderedDict()
        self._last_counter: dict[bytes, int] = {}

    def verify(self, session_id: bytes, counter: int, tag: bytes, parts: Iterable[Buffer]) -> None:
        """Accept the message or raise :class:`AuthenticationError`; on success the counter is
        recorded so the same message is refused next time."""
        if len(session_id) != SESSION_ID_BYTES or len(tag) != TAG_BYTES:
            raise AuthenticationError("malformed authentication fields")
        last = self._last_counter.get(session_id, 0)
        if counter <= last:
            raise AuthenticationError(
                f"replayed or reordered message: counter {counter} is not above "
                f"{last} for this session"
            )
        key = self._keys.get(session_id)
        if key is None:
            key = derive_session_key(self._secret, session_id, self._role)
        decryptor = Cipher(algorithms.AES(key), modes.GCM(_nonce(counter), tag)).decryptor()
        for part in parts:
            decryptor.authenticate_additional_data(part)
        try:
            decryptor.finalize()
        except InvalidTag:
            raise AuthenticationError(
                "message authentication failed: the sender does not hold this cluster's secret "
                "(or the message was altered)"
            ) from None
        self._remember(session_id, key, counter)

    def _remember(self, session_id: bytes, key: bytes, counter: int) -> None:
        self._keys[session_id] = key
        self._keys.move_to_end(session_id)
        self._last_counter[session_id] = counter
        while len(self._keys) > self._max_sessions:
            old, _ = self._keys.popitem(last=False)
            self._last_counter.pop(old, None)
