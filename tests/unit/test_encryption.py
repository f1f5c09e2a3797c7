"""With encryption on, nothing of the model crosses the network in the clear; without it, a
passive observer sees the values (that is what --encrypt is for). A client that does not
encrypt cannot talk to a ps that does, and is told what to check."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from tensorfleet.errors import DeadlineExceeded
from tensorfleet.launch.ports import free_port
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service import ParameterService, ServiceConfig
from tensorfleet.ps.update_rules import SGD
from tensorfleet.wire.service_socket import ServiceSocket
from tensorfleet.worker.client import ClientTimeouts, ParameterClient

pytestmark = pytest.mark.timeout(60)
SECRET = b"encryption-test-secret-0123456789"
MARKER = b"TENSORFLEET-PLAINTEXT-MARKER!!!!"  # 32 bytes = 8 float32 values


class RecordingRelay:
    """A TCP relay between a client and the ps that keeps every byte it forwards."""

    def __init__(self, target_port: int) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        self.recorded = bytearray()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            while True:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target_port))
                self.sockets += [client, server]
                for a, b in ((client, server), (server, client)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()
        except OSError:
            return  # closed

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                with self.lock:
                    self.recorded += data
                sink.sendall(data)
        except OSError:
            return

    def close(self) -> None:
        for s in self.sockets:
            s.close()


def _serve(encrypt: bool):
    port = free_port()
    sock = ServiceSocket(f"127.0.0.1:{port}", SECRET, encrypt=encrypt)
    service = ParameterService(sock, ServiceConfig(0, ("worker:0",)))
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop,), daemon=True)
    thread.start()
    return port, sock, stop, thread


def _exchange(address: str, encrypt: bool, timeouts: ClientTimeouts | None = None) -> None:
    weight = torch.nn.Parameter(
        torch.frombuffer(bytearray(MARKER * 64), dtype=torch.float32).clone()
    )
    weight.grad = torch.zeros_like(weight)
    plan = plan_placement([VariableSpec("secret.weight", tuple(weight.shape), "float32", 4)], 1)
    client = ParameterClient([address], SECRET, "worker:0", timeouts, encrypt=encrypt)
    try:
        client.connect()
        client.register([("secret.weight", weight)], plan, SGD(lr=0.0), is_chief=True)
        client.pull()
        client.push_pull()
    finally:
        client.close()


@pytest.mark.parametrize("encrypt", [True, False])
def test_the_model_crosses_the_network_in_the_clear_only_without_encryption(encrypt):
    port, sock, stop, thread = _serve(encrypt)
    relay = RecordingRelay(port)
    try:
        _exchange(f"127.0.0.1:{relay.port}", encrypt)
    finally:
        stop.set()
        thread.join(10)
        sock.close()
        relay.close()
    with relay.lock:
        seen = bytes(relay.recorded)
    assert len(seen) > 64 * len(MARKER), "the relay saw the traffic"
    assert (MARKER in seen) is (not encrypt)
    assert (b"secret.weight" in seen) is (not encrypt)


def test_a_client_that_does_not_encrypt_cannot_talk_to_an_encrypted_ps():
    port, sock, stop, thread = _serve(encrypt=True)
    try:
        with pytest.raises(DeadlineExceeded, match="agrees on encryption"):
            _exchange(f"127.0.0.1:{port}", encrypt=False, timeouts=ClientTimeouts(connect_s=1.5))
    finally:
        stop.set()
        thread.join(10)
        sock.close()
