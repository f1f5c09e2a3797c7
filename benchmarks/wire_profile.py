"""Where the time of a push+pull goes: cProfile on both ends of a real ps process.

The client (this process) and a ps shard (a child process running the same
:class:`ParameterService` loop as ``tensorfleet server``, under cProfile) each profile the
same rounds; the report lists, for each end, the
functions with the most time of their own (C functions such as the MAC, ZeroMQ's send and
receive, torch copies and the optimizer show up by name), as milliseconds per round.

    .venv/bin/python benchmarks/wire_profile.py [--megabytes 8 --rounds 200 --op push_pull]

Writes benchmarks/results/wire_profile_<op>[_encrypted][_shared_memory].json and .md (e.g.
``wire_profile_push_pull.md`` for the defaults, ``wire_profile_push_pull_shared_memory.md``
with ``--shared-memory 1``).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from results_writer import add_out_dir_option, write_results  # noqa: E402

from tensorfleet.launch.ports import free_port  # noqa: E402
from tensorfleet.ps.placement import VariableSpec, plan_placement  # noqa: E402
from tensorfleet.ps.update_rules import SGD  # noqa: E402
from tensorfleet.wire.secret import generate_secret  # noqa: E402
from tensorfleet.worker.client import ParameterClient  # noqa: E402

PS_PROGRAM = r"""
import cProfile, sys, torch
torch.set_num_threads(1)  # as `tensorfleet server` (--threads 1)
from tensorfleet.ps.service import ParameterService, ServiceConfig
from tensorfleet.wire.service_socket import ServiceSocket
address, secret, encrypt, out = sys.argv[1], sys.argv[2].encode(), sys.argv[3] == "1", sys.argv[4]
socket = ServiceSocket(address, secret, encrypt=encrypt)
service = ParameterService(socket, ServiceConfig(0, ("worker:0",)))
profiler = cProfile.Profile()
profiler.runcall(service.serve)
profiler.dump_stats(out)
socket.close(linger_s=2.0)
"""


def top(stats: pstats.Stats, rounds: int, limit: int) -> list[dict]:
    """The functions with the most own time, in ms per round."""
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        rows.append(
            {
                "function": where,
                "own_ms_per_round": own * 1e3 / rounds,
                "cumulative_ms_per_round": cumulative * 1e3 / rounds,
                "calls_per_round": calls / rounds,
            }
        )
    rows.sort(key=lambda r: -r["own_ms_per_round"])
    return rows[:limit]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--op", choices=("push_pull", "pull"), default="push_pull")
    parser.add_argument("--encrypt", action="store_true")
    parser.add_argument(
        "--shared-memory", choices=("0", "1"), default="0", help="the same-host fast path"
    )
    parser.add_argument("--limit", type=int, default=15)
    add_out_dir_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    secret = generate_secret()
    ps_address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        server_profile = Path(tmp) / "ps.prof"
        ps = subprocess.Popen(
            [sys.executable, "-c", PS_PROGRAM, ps_address, secret]
            + ["1" if args.encrypt else "0", str(server_profile)],
            env={
                **os.environ,
                "PYTHONPATH": str(ROOT / "src"),
                "TENSORFLEET_SHARED_MEMORY": args.shared_memory,
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            numel = int(args.megabytes * 1e6) // 4
            weight = torch.nn.Parameter(torch.randn(numel))
            weight.grad = torch.randn_like(weight) * 1e-6
            plan = plan_placement([VariableSpec("weight", (numel,), "float32", 4)], 1)
            os.environ["TENSORFLEET_SHARED_MEMORY"] = args.shared_memory  # the client's channels
            client = ParameterClient(
                [ps_address], secret.encode(), "worker:0", encrypt=args.encrypt
            )
            client.connect()
            client.register([("weight", weight)], plan, SGD(lr=0.1), is_chief=True)
            call = client.push_pull if args.op == "push_pull" else client.pull
            for _ in range(20):
                call()
            profiler = cProfile.Profile()
            start = time.perf_counter()
            profiler.enable()
            for _ in range(args.rounds):
                call()
            profiler.disable()
            elapsed = time.perf_counter() - start
            client.finish(declare_end=True)
            client.close()
            ps.wait(timeout=60)
        finally:
            if ps.poll() is None:
                ps.kill()
        client_rows = top(pstats.Stats(profiler), args.rounds, args.limit)
        # The ps profile covers its whole life (warm-up rounds included): per round of all.
        ps_rows = top(pstats.Stats(str(server_profile)), args.rounds + 20, args.limit + 10)
    ps_rows = [r for r in ps_rows if "poll" not in r["function"]][: args.limit]
    result = {
        "benchmark": f"profile of {args.op} of {args.megabytes:g} MB"
        + (" (encrypted)" if args.encrypt else "")
        + (" through shared memory" if args.shared_memory == "1" else " over TCP"),
        "rounds": args.rounds,
        "ms_per_round": elapsed * 1e3 / args.rounds,
        "client": client_rows,
        "ps": ps_rows,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    table = ["| end | function | own ms/round | cumulative ms/round | calls/round |"]
    table.append("|---|---|---|---|---|")
    for end, rows in (("client", client_rows), ("ps", ps_rows)):
        for r in rows:
            table.append(
                f"| {end} | `{r['function']}` | {r['own_ms_per_round']:.3f} | "
                f"{r['cumulative_ms_per_round']:.3f} | {r['calls_per_round']:.1f} |"
            )
    heading = f"{result['benchmark']}: {result['ms_per_round']:.2f} ms per round (under cProfile), {result['date']}"
    write_results(
        f"wire_profile_{args.op}"
        + ("_encrypted" if args.encrypt else "")
        + ("_shared_memory" if args.shared_memory == "1" else ""),
        result,
        heading,
        table,
    )
    print(heading)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
