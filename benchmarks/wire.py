"""Push+pull of a 6.6 MB model through a real ps process, against a raw TCP echo.

Both in one run, each with its server in a separate process on localhost:

* ``raw_tcp_echo``: a plain socket server that receives 6.6 MB and sends 6.6 MB back
  (no framing, no authentication, no update): the ceiling for one round trip;
* ``tensorfleet_push_pull``: a ParameterClient pushing 6.6 MB of gradients to a
  ``tensorfleet server`` ps, which authenticates them, applies SGD and sends the 6.6 MB of
  new values back in the reply (what every training step does);
* ``tensorfleet_pull``: values only (6.6 MB one way, a small request the other).

    .venv/bin/python benchmarks/wire.py [--rounds 100]

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

from tensorfleet.launch.ports import free_port  # noqa: E402
from tensorfleet.ps.placement import VariableSpec, plan_placement  # noqa: E402
from tensorfleet.ps.update_rules import SGD  # noqa: E402
from tensorfleet.wire.secret import generate_secret  # noqa: E402
from tensorfleet.worker.client import ParameterClient  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
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


def raw_tcp_echo(rounds: int) -> list[float]:
    """Seconds per round trip of 6.6 MB each way over a plain TCP socket."""
    server = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVER, str(MODEL_BYTES), str(rounds + WARMUP)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())
        conn = socket.create_connection(("127.0.0.1", port), timeout=60)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload, back = os.urandom(MODEL_BYTES), bytearray(MODEL_BYTES)
        view = memoryview(back)
        times = []
        for i in range(rounds + WARMUP):
            start = time.perf_counter()
            conn.sendall(payload)
            got = 0
            while got < MODEL_BYTES:
                got += conn.recv_into(view[got:])
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        conn.close()
        return times
    finally:
        server.wait(timeout=30)


def tensorfleet_round_trips(rounds: int) -> dict[str, list[float]]:
    """Seconds per push+pull and per pull against a real ps process."""
    secret = generate_secret()
    ps_address, worker_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    tf_config = {
        "cluster": {"ps": [ps_address], "worker": [worker_address]},
        "task": {"type": "ps", "index": 0},
    }
    env = {**os.environ, "TF_CONFIG": json.dumps(tf_config), "TENSORFLEET_SECRET": secret}
    ps = subprocess.Popen(
        [sys.executable, "-m", "tensorfleet", "server"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    torch.set_num_threads(1)
    weight = torch.nn.Parameter(torch.randn(MODEL_BYTES // 4))
    weight.grad = torch.randn_like(weight) * 1e-6
    plan = plan_placement([VariableSpec("weight", tuple(weight.shape), "float32", 4)], 1)
    client = ParameterClient([ps_address], secret.encode(), "worker:0")
    try:
        client.connect()
        client.register([("weight", weight)], plan, SGD(lr=0.1), is_chief=True)
        times: dict[str, list[float]] = {"push_pull": [], "pull": []}
        for name, call in (("push_pull", client.push_pull), ("pull", client.pull)):
            for i in range(rounds + WARMUP):
                start = time.perf_counter()
                call()
                if i >= WARMUP:
                    times[name].append(time.perf_counter() - start)
        client.finish(declare_end=True)
        return times
    finally:
        client.close()
        try:
            ps.wait(timeout=30)
        except subprocess.TimeoutExpired:
            ps.kill()


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
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    rows = {"raw_tcp_echo": summary(raw_tcp_echo(args.rounds), 2 * MODEL_BYTES)}
    ours = tensorfleet_round_trips(args.rounds)
    rows["tensorfleet_push_pull"] = summary(ours["push_pull"], 2 * MODEL_BYTES)
    rows["tensorfleet_pull"] = summary(ours["pull"], MODEL_BYTES)
    for row in rows.values():
        row["ratio_vs_raw_tcp"] = row["gb_per_s"] / rows["raw_tcp_echo"]["gb_per_s"]
    result = {
        "benchmark": "6.6 MB push+pull round trip on localhost (median of rounds)",
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "wire.json").write_text(json.dumps(result, indent=2))
    table = ["| run | median ms | p90 ms | GB/s | ratio vs raw TCP |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        table.append(
            f"| {name} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} | {row['gb_per_s']:.2f} | {row['ratio_vs_raw_tcp']:.2f}x |"
        )
    (RESULTS / "wire.md").write_text(
        f"{result['benchmark']}, {args.rounds} rounds, {result['date']}\n\n"
        + "\n".join(table)
        + "\n"
    )
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
