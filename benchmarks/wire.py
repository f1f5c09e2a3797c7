"""Push+pull of a 6.6 MB model through a real ps process, against a raw TCP echo.

Both in one run, each with its server in a separate process on localhost:

* ``raw_tcp_echo``: a plain socket server that receives 6.6 MB and sends 6.6 MB back
  (no framing, no authentication, no update): the ceiling for one round trip;
* ``tensorfleet_push_pull``: a ParameterClient pushing 6.6 MB of gradients to a
  ``tensorfleet server`` ps, which authenticates them, applies SGD and sends the 6.6 MB of
  new values back in the reply (what every training step does);
* ``tensorfleet_pull``: values only (6.6 MB one way, a small request the other);
* ``tensorfleet_push_pull_encrypted``: the push+pull with ZeroMQ CURVE encryption on.

    .venv/bin/python benchmarks/wire.py [--batches 10 --per-batch 10]

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
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from results_writer import write_results  # noqa: E402

from tensorfleet.launch.ports import free_port  # noqa: E402
from tensorfleet.ps.placement import VariableSpec, plan_placement  # noqa: E402
from tensorfleet.ps.update_rules import SGD  # noqa: E402
from tensorfleet.wire.secret import generate_secret  # noqa: E402
from tensorfleet.worker.client import ParameterClient  # noqa: E402

MODEL_BYTES = 6_600_000
WARMUP = 10

ECHO_SERVER = r"""
import socket, sys
n, rounds = int(sys.argv[1]), int(sys.argv[2])
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(n); view = memoryview(buf)
for _ in range(rounds):
    got = 0
    while got < n:
        got += conn.recv_into(view[got:])
    conn.sendall(buf)
"""


class RawEcho:
    """A plain TCP echo server in its own process, and the client end of it."""

    def __init__(self, rounds: int) -> None:
        self.server = subprocess.Popen(
            [sys.executable, "-c", ECHO_SERVER, str(MODEL_BYTES), str(rounds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        port = int(self.server.stdout.readline())
        self.conn = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload, self.back = os.urandom(MODEL_BYTES), bytearray(MODEL_BYTES)

    def round_trip(self) -> None:
        self.conn.sendall(self.payload)
        view, got = memoryview(self.back), 0
        while got < MODEL_BYTES:
            got += self.conn.recv_into(view[got:])

    def close(self) -> None:
        self.conn.close()
        self.server.wait(timeout=30)


class TensorfleetPs:
    """A real ``tensorfleet server`` ps process holding one 6.6 MB variable, and a client."""

    def __init__(self, encrypt: bool = False) -> None:
        secret = generate_secret()
        ps_address, worker_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        tf_config = {
            "cluster": {"ps": [ps_address], "worker": [worker_address]},
            "task": {"type": "ps", "index": 0},
        }
        env = {**os.environ, "TF_CONFIG": json.dumps(tf_config), "TENSORFLEET_SECRET": secret}
        env["TENSORFLEET_ENCRYPT"] = "1" if encrypt else "0"
        self.ps = subprocess.Popen(
            [sys.executable, "-m", "tensorfleet", "server"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.weight = torch.nn.Parameter(torch.randn(MODEL_BYTES // 4))
        self.weight.grad = torch.randn_like(self.weight) * 1e-6
        plan = plan_placement([VariableSpec("weight", tuple(self.weight.shape), "float32", 4)], 1)
        self.client = ParameterClient([ps_address], secret.encode(), "worker:0", encrypt=encrypt)
        self.client.connect()
        self.client.register([("weight", self.weight)], plan, SGD(lr=0.1), is_chief=True)

    def push_pull(self) -> None:
        self.client.push_pull()

    def pull(self) -> None:
        self.client.pull()

    def close(self) -> None:
        try:
            self.client.finish(declare_end=True)
        finally:
            self.client.close()
            try:
                self.ps.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.ps.kill()


def interleaved(batches: int, per_batch: int) -> dict[str, list[float]]:
    """Seconds per round trip for each kind, measured in alternating batches so that the
    machine's drift (this is a shared 2-core VM) hits every kind alike."""
    torch.set_num_threads(1)
    raw = RawEcho((batches + 1) * per_batch)
    ours, encrypted = TensorfleetPs(), TensorfleetPs(encrypt=True)
    kinds = {
        "raw_tcp_echo": raw.round_trip,
        "tensorfleet_push_pull": ours.push_pull,
        "tensorfleet_pull": ours.pull,
        "tensorfleet_push_pull_encrypted": encrypted.push_pull,
    }
    times: dict[str, list[float]] = {name: [] for name in kinds}
    try:
        for batch in range(batches + 1):
            for name, call in kinds.items():
                for _ in range(per_batch):
                    start = time.perf_counter()
                    call()
                    if batch > 0:  # the first batch warms up
                        times[name].append(time.perf_counter() - start)
    finally:
        raw.close()
        ours.close()
        encrypted.close()
    return times


def summary(times: list[float], bytes_moved: int) -> dict[str, float]:
    median = statistics.median(times)
    return {
        "median_ms": median * 1e3,
        "p90_ms": sorted(times)[int(len(times) * 0.9)] * 1e3,
        "gb_per_s": bytes_moved / median / 1e9,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--per-batch", type=int, default=10)
    args = parser.parse_args()
    times = interleaved(args.batches, args.per_batch)
    rows = {
        "raw_tcp_echo": summary(times["raw_tcp_echo"], 2 * MODEL_BYTES),
        "tensorfleet_push_pull": summary(times["tensorfleet_push_pull"], 2 * MODEL_BYTES),
        "tensorfleet_pull": summary(times["tensorfleet_pull"], MODEL_BYTES),
        "tensorfleet_push_pull_encrypted": summary(
            times["tensorfleet_push_pull_encrypted"], 2 * MODEL_BYTES
        ),
    }
    for row in rows.values():
        row["ratio_vs_raw_tcp"] = row["gb_per_s"] / rows["raw_tcp_echo"]["gb_per_s"]
    result = {
        "benchmark": "6.6 MB push+pull round trip on localhost (median of rounds)",
        "round_trips_per_kind": args.batches * args.per_batch,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    table = ["| run | median ms | p90 ms | GB/s | ratio vs raw TCP |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        table.append(
            f"| {name} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} | {row['gb_per_s']:.2f} | {row['ratio_vs_raw_tcp']:.2f}x |"
        )
    heading = f"{result['benchmark']}, {args.batches * args.per_batch} round trips each, interleaved, {result['date']}"
    write_results("wire", result, heading, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
