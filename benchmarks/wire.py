"""Push+pull of a model through a real ps process, against a raw TCP echo.

For each model size, all in one run, each with its server in a separate process on
localhost, measured in alternating batches (the machine's drift hits every kind alike):

* ``raw_tcp_echo``: a plain socket server that receives the model's bytes and sends them
  back (no framing, no authentication, no update): the ceiling for one round trip over TCP;
* ``raw_tcp_sgd``: the same socket server, but it applies the SGD update a ps applies
  (``weight.add_(gradient, alpha=-lr)`` on a float32 tensor over the received bytes) and
  sends the updated weights back: the same work as a push+pull with nothing of
  tensorfleet's (no framing, authentication, snapshot or copy into the model). The push+pull
  rows apply that update too, so their ratio against this row compares like with like;
* ``push_pull``: a ParameterClient pushing the gradients to a ``tensorfleet server`` ps over
  TCP (``TENSORFLEET_SHARED_MEMORY=0``), every payload in its ZeroMQ message
  (``TENSORFLEET_PAYLOAD_STREAM=0``; the stream's rows are below), which authenticates them, applies SGD and sends the
  new values back in the reply (what every training step does);
* ``pull``: values only (the model one way, a small request the other);
* ``push_pull_encrypted``: the push+pull over TCP with ``--encrypt`` (every message sealed
  with AES-256-GCM under per-connection keys, ``wire/encryption.py``);
* ``push_pull_shared_memory`` / ``pull_shared_memory``: the same, with the same-host fast
  path (payloads in shared memory, the wire carrying the authenticated headers only);
* ``push_pull_stream`` / ``pull_stream``: over TCP with ``TENSORFLEET_PAYLOAD_STREAM=1``:
  the push's gradients and the reply's values over the client's payload stream beside
  ZeroMQ, each tagged chunk by chunk as it leaves and received in place
  (``wire/payload_stream.py``, ``wire/payload_collector.py``);
* ``push_pull_parts``: the push+pull over TCP streamed: the model registered as variables of
  1 MiB, pushed as one bucket each (partial pushes, :mod:`tensorfleet.ps.partial_push`), up
  to 8 in flight, each applied and answered as it arrives. What a push+pull cut into parts
  smaller than a variable would reach on the same ps (the ps lends each bucket's reply only
  that bucket's slices, so the next bucket is applied in place);
* ``push_pull_parts_encrypted``: the same stream with ``--encrypt``: whether sealing each
  part while the previous one travels pays where sealing one whole message does not;
* ``zmq_aes_gcm_echo``: the floor of the encrypted rows, measured in the same rounds
  (``wire_floor.py``'s row of that name): a ZeroMQ echo whose payload is sealed with
  AES-256-GCM in 1 MiB chunks before every send and opened after every receive, one thread
  at each end, nothing else. The encrypted rows get a ratio against it too (the issue's
  target for ``--encrypt``: 0.9x this floor of the same run).

Every process runs with ``GOMP_SPINCOUNT`` as ``tensorfleet launch`` sets it for its tasks
(20,000: torch's idle OpenMP threads spin that many iterations, not libgomp's 300,000, before
they sleep; docs/devices.md), unless the environment sets it; and the ps with the torch
threads the launcher plans for the ps of 1 ps + 1 worker on this host
(``TENSORFLEET_INTRA_OP_THREADS``, :func:`~tensorfleet.cluster.thread_budget.planned_threads`:
the two take turns, so each gets every core; ``tensorfleet server`` alone takes 1), unless
the environment sets it. The client (this process, the worker's end of every kind) takes the
threads the same plan gives the worker (``--client-threads`` chooses): its gather of the
gradients into a same-host request is a copy that torch splits over them, as a launched
worker's is. Before 2026-11-29 it took 1 thread, where the launcher gives a worker taking
turns with its ps every core; the same-host rows were then slower than a launched worker's
exchange (docs/wire-performance.md, "Measured again (2026-11-29)").

Ratios are bytes per second against the raw echo of the same size (a pull moves half the
bytes of an echo); the rows that apply an update also get a ratio against ``raw_tcp_sgd``,
the encrypted ones against ``zmq_aes_gcm_echo``.

``--baseline-src DIR`` adds ``push_pull_baseline`` and ``pull_baseline``: the same over TCP
with the ps process running the package found in ``DIR`` (the ``src`` directory of another
checkout, e.g. ``git worktree add /tmp/before HEAD~1`` then ``--baseline-src
/tmp/before/src``), in the same interleaved rounds: an A/B of a change to the ps.

    .venv/bin/python benchmarks/wire.py [--megabytes 8 32 --batches 10 --per-batch 10]

Writes benchmarks/results/wire.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tensorfleet.cluster.resources import OPENMP_SPIN_COUNT  # noqa: E402  (imports no torch)

# Every process of this benchmark (its own client, the ps, the baselines' servers, which
# inherit the environment) runs with the idle-thread setting `tensorfleet launch` gives every
# task it budgets (cluster/resources.py): torch's idle OpenMP threads spin 20,000 iterations,
# not libgomp's 300,000, before they sleep. Set before torch is imported (libgomp reads it
# once). A value in the environment is kept: GOMP_SPINCOUNT=300000 measures libgomp's default.
os.environ.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPIN_COUNT))

import torch  # noqa: E402
from results_writer import add_out_dir_option, write_results  # noqa: E402
from wire_floor import ZmqEcho  # noqa: E402

from tensorfleet.cluster.thread_budget import planned_threads  # noqa: E402
from tensorfleet.environment import INTRA_OP_THREADS_VAR, host_cpu_count  # noqa: E402
from tensorfleet.launch.ports import free_port  # noqa: E402
from tensorfleet.ps.placement import VariableSpec, plan_placement  # noqa: E402
from tensorfleet.ps.update_rules import SGD  # noqa: E402
from tensorfleet.wire.secret import generate_secret  # noqa: E402
from tensorfleet.worker.client import ParameterClient  # noqa: E402

SHARED_MEMORY_VAR = "TENSORFLEET_SHARED_MEMORY"
PAYLOAD_STREAM_VAR = "TENSORFLEET_PAYLOAD_STREAM"


#: The ps's torch threads: what ``tensorfleet launch`` plans for the ps of 1 ps + 1 worker here.
PS_THREADS = planned_threads(1, 1, host_cpu_count())["ps:0"]
#: The client's torch threads: what ``tensorfleet launch`` plans for its worker.
CLIENT_THREADS = planned_threads(1, 1, host_cpu_count())["worker:0"]
#: Seconds a streamed part may take to be answered.
STEP_TIMEOUT_S = 60.0

ECHO_SERVER = r"""
import socket, sys
n, rounds, sgd = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "sgd"
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(n); view = memoryview(buf)
if sgd:  # the update a ps applies, in place, then the weights go back
    import torch
    gradient = torch.frombuffer(buf, dtype=torch.float32)
    weight = torch.randn(n // 4)
    reply = memoryview(weight.numpy()).cast("B")
else:
    reply = buf
for _ in range(rounds):
    got = 0
    while got < n:
        received = conn.recv_into(view[got:])
        if not received:  # the client closed early (it failed): end instead of spinning
            sys.exit(0)
        got += received
    if sgd:
        weight.add_(gradient, alpha=-0.1)
    conn.sendall(reply)
"""


class RawEcho:
    """A plain TCP echo server in its own process, and the client end of it. With
    ``sgd`` the server applies an SGD update to its weights with the received bytes as the
    gradient and sends the weights back (the work of a push+pull, over a bare socket)."""

    def __init__(self, model_bytes: int, rounds: int, sgd: bool = False) -> None:
        self.model_bytes = model_bytes
        self.server = subprocess.Popen(
            [
                sys.executable,
                "-c",
                ECHO_SERVER,
                str(model_bytes),
                str(rounds),
                "sgd" if sgd else "echo",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        port = int(self.server.stdout.readline())
        self.conn = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Small float32 values, so that the gradient the SGD server reads is finite.
        self.payload = memoryview((torch.randn(model_bytes // 4) * 1e-6).numpy()).cast("B")
        self.back = bytearray(model_bytes)

    def round_trip(self) -> None:
        self.conn.sendall(self.payload)
        view, got = memoryview(self.back), 0
        while got < self.model_bytes:
            received = self.conn.recv_into(view[got:])
            if not received:
                raise ConnectionError(f"the echo server closed after {got} bytes of an echo")
            got += received

    def close(self) -> None:
        self.conn.close()
        self.server.wait(timeout=30)


class TensorfleetPs:
    """A real ``tensorfleet server`` ps process holding one variable, and a client."""

    def __init__(
        self,
        model_bytes: int,
        encrypt: bool = False,
        shared_memory: bool = False,
        ps_src: Path | None = None,
        part_bytes: int | None = None,
        window: int = 8,
        payload_stream: bool = False,
    ) -> None:
        secret = generate_secret()
        env = {**os.environ, "TENSORFLEET_SECRET": secret}
        env["TENSORFLEET_ENCRYPT"] = "1" if encrypt else "0"
        env[SHARED_MEMORY_VAR] = "1" if shared_memory else "0"
        env.setdefault(INTRA_OP_THREADS_VAR, str(PS_THREADS))
        env[PAYLOAD_STREAM_VAR] = "1" if payload_stream else "0"
        env["PYTHONPATH"] = str(ps_src or ROOT / "src")  # the package the ps process runs
        self.ps, ps_address = self._start_ps(env)
        numel, parts = model_bytes // 4, max(1, model_bytes // (part_bytes or model_bytes))
        sizes = [numel * (k + 1) // parts - numel * k // parts for k in range(parts)]
        self.weights = [torch.nn.Parameter(torch.randn(size)) for size in sizes]
        for weight in self.weights:
            weight.grad = torch.randn_like(weight) * 1e-6
        names = ["weight"] if parts == 1 else [f"weight/{k}" for k in range(parts)]
        specs = [VariableSpec(n, (s,), "float32", 4) for n, s in zip(names, sizes, strict=True)]
        os.environ[SHARED_MEMORY_VAR] = env[SHARED_MEMORY_VAR]  # read by the client's channels
        os.environ[PAYLOAD_STREAM_VAR] = env[PAYLOAD_STREAM_VAR]
        self.client = ParameterClient([ps_address], secret.encode(), "worker:0", encrypt=encrypt)
        self.client.connect()
        self.shared_memory = self.client._shards.channels[0].uses_shared_memory
        self.streamed = self.client._shards.channels[0].stream.open
        self.client.register(
            list(zip(names, self.weights, strict=True)),
            plan_placement(specs, 1),
            SGD(lr=0.1),
            is_chief=True,
        )
        self.window = window

    @staticmethod
    def _start_ps(env: dict[str, str], tries: int = 3) -> tuple[subprocess.Popen, str]:
        """The ps process and its address, once it listens. A free port can be taken by
        another socket before the ps binds it (an outgoing connection's local port): the ps
        then exits, and is started again on another port (``tries`` times), instead of its
        client waiting out the hello's deadline."""
        errors = []
        for _ in range(tries):
            port = free_port()
            ps_address, worker_address = f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"
            tf_config = {
                "cluster": {"ps": [ps_address], "worker": [worker_address]},
                "task": {"type": "ps", "index": 0},
            }
            with tempfile.TemporaryFile() as stderr:
                ps = subprocess.Popen(
                    [sys.executable, "-m", "tensorfleet", "server"],
                    env={**env, "TF_CONFIG": json.dumps(tf_config)},
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
                deadline = time.monotonic() + STEP_TIMEOUT_S
                while ps.poll() is None and time.monotonic() < deadline:
                    try:
                        socket.create_connection(("127.0.0.1", port), timeout=1).close()
                        return ps, ps_address
                    except OSError:
                        time.sleep(0.05)
                if ps.poll() is None:
                    ps.kill()
                ps.wait()
                stderr.seek(0)
                errors.append(stderr.read().decode(errors="replace")[-2000:])
        raise RuntimeError(f"the ps did not come up in {tries} tries; its last words: {errors[-1]}")

    def push_pull(self) -> None:
        self.client.push_pull()

    def pull(self) -> None:
        self.client.pull()

    def push_pull_parts(self) -> None:
        """Each variable's gradient as one partial push, ``window`` in flight; the replies'
        values put into the model as they come."""
        channel, fused = self.client._shards.channels[0], self.client._bound()
        count, sent, answered, pending = len(self.weights), 0, 0, []
        while answered < count:
            while sent < count and sent - answered < self.window:
                last = sent == count - 1
                body = {"task": "worker:0", "want_values": True, "count_step": last,
                        "part": [sent, sent + 1], "last": last}  # fmt: skip
                buffers = [memoryview(self.weights[sent].grad.numpy()).cast("B")]
                pending.append(channel.send("push", body, buffers, timeout_s=STEP_TIMEOUT_S))
                sent += 1
            reply = channel.wait(pending[answered], STEP_TIMEOUT_S)
            fused.scatter(0, reply.buffers, (answered, answered + 1))
            answered += 1

    def close(self) -> None:
        try:
            self.client.finish(declare_end=True)
        finally:
            self.client.close()
            try:
                self.ps.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.ps.kill()


#: The kinds that apply an SGD update on the server, compared with ``raw_tcp_sgd`` too.
UPDATING = (
    "push_pull",
    "push_pull_parts",
    "push_pull_parts_encrypted",
    "push_pull_encrypted",
    "push_pull_shared_memory",
    "push_pull_stream",
    "push_pull_baseline",
)

#: The encrypted kinds, compared with ``zmq_aes_gcm_echo`` too.
SEALED = ("push_pull_encrypted", "push_pull_parts_encrypted")

#: Bytes each kind moves per round trip, in units of the model's size.
MOVES = {
    "raw_tcp_echo": 2,
    "raw_tcp_sgd": 2,
    "zmq_aes_gcm_echo": 2,
    "push_pull": 2,
    "push_pull_parts": 2,
    "push_pull_parts_encrypted": 2,
    "pull": 1,
    "push_pull_encrypted": 2,
    "push_pull_shared_memory": 2,
    "pull_shared_memory": 1,
    "push_pull_stream": 2,
    "pull_stream": 1,
    "push_pull_baseline": 2,
    "pull_baseline": 1,
}


def interleaved(
    model_bytes: int,
    batches: int,
    per_batch: int,
    baseline_src: Path | None = None,
    only: Sequence[str] = (),
    client_threads: int = CLIENT_THREADS,
) -> dict[str, list[float]]:
    """Seconds per round trip for each kind (``only``: those and the baselines they are
    compared with; empty: every kind), measured in alternating batches so that the
    machine's drift (this is a shared 2-core VM) hits every kind alike; this process (the
    client of every kind) with ``client_threads`` torch threads."""
    torch.set_num_threads(client_threads)
    wanted = chosen_kinds(only, baseline_src is not None)
    rounds = (batches + 1) * per_batch
    servers: list[Any] = []

    def started(server: Any) -> Any:
        servers.append(server)
        return server

    kinds: dict[str, Callable[[], None]] = {}
    try:
        if "raw_tcp_echo" in wanted:
            kinds["raw_tcp_echo"] = started(RawEcho(model_bytes, rounds)).round_trip
        if "raw_tcp_sgd" in wanted:
            kinds["raw_tcp_sgd"] = started(RawEcho(model_bytes, rounds, sgd=True)).round_trip
        if "zmq_aes_gcm_echo" in wanted:
            echo = started(ZmqEcho(os.urandom(model_bytes), curve=False, aes_gcm=True))
            kinds["zmq_aes_gcm_echo"] = echo.round_trip
        ps_kinds = {
            # kind: (the ps's options, the round trip's method)
            "push_pull": ({}, "push_pull"),
            "push_pull_parts": ({"part_bytes": 1 << 20}, "push_pull_parts"),
            "push_pull_parts_encrypted": (
                {"encrypt": True, "part_bytes": 1 << 20},
                "push_pull_parts",
            ),
            "pull": ({}, "pull"),
            "push_pull_encrypted": ({"encrypt": True}, "push_pull"),
            "push_pull_shared_memory": ({"shared_memory": True}, "push_pull"),
            "pull_shared_memory": ({"shared_memory": True}, "pull"),
            "push_pull_stream": ({"payload_stream": True}, "push_pull"),
            "pull_stream": ({"payload_stream": True}, "pull"),
            "push_pull_baseline": ({"ps_src": baseline_src}, "push_pull"),
            "pull_baseline": ({"ps_src": baseline_src}, "pull"),
        }
        by_options: dict[str, TensorfleetPs] = {}
        for name, (options, method) in ps_kinds.items():
            if name not in wanted:
                continue
            key = repr(sorted(options.items()))
            if key not in by_options:
                ps = by_options[key] = started(TensorfleetPs(model_bytes, **options))
                if ps.shared_memory != bool(options.get("shared_memory")):
                    raise RuntimeError("the shared-memory fast path was not chosen as asked")
                if ps.streamed != bool(options.get("payload_stream")):
                    raise RuntimeError("the payload stream was not opened as asked")
            kinds[name] = getattr(by_options[key], method)
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for batch in range(batches + 1):
            for name, call in kinds.items():
                for _ in range(per_batch):
                    start = time.perf_counter()
                    call()
                    if batch > 0:  # the first batch warms up
                        times[name].append(time.perf_counter() - start)
    finally:
        for server in servers:
            server.close()
            if isinstance(server, ZmqEcho):
                server.server.wait(timeout=30)
    return times


def chosen_kinds(only: Sequence[str], with_baseline: bool) -> list[str]:
    """The kinds a run measures: ``only`` (every kind when empty), the raw TCP echo every
    ratio is taken against, and the floor each chosen kind is also compared with
    (``raw_tcp_sgd`` for the updating kinds, ``zmq_aes_gcm_echo`` for the sealed ones)."""
    every = [name for name in MOVES if with_baseline or not name.endswith("_baseline")]
    unknown = sorted(set(only) - set(every))
    if unknown:
        raise ValueError(f"no such kind {unknown}: choose among {every}")
    if not only:
        return every
    wanted = {"raw_tcp_echo", *only}
    if wanted & set(UPDATING):
        wanted.add("raw_tcp_sgd")
    if wanted & set(SEALED):
        wanted.add("zmq_aes_gcm_echo")
    return [name for name in every if name in wanted]


def summary(times: list[float], bytes_moved: int) -> dict[str, float]:
    median = statistics.median(times)
    ordered = sorted(times)
    return {
        "median_ms": median * 1e3,
        "p10_ms": ordered[int(len(times) * 0.1)] * 1e3,
        "p90_ms": ordered[int(len(times) * 0.9)] * 1e3,
        "gb_per_s": bytes_moved / median / 1e9,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=float, nargs="+", default=[8.0, 32.0])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--per-batch", type=int, default=10)
    parser.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="the src directory of another checkout: its ps in the same rounds (an A/B)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="KIND",
        help="measure only these kinds (and the baselines their ratios need), e.g. "
        "--only push_pull_shared_memory pull_shared_memory",
    )
    parser.add_argument(
        "--client-threads",
        type=int,
        default=CLIENT_THREADS,
        help=f"this process's torch threads (default {CLIENT_THREADS}: the launcher's plan for "
        "the worker of 1 ps + 1 worker on this host)",
    )
    add_out_dir_option(parser)
    args = parser.parse_args()
    try:
        chosen_kinds(args.only, args.baseline_src is not None)
    except ValueError as error:
        parser.error(str(error))
    if args.baseline_src is not None and not (args.baseline_src / "tensorfleet").is_dir():
        parser.error(
            f"--baseline-src {args.baseline_src} has no tensorfleet package: give the src "
            "directory of a checkout (e.g. /tmp/before/src after git worktree add /tmp/before HEAD~1)"
        )
    sizes: dict[str, dict] = {}
    table = [
        "| MB | run | median ms | p10-p90 ms | GB/s | ratio vs raw TCP | vs raw TCP + SGD "
        "| vs AES-GCM echo |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for megabytes in args.megabytes:
        model_bytes = int(megabytes * 1e6) // 4 * 4
        times = interleaved(
            model_bytes, args.batches, args.per_batch, args.baseline_src, args.only,
            args.client_threads,
        )  # fmt: skip
        rows = {name: summary(t, MOVES[name] * model_bytes) for name, t in times.items()}
        for name, row in rows.items():
            row["ratio_vs_raw_tcp"] = row["gb_per_s"] / rows["raw_tcp_echo"]["gb_per_s"]
            same_work = ""
            if name in UPDATING:
                row["ratio_vs_raw_tcp_sgd"] = row["gb_per_s"] / rows["raw_tcp_sgd"]["gb_per_s"]
                same_work = f"{row['ratio_vs_raw_tcp_sgd']:.2f}x"
            sealed_floor = ""
            if name in SEALED:
                row["ratio_vs_aes_gcm_echo"] = (
                    row["gb_per_s"] / rows["zmq_aes_gcm_echo"]["gb_per_s"]
                )
                sealed_floor = f"{row['ratio_vs_aes_gcm_echo']:.2f}x"
            table.append(
                f"| {megabytes:g} | {name} | {row['median_ms']:.2f} | "
                f"{row['p10_ms']:.2f}-{row['p90_ms']:.2f} | {row['gb_per_s']:.2f} | "
                f"{row['ratio_vs_raw_tcp']:.2f}x | {same_work} | {sealed_floor} |"
            )
        sizes[f"{megabytes:g}"] = rows
    result = {
        "benchmark": "push+pull round trip on localhost vs a raw TCP echo (median of rounds)",
        "round_trips_per_kind": args.batches * args.per_batch,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "gomp_spincount": os.environ["GOMP_SPINCOUNT"],
        "ps_threads": os.environ.get(INTRA_OP_THREADS_VAR, str(PS_THREADS)),
        "client_threads": args.client_threads,
        "sizes": sizes,
    }
    heading = (
        f"{result['benchmark']}, {args.batches * args.per_batch} round trips each, "
        f"interleaved, GOMP_SPINCOUNT={result['gomp_spincount']} in every process, "
        f"{result['ps_threads']} torch thread(s) in the ps, {args.client_threads} in the "
        f"client, {result['date']}"
    )
    write_results("wire", result, heading, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
