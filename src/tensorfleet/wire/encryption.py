"""Encryption (``--encrypt``): the header and payload of every message sealed with AES-256-GCM
under keys agreed per connection by an ephemeral X25519 exchange that the cluster secret
authenticates.

How it works, and why:

* **Key exchange.** Before its first request, and again before every ``hello``, a client
  (:class:`~tensorfleet.wire.channel.Channel`) sends a :data:`KEY_EXCHANGE_OP` request with a
  fresh X25519 public key (requests sent meanwhile wait for the answer:
  :mod:`tensorfleet.wire.channel_handshake`); the service answers with a fresh key of its
  own. Both are ordinary signed messages (:mod:`tensorfleet.wire.auth`: AES-GMAC under keys
  derived from the secret, counters against replay), so a peer without the secret can
  neither take part nor put its own key in the middle. Both ends derive ``request key || reply key =
  HKDF-SHA256(X25519 shared secret, salt=cluster secret, info=label || client session ||
  service session || client public key || service public key)``: two keys per connection,
  one per direction. The private keys exist only in memory for the exchange, so a secret
  stolen later does not decrypt recorded traffic (forward secrecy); the secret in the salt
  means that breaking the exchange alone is not enough either.
* **Sealing.** Each message gets its own key, ``HMAC-SHA256(direction key, label ||
  counter)`` with the sender's message counter. The header is encrypted with nonce
  ``0 || counter`` and the envelope and the chunk tags as associated data; its GCM tag is
  the envelope's tag, checked before anything is parsed. Each 1 MiB chunk of the payload
  is encrypted with nonce ``index || counter`` (index 1, 2, ...), its tag in the chunk-tags
  frame; the chunks are sealed and opened on the two threads that compute GMAC tags for
  plain messages (OpenSSL runs without the GIL), from the caller's buffers into reused
  buffers (:mod:`tensorfleet.wire.buffer_pool`), and on arrival into reused buffers that
  the receiver then owns: no byte is handed out before its chunk's tag verified.
* **A (key, nonce) pair is never used twice.** A message key seals exactly one message: a
  direction key belongs to one connection's one sender, whose counter only grows (a
  service's counter is shared by all its connections and still only grows), and within a
  message the indexes differ. Every exchange draws fresh ephemeral keys on both sides, so
  its keys are new even between the same two sessions. Per-message keys also keep every key
  far below AES-GCM's usage limits (one message of at most 2 GiB per key).
* **Replay.** The receiver keeps the last counter it accepted per connection and refuses
  anything not above it, as for plain messages.
* **Refusals.** A peer without the secret fails the exchange's signature and gets the usual
  "secret mismatch" notice. A service that encrypts answers a request that was not sealed
  with :class:`~tensorfleet.errors.EncryptionMismatch`, naming the flag; a service that does
  not encrypt answers a key exchange the same way. A sealed request from a connection the
  service holds no keys for (it restarted, or forgot the connection among more than
  :data:`MAX_CONNECTIONS`) gets a signed ``StaleSession`` refusal naming the request's
  counter: the client drops its keys, says hello again, and so exchanges new ones.
* **Not sealed.** The 48-byte envelope (it names the session and counter, hence the key),
  and the lengths of the frames (so the sizes of headers and tensors). Payloads that go
  through shared memory between tasks of one host (:mod:`tensorfleet.wire.shared_memory`)
  are neither encrypted nor tagged (the sealed header names them): they never leave the
  host, and whoever can open a task's memory file (through ``/proc``: the same user, or
  root) can read that task's secret too, so sealing them would cost a pass and protect
  nothing. ``TENSORFLEET_SHARED_MEMORY=0`` sends them in sealed frames instead.

The choice, and the alternatives. ZeroMQ CURVE (what ``--encrypt`` used before protocol 3)
needs no code of ours and has forward secrecy, but it encrypts (XSalsa20-Poly1305, after a
copy) on the single ZeroMQ I/O thread of each end, and on top of the GMAC every message
paid anyway: measured on this project's 2-vCPU machine, a CURVE echo alone reached
0.13-0.25x a raw TCP echo (``benchmarks/wire_floor.py``), below the issue's 0.5x target
before tensorfleet adds anything. TLS is not available for ZeroMQ's tcp transport (libzmq
has it for WebSocket in draft builds only, not in pyzmq's wheels), and TLS beside ZeroMQ
would be a socket layer of our own. WireGuard or IPsec between the machines covers all
traffic, the all-reduce and pipeline groups included, and is left to the user
(docs/security.md). AES-256-GCM in OpenSSL ran at 8.6-23 GB/s on one thread on this
machine (the VM's speed varies between sessions) and takes the place of the GMAC pass
(19-31 GB/s) rather than adding to it, and on the ps the encryption is the copy of the
values that a plain reply makes anyway. Measured with ``benchmarks/wire.py`` (7 runs on the
shared machine): an encrypted 8 MB push+pull ran at 0.88x the speed of the plain one of
the same run, 32 MB at 1.07x, where CURVE ran at 0.40x and 0.25x; docs/wire-performance.md
has the figures.
"""

from __future__ import annotations

import hmac
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tensorfleet.errors import AuthenticationError, ProtocolError, ReplayedMessage
from tensorfleet.wire.auth import (
    TAG_BYTES,
    Buffer,
    bytes_view,
    chunk_spans,
    gmac_chunk_tags,
    in_parallel,
    nonce,
)
from tensorfleet.wire.buffer_pool import BufferPool

#: The transport's own operation that starts an encrypted connection (a service never hands
#: it to its owner).
KEY_EXCHANGE_OP = "key_exchange"
PUBLIC_KEY_BYTES = 32
KEY_BYTES = 32
#: Connections whose keys a service keeps (least recently used are forgotten).
MAX_CONNECTIONS = 4096
_CONNECTION_LABEL = b"tensorfleet/3/connection keys"
_MESSAGE_LABEL = b"tensorfleet/3/message key"


@dataclass(frozen=True)
class ConnectionKeys:
    """The two keys of one connection: requests (client to service) and replies."""

    request: bytes
    reply: bytes


def derive_connection_keys(
    secret: bytes,
    shared: bytes,
    client_session: bytes,
    service_session: bytes,
    client_public: bytes,
    service_public: bytes,
) -> ConnectionKeys:
    """Both keys of a connection from the X25519 shared secret, bound to the secret, both
    sessions and both public keys."""
    info = _CONNECTION_LABEL + client_session + service_session + client_public + service_public
    keys = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=secret, info=info).derive(
        shared
    )
    return ConnectionKeys(request=keys[:KEY_BYTES], reply=keys[KEY_BYTES:])


def message_key(direction_key: bytes, counter: int) -> bytes:
    """The key that seals the one message of ``counter`` in one direction."""
    return hmac.digest(direction_key, _MESSAGE_LABEL + counter.to_bytes(8, "big"), "sha256")


def _peer_public(value: object, peer: str) -> bytes:
    """The peer's public key from a verified body, checked."""
    if not isinstance(value, bytes) or len(value) != PUBLIC_KEY_BYTES:
        seen = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise ProtocolError(
            f"the key exchange needs the {peer}'s {PUBLIC_KEY_BYTES}-byte X25519 public key "
            f"(body field 'public_key'), got {seen}"
        )
    return value


def _shared_secret(private: X25519PrivateKey, peer_public: bytes, peer: str) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:  # a low-order point: the shared secret would be all zeros
        raise ProtocolError(
            f"the {peer}'s X25519 public key is not usable (a low-order point)"
        ) from None


def _public_bytes(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes_raw()


def answer_key_exchange(
    secret: bytes, client_public: object, client_session: bytes, service_session: bytes
) -> tuple[bytes, ConnectionKeys]:
    """The service's side of an exchange: its fresh public key and the connection's keys."""
    client_public = _peer_public(client_public, "client")
    private = X25519PrivateKey.generate()
    public = _public_bytes(private)
    shared = _shared_secret(private, client_public, "client")
    keys = derive_connection_keys(
        secret, shared, client_session, service_session, client_public, public
    )
    return public, keys


class Sealer:
    """Seals the messages of one direction of one connection. ``pool`` gives the buffers the
    ciphertext is written into (they stay referenced by the frames until ZeroMQ sent them)."""

    def __init__(self, key: bytes, pool: BufferPool) -> None:
        self._key = key
        self._pool = pool

    def seal_payload(
        self, counter: int, buffers: Sequence[Buffer], encrypt: bool = True
    ) -> tuple[bytes, list[memoryview]]:
        """The chunk tags of ``buffers`` and, with ``encrypt``, their ciphertexts (empty
        without: the buffers travel elsewhere, e.g. in shared memory, only authenticated)."""
        key = message_key(self._key, counter)
        if not encrypt:
            return gmac_chunk_tags(key, counter, buffers), []
        views = [bytes_view(b) for b in buffers]
        outputs = self._pool.views([v.nbytes for v in views])
        spans = chunk_spans([v.nbytes for v in views])
        jobs = [
            (index + 1, views[b][start:stop], outputs[b][start:stop])
            for index, (b, start, stop) in enumerate(spans)
        ]

        def run(job: tuple[int, memoryview, memoryview]) -> bytes:
            index, source, target = job
            encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce(counter, index))).encryptor()
            encryptor.update_into(source, target)
            encryptor.finalize()
            return encryptor.tag

        tags = in_parallel(jobs, run, sum(v.nbytes for v in views))
        return b"".join(tags), outputs

    def seal_header(
        self, counter: int, header: bytes, associated: Sequence[Buffer]
    ) -> tuple[bytes, bytes]:
        """The header's ciphertext and tag; the tag also covers ``associated`` (the envelope
        up to its tag, and the chunk tags)."""
        encryptor = Cipher(
            algorithms.AES(message_key(self._key, counter)), modes.GCM(nonce(counter))
        ).encryptor()
        for part in associated:
            encryptor.authenticate_additional_data(part)
        ciphertext = encryptor.update(header) + encryptor.finalize()
        return ciphertext, encryptor.tag


class Opener:
    """Opens the messages of one direction of one connection and refuses replays. ``pool``
    gives the buffers payloads are decrypted into (handed to the receiver)."""

    def __init__(self, key: bytes, pool: BufferPool) -> None:
        self._key = key
        self._pool = pool
        self.last_counter = 0

    def open_header(
        self, counter: int, ciphertext: Buffer, tag: bytes, associated: Sequence[Buffer]
    ) -> bytes:
        """The header's plaintext, or :class:`AuthenticationError` (a replayed counter, or a
        header, envelope or chunk-tags frame that is not what was sealed). Nothing is
        recorded until :meth:`accept`."""
        if counter <= self.last_counter:
            raise ReplayedMessage(
                f"replayed or reordered message: counter {counter} is not above "
                f"{self.last_counter} for this connection"
            )
        decryptor = Cipher(
            algorithms.AES(message_key(self._key, counter)), modes.GCM(nonce(counter), tag)
        ).decryptor()
        for part in associated:
            decryptor.authenticate_additional_data(part)
        plaintext = decryptor.update(bytes_view(ciphertext))
        try:
            return plaintext + decryptor.finalize()
        except InvalidTag:
            raise AuthenticationError(
                "sealed message failed authentication: its envelope, header or chunk tags were "
                "altered, or it was not sealed under this connection's keys"
            ) from None

    def open_payload(
        self, counter: int, chunk_tags: Buffer, buffers: Sequence[Buffer], decrypt: bool = True
    ) -> list[Buffer]:
        """The payload's plaintext buffers (decrypted into fresh or reused memory that the
        caller owns; with ``decrypt=False`` the buffers themselves, whose tags verified), or
        :class:`AuthenticationError` naming the first chunk that does not verify."""
        views = [bytes_view(b) for b in buffers]
        spans = chunk_spans([v.nbytes for v in views])
        tags = memoryview(chunk_tags)
        if tags.nbytes != TAG_BYTES * len(spans):
            raise AuthenticationError(
                f"{tags.nbytes // TAG_BYTES} chunk tags for {len(spans)} chunks"
            )
        key = message_key(self._key, counter)
        if not decrypt:
            if not hmac.compare_digest(gmac_chunk_tags(key, counter, views), bytes(tags)):
                raise AuthenticationError(
                    "payload authentication failed: the payload in shared memory was altered "
                    "(or not sealed under this connection's keys)"
                )
            return list(views)
        outputs = self._pool.views([v.nbytes for v in views])
        jobs = [
            (index + 1, views[b][start:stop], outputs[b][start:stop])
            for index, (b, start, stop) in enumerate(spans)
        ]

        def run(job: tuple[int, memoryview, memoryview]) -> bool:
            index, source, target = job
            expected = bytes(tags[(index - 1) * TAG_BYTES : index * TAG_BYTES])
            decryptor = Cipher(
                algorithms.AES(key), modes.GCM(nonce(counter, index), expected)
            ).decryptor()
            decryptor.update_into(source, target)
            try:
                decryptor.finalize()
            except InvalidTag:
                return False
            return True

        verified = in_parallel(jobs, run, sum(v.nbytes for v in views))
        bad = [job[0] for job, ok in zip(jobs, verified, strict=True) if not ok]
        if bad:
            raise AuthenticationError(
                f"sealed payload failed authentication in chunk {bad[0]} of {len(jobs)}: it "
                "was altered (or not sealed under this connection's keys)"
            )
        return list(outputs)

    def accept(self, counter: int) -> None:
        """Record ``counter``: the message verified, the same one is refused from now on."""
        self.last_counter = counter


class ChannelEncryption:
    """A client's encryption towards one service: the key exchange, then the sealer of its
    requests and the opener of the replies of the service session it exchanged keys with."""

    def __init__(self, secret: bytes, client_session: bytes) -> None:
        self._secret = secret
        self._client_session = client_session
        self._private: X25519PrivateKey | None = None
        self.sealer: Sealer | None = None
        self.service_session: bytes | None = None
        self._opener: Opener | None = None
        self._send_pool = BufferPool()
        self._receive_pool = BufferPool()

    def start(self) -> dict[str, bytes]:
        """The body of a key-exchange request (a fresh key pair; the old keys stay in use
        until :meth:`finish`)."""
        self._private = X25519PrivateKey.generate()
        return {"public_key": _public_bytes(self._private)}

    def finish(self, body: dict[str, object], service_session: bytes) -> None:
        """Take the service's answer (from ``service_session``): the connection's keys."""
        if self._private is None:
            raise ProtocolError("a key-exchange answer without a key exchange in flight")
        private, self._private = self._private, None
        service_public = _peer_public(body.get("public_key"), "service")
        shared = _shared_secret(private, service_public, "service")
        keys = derive_connection_keys(
            self._secret,
            shared,
            self._client_session,
            service_session,
            _public_bytes(private),
            service_public,
        )
        self.sealer = Sealer(keys.request, self._send_pool)
        self._opener = Opener(keys.reply, self._receive_pool)
        self.service_session = service_session

    def forget(self) -> None:
        """Drop the keys (the service no longer holds its side): the next request exchanges
        new ones."""
        self.sealer = self._opener = None
        self.service_session = None

    def opener(self, session_id: bytes) -> Opener | None:
        """The opener of sealed replies from ``session_id`` (None: not the keyed service)."""
        return self._opener if session_id == self.service_session else None


class ServiceEncryption:
    """A service's keys, per client connection (session), at most :data:`MAX_CONNECTIONS`."""

    def __init__(
        self, secret: bytes, service_session: bytes, max_connections: int = MAX_CONNECTIONS
    ) -> None:
        self._secret = secret
        self._service_session = service_session
        self._max_connections = max_connections
        self._connections: OrderedDict[bytes, tuple[Sealer, Opener]] = OrderedDict()
        self._send_pool = BufferPool()
        self._receive_pool = BufferPool()

    def answer(self, client_session: bytes, client_public: object) -> bytes:
        """Take a client's key exchange (its signature verified): new keys for its session,
        replacing any it had; returns the service's public key for the answer."""
        public, keys = answer_key_exchange(
            self._secret, client_public, client_session, self._service_session
        )
        self._connections[client_session] = (
            Sealer(keys.reply, self._send_pool),
            Opener(keys.request, self._receive_pool),
        )
        self._connections.move_to_end(client_session)
        while len(self._connections) > self._max_connections:
            self._connections.popitem(last=False)
        return public

    def opener(self, client_session: bytes) -> Opener | None:
        """The opener of ``client_session``'s sealed requests (None: no keys for it)."""
        entry = self._connections.get(client_session)
        if entry is None:
            return None
        self._connections.move_to_end(client_session)
        return entry[1]

    def sealer(self, client_session: bytes) -> Sealer | None:
        """The sealer of the replies to ``client_session`` (None: no keys for it)."""
        entry = self._connections.get(client_session)
        return None if entry is None else entry[0]

    @property
    def connections(self) -> int:
        """How many connections' keys are held."""
        return len(self._connections)
