"""The load of the parameter-server benchmarks: ps processes and worker processes that
push+pull a synthetic model as fast as they can, each reporting its steps and latencies.

``ps_capacity.py`` (one shard, 1..16 workers on localhost) and ``ps_sharding_links.py``
(1, 2, 4 shards over rate-limited links between network namespaces) both use it. A worker
process runs this file (``python benchmarks/ps_load.py worker ...``); the ps processes are
``tensorfleet server``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

#: Seconds a run may take beyond its duration (start-up, registration, the end).
SLACK_S = 120.0


def cluster_config(ps: Sequence[str], workers: Sequence[str], job: str, index: int) -> str:
    return json.dumps(
        {
            "cluster": {"ps": list(ps), "worker": list(workers)},
            "task": {"type": job, "index": index},
        }
    )


def start_ps(
    ps: Sequence[str],
    workers: Sequence[str],
    index: int,
    secret: str,
    env_extra: dict[str, str],
    prefix: Sequence[str] = (),
) -> subprocess.Popen:
    """``tensorfleet server`` for ps ``index`` (its output goes to a temporary log)."""
    env = {
        **os.environ,
        "TF_CONFIG": cluster_config(ps, workers, "ps", index),
        "TENSORFLEET_SECRET": secret,
        "PYTHONPATH": str(ROOT / "src"),
        **env_extra,
    }
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "tensorfleet", "server"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_worker(
    ps: Sequence[str],
    index: int,
    num_workers: int,
    secret: str,
    model: dict,
    duration_s: float,
    env_extra: dict[str, str],
    prefix: Sequence[str] = (),
) -> subprocess.Popen:
    """A worker process: it prints ``ready`` once registered, starts at ``go`` on its stdin,
    and prints its report (one JSON line) at the end."""
    env = {**os.environ, "TENSORFLEET_SECRET": secret, **env_extra}
    argv = [sys.executable, str(Path(__file__).resolve()), "worker", "--ps", *ps]
    argv += ["--index", str(index), "--workers", str(num_workers), "--model", json.dumps(model)]
    argv += ["--duration", str(duration_s)]
    return subprocess.Popen(
        [*prefix, *argv],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_load(
    ps_addresses: Sequence[str],
    num_workers: int,
    model: dict,
    duration_s: float,
    env_extra: dict[str, str],
    ps_prefix: Sequence[Sequence[str]] | None = None,
    worker_prefix: Sequence[Sequence[str]] | None = None,
) -> list[dict]:
    """Start the ps processes and ``num_workers`` workers; return every worker's report.
    Every child is killed when anything fails."""
    from tensorfleet.wire.secret import generate_secret

    secret = generate_secret()
    workers = [f"worker-{i}.invalid:1" for i in range(num_workers)]  # names only
    children: list[subprocess.Popen] = []
    try:
        for i in range(len(ps_addresses)):
            prefix = ps_prefix[i] if ps_prefix else ()
            children.append(start_ps(ps_addresses, workers, i, secret, env_extra, prefix))
        runners = [
            start_worker(
                ps_addresses,
                i,
                num_workers,
                secret,
                model,
                duration_s,
                env_extra,
                worker_prefix[i] if worker_prefix else (),
            )
            for i in range(num_workers)
        ]
        children += runners
        for runner in runners:  # every worker registered and warmed up...
            line = _read_line(runner, SLACK_S)
            if line.strip() != "ready":
                raise RuntimeError(
                    f"a worker did not start: {line!r} {runner.stderr.read()[-3000:]}"
                )
        for runner in runners:  # ...then all start at once
            runner.stdin.write("go\n")
            runner.stdin.flush()
        reports = []
        for runner in runners:
            out, err = runner.communicate(timeout=duration_s + SLACK_S + num_workers)
            if runner.returncode != 0:
                raise RuntimeError(
                    f"a worker failed ({runner.returncode}): {err[-3000:]}\n"
                    + "".join(_ps_output(c) for c in children[: len(ps_addresses)])
                )
            reports.append(json.loads(out.strip().splitlines()[-1]))
        for child in children[: len(ps_addresses)]:
            child.wait(timeout=60)
        return reports
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)


def _ps_output(process: subprocess.Popen) -> str:
    if process.poll() is None:
        process.kill()
    return f"ps output: {process.stderr.read()[-2000:]}\n"


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    """One line of the process's output, or RuntimeError after ``timeout_s``."""
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    if not ready:
        raise RuntimeError(f"no output from a worker within {timeout_s:.0f} s")
    return process.stdout.readline()


def summarize(reports: list[dict], duration_s: float, model_bytes: int) -> dict:
    latencies = sorted(x for r in reports for x in r["latencies_s"])
    steps = sum(r["steps"] for r in reports)
    return {
        "workers": len(reports),
        "pushes_per_s": steps / duration_s,
        "push_pull_mb_per_s": steps * 2 * model_bytes / duration_s / 1e6,
        "latency_p50_ms": statistics.median(latencies) * 1e3 if latencies else None,
        "latency_p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3 if latencies else None,
        "steps": steps,
    }


def _worker(args: argparse.Namespace) -> int:
    import torch

    from tensorfleet.ps.placement import VariableSpec, plan_placement
    from tensorfleet.ps.update_rules import SGD
    from tensorfleet.wire.secret import load_secret
    from tensorfleet.worker.client import ClientTimeouts, ParameterClient

    torch.set_num_threads(1)
    model = json.loads(args.model)
    numel = model["bytes"] // 4 // model["variables"]
    params = [(f"v{i}", torch.nn.Parameter(torch.randn(numel))) for i in range(model["variables"])]
    for _, p in params:
        p.grad = torch.randn_like(p) * 1e-6
    specs = [VariableSpec(name, (numel,), "float32", 4) for name, _ in params]
    plan = plan_placement(specs, len(args.ps))
    client = ParameterClient(
        args.ps,
        load_secret(),
        f"worker:{args.index}",
        # Generous: on a loaded machine a starting ps can be silent for seconds (imports).
        timeouts=ClientTimeouts(connect_s=120, initialize_s=120, finish_s=60, ps_silence_s=60),
    )
    try:
        client.connect()
        client.register(params, plan, SGD(lr=1e-3), is_chief=args.index == 0)
        client.push_pull()  # warm
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            raise RuntimeError("expected 'go' on stdin")
        latencies = []
        end = time.perf_counter() + args.duration
        while True:
            start = time.perf_counter()
            if start >= end:
                break
            client.push_pull()
            latencies.append(time.perf_counter() - start)
        client.finish(declare_end=args.index == 0)
    finally:
        client.close()
    print(json.dumps({"steps": len(latencies), "latencies_s": latencies}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("worker")
    worker.add_argument("--ps", nargs="+", required=True)
    worker.add_argument("--index", type=int, required=True)
    worker.add_argument("--workers", type=int, required=True)
    worker.add_argument("--model", required=True)
    worker.add_argument("--duration", type=float, required=True)
    args = parser.parse_args()
    return _worker(args)


if __name__ == "__main__":
    raise SystemExit(main())
