"""The CPU a small request costs at each end: a worker's exchange with a ps of a small model,
against a bare ZeroMQ echo of the same frames.

Where the payloads are small (a model of a few kilobytes, a heartbeat, an embedding table's
lookup of a few hundred rows) a round trip costs what the two processes' Python does per
message, not what the bytes cost: on a host where the ps shares the workers' cores (every
local cluster, every test, the click model of ``sparse_tables.py``) that CPU is the step's
price. This benchmark measures it, per round trip, in one run, with the kinds interleaved in
batches so that the machine's drift hits them alike:

* ``zmq_echo``: a ``zmq.ROUTER`` in its own process that sends back every message of a
  ``zmq.DEALER`` (this process), four frames shaped like tensorfleet's (a 62-byte envelope,
  a 120-byte header, empty chunk tags, the payload): the floor, ZeroMQ and a Python loop
  at each end doing nothing else;
* ``heartbeat``: a worker's heartbeat to a ``tensorfleet server`` ps (a request with no
  payload, answered with the training's progress);
* ``push_pull``: ``ParameterClient.push_pull()`` of a model of ``--kilobytes`` in
  ``--variables`` float32 variables (SGD on the ps), over TCP with every payload in its
  ZeroMQ message (``TENSORFLEET_SHARED_MEMORY=0``, ``TENSORFLEET_PAYLOAD_STREAM=0``; the
  shared-memory and stream paths take over only above a size this model is below);
* ``heartbeat_baseline``, ``push_pull_baseline`` (``--baseline-src DIR``): the same with both
  ends running the package in ``DIR`` (another checkout's ``src``): an A/B of a change to the
  request path.
  Its client end runs that checkout's ``benchmarks/wire.py`` and package, as does its ps.

For each kind: the client's CPU per round trip (the thread that sends and waits,
``time.thread_time``; ZeroMQ's I/O thread is counted with the process's other threads in
``client_process_cpu_us``), the server's (the whole ps or echo process, ``/proc``), and the
wall time. The two process columns come from ``/proc``'s clock ticks (10 ms here): per round
trip their resolution is 10 ms / ``--rounds`` (5 us at the default 2,000). Ratios are each kind's CPU (client thread + server process) against
``zmq_echo``'s of the same run.

    .venv/bin/python benchmarks/request_cost.py [--rounds 2000 --batches 5]

Writes benchmarks/results/request_cost.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from results_writer import add_out_dir_option, write_results  # noqa: E402

#: The client's end, run as a child for every kind (so that the A/B's baseline client imports
#: its own package): it prints one JSON line per batch of round trips it is told to run.
CLIENT = r"""
import json, os, sys, time
kind, kilobytes, variables = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
TICK = os.sysconf("SC_CLK_TCK")

def process_cpu(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK

if kind == "zmq_echo":
    import zmq
    server = __import__("subprocess").Popen(
        [sys.executable, "-c", ECHO], stdout=__import__("subprocess").PIPE, text=True
    )
    port = int(server.stdout.readline())
    context = zmq.Context(io_threads=1)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    frames = [os.urandom(62), os.urandom(120), b"", os.urandom(kilobytes * 1024)]
    def round_trip():
        dealer.send_multipart(frames, copy=False)
        if not dealer.poll(60_000):
            raise TimeoutError("no echo within 60 s")
        dealer.recv_multipart(copy=False)
    server_pid = server.pid
    def close():
        dealer.send(b"")
        server.wait(timeout=30)
else:
    sys.path.insert(0, os.environ["BENCH_DIR"])
    import torch
    torch.set_num_threads(1)
    from wire import TensorfleetPs
    ps = TensorfleetPs(kilobytes * 1024, part_bytes=kilobytes * 1024 // variables)
    if kind == "heartbeat":
        channel = ps.client._shards.channels[0]
        def round_trip():
            channel.wait(channel.send("heartbeat", {"task": "worker:0"}), 60)
    else:
        round_trip = ps.push_pull
    server_pid = ps.ps.pid
    close = ps.close

for _ in range(50):  # warm up
    round_trip()
print("ready", flush=True)
for line in sys.stdin:
    rounds = int(line)
    cpu, process, served, wall = (
        time.thread_time(), process_cpu(os.getpid()), process_cpu(server_pid), time.perf_counter()
    )
    for _ in range(rounds):
        round_trip()
    report = {
        "client_us": (time.thread_time() - cpu) / rounds * 1e6,
        "client_process_us": (process_cpu(os.getpid()) - process) / rounds * 1e6,
        "server_us": (process_cpu(server_pid) - served) / rounds * 1e6,
        "wall_us": (time.perf_counter() - wall) / rounds * 1e6,
    }
    print(json.dumps(report), flush=True)
close()
"""

#: The bare echo's server: sends back every message it gets, until an empty one.
ECHO = r"""
import zmq
context = zmq.Context(io_threads=1)
router = context.socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
print(router.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    frames = router.recv_multipart(copy=False)
    if len(frames) == 2 and not frames[1].bytes:
        break
    router.send_multipart(frames, copy=False)
"""

KINDS = ("zmq_echo", "heartbeat", "push_pull", "heartbeat_baseline", "push_pull_baseline")


class ClientProcess:
    """One kind's client end in a child process, told batch by batch how many round trips
    to run."""

    def __init__(self, kind: str, kilobytes: int, variables: int, src: Path) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": str(src),
            "BENCH_DIR": str(src.parent / "benchmarks"),  # its wire.py imports its package
            "TENSORFLEET_SHARED_MEMORY": "0",
            "TENSORFLEET_PAYLOAD_STREAM": "0",
            "TENSORFLEET_UPDATE_LOG": "0",
        }
        program = f"ECHO = {ECHO!r}\n{CLIENT}"
        mode = kind.removesuffix("_baseline")
        self.kind = kind
        self.process = subprocess.Popen(
            [sys.executable, "-c", program, mode, str(kilobytes), str(variables)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._expect("ready")

    def _expect(self, word: str) -> str:
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        if not line or (word and line.strip() != word):
            self.process.kill()
            raise RuntimeError(f"the {self.kind} client said {line!r}, expected {word!r}")
        return line

    def batch(self, rounds: int) -> dict[str, float]:
        self.process.stdin.write(f"{rounds}\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self._expect(""))

    def close(self) -> None:
        self.process.stdin.close()  # type: ignore[union-attr]
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def baseline_problem(src: Path) -> str | None:
    """Why ``src`` cannot be the baseline's package (None when it can): it must be another
    checkout's ``src`` directory, beside that checkout's ``benchmarks/wire.py``."""
    if not (src / "tensorfleet" / "__init__.py").is_file():
        return (
            f"--baseline-src {src}: no tensorfleet package there; give the src directory of "
            f"another checkout (e.g. git clone -q . /tmp/before && git -C /tmp/before checkout "
            f"-q COMMIT, then --baseline-src /tmp/before/src)"
        )
    if not (src.parent / "benchmarks" / "wire.py").is_file():
        return (
            f"--baseline-src {src}: its checkout has no benchmarks/wire.py beside it (at "
            f"{src.parent / 'benchmarks'}), which the baseline's client runs; give the src "
            f"directory of a whole checkout"
        )
    return None


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Each kind's batches, interleaved (one batch of every kind per round)."""
    kinds = [k for k in KINDS if not k.endswith("_baseline") or args.baseline_src]
    sources = {k: (args.baseline_src if k.endswith("_baseline") else ROOT / "src") for k in kinds}
    clients: dict[str, ClientProcess] = {}
    try:
        for kind in kinds:
            clients[kind] = ClientProcess(kind, args.kilobytes, args.variables, sources[kind])
        batches: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
        for batch in range(args.batches):
            for kind, client in clients.items():
                batches[kind].append(client.batch(args.rounds))
                print(batch, kind, json.dumps(batches[kind][-1]), flush=True)
    finally:
        for client in clients.values():
            client.close()
    return batches


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2000, help="round trips per batch")
    parser.add_argument("--batches", type=int, default=5, help="batches of each kind")
    parser.add_argument("--kilobytes", type=int, default=4, help="the model's (and echo's) size")
    parser.add_argument("--variables", type=int, default=4, help="the model's variables")
    parser.add_argument(
        "--baseline-src", type=Path, help="another checkout's src: adds the *_baseline kinds"
    )
    parser.add_argument("--name", default="request_cost", help="the results' file name")
    add_out_dir_option(parser)
    args = parser.parse_args()
    if args.baseline_src is not None:
        problem = baseline_problem(args.baseline_src)
        if problem:
            parser.error(problem)
    batches = measure(args)
    medians = {
        kind: {key: statistics.median(b[key] for b in runs) for key in runs[0]}
        for kind, runs in batches.items()
    }

    def both(kind: str) -> float:
        return medians[kind]["client_us"] + medians[kind]["server_us"]

    table = [
        "| kind | client thread CPU us | client process CPU us | server CPU us | wall us | "
        "CPU (client thread + server) vs zmq_echo |",
        "|---|---|---|---|---|---|",
    ]
    for kind, m in medians.items():
        table.append(
            f"| {kind} | {m['client_us']:.0f} | {m['client_process_us']:.0f} | "
            f"{m['server_us']:.0f} | {m['wall_us']:.0f} | {both(kind) / both('zmq_echo'):.2f}x |"
        )
    heading = (
        f"Request cost per round trip, a {args.kilobytes} KB model in {args.variables} "
        f"variables, medians of {args.batches} batches of {args.rounds} ({os.cpu_count()} CPUs)"
        + (f"; *_baseline: the package in {args.baseline_src}" if args.baseline_src else "")
    )
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "batches": batches,
              "medians": medians}  # fmt: skip
    write_results(args.name, result, heading, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
