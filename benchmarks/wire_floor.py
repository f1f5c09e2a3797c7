"""The floor under the wire: what the transports cost with nothing of tensorfleet's in them.

``benchmarks/wire.py`` compares a push+pull with a raw TCP echo. Part of the gap is not
tensorfleet's framing, authentication or copies but ZeroMQ itself (its I/O thread, its
message allocation) and, with ``--encrypt``, the encryption. This benchmark measures those floors
alone, all in one run, each echo server in its own process on localhost, in alternating
batches:

* ``raw_tcp_echo``: a plain socket receives the bytes and sends them back (all in, then all
  out, one thread per end: the yardstick ``wire.py``'s ratios use);
* ``raw_tcp_echo_duplex``: the same bytes with both directions busy at once (the server
  answering each 1 MiB chunk as it arrives, the client sending from a second thread while
  it receives): what a round trip over TCP can reach here when it does not wait for the whole
  payload, as ZeroMQ's echo does not;
* ``zmq_echo``: a ZeroMQ ROUTER echoes one DEALER's message (``copy=False`` both ways,
  as the transport does): the ceiling for any protocol over ZeroMQ tcp;
* ``zmq_curve_echo``: the same with CURVE encryption (what ``--encrypt`` used before
  protocol 3);
* ``zmq_aes_gcm_echo``: the ZeroMQ echo with the payload sealed by AES-256-GCM in 1 MiB
  chunks before every send and opened after every receive, on one thread at each end
  (four passes per round trip: what ``--encrypt`` adds to the wire since protocol 3, see
  ``wire/encryption.py``, without its second thread);
* ``zmq_gmac_sgd_echo``: the least work an authenticated push+pull over ZeroMQ does, with
  nothing else of tensorfleet's: the client tags the gradient (AES-256-GMAC per 1 MiB
  chunk), the server verifies every tag, applies SGD to its float32 weights
  (``weight.add_(gradient, alpha=-lr)``, one thread), tags the new weights and sends them
  back, where the client verifies them. No snapshot (a ps needs one: other workers' pushes
  change the weights while a reply is being sent), no header, no copy into a model;
* ``zmq_gmac_sgd_pipelined``: the same work with every 1 MiB chunk its own message, up to
  four in flight, the server answering each chunk as it comes: whether overlapping the
  tagging and the update of one chunk with the transfer of the next pays on this machine
  (it cannot when both cores are already busy with the copies of the transfer);
* ``tcp_sgd``, ``tcp_gmac_sgd_echo``, ``tcp_gmac_sgd_streamed``: the same work over a plain
  TCP socket, both ends receiving with ``recv_into`` into buffers they keep (nothing
  allocated per message): the bare update with no MAC (``wire.py``'s ``raw_tcp_sgd``), the
  authenticated update in one message each way, and streamed (the server verifying,
  applying and answering each 1 MiB chunk as it arrives while the client's second thread
  still sends): whether a stream per connection, the data-plane issue's alternative to
  ZeroMQ messages for large payloads, beats ZeroMQ on the same work;
* ``raw_tcp_pull``, ``tcp_gmac_pull_streamed``, ``zmq_pull``, ``zmq_gmac_pull``,
  ``zmq_gmac_pull_adopted``, ``zmq_gmac_pull_streamed``: a *pull*, the values travelling one
  way (their GB/s counts the payload once, where the echoes count it twice): the client asks
  with a few bytes and makes the answer its own. Over a plain socket, received straight into
  the client's model (``recv_into``), unauthenticated and streamed with a GMAC tag per 1 MiB
  chunk (the server tagging the next chunk while one travels, the client verifying each
  while the next arrives); over ZeroMQ in one message copied into the model,
  unauthenticated; the same with every chunk tagged by the server before it sends and
  verified by the client, then copied, or kept as the model's memory (no copy: what
  ``wire.py``'s ``pull`` does); and streamed, each chunk its own message, verified and
  copied as it comes (a chunk's message cannot become a larger model's memory);
  ``payload_stream_pull``: the plain-socket stream through tensorfleet's own
  ``wire/payload_stream.py`` (its opening, its sender thread, its receiver into fresh
  memory): whether the module reaches ``tcp_gmac_pull_streamed``;

* ``same_host_floor``: no transport at all, on this thread: the gradient copied into a
  buffer (the shared memory a same-host push writes), the SGD update reading it, the new
  values copied out (the reply a worker keeps): the memory traffic any same-host push+pull
  that applies the update and leaves the worker its own copy must do;
  ``same_host_floor_authenticated`` adds the four GMAC passes of the same authentication as
  over TCP (each direction tagged by its sender and verified by its receiver, on two
  threads as tensorfleet does). Their ratio
  to the raw TCP echo bounds what a same-host fast path can reach on this machine;
* ``same_host_lend_floor``: the same between two processes, as a ps that lends its values
  in shared memory would do it (docs/wire-performance.md): the worker copies its gradient into shared memory and sends a
  header over ZeroMQ, the ps (its own process, torch's default threads) applies SGD in place
  in the shared memory holding its values and answers, the worker copies the values out
  (no authentication, version check or tensorfleet code): the floor of that design here,
  wake-ups of two processes included;

and, on this thread, the cryptography an encrypted or authenticated message needs, in GB/s
over one buffer of the size: ``aes_gcm_encrypt`` (AES-256-GCM into a fresh output buffer,
what an application-level encryption would cost per direction and per end),
``aes_gcm_encrypt_into`` (the same into a buffer reused across calls, no page faults) and
``gmac`` (the MAC tensorfleet computes on every payload, see ``wire/auth.py``).

Last, the hand-over of values across processes, in milliseconds on the reading side: a
writer process holds the values in a shared-memory file and rewrites them (an update)
before every round; this process then makes them its own and reads them once (as a forward
pass would), four ways: ``handover_copy`` copies them out of a mapping kept open into
memory of its own (what a reply region costs today, the copy made by the reader instead
of the ps); ``handover_fresh_private_map`` maps the file afresh with ``MAP_PRIVATE`` (no
copy: a write of the reader's lands in its own page, never in the writer's) and reads it
there, paying the page-table set-up; ``handover_kept_map_read`` reads in place through a
mapping kept open (no copy, no set-up: correct only for a reader that never writes the
values, since a shared mapping would carry its writes back to the writer);
``handover_kept_private_map_checked`` reads through a ``MAP_PRIVATE`` mapping kept open,
after checking in ``/proc/self/pagemap`` that none of its pages was written here (a written
page is the reader's own copy and would show stale values: a reader that may write its
values can keep such a mapping only with that check). Whether the
values a ps keeps in shared memory can be *lent* to a worker instead of copied into its
reply region turns on the second row against the first.

    .venv/bin/python benchmarks/wire_floor.py [--megabytes 8 32 --batches 10 --per-batch 10]

Writes benchmarks/results/wire_floor.json and .md.
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zmq
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from results_writer import add_out_dir_option, write_results  # noqa: E402

from tensorfleet.wire.auth import in_parallel  # noqa: E402

#: Seconds any one round trip may take before the benchmark gives up.
ROUND_TRIP_TIMEOUT_S = 60
#: Payload bytes sealed under one tag (as ``wire/auth.py``'s CHUNK_BYTES).
CHUNK_BYTES = 1 << 20
#: The pulls (``ZmqEcho`` modes, rows ``zmq_<mode>``): the payload travels one way only.
PULLS = ("pull", "gmac_pull", "gmac_pull_adopted", "gmac_pull_streamed")
#: Rows whose payload travels one way (GB/s over the payload once, not twice).
ONE_WAY = (
    "raw_tcp_pull",
    "tcp_gmac_pull_streamed",
    "payload_stream_pull",
    *(f"zmq_{mode}" for mode in PULLS),
)

#: What every plain-socket server below starts with: one connection accepted on a free
#: loopback port (printed for the client), and ``receive_into(view)``, which fills ``view``
#: or ends the server when the client closed early (it failed) instead of spinning.
SOCKET_SERVER_PRELUDE = r"""
import socket, sys
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
conn.settimeout(60)

def receive_into(view):
    got = 0
    while got < len(view):
        received = conn.recv_into(view[got:])
        if not received:
            sys.exit(0)
        got += received
"""

TCP_SERVER = (
    SOCKET_SERVER_PRELUDE
    + r"""
n, rounds = int(sys.argv[1]), int(sys.argv[2])
buf = bytearray(n); view = memoryview(buf)
for _ in range(rounds):
    receive_into(view)
    conn.sendall(buf)
"""
)

TCP_PULL_SERVER = (
    SOCKET_SERVER_PRELUDE
    + r"""
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
n, rounds, key = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
values, ask, CHUNK = bytearray(n), bytearray(4), 1 << 20
view = memoryview(values)
aead = None if key == "-" else AESGCM(bytes.fromhex(key))
for counter in range(rounds):
    receive_into(memoryview(ask))
    if aead is None:
        conn.sendall(values)
        continue
    for index, start in enumerate(range(0, n, CHUNK)):  # each chunk tagged, then sent
        chunk = view[start:start + CHUNK]
        nonce = (index + 1).to_bytes(4, "big") + (counter + 1).to_bytes(8, "big")
        conn.sendall(aead.encrypt(nonce, b"", chunk))  # the GMAC tag (no plaintext)
        conn.sendall(chunk)
"""
)

STREAM_PULL_SERVER = r"""
import queue, sys, threading
sys.path.insert(0, sys.argv[4])  # the package under test
from tensorfleet.wire.auth import MessageSigner, MessageVerifier
from tensorfleet.wire.payload_stream import OPENED, PayloadSender, StreamListener
n, rounds, secret = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
signer = MessageSigner(secret, "reply")
opened = queue.Queue()
listener = StreamListener("127.0.0.1", MessageVerifier(secret, "request"), signer.session_id,
                          lambda session, conn: opened.put((conn, PayloadSender(conn, signer, greeting=OPENED))))
print(listener.port, signer.session_id.hex(), flush=True)
conn, sender = opened.get(timeout=60)
listener.close()
values, ask = bytearray(n), bytearray(4)
for _ in range(rounds):  # each 4-byte ask answered with the values, streamed
    got = 0
    while got < 4:
        received = conn.recv_into(memoryview(ask)[got:])
        if not received:
            sys.exit(0)
        got += received
    done = threading.Event()
    sender.send(signer.next_counter(), [values], lambda sent: done.set())
    done.wait(60)  # the values stay unchanged until they left, as a ps's would
sender.close()
"""

TCP_DUPLEX_SERVER = (
    SOCKET_SERVER_PRELUDE
    + r"""
n, rounds, chunk = int(sys.argv[1]), int(sys.argv[2]), 1 << 20
buf = bytearray(n); view = memoryview(buf)
for _ in range(rounds):
    for start in range(0, n, chunk):  # each chunk sent back as soon as it is in
        stop = min(start + chunk, n)
        receive_into(view[start:stop])
        conn.sendall(view[start:stop])
"""
)

ZMQ_SERVER = r"""
import sys, zmq
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
curve_secret, aes_key, mode = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3]
pull_bytes = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # the values a pull answers with
CHUNK = 1 << 20

def seal(key, counter, source, target):
    tags = []
    for index, start in enumerate(range(0, len(source), CHUNK)):
        nonce = (index + 1).to_bytes(4, "big") + counter.to_bytes(8, "big")
        encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        encryptor.update_into(source[start:start + CHUNK], target[start:start + CHUNK])
        encryptor.finalize()
        tags.append(encryptor.tag)
    return b"".join(tags)

def open_(key, counter, source, tags, target):
    for index, start in enumerate(range(0, len(source), CHUNK)):
        nonce = (index + 1).to_bytes(4, "big") + counter.to_bytes(8, "big")
        tag = tags[16 * index:16 * index + 16]
        decryptor = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
        decryptor.update_into(source[start:start + CHUNK], target[start:start + CHUNK])
        decryptor.finalize()
def tag(key, nonce, source):
    encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    encryptor.authenticate_additional_data(source)
    encryptor.finalize()
    return encryptor.tag

def verify(key, nonce, source, expected):
    decryptor = Cipher(algorithms.AES(key), modes.GCM(nonce, expected)).decryptor()
    decryptor.authenticate_additional_data(source)
    decryptor.finalize()  # InvalidTag if anything was altered

def chunk_nonce(index, counter):
    return (index + 1).to_bytes(4, "big") + counter.to_bytes(8, "big")

weight = None
if mode != "echo":
    import torch
    torch.set_num_threads(1)

def updated(gradient, start):
    # SGD on the weights the gradient's bytes cover (from byte ``start``); their bytes
    global weight
    if weight is None or weight.numel() * 4 < start + len(gradient):
        weight = torch.randn((start + len(gradient)) // 4)
    part = weight[start // 4:(start + len(gradient)) // 4]
    part.add_(torch.frombuffer(gradient, dtype=torch.float32), alpha=-0.1)
    return memoryview(part.numpy()).cast("B")

def pulled():
    # The weights a pull answers with (pull_bytes of them, made at the first pull), as bytes
    global weight
    if weight is None:
        weight = torch.randn(pull_bytes // 4)
    return memoryview(weight.numpy()).cast("B")

router = zmq.Context().socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 1000)
router.setsockopt(zmq.RCVTIMEO, 60_000)
if curve_secret != "-":
    router.curve_secretkey = curve_secret.encode()
    router.curve_publickey = zmq.curve_public(curve_secret.encode())
    router.curve_server = True
port = router.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
counter, plain, sealed = 0, None, None
while True:
    frames = router.recv_multipart(copy=False)
    if len(frames[-1]) == 0:  # the client is done
        break
    if mode == "gmac_sgd" and len(frames) == 3:  # [peer, gradient, tags]: the whole model
        data, tags = frames[1].buffer, frames[2].bytes
        for index, start in enumerate(range(0, len(data), CHUNK)):
            verify(aes_key, chunk_nonce(index, 1), data[start:start + CHUNK], tags[16 * index:16 * index + 16])
        values = updated(data, 0)
        out = b"".join(tag(aes_key, chunk_nonce(i, 2), values[s:s + CHUNK]) for i, s in enumerate(range(0, len(values), CHUNK)))
        router.send_multipart([frames[0], values, out], copy=False)
        continue
    if mode == "gmac_sgd_pipelined" and len(frames) == 4:  # [peer, index, chunk, tag]
        index = int.from_bytes(frames[1].bytes, "big")
        data = frames[2].buffer
        verify(aes_key, chunk_nonce(index, 1), data, frames[3].bytes)
        values = updated(data, index * CHUNK)
        out = tag(aes_key, chunk_nonce(index, 2), values)
        router.send_multipart([frames[0], frames[1], values, out], copy=False)
        continue
    if len(frames) == 2 and frames[1].bytes == b"pull":  # a pull (pings are echoed)
        values = pulled()
        spans = list(enumerate(range(0, len(values), CHUNK)))
        if mode == "pull":  # the values alone
            router.send_multipart([frames[0], values], copy=False)
        elif mode in ("gmac_pull", "gmac_pull_adopted"):  # every tag first, then one message
            out = b"".join(tag(aes_key, chunk_nonce(i, 2), values[s:s + CHUNK]) for i, s in spans)
            router.send_multipart([frames[0], values, out], copy=False)
        else:  # each chunk tagged and sent as its own message while the last one travels
            for i, s in spans:
                chunk = values[s:s + CHUNK]
                out = tag(aes_key, chunk_nonce(i, 2), chunk)
                router.send_multipart([frames[0], i.to_bytes(4, "big"), chunk, out], copy=False)
        continue
    if aes_key and len(frames) == 3:  # [peer, ciphertext, tags]: open, then seal the answer
        data = frames[1].buffer
        if plain is None or len(plain) != len(data):
            plain, sealed = bytearray(len(data)), bytearray(len(data))
        open_(aes_key, counter + 1, data, frames[2].bytes, memoryview(plain))
        counter += 2
        tags = seal(aes_key, counter, memoryview(plain), memoryview(sealed))
        router.send_multipart([frames[0], sealed, tags], copy=False)
        continue
    router.send_multipart(frames, copy=False)
"""

TCP_SGD_SERVER = (
    SOCKET_SERVER_PRELUDE
    + r"""
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
n, rounds, key, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
key = None if key == "-" else bytes.fromhex(key)
CHUNK = 1 << 20
torch.set_num_threads(1)

def nonce(index, counter):
    return (index + 1).to_bytes(4, "big") + counter.to_bytes(8, "big")

def tag(nonce, source):
    encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    encryptor.authenticate_additional_data(source)
    encryptor.finalize()
    return encryptor.tag

def verify(nonce, source, expected):
    decryptor = Cipher(algorithms.AES(key), modes.GCM(nonce, expected)).decryptor()
    decryptor.authenticate_additional_data(source)
    decryptor.finalize()  # InvalidTag if anything was altered

chunks = [(i, s, min(s + CHUNK, n)) for i, s in enumerate(range(0, n, CHUNK))]
gradient, tags = bytearray(n), bytearray(16 * len(chunks))  # kept: received into, never again allocated
weight = torch.randn(n // 4) * 1e-3
values = memoryview(weight.numpy()).cast("B")
incoming = torch.frombuffer(gradient, dtype=torch.float32)
for _ in range(rounds):
    if mode == "whole":  # [tags][gradient] in, [tags][values] out
        if key is not None:
            receive_into(memoryview(tags))
        receive_into(memoryview(gradient))
        if key is not None:
            for i, s, e in chunks:
                verify(nonce(i, 1), memoryview(gradient)[s:e], bytes(tags[16 * i:16 * i + 16]))
        weight.add_(incoming, alpha=-0.1)
        if key is not None:
            conn.sendall(b"".join(tag(nonce(i, 2), values[s:e]) for i, s, e in chunks))
        conn.sendall(values)
    else:  # streamed: each chunk verified, applied and answered as it arrives
        for i, s, e in chunks:
            chunk_tag = bytearray(16)
            receive_into(memoryview(chunk_tag))
            receive_into(memoryview(gradient)[s:e])
            verify(nonce(i, 1), memoryview(gradient)[s:e], bytes(chunk_tag))
            weight[s // 4:e // 4].add_(incoming[s // 4:e // 4], alpha=-0.1)
            conn.sendall(tag(nonce(i, 2), values[s:e]))
            conn.sendall(values[s:e])
"""
)


def _start(program: str, *args: str) -> tuple[subprocess.Popen, int]:
    server = subprocess.Popen(
        [sys.executable, "-c", program, *args], stdout=subprocess.PIPE, text=True
    )
    line = server.stdout.readline()
    if not line.strip().isdigit():
        server.kill()
        raise RuntimeError(f"echo server did not start (said {line!r})")
    return server, int(line)


class TcpEcho:
    """A plain TCP echo server in its own process, and the client end of it."""

    def __init__(self, payload: bytes, rounds: int) -> None:
        self.server, port = _start(TCP_SERVER, str(len(payload)), str(rounds))
        self.conn = socket.create_connection(("127.0.0.1", port), timeout=ROUND_TRIP_TIMEOUT_S)
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload, self.back = payload, bytearray(len(payload))

    def round_trip(self) -> None:
        self.conn.sendall(self.payload)
        view, got = memoryview(self.back), 0
        while got < len(self.payload):
            received = self.conn.recv_into(view[got:])
            if not received:
                raise ConnectionError(f"the echo server closed after {got} bytes of an echo")
            got += received

    def close(self) -> None:
        self.conn.close()


class TcpPull:
    """A plain TCP server that answers each 4-byte ask with the whole payload, which the
    client receives straight into its model (``recv_into``: nothing allocated, no copy):
    the unauthenticated floor of a pull over one socket (``raw_tcp_pull``). With
    ``authenticated`` (``tcp_gmac_pull_streamed``) the server sends each 1 MiB chunk after
    its AES-256-GMAC tag, tagging the next while this one travels, and the client verifies
    each chunk once it is in, while the next arrives: a stream received in place, which a
    reply could be if its memory becomes the model's once every chunk verified (as
    tensorfleet adopts a reply's memory today)."""

    def __init__(self, payload: bytes, rounds: int, authenticated: bool = False) -> None:
        self.key = os.urandom(32) if authenticated else None
        self.server, port = _start(
            TCP_PULL_SERVER, str(len(payload)), str(rounds), self.key.hex() if self.key else "-"
        )
        self.conn = socket.create_connection(("127.0.0.1", port), timeout=ROUND_TRIP_TIMEOUT_S)
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.model = bytearray(len(payload))
        self.counter = 0

    def _receive_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            received = self.conn.recv_into(view[got:])
            if not received:
                raise ConnectionError(f"the pull server closed after {got} bytes of a pull")
            got += received

    def round_trip(self) -> None:
        self.conn.sendall(b"pull")
        view = memoryview(self.model)
        if self.key is None:
            self._receive_into(view)
            return
        self.counter += 1
        tag = bytearray(16)
        for index, start in enumerate(range(0, len(view), CHUNK_BYTES)):
            chunk = view[start : start + CHUNK_BYTES]
            self._receive_into(memoryview(tag))
            self._receive_into(chunk)
            _verify(self.key, _nonce(index, self.counter), chunk, bytes(tag))

    def close(self) -> None:
        self.conn.close()


class StreamPull:
    """``payload_stream_pull``: the pull of ``tcp_gmac_pull_streamed`` through tensorfleet's
    own stream (``wire/payload_stream.py``): a server process with a ``StreamListener`` and a
    ``PayloadSender`` (each chunk tagged on the sender's thread just before it goes), the
    client opening the stream with ``open_stream`` and reading each payload with
    ``PayloadReceiver.receive`` into fresh memory, verified chunk by chunk (the reply's
    header, which in the service comes over ZeroMQ, is left out: the client knows the
    sizes and counts the counter). Whether the module reaches the floor above."""

    def __init__(self, payload: bytes, rounds: int) -> None:
        from tensorfleet.wire.auth import MessageSigner, derive_session_key
        from tensorfleet.wire.payload_stream import PayloadReceiver, open_stream

        secret = os.urandom(32)
        self.server = subprocess.Popen(
            [sys.executable, "-c", STREAM_PULL_SERVER, str(len(payload)), str(rounds)]
            + [secret.hex(), str(HERE.parent / "src")],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.server.stdout.readline().split()
        if len(line) != 2 or not line[0].isdigit():
            self.server.kill()
            raise RuntimeError(f"the stream server did not start (said {line!r})")
        port, service_session = int(line[0]), bytes.fromhex(line[1])
        client = MessageSigner(secret, "request")
        self.conn = open_stream("127.0.0.1", port, client, service_session, ROUND_TRIP_TIMEOUT_S)
        key = derive_session_key(secret, service_session, "reply")
        self.receiver = PayloadReceiver(self.conn, key)
        self.size, self.counter = len(payload), 0
        self.model: list[memoryview] = []

    def round_trip(self) -> None:
        self.conn.sendall(b"pull")
        self.counter += 1
        deadline = time.monotonic() + ROUND_TRIP_TIMEOUT_S
        self.model = self.receiver.receive(self.counter, [self.size], deadline)  # adopted

    def close(self) -> None:
        self.receiver.close()


class TcpDuplexEcho:
    """A plain TCP echo that uses both directions at once: the server sends each 1 MiB chunk
    back as soon as it is in, the client sends from a second thread while it receives (what
    ZeroMQ's I/O thread does for its echo). The ceiling of a round trip over TCP here that
    does not wait for the whole payload before answering."""

    def __init__(self, payload: bytes, rounds: int) -> None:
        self.server, port = _start(TCP_DUPLEX_SERVER, str(len(payload)), str(rounds))
        self.conn = socket.create_connection(("127.0.0.1", port), timeout=ROUND_TRIP_TIMEOUT_S)
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload, self.back = memoryview(payload), bytearray(len(payload))

    def round_trip(self) -> None:
        sender = threading.Thread(target=self.conn.sendall, args=(self.payload,))
        sender.start()
        view, got = memoryview(self.back), 0
        while got < len(self.payload):
            received = self.conn.recv_into(view[got:])
            if not received:
                raise ConnectionError(f"the echo server closed after {got} bytes of an echo")
            got += received
        sender.join()

    def close(self) -> None:
        self.conn.close()


class TcpSgd:
    """The work of a push+pull over a plain TCP socket, both ends receiving into buffers
    they keep (``recv_into``, no message allocated per receive): ``tcp_sgd`` (no MAC: the
    bare work, as ``wire.py``'s ``raw_tcp_sgd``), ``tcp_gmac_sgd_echo`` (AES-256-GMAC per
    1 MiB chunk, each direction tagged by its sender and verified by its receiver, one
    message each way: what ``zmq_gmac_sgd_echo`` does over ZeroMQ) and
    ``tcp_gmac_sgd_streamed`` (the same, the server verifying, applying and answering each
    chunk as it arrives while the client's thread still sends: the stream per connection
    the data-plane issue proposes instead of ZeroMQ messages)."""

    def __init__(self, gradient: bytes, rounds: int, mode: str, authenticated: bool) -> None:
        self.key = os.urandom(32) if authenticated else None
        self.mode = mode
        self.server, port = _start(
            TCP_SGD_SERVER,
            str(len(gradient)),
            str(rounds),
            self.key.hex() if self.key else "-",
            mode,
        )
        self.conn = socket.create_connection(("127.0.0.1", port), timeout=ROUND_TRIP_TIMEOUT_S)
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.gradient = memoryview(gradient)
        size = len(gradient)
        self.chunks = [
            (i, s, min(s + CHUNK_BYTES, size)) for i, s in enumerate(range(0, size, CHUNK_BYTES))
        ]
        self.back, self.tags = bytearray(size), bytearray(16 * len(self.chunks))

    def _receive_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            received = self.conn.recv_into(view[got:])
            if not received:
                raise ConnectionError(f"the server closed after {got} bytes of an answer")
            got += received

    def round_trip(self) -> None:
        if self.mode == "streamed":
            self._streamed_round_trip()
            return
        if self.key is not None:
            self.conn.sendall(
                b"".join(
                    _tag(self.key, _nonce(i, 1), self.gradient[s:e]) for i, s, e in self.chunks
                )
            )
        self.conn.sendall(self.gradient)
        if self.key is not None:
            self._receive_into(memoryview(self.tags))
        back = memoryview(self.back)
        self._receive_into(back)
        if self.key is not None:
            for i, s, e in self.chunks:
                _verify(self.key, _nonce(i, 2), back[s:e], bytes(self.tags[16 * i : 16 * i + 16]))

    def _streamed_round_trip(self) -> None:
        assert self.key is not None

        def send() -> None:
            for i, s, e in self.chunks:
                self.conn.sendall(_tag(self.key, _nonce(i, 1), self.gradient[s:e]))
                self.conn.sendall(self.gradient[s:e])

        sender = threading.Thread(target=send)
        sender.start()
        back, tag = memoryview(self.back), bytearray(16)
        for i, s, e in self.chunks:
            self._receive_into(memoryview(tag))
            self._receive_into(back[s:e])
            _verify(self.key, _nonce(i, 2), back[s:e], bytes(tag))
        sender.join()

    def close(self) -> None:
        self.conn.close()


class ZmqEcho:
    """A ZeroMQ ROUTER echo server in its own process, and a DEALER talking to it; with
    ``aes_gcm`` both ends seal and open every payload (one thread each). ``mode`` "gmac_sgd"
    and "gmac_sgd_pipelined": the server verifies, updates and tags (see the module
    docstring; the payload is the float32 gradient)."""

    def __init__(
        self, payload: bytes, curve: bool, aes_gcm: bool = False, mode: str = "echo"
    ) -> None:
        server_public, server_secret = zmq.curve_keypair() if curve else (b"", b"-")
        self.mode = mode
        self.key = os.urandom(32) if aes_gcm or mode != "echo" else b""
        self.server, port = _start(
            ZMQ_SERVER, server_secret.decode(), self.key.hex(), mode, str(len(payload))
        )
        self.model = bytearray(len(payload))  # where a pull's values go
        self.counter = 0
        self.sealed, self.opened = bytearray(len(payload)), bytearray(len(payload))
        self.context = zmq.Context()
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        if curve:
            public, secret = zmq.curve_keypair()
            self.dealer.curve_serverkey = server_public
            self.dealer.curve_publickey = public
            self.dealer.curve_secretkey = secret
        self.dealer.connect(f"tcp://127.0.0.1:{port}")
        self.payload = payload
        # Ping until the server answers: a message sent while the connection (and CURVE's
        # handshake) is being set up was seen lost now and then on this machine.
        deadline = time.monotonic() + ROUND_TRIP_TIMEOUT_S
        while True:
            self.dealer.send(b"p")
            if self.dealer.poll(1000):
                self.dealer.recv()
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the ZeroMQ echo server did not answer a ping in {ROUND_TRIP_TIMEOUT_S} s"
                )
        while self.dealer.poll(200):  # answers to earlier pings
            self.dealer.recv()

    def round_trip(self) -> None:
        if self.mode in PULLS:
            self._pull()
            return
        if self.mode == "gmac_sgd":
            self._gmac_sgd_round_trip()
            return
        if self.mode == "gmac_sgd_pipelined":
            self._gmac_sgd_pipelined_round_trip()
            return
        if self.key:
            self.counter += 1
            tags = _seal(self.key, self.counter, self.payload, memoryview(self.sealed))
            self.dealer.send_multipart([self.sealed, tags], copy=False)
        else:
            self.dealer.send(self.payload, copy=False)
        if not self.dealer.poll(ROUND_TRIP_TIMEOUT_S * 1000):
            raise TimeoutError(f"no echo within {ROUND_TRIP_TIMEOUT_S} s")
        frames = self.dealer.recv_multipart(copy=False)
        if self.key:
            self.counter += 1
            _open(self.key, self.counter, frames[0].buffer, frames[1].bytes, self.opened)

    def _receive(self) -> list[zmq.Frame]:
        if not self.dealer.poll(ROUND_TRIP_TIMEOUT_S * 1000):
            raise TimeoutError(f"no answer within {ROUND_TRIP_TIMEOUT_S} s")
        return self.dealer.recv_multipart(copy=False)

    def _gmac_sgd_round_trip(self) -> None:
        view = memoryview(self.payload)
        chunks = range(0, len(view), CHUNK_BYTES)
        tags = b"".join(
            _tag(self.key, _nonce(i, 1), view[s : s + CHUNK_BYTES]) for i, s in enumerate(chunks)
        )
        self.dealer.send_multipart([self.payload, tags], copy=False)
        values, tags = self._receive()
        for index, start in enumerate(range(0, len(values.buffer), CHUNK_BYTES)):
            _verify(
                self.key,
                _nonce(index, 2),
                values.buffer[start : start + CHUNK_BYTES],
                tags.bytes[16 * index : 16 * index + 16],
            )

    def _pull(self) -> None:
        """Ask for the server's values and make them this end's (copied into ``self.model``,
        as a pull puts them into the worker's parameters): ``pull`` unauthenticated in one
        message; ``gmac_pull`` in one message, every chunk verified once it is in;
        ``gmac_pull_adopted`` the same, the message's memory kept as the model (what
        tensorfleet's pull does: the parameters adopt the reply's memory, no copy);
        ``gmac_pull_streamed`` one message per chunk, each verified and copied as it comes
        while the next ones travel (a message's memory holds one chunk: it cannot be adopted
        by a model larger than a chunk)."""
        model = memoryview(self.model)
        self.dealer.send(b"pull")
        if self.mode == "gmac_pull_streamed":
            for _ in range(0, len(model), CHUNK_BYTES):
                index, values, tag = self._receive()
                start = int.from_bytes(index.bytes, "big") * CHUNK_BYTES
                chunk = values.buffer
                _verify(self.key, _nonce(start // CHUNK_BYTES, 2), chunk, tag.bytes)
                model[start : start + len(chunk)] = chunk
            return
        frames = self._receive()
        values = frames[0].buffer
        if self.mode != "pull":
            tags = frames[1].bytes
            for index, start in enumerate(range(0, len(values), CHUNK_BYTES)):
                chunk = values[start : start + CHUNK_BYTES]
                _verify(self.key, _nonce(index, 2), chunk, tags[16 * index : 16 * index + 16])
        if self.mode == "gmac_pull_adopted":
            self.adopted = frames[0]  # the message's memory is the model now: no copy
        else:
            model[:] = values

    def _gmac_sgd_pipelined_round_trip(self, window: int = 4) -> None:
        view = memoryview(self.payload)
        starts = list(range(0, len(view), CHUNK_BYTES))
        sent = answered = 0
        while answered < len(starts):
            while sent < len(starts) and sent - answered < window:
                chunk = view[starts[sent] : starts[sent] + CHUNK_BYTES]
                index = sent.to_bytes(4, "big")
                tag = _tag(self.key, _nonce(sent, 1), chunk)
                self.dealer.send_multipart([index, chunk, tag], copy=False)
                sent += 1
            index, values, tag = self._receive()
            _verify(
                self.key, _nonce(int.from_bytes(index.bytes, "big"), 2), values.buffer, tag.bytes
            )
            answered += 1

    def close(self) -> None:
        self.dealer.send(b"")  # tells the server to exit
        self.dealer.close(linger=1000)
        self.context.term()


def _nonce(index: int, counter: int) -> bytes:
    return (index + 1).to_bytes(4, "big") + counter.to_bytes(8, "big")


def _tag(key: bytes, nonce: bytes, source: memoryview) -> bytes:
    """The AES-256-GMAC tag of ``source`` (what ``wire/auth.py`` computes per chunk)."""
    encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    encryptor.authenticate_additional_data(source)
    encryptor.finalize()
    return encryptor.tag


def _verify(key: bytes, nonce: bytes, source: memoryview, tag: bytes) -> None:
    """Raise InvalidTag unless ``tag`` is ``source``'s."""
    decryptor = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
    decryptor.authenticate_additional_data(source)
    decryptor.finalize()


def _seal(key: bytes, counter: int, source: bytes, target: memoryview) -> bytes:
    """AES-256-GCM of ``source`` into ``target`` in 1 MiB chunks; their tags."""
    tags = []
    view = memoryview(source)
    for index, start in enumerate(range(0, len(source), CHUNK_BYTES)):
        nonce = (index + 1).to_bytes(4, "big") + counter.to_bytes(8, "big")
        encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        stop = start + CHUNK_BYTES
        encryptor.update_into(view[start:stop], target[start:stop])
        encryptor.finalize()
        tags.append(encryptor.tag)
    return b"".join(tags)


def _open(key: bytes, counter: int, source: memoryview, tags: bytes, target: bytearray) -> None:
    """The inverse of :func:`_seal` into ``target`` (InvalidTag if anything was altered)."""
    out = memoryview(target)
    for index, start in enumerate(range(0, len(source), CHUNK_BYTES)):
        nonce = (index + 1).to_bytes(4, "big") + counter.to_bytes(8, "big")
        tag = tags[16 * index : 16 * index + 16]
        decryptor = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
        stop = start + CHUNK_BYTES
        decryptor.update_into(source[start:stop], out[start:stop])
        decryptor.finalize()


def crypto_rates(payload: bytes, repeats: int) -> dict[str, float]:
    """GB/s of AES-256-GCM encryption and of GMAC over ``payload`` on this thread (medians)."""
    key = os.urandom(32)
    aes = AESGCM(key)

    def encrypt() -> None:
        aes.encrypt(os.urandom(12), payload, None)

    out = bytearray(len(payload))

    def encrypt_into() -> None:
        encryptor = Cipher(algorithms.AES(key), modes.GCM(os.urandom(12))).encryptor()
        encryptor.update_into(payload, out)
        encryptor.finalize()

    def gmac() -> None:
        encryptor = Cipher(algorithms.AES(key), modes.GCM(os.urandom(12))).encryptor()
        encryptor.authenticate_additional_data(payload)
        encryptor.finalize()

    rates = {}
    kinds = (("aes_gcm_encrypt", encrypt), ("aes_gcm_encrypt_into", encrypt_into), ("gmac", gmac))
    for name, call in kinds:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        rates[name] = len(payload) / statistics.median(times) / 1e9
    return rates


class SameHostFloor:
    """The copies and the update of a same-host push+pull, with no transport (see the module
    docstring); with ``authenticated`` the four GMAC passes too."""

    def __init__(self, model_bytes: int, authenticated: bool) -> None:
        self.gradient = torch.full((model_bytes // 4,), 6e-8)
        self.shared = torch.empty_like(self.gradient)
        self.weight = torch.randn(model_bytes // 4)
        self.private = torch.empty_like(self.weight)
        self.key = os.urandom(32) if authenticated else b""

    def _chunks(self, tensor: torch.Tensor) -> list[tuple[int, memoryview]]:
        view = memoryview(tensor.numpy()).cast("B")
        return list(enumerate(view[s : s + CHUNK_BYTES] for s in range(0, len(view), CHUNK_BYTES)))

    def _tags(self, tensor: torch.Tensor, counter: int) -> list[bytes]:
        # On two threads, as tensorfleet computes its tags (wire/auth.py's in_parallel).
        jobs = self._chunks(tensor)
        return in_parallel(
            jobs, lambda job: _tag(self.key, _nonce(job[0], counter), job[1]), tensor.nbytes
        )

    def _verify(self, tensor: torch.Tensor, counter: int, tags: list[bytes]) -> None:
        jobs = self._chunks(tensor)
        in_parallel(
            jobs,
            lambda job: _verify(self.key, _nonce(job[0], counter), job[1], tags[job[0]]),
            tensor.nbytes,
        )

    def round_trip(self) -> None:
        self.shared.copy_(self.gradient)  # the push, into shared memory
        if self.key:
            self._verify(self.shared, 1, self._tags(self.shared, 1))
        self.weight.add_(self.shared, alpha=-0.1)  # the ps's update, read in place
        tags = self._tags(self.weight, 2) if self.key else []
        self.private.copy_(self.weight)  # the reply, into the worker's own memory
        if self.key:
            self._verify(self.private, 2, tags)


SAME_HOST_LEND_SERVER = r"""
import mmap, os, sys, torch, zmq
size = int(sys.argv[1])
fd = os.memfd_create("tensorfleet-lend-floor")
os.ftruncate(fd, 2 * size)
memory = torch.frombuffer(mmap.mmap(fd, 2 * size), dtype=torch.float32)
gradient, weight = memory[: size // 4], memory[size // 4 :]
weight.normal_()
socket = zmq.Context().socket(zmq.ROUTER)
port = socket.bind_to_random_port("tcp://127.0.0.1")
print(os.getpid(), fd, port, flush=True)
while True:
    peer, header = socket.recv_multipart()
    if header == b"end":
        break
    weight.add_(gradient, alpha=-0.1)  # the push, applied in place where the worker reads
    socket.send_multipart([peer, header])  # "version N": the worker may copy the values
"""


class SameHostLendFloor:
    """The floor of a same-host push+pull that lends the ps's values between two processes
    (docs/wire-performance.md): the worker copies its gradient into shared memory and
    sends a header over ZeroMQ; the ps (another process, torch's default threads, as the ps
    of 1 ps + 1 worker gets them from the launcher) applies SGD in place in the shared
    memory that holds its values and answers; the worker copies the values out into memory
    of its own. No authentication, no version check, no Python of tensorfleet's: three passes
    over the model and one update, and two processes' wake-ups, on this machine."""

    def __init__(self, model_bytes: int) -> None:
        self.server = subprocess.Popen(
            [sys.executable, "-c", SAME_HOST_LEND_SERVER, str(model_bytes)],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.server.stdout.readline().split()
        if len(line) != 3:
            self.server.kill()
            raise RuntimeError(f"the lend floor's ps did not start (exit {self.server.wait()})")
        pid, fd, port = (int(v) for v in line)
        opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            self.mapping = mmap.mmap(opened, 2 * model_bytes)
        finally:
            os.close(opened)
        memory = torch.frombuffer(self.mapping, dtype=torch.float32)
        self.shared_gradient, self.lent = memory[: model_bytes // 4], memory[model_bytes // 4 :]
        self.gradient = torch.full((model_bytes // 4,), 6e-8)
        self.private = torch.empty(model_bytes // 4)
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.header = os.urandom(150)  # about a push's header

    def round_trip(self) -> None:
        self.shared_gradient.copy_(self.gradient)
        self.socket.send(self.header)
        if not self.socket.poll(ROUND_TRIP_TIMEOUT_S * 1000):
            raise RuntimeError("the lend floor's ps did not answer")
        self.socket.recv()
        self.private.copy_(self.lent)

    def close(self) -> None:
        self.socket.send(b"end")
        del self.shared_gradient, self.lent
        try:
            self.server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self.socket.close(linger=0)


HANDOVER_WRITER = r"""
import mmap, os, sys, torch
torch.set_num_threads(1)  # no idle OpenMP threads spinning on the reader's cores
size = int(sys.argv[1])
fd = os.memfd_create("tensorfleet-handover")
os.ftruncate(fd, size)
values = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.float32)
step = torch.full((size // 4,), 1e-7)
print(os.getpid(), fd, flush=True)
for _ in sys.stdin:  # one line per round: update the values, then say so
    values.add_(step)
    print("updated", flush=True)
"""


def handover_times(model_bytes: int, repeats: int) -> dict[str, float]:
    """Milliseconds (medians) for this process to make ``model_bytes`` that another process
    just rewrote in a shared-memory file its own and read them once (see the module
    docstring): a copy out of a kept mapping, a fresh private mapping, a read through a kept
    mapping, a read through a kept private mapping checked in ``/proc/self/pagemap``. Both ends on one thread (an idle OpenMP pool of either spins on the cores the
    other needs: with torch's default threads the read through a kept mapping of 8 MB took
    3.8 ms instead of 0.2 ms here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    writer = subprocess.Popen(
        [sys.executable, "-c", HANDOVER_WRITER, str(model_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        first_line = writer.stdout.readline()
        if not first_line:
            raise RuntimeError(f"the hand-over writer ended at start (exit {writer.wait()})")
        pid, fd = (int(v) for v in first_line.split())
        path = f"/proc/{pid}/fd/{fd}"

        def mapped(flags: int) -> mmap.mmap:
            opened = os.open(path, os.O_RDWR)
            try:
                return mmap.mmap(opened, model_bytes, flags=flags)
            finally:
                os.close(opened)

        kept = mapped(mmap.MAP_SHARED)
        kept_values = [torch.frombuffer(kept, dtype=torch.float32)]  # dropped before the unmap
        own = torch.empty(model_bytes // 4)

        def copy() -> None:
            own.copy_(kept_values[0])
            own.sum()

        def fresh_private_map() -> None:
            private = mapped(mmap.MAP_PRIVATE)
            values = torch.frombuffer(private, dtype=torch.float32)
            values.sum()
            del values
            private.close()

        def kept_map_read() -> None:
            kept_values[0].sum()

        private = mapped(mmap.MAP_PRIVATE)
        private_values = [torch.frombuffer(private, dtype=torch.float32)]
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)

        def kept_private_map_checked() -> None:
            # One 64-bit entry per page: bit 63 present, 62 swapped, 61 the file's page. A
            # present page that is not the file's, or a swapped one, was written here: stale.
            values = private_values[0]
            first, pages = values.data_ptr() // mmap.PAGESIZE, -(-model_bytes // mmap.PAGESIZE)
            entries = torch.frombuffer(
                bytearray(os.pread(pagemap, pages * 8, first * 8)), dtype=torch.int64
            )
            present, swapped, file_page = (
                (entries >> 63) & 1,
                (entries >> 62) & 1,
                (entries >> 61) & 1,
            )
            if bool(((present & (1 - file_page)) | swapped).any()):
                raise RuntimeError("a page of the kept private mapping was written here")
            values.sum()

        kinds = {
            "handover_copy": copy,
            "handover_fresh_private_map": fresh_private_map,
            "handover_kept_map_read": kept_map_read,
            "handover_kept_private_map_checked": kept_private_map_checked,
        }
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for round_ in range(repeats + 1):
            for name, call in kinds.items():
                writer.stdin.write("update\n")
                writer.stdin.flush()
                if not writer.stdout.readline():
                    raise RuntimeError(f"the hand-over writer ended (exit {writer.wait()})")
                start = time.perf_counter()
                call()
                if round_ > 0:  # the first round warms up
                    times[name].append(time.perf_counter() - start)
        kept_values.clear()
        private_values.clear()
        kept.close()
        private.close()
        os.close(pagemap)
    finally:
        torch.set_num_threads(threads)
        writer.stdin.close()
        try:
            writer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait()
    return {name: statistics.median(samples) * 1e3 for name, samples in times.items()}


def interleaved(model_bytes: int, batches: int, per_batch: int) -> dict[str, list[float]]:
    """Seconds per round trip of each echo, in alternating batches (the first warms up)."""
    payload = os.urandom(model_bytes)
    # Small float32 values for the rows that apply them as a gradient (finite weights).
    gradient = b"\x00\x00\x80\x33" * (model_bytes // 4)  # 6e-8 each
    rounds = (batches + 1) * per_batch
    echoes: dict[str, TcpEcho | TcpPull | StreamPull | TcpDuplexEcho | ZmqEcho | TcpSgd] = {}
    closing: list[Callable[[], None]] = []
    try:
        echoes["raw_tcp_echo"] = TcpEcho(payload, rounds)
        echoes["raw_tcp_echo_duplex"] = TcpDuplexEcho(payload, rounds)
        echoes["raw_tcp_pull"] = TcpPull(payload, rounds)
        echoes["tcp_gmac_pull_streamed"] = TcpPull(payload, rounds, authenticated=True)
        echoes["payload_stream_pull"] = StreamPull(payload, rounds)
        echoes["tcp_sgd"] = TcpSgd(gradient, rounds, "whole", authenticated=False)
        echoes["tcp_gmac_sgd_echo"] = TcpSgd(gradient, rounds, "whole", authenticated=True)
        echoes["tcp_gmac_sgd_streamed"] = TcpSgd(gradient, rounds, "streamed", authenticated=True)
        echoes["zmq_echo"] = ZmqEcho(payload, curve=False)
        echoes["zmq_curve_echo"] = ZmqEcho(payload, curve=True)
        echoes["zmq_aes_gcm_echo"] = ZmqEcho(payload, curve=False, aes_gcm=True)
        echoes["zmq_gmac_sgd_echo"] = ZmqEcho(gradient, curve=False, mode="gmac_sgd")
        echoes["zmq_gmac_sgd_pipelined"] = ZmqEcho(gradient, curve=False, mode="gmac_sgd_pipelined")
        for mode in PULLS:
            echoes[f"zmq_{mode}"] = ZmqEcho(payload, curve=False, mode=mode)
        kinds: dict[str, Callable[[], None]] = {n: e.round_trip for n, e in echoes.items()}
        kinds["same_host_floor"] = SameHostFloor(model_bytes, authenticated=False).round_trip
        kinds["same_host_floor_authenticated"] = SameHostFloor(
            model_bytes, authenticated=True
        ).round_trip
        lend_floor = SameHostLendFloor(model_bytes)
        closing.append(lend_floor.close)
        kinds["same_host_lend_floor"] = lend_floor.round_trip
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for batch in range(batches + 1):
            for name, call in kinds.items():
                for _ in range(per_batch):
                    start = time.perf_counter()
                    call()
                    if batch > 0:
                        times[name].append(time.perf_counter() - start)
    finally:
        for close in closing:
            close()
        for echo in echoes.values():
            echo.close()
            try:
                echo.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                echo.server.kill()
                echo.server.wait()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=float, nargs="+", default=[8.0, 32.0])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--per-batch", type=int, default=10)
    add_out_dir_option(parser)
    args = parser.parse_args()
    table = [
        "| MB | run | median ms | p10-p90 ms | GB/s | ratio vs raw TCP |",
        "|---|---|---|---|---|---|",
    ]
    sizes: dict[str, dict] = {}
    for megabytes in args.megabytes:
        model_bytes = int(megabytes * 1e6) // 4 * 4
        times = interleaved(model_bytes, args.batches, args.per_batch)
        rows: dict[str, dict] = {}
        for name, samples in times.items():
            ordered, median = sorted(samples), statistics.median(samples)
            rows[name] = {
                "median_ms": median * 1e3,
                "p10_ms": ordered[int(len(ordered) * 0.1)] * 1e3,
                "p90_ms": ordered[int(len(ordered) * 0.9)] * 1e3,
                "gb_per_s": (1 if name in ONE_WAY else 2) * model_bytes / median / 1e9,
            }
        for name, row in rows.items():
            row["ratio_vs_raw_tcp"] = row["gb_per_s"] / rows["raw_tcp_echo"]["gb_per_s"]
            table.append(
                f"| {megabytes:g} | {name} | {row['median_ms']:.2f} | "
                f"{row['p10_ms']:.2f}-{row['p90_ms']:.2f} | {row['gb_per_s']:.2f} | "
                f"{row['ratio_vs_raw_tcp']:.2f}x |"
            )
        for name, rate in crypto_rates(os.urandom(model_bytes), 15).items():
            rows[name] = {"gb_per_s": rate}
            table.append(f"| {megabytes:g} | {name} (one thread) | | | {rate:.2f} | |")
        for name, milliseconds in handover_times(model_bytes, 30).items():
            rows[name] = {"median_ms": milliseconds}
            table.append(f"| {megabytes:g} | {name} (reading side) | {milliseconds:.2f} | | | |")
        sizes[f"{megabytes:g}"] = rows
    result = {
        "benchmark": (
            "transport floors on localhost: raw TCP, ZeroMQ, ZeroMQ CURVE and AES-GCM echoes, "
            "and an authenticated SGD push+pull over bare ZeroMQ and over a plain TCP socket"
        ),
        "round_trips_per_kind": args.batches * args.per_batch,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "sizes": sizes,
    }
    heading = (
        f"{result['benchmark']}, {args.batches * args.per_batch} round trips each, "
        f"interleaved, {result['date']}"
    )
    write_results("wire_floor", result, heading, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
