"""A message one byte over the ps's size limit is rejected, and the next valid message on the
same connection is served; the variables are untouched."""

from __future__ import annotations

import threading

import pytest
import zmq

from tensorfleet.launch.ports import free_port
from tensorfleet.ps.service import ParameterService, ServiceConfig
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.auth import REPLY_ROLE, REQUEST_ROLE, MessageSigner, MessageVerifier
from tensorfleet.wire.service_socket import ServiceSocket

pytestmark = pytest.mark.timeout(30)
SECRET = b"message-limits-test-secret-012345"
PAD = 200


def _hello_frames(signer: MessageSigner, pad: int, request_id: int) -> list[bytes]:
    body = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "pad": "x" * pad}
    header = {"op": "hello", "id": request_id, "srv": None, "timeout_ms": 5000, "body": body}
    return [bytes(f) for f in wire.encode(wire.KIND_REQUEST, header, [], signer)]


def test_one_byte_over_the_limit_is_rejected_and_the_next_valid_message_served():
    # The size of a valid hello with PAD characters of padding becomes the exact limit.
    probe = _hello_frames(MessageSigner(SECRET, REQUEST_ROLE), PAD, 1)
    limit = sum(len(f) for f in probe)
    address = f"127.0.0.1:{free_port()}"
    sock = ServiceSocket(address, SECRET, wire.Limits(max_message_bytes=limit))
    service = ParameterService(sock, ServiceConfig(0, ("worker:0",), limits=sock.limits))
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop,), daemon=True)
    thread.start()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://{address}")
        signer = MessageSigner(SECRET, REQUEST_ROLE)
        over = _hello_frames(signer, PAD + 1, 1)
        exact = _hello_frames(signer, PAD, 2)
        assert sum(len(f) for f in over) == limit + 1 and sum(len(f) for f in exact) == limit
        dealer.send_multipart(over)
        dealer.send_multipart(exact)
        assert dealer.poll(10_000), "no answer to the valid message after the oversized one"
        reply = wire.decode(
            dealer.recv_multipart(),
            wire.KIND_REPLY,
            MessageVerifier(SECRET, REPLY_ROLE),
            wire.Limits(),
        )
        assert reply.header["re"] == 2 and reply.header["ok"] is True
        assert not dealer.poll(200), "the oversized message must get no answer"
        assert sock.rejected == {"malformed": 1}
        assert not service.store.initialized
    finally:
        stop.set()
        thread.join(10)
        dealer.close()
        context.term()
        sock.close()
