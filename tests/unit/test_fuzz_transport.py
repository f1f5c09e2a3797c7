"""Property-based fuzzing of a real ps over ZeroMQ: a :class:`ParameterService` on a
:class:`ServiceSocket` bound to a free loopback port, served in a background thread.

A raw DEALER sends what no client would: unauthenticated garbage, and messages signed with the
cluster secret (so they pass the MAC) whose header or buffers were mutated before signing:
authenticated but malformed. Every property runs twice: against a plain shard, and against a
shard that encrypts (``--encrypt``), to which the peer sends the same messages sealed under
keys it exchanged first, plus sealed garbage from connections the shard holds no keys for. After each example, a signed request on the same connection is
answered (so everything before it was handled) and the shard must be untouched: service
thread alive, values bit for bit, version and global step 0. After all examples a
well-behaved :class:`Channel` still gets answers, and its push gives exactly one SGD step.

``TENSORFLEET_FUZZ_EXAMPLES`` sets the number of examples per property (``scripts/fuzz.sh``).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tensorfleet.launch.ports import free_port
from tensorfleet.ps.service import ParameterService, ServiceConfig, ServiceOutcome
from tensorfleet.ps.update_rules import SGD
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.auth import REPLY_ROLE, REQUEST_ROLE, MessageSigner, MessageVerifier
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.encryption import KEY_EXCHANGE_OP, ChannelEncryption
from tensorfleet.wire.service_socket import ServiceSocket
from tensorfleet.wire.tensors import as_buffer

EXAMPLES = int(os.environ.get("TENSORFLEET_FUZZ_EXAMPLES", "50"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    # One shard per test, shared by its examples (each checks that it is untouched).
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
SECRET = b"fuzz-transport-unit-test-secret-0001"
WORKERS = ("worker:0", "worker:1")
TIMEOUT_S = 5.0
LR = 0.25
#: magic | protocol | kind | session id | counter | header length | tag  (see message.py)
ENVELOPE = struct.Struct(">2sBB16sQI16s")

VARIABLES = [
    {"name": "w", "shape": [2, 3], "dtype": "float32"},
    {"name": "b", "shape": [3], "dtype": "float32"},
    {"name": "d", "shape": [4], "dtype": "float64"},
    {"name": "h", "shape": [2], "dtype": "float16"},
]


def _initial_values() -> list[torch.Tensor]:
    return [
        torch.tensor([0.5, -1.25, 3.0, 1e-3, -0.0, 7.5, 2.0, -4.0, 0.125]),
        torch.tensor([1.0, -2.5, 1e-300, 12345.678], dtype=torch.float64),
        torch.tensor([0.5, -3.0], dtype=torch.float16),
    ]


def _gradients() -> list[torch.Tensor]:
    return [
        torch.tensor([0.1, 0.2, -0.3, 0.4, 0.5, -0.6, 0.7, 0.8, -0.9]),
        torch.tensor([0.3, -0.1, 2.0, 0.0], dtype=torch.float64),
        torch.tensor([0.5, 0.25], dtype=torch.float16),
    ]


def _buffers(tensors: list[torch.Tensor]) -> list[bytes]:
    return [bytes(as_buffer(t)) for t in tensors]


INITIAL = _buffers(_initial_values())
GRADIENTS = _buffers(_gradients())


def _sgd(values: list[torch.Tensor], gradients: list[torch.Tensor]) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(v.clone()) for v in values]
    for param, grad in zip(params, gradients, strict=True):
        param.grad = grad.clone()
    torch.optim.SGD(params, lr=LR).step()
    return [p.detach() for p in params]


# -- the shard and a raw peer ---------------------------------------------------------------------


class RawPeer:
    """A DEALER that sends frames as given, and signs (with the right secret) what it is told;
    towards a shard that encrypts, it exchanges keys first and seals what it is told."""

    def __init__(
        self, context: zmq.Context, address: str, server_session: bytes, encrypt: bool = False
    ) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://{address}")
        self.signer = MessageSigner(SECRET, REQUEST_ROLE)
        self.verifier = MessageVerifier(SECRET, REPLY_ROLE)
        self.server_session = server_session
        self.next_id = 0
        self.encryption: ChannelEncryption | None = None
        if encrypt:
            encryption = ChannelEncryption(SECRET, self.signer.session_id)
            header = self.header(KEY_EXCHANGE_OP, encryption.start())
            self.send([bytes(f) for f in wire.encode(wire.KIND_REQUEST, header, [], self.signer)])
            answer = self.reply_to(header["id"])
            encryption.finish(answer.header["body"], answer.session_id)
            self.encryption = encryption

    def header(self, op: str, body: dict, overrides: dict | None = None) -> dict[str, Any]:
        self.next_id += 1
        return {
            "op": op,
            "id": self.next_id,
            "srv": self.server_session,
            "timeout_ms": int(TIMEOUT_S * 1000),
            "body": body,
            **(overrides or {}),
        }

    def encode(self, header: dict, buffers: list[bytes]) -> list[bytes]:
        """A valid request with this header (sealed towards a shard that encrypts)."""
        sealer = self.encryption.sealer if self.encryption is not None else None
        frames = wire.encode(wire.KIND_REQUEST, header, buffers, self.signer, sealer=sealer)
        return [bytes(memoryview(f)) for f in frames]

    def signed(self, header_bytes: bytes, buffers: list[bytes]) -> list[bytes]:
        """Frames carrying exactly these header bytes, with valid tags (sealed towards a
        shard that encrypts)."""
        counter = self.signer.next_counter()
        if self.encryption is None:
            tags = self.signer.chunk_tags(counter, buffers)
            return [
                *wire.sign_frames(self.signer, wire.KIND_REQUEST, counter, header_bytes, tags),
                *buffers,
            ]
        sealer = self.encryption.sealer
        tags, sealed = sealer.seal_payload(counter, buffers)
        envelope = ENVELOPE.pack(
            wire.MAGIC,
            wire.PROTOCOL_VERSION,
            wire.KIND_REQUEST | wire.SEALED,
            self.signer.session_id,
            counter,
            len(header_bytes),
            b"",
        )[: wire.ENVELOPE_BYTES - 16]
        ciphertext, tag = sealer.seal_header(counter, header_bytes, [envelope, tags])
        return [envelope + tag, ciphertext, tags, *(bytes(b) for b in sealed)]

    def send(self, frames: list[bytes]) -> None:
        self.socket.send_multipart(frames)

    def call(self, op: str, body: dict, buffers: list[bytes] | None = None) -> wire.Message:
        """Send a valid request; return its reply, skipping everything that arrives first
        (so the reply proves every earlier message on this connection was handled). Its id is
        far above those of the fuzzed requests: a mutated header byte can turn a request's
        id into the next one, whose reply must not pass for this one's."""
        self.next_id += 1_000_000
        header = self.header(op, body)
        self.send(self.encode(header, buffers or []))
        return self.reply_to(header["id"])

    def reply_to(self, request_id: int) -> wire.Message:
        while True:
            assert self.socket.poll(int(TIMEOUT_S * 1000)), "no answer from the service"
            frames = self.socket.recv_multipart()
            if wire.decode_notice(frames) is not None:
                continue
            openers = self.encryption.opener if self.encryption is not None else None
            reply = wire.decode(
                frames, wire.KIND_REPLY, self.verifier, wire.Limits(), openers=openers
            )
            if reply.header.get("re") == request_id:
                return reply


@dataclass
class Shard:
    address: str
    service: ParameterService
    stop: threading.Event
    thread: threading.Thread
    context: zmq.Context
    encrypt: bool = False
    result: dict[str, Any] = field(default_factory=dict)

    @contextmanager
    def peer(self) -> Iterator[RawPeer]:
        """A new connection: one per example, as the service ignores a connection for good
        after a few invalid messages (QUARANTINE_AFTER_INVALID)."""
        peer = RawPeer(self.context, self.address, self.service.socket.session_id, self.encrypt)
        try:
            yield peer
        finally:
            peer.socket.close(linger=0)

    def channel(self) -> Channel:
        return Channel(self.address, SECRET, "ps:0", context=self.context, encrypt=self.encrypt)

    def rejected(self) -> int:
        return sum(self.service.socket.rejected.values())

    def counters(self) -> tuple[int, int]:
        """Messages dropped by the socket, requests refused by the service (read while the
        service waits for the next message)."""
        stats = self.service.stats
        return self.rejected(), stats["refused"] + stats["unknown_op"]

    def outcome(self, before: tuple[int, int]) -> str:
        """What became of the one message sent since ``before`` (reported by hypothesis)."""
        rejected, refused = self.counters()
        if rejected > before[0]:
            return "dropped by the socket (not a valid request)"
        return "refused by the service" if refused > before[1] else "answered"

    def assert_untouched(self, peer: RawPeer) -> None:
        """Everything ``peer`` sent was handled; the service runs; the variables are as
        created."""
        pulled = peer.call("pull", {})
        assert "error" not in self.result, self.result
        assert self.thread.is_alive()
        assert pulled.header["ok"] is True, pulled.header
        assert pulled.sealed is self.encrypt
        assert pulled.header["body"] == {"global_step": 0, "version": 0, "stop": False}
        assert [bytes(b) for b in pulled.buffers] == INITIAL


@pytest.fixture(params=[False, True], ids=["plain", "encrypted"])
def shard(request: pytest.FixtureRequest) -> Iterator[Shard]:
    """A created shard (async SGD) serving in a background thread, plain or encrypting. After
    the test (all its examples), a well-behaved client must still be served; then the shard
    is stopped, and must not have crashed."""
    encrypt = request.param
    config = ServiceConfig(shard_index=0, worker_tasks=WORKERS, idle_timeout_s=60.0)
    address = f"127.0.0.1:{free_port()}"
    socket = ServiceSocket(address, SECRET, config.limits, encrypt=encrypt)
    service = ParameterService(socket, config)
    stop = threading.Event()
    context = zmq.Context(io_threads=1)
    handle = Shard(address, service, stop, threading.Thread(target=lambda: None), context, encrypt)

    def serve() -> None:
        try:
            handle.result["outcome"] = service.serve(stop)
        except BaseException as exc:  # reported at teardown: a crash fails the test
            handle.result["error"] = exc

    handle.thread = threading.Thread(target=serve, name=f"ps@{address}", daemon=True)
    handle.thread.start()
    chief = handle.channel()
    try:
        chief.call("hello", _hello_body(), timeout_s=TIMEOUT_S)
        body = {"variables": VARIABLES, "rule": SGD(lr=LR).to_wire(), "owns_global_step": True}
        assert chief.call("create", body, INITIAL, TIMEOUT_S).body["created"] is True
        yield handle
        assert_channel_still_served(handle)
    finally:
        chief.close()
        stop.set()
        with context.socket(zmq.DEALER) as waker:  # out of poll() now, not in 0.2 s
            waker.setsockopt(zmq.LINGER, 1000)
            waker.connect(f"tcp://{address}")
            waker.send(b"wake up")
        handle.thread.join(TIMEOUT_S)
        stuck = handle.thread.is_alive()
        if not stuck:
            socket.close()
        context.term()
        assert not stuck, "the service thread did not stop"
    assert "error" not in handle.result, handle.result["error"]
    assert handle.result["outcome"] == ServiceOutcome("stopped", handle.service.global_step)


def _hello_body() -> dict:
    return {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": "worker:0"}


def assert_channel_still_served(shard: Shard) -> None:
    """A new, well-behaved client is answered; its push is exactly one SGD step."""
    channel = shard.channel()
    try:
        assert channel.call("hello", _hello_body(), timeout_s=TIMEOUT_S).body["initialized"]
        pushed = channel.call(
            "push", {"count_step": True, "want_values": True}, GRADIENTS, TIMEOUT_S
        )
        assert pushed.body["version"] == 1 and pushed.body["global_step"] == 1
        assert [bytes(b) for b in pushed.buffers] == _buffers(_sgd(_initial_values(), _gradients()))
        assert channel.call("stats", {}, timeout_s=TIMEOUT_S).body["pushes"] == 1
    finally:
        channel.close()


# -- strategies -----------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from([*WORKERS, "float32", "sgd", "push", "pull"]),
)
KEYS = st.sampled_from(["variables", "task", "step", "op", "body", "sizes"]) | st.text(max_size=6)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(KEYS, children, max_size=3),
    max_leaves=6,
)


@st.composite
def plausible_envelopes(draw: st.DrawFn) -> list[bytes]:
    """Frames that look like ours up to the MAC (right magic, protocol, kind and lengths)."""
    header = draw(st.binary(max_size=40))
    buffers = draw(st.lists(st.binary(max_size=40), max_size=3))
    envelope = ENVELOPE.pack(
        wire.MAGIC,
        draw(st.sampled_from([wire.PROTOCOL_VERSION, wire.PROTOCOL_VERSION + 1])),
        draw(st.sampled_from([wire.KIND_REQUEST, wire.KIND_REPLY]))
        | draw(st.sampled_from([0, wire.SEALED])),
        draw(st.binary(min_size=16, max_size=16)),
        draw(st.integers(0, 2**64 - 1)),
        len(header),
        draw(st.binary(min_size=16, max_size=16)),
    )
    return [envelope, header, *buffers]


GARBAGE = st.one_of(
    st.lists(st.binary(max_size=120), min_size=1, max_size=5),
    plausible_envelopes(),
    st.lists(st.binary(max_size=40), max_size=2).map(lambda rest: [wire.NOTICE_MAGIC, *rest]),
)


def _base_requests() -> list[tuple[str, dict, list[bytes]]]:
    """Requests whose every one-byte header mutation must leave the shard as it is: none of
    them can become a valid push (its buffers are wrong), 'done' or 'end'."""
    return [
        ("hello", _hello_body(), []),
        ("create", {"variables": VARIABLES, "rule": SGD(lr=LR).to_wire()}, INITIAL),
        ("wait_ready", {"variables": VARIABLES, "task": "worker:1"}, []),
        ("pull", {"moving_average": False}, []),
        ("stats", {}, []),
        ("push", {"task": "worker:0", "count_step": True}, GRADIENTS[:-1]),
        ("push", {"task": "worker:0", "want_values": True}, [GRADIENTS[0][:-1], *GRADIENTS[1:]]),
    ]


# -- properties -------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
@FUZZ
@given(messages=st.lists(GARBAGE, min_size=1, max_size=4))
def test_unauthenticated_garbage_is_rejected_and_changes_nothing(
    shard: Shard, messages: list[list[bytes]]
) -> None:
    rejected = shard.rejected()
    with shard.peer() as peer:
        for frames in messages:
            peer.send(frames)
        shard.assert_untouched(peer)
    assert shard.rejected() - rejected == len(messages)  # each one dropped, none handled


@pytest.mark.timeout(600)
@FUZZ
@given(data=st.data())
def test_signed_requests_with_a_mutated_header_byte_change_nothing(
    shard: Shard, data: st.DataObject
) -> None:
    op, body, buffers = data.draw(st.sampled_from(_base_requests()), label="request")
    with shard.peer() as peer:
        header = peer.header(op, body, {"sizes": [len(b) for b in buffers]})
        header_bytes = bytearray(msgpack.packb(header, use_bin_type=True))
        position = data.draw(st.integers(0, len(header_bytes) - 1), label="position")
        header_bytes[position] ^= data.draw(st.integers(1, 255), label="xor")
        before = shard.counters()
        peer.send(peer.signed(bytes(header_bytes), buffers))
        shard.assert_untouched(peer)
        event(shard.outcome(before))


@pytest.mark.timeout(600)
@FUZZ
@given(data=st.data())
def test_a_valid_request_with_any_byte_flipped_is_dropped_and_changes_nothing(
    shard: Shard, data: st.DataObject
) -> None:
    """A push that would be applied, or another request, signed (or sealed) properly, then
    one bit flipped anywhere in its frames: the socket drops it, whatever the byte."""
    valid_push = ("push", {"task": "worker:0", "count_step": True}, GRADIENTS)
    op, body, buffers = data.draw(st.sampled_from([valid_push, *_base_requests()]))
    with shard.peer() as peer:
        frames = [bytearray(f) for f in peer.encode(peer.header(op, body), buffers)]
        frame = data.draw(
            st.sampled_from([i for i, f in enumerate(frames) if len(f)]), label="frame"
        )
        position = data.draw(st.integers(0, len(frames[frame]) - 1), label="position")
        frames[frame][position] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        rejected = shard.rejected()
        peer.send([bytes(f) for f in frames])
        shard.assert_untouched(peer)
        assert shard.rejected() == rejected + 1


@pytest.mark.timeout(600)
@FUZZ
@given(data=st.data())
def test_signed_pushes_with_wrong_buffers_are_refused(shard: Shard, data: st.DataObject) -> None:
    """Buffers dropped, added, cut, grown, swapped or replaced, with the header's sizes to
    match (so the message decodes): the shard itself refuses the push, and nothing changes."""
    buffers = list(GRADIENTS)
    kind = data.draw(st.sampled_from(["drop", "add", "cut", "grow", "swap", "replace"]))
    index = data.draw(st.integers(0, len(buffers) - 1), label="index")
    if kind == "drop":
        del buffers[index]
    elif kind == "add":
        buffers.insert(index, data.draw(st.binary(max_size=40), label="extra"))
    elif kind == "cut":
        buffers[index] = buffers[index][: data.draw(st.integers(0, len(buffers[index]) - 1))]
    elif kind == "grow":
        buffers[index] += data.draw(st.binary(min_size=1, max_size=40), label="more")
    elif kind == "swap":
        buffers[0], buffers[1] = buffers[1], buffers[0]
    else:
        buffers = data.draw(st.lists(st.binary(max_size=40), max_size=6), label="buffers")
        if [len(b) for b in buffers] == [len(b) for b in GRADIENTS]:
            buffers.append(b"")
    body = data.draw(
        st.fixed_dictionaries({}, optional={"count_step": VALUES, "want_values": VALUES}),
        label="body",
    )
    with shard.peer() as peer:
        header = peer.header("push", body)
        peer.send(peer.encode(header, buffers))
        reply = peer.reply_to(header["id"])
        assert reply.header["ok"] is False, reply.header
        assert reply.header["error_type"] == "ProtocolError", reply.header
        shard.assert_untouched(peer)


#: Every operation that cannot change a created shard without the right buffers ('done' and
#: 'end' can: they are left out).
HARMLESS_OPS = st.sampled_from(["hello", "create", "wait_ready", "pull", "push", "stats"])
HEADER_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "op": VALUES,
        "id": VALUES,
        "srv": VALUES,
        "timeout_ms": st.integers(-(2**63), 2**64 - 1) | VALUES,
        "body": VALUES,
        "extra": VALUES,
    },
)


@pytest.mark.timeout(600)
@FUZZ
@given(
    op=HARMLESS_OPS | st.text(max_size=8).filter(lambda o: o not in ("done", "end")),
    body=st.dictionaries(KEYS, VALUES, max_size=4),
    overrides=HEADER_FIELDS,
    buffers=st.lists(st.binary(max_size=40), max_size=3),
)
def test_signed_requests_with_arbitrary_headers_change_nothing(
    shard: Shard, op: str, body: dict, overrides: dict, buffers: list[bytes]
) -> None:
    """Signed headers with arbitrary values for their fields, and extra ones."""
    if overrides.get("op") in ("done", "end"):
        overrides["op"] = "stats"
    if [len(b) for b in buffers] == [len(g) for g in GRADIENTS]:
        buffers = [*buffers, b""]  # a push of the right sizes would be valid
    with shard.peer() as peer:
        header = peer.header(op, body, overrides)
        frames = peer.encode(header, buffers)
        before = shard.counters()
        peer.send(frames)
        shard.assert_untouched(peer)
        event(shard.outcome(before))
