"""The same-host all-reduce against gloo's, bucket by bucket: what averaging a bucket costs
through shared memory (``worker/host_allreduce.py``) and over gloo's TCP ring, on the same
processes in one run.

``--world`` processes (3 by default, the examples' worker count) form a gloo group on
loopback, build the same-host path, and average float32 buckets of each size in
``--megabytes`` both ways: gloo as DDP's default hook does it (divide, then ``all_reduce``)
and ``HostAllReduce.average``. The two ways alternate in ``--rounds`` blocks of ``--calls``
calls (after a warm-up of each), and rank 0 reports the median milliseconds per call of each
way and the ratio (gloo's time over the path's: above 1, the path is faster). Each process
uses one torch thread, as the launcher's thread budget gives three workers on this 2-core
machine. The results are checked: both ways must give the mean of the ranks' values.

    .venv/bin/python benchmarks/host_allreduce.py [--megabytes 1 8 32] [--world 3]
        [--calls 10] [--rounds 3]

Writes benchmarks/results/host_allreduce.json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from results_writer import add_out_dir_option, write_results  # noqa: E402

NAME = "host_allreduce"
#: Seconds the ranks may take, all sizes together, before they are stopped.
TIMEOUT_S = 600
#: Warm-up calls of each way before the timed ones, per size.
WARMUP_CALLS = 3


def rank_main(args: argparse.Namespace) -> int:
    """One rank: every size both ways; rank 0 prints the figures as one JSON line."""
    import torch
    import torch.distributed as dist

    from tensorfleet.worker.host_allreduce import HostAllReduce

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    largest = max(int(mb * (1 << 20)) // 4 for mb in args.megabytes)
    host, problem = HostAllReduce.form(
        args.rank, args.world, [torch.zeros(largest, requires_grad=True)], torch.device("cpu")
    )
    if host is None:
        print(f"host_allreduce: the path could not be formed: {problem}", flush=True)
        return 1

    def over_gloo(tensor: torch.Tensor) -> torch.Tensor:
        tensor.div_(args.world)
        dist.all_reduce(tensor)
        return tensor

    ways = {"gloo": over_gloo, "shared_memory": host.average}
    expected_mean = sum(range(1, args.world + 1)) / args.world
    figures = {}
    try:
        for megabytes in args.megabytes:
            numel = int(megabytes * (1 << 20)) // 4
            tensor = torch.empty(numel)
            per_call: dict[str, list[float]] = {way: [] for way in ways}
            for way, average in ways.items():
                for _ in range(WARMUP_CALLS):
                    tensor.fill_(args.rank + 1)
                    average(tensor)
                if (
                    abs(float(tensor[0]) - expected_mean) > 1e-5
                    or abs(float(tensor[-1]) - expected_mean) > 1e-5
                ):
                    print(f"host_allreduce: {way} gave {float(tensor[0])}, not the mean")
                    return 1
            for _ in range(args.rounds):
                for way, average in ways.items():
                    dist.barrier()
                    started = time.perf_counter()
                    for _ in range(args.calls):
                        average(tensor)
                    per_call[way].append((time.perf_counter() - started) / args.calls * 1e3)
            gloo_ms = statistics.median(per_call["gloo"])
            host_ms = statistics.median(per_call["shared_memory"])
            figures[str(megabytes)] = {
                "gloo_ms": gloo_ms,
                "shared_memory_ms": host_ms,
                "ratio": gloo_ms / host_ms,
                "rounds_ms": per_call,
            }
    finally:
        host.close()
        dist.destroy_process_group()
    if args.rank == 0:
        print("FIGURES " + json.dumps(figures), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, nargs="+", default=[1.0, 8.0, 32.0])
    parser.add_argument("--world", type=int, default=3, help="processes (workers)")
    parser.add_argument("--calls", type=int, default=10, help="timed calls per block")
    parser.add_argument("--rounds", type=int, default=3, help="blocks of each way, alternated")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    add_out_dir_option(parser)
    args = parser.parse_args(argv)
    if args.rank is not None:
        return rank_main(args)

    from tensorfleet.launch.ports import free_port

    port = free_port()
    command = [sys.executable, __file__, "--world", str(args.world), "--port", str(port),
               "--calls", str(args.calls), "--rounds", str(args.rounds),
               "--megabytes", *map(str, args.megabytes)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [*command, "--rank", str(rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(args.world)
    ]
    outputs = []
    try:
        for proc in ranks:
            outputs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    lines = [line for line in outputs[0].splitlines() if line.startswith("FIGURES ")]
    if any(proc.returncode != 0 for proc in ranks) or not lines:
        for rank, output in enumerate(outputs):
            print(f"--- rank {rank} (exit {ranks[rank].returncode}) ---\n{output}", flush=True)
        return 1
    figures = json.loads(lines[-1][len("FIGURES ") :])
    result = {
        "benchmark": "same-host all-reduce vs gloo, per bucket",
        "command": " ".join(["python", "benchmarks/host_allreduce.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "world": args.world,
        "calls": args.calls,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "sizes": figures,
    }
    heading = (
        f"Averaging one float32 bucket over {args.world} processes on one host (one torch thread "
        f"each): gloo's all_reduce vs the shared-memory path, median ms per call of "
        f"{args.rounds} alternated blocks of {args.calls}; {os.cpu_count()} CPUs, load "
        f"{result['load_average']:.1f}; {result['date']}"
    )
    table = [
        "| bucket (MB) | gloo (ms) | shared memory (ms) | shared memory vs gloo |",
        "|---|---|---|---|",
    ]
    for size, row in figures.items():
        table.append(
            f"| {float(size):g} | {row['gloo_ms']:.2f} | {row['shared_memory_ms']:.2f} | "
            f"**{row['ratio']:.2f}x** |"
        )
    write_results(NAME, result, heading, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
