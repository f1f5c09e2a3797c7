"""An encrypting channel's bookkeeping around its key exchanges: when to exchange keys,
which requests wait for the keys, and how the replies that come signed rather than sealed
are told apart.

The rule: a key exchange precedes the first request and every ``hello`` (a ``hello`` starts
a session with a service, possibly a restarted one). Requests sent while an exchange is in
flight are *deferred*: :meth:`~tensorfleet.wire.channel.Channel.send` returns their ids at
once, and they are sealed and sent when the service's answer arrives (inside whatever
:meth:`~tensorfleet.wire.channel.Channel.wait` receives it), or fail with the service's
refusal. So a fan-out to several services still sends to all before it waits on any, and
the exchange costs no deadline of its own: the deferred request's deadline covers it. An
exchange whose deferred requests were all abandoned (a timeout, a lost connection) is
abandoned too, and the next request starts a fresh one.

The channel's messages are sealed (:mod:`tensorfleet.wire.encryption`) except the key
exchange itself; of the replies, only two kinds may come signed but not sealed, both
without payload: the answer to the exchange in flight, and a service's refusal of keys it
does not hold, which names the refused request by its message counter (its id was sealed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorfleet.errors import ServiceRestarted
from tensorfleet.wire.auth import Buffer
from tensorfleet.wire.encryption import KEY_EXCHANGE_OP, ChannelEncryption
from tensorfleet.wire.message import Message


@dataclass
class DeferredRequest:
    """A request waiting for the keys: sent as it was given once they arrive."""

    request_id: int
    op: str
    body: dict[str, Any]
    buffers: list[Buffer] | None
    timeout_s: float


class ChannelHandshake:
    """The key exchanges of one encrypting channel and the requests that wait for them."""

    def __init__(self, secret: bytes, client_session: bytes) -> None:
        self.encryption = ChannelEncryption(secret, client_session)
        self.exchange_id: int | None = None
        """The id of the key-exchange request in flight, or None."""
        self.deferred: list[DeferredRequest] = []
        self._counters: dict[int, int] = {}

    def needs_exchange(self, op: str) -> bool:
        """Whether a request ``op`` must be preceded by a new key exchange (none is in
        flight, and there are no keys yet or ``op`` starts a session)."""
        return self.exchange_id is None and (op == "hello" or self.encryption.sealer is None)

    def start(self, exchange_id: int) -> dict[str, Any]:
        """The body of the key-exchange request ``exchange_id`` (now in flight)."""
        self.exchange_id = exchange_id
        return self.encryption.start()

    def sent(self, request_id: int, counter: int) -> None:
        """``request_id`` left with message counter ``counter``."""
        self._counters[request_id] = counter

    def take_deferred(self) -> list[DeferredRequest]:
        """The requests that waited for the exchange that just ended (answered or not)."""
        deferred, self.deferred, self.exchange_id = self.deferred, [], None
        return deferred

    def forget(self, request_id: int) -> int | None:
        """``request_id`` is no longer awaited. Returns the id of a key exchange that no
        request waits for any more (to be abandoned: the next request starts a fresh one)."""
        self._counters.pop(request_id, None)
        self.deferred = [d for d in self.deferred if d.request_id != request_id]
        if self.exchange_id is not None and request_id != self.exchange_id and not self.deferred:
            abandoned, self.exchange_id = self.exchange_id, None
            return abandoned
        return None

    def clear(self) -> None:
        """Every request was abandoned (before a hello): none waits, none is in flight."""
        self.deferred.clear()
        self._counters.clear()
        self.exchange_id = None

    def unsealed_reply_expected(self, msg: Message, pending: Mapping[int, str]) -> bool:
        """Whether a reply that came signed but not sealed may be taken: the answer to the
        exchange in flight, or a refusal of keys the service does not hold (no payload
        either way). Anything else unsealed is dropped."""
        header = msg.header
        if msg.buffers:
            return False
        re = header.get("re")
        if re is not None:
            return re == self.exchange_id and pending.get(re) == KEY_EXCHANGE_OP
        return (
            header.get("ok") is False
            and header.get("error_type") == ServiceRestarted.code
            and isinstance(header.get("re_counter"), int)
        )

    def refused_request(self, header: dict[str, Any]) -> int | None:
        """The request a refusal of unknown keys answers (by its counter); the keys are
        dropped, so the next request exchanges new ones."""
        counter = header.get("re_counter")
        request_id = next((r for r, c in self._counters.items() if c == counter), None)
        if request_id is not None:
            self.encryption.forget()
        return request_id
