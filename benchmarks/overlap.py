"""Overlapping the exchange with the computation: async training throughput with the step
sequential, with the gradients pushed in buckets during the backward pass, and with buckets
and the last reply prefetched (``tfl.Overlap``), for the example's CNN and an MLP with large
layers (784-1024-1024-1024-10, 11.6 MB), on 1 ps + ``--workers`` workers.

Two settings of the links:

* ``local`` (default): every task on this machine, payloads through shared memory;
* ``--rate RATE`` (e.g. ``200mbit``): every task in a network namespace of its own
  (``tests/multihost/netns.py``: fresh uniquely named namespaces joined by a bridge in a hub
  namespace, deleted at the end whatever happens; nothing is added to the host's
  interfaces), both ends of every veth limited by a ``tc`` token bucket of RATE, shared memory
  off: a slow network between hosts. Needs root.

Each configuration runs ``--repeats`` times, interleaved (one of each per round), and the
table gives the chief's steady-state global steps/s (median, min-max) and the ratio to the
sequential step measured in the same round (median). ``--bucket-sizes`` adds the bucketed
configuration at other sizes (how the default was chosen). ``--wire-dtypes`` adds the
bf16 wire with buckets and prefetch: gradients in bf16, the values in the replies in bf16,
and both (docs/compute.md). ``--timelines DIR`` also writes one run's traces per
configuration (for ``benchmarks/timeline_picture.py``).

    .venv/bin/python benchmarks/overlap.py [--models cnn mlp --steps 300 --repeats 3]
    sudo .venv/bin/python benchmarks/overlap.py --rate 200mbit
    sudo .venv/bin/python benchmarks/overlap.py --rate 1gbit --wire-dtypes

Writes benchmarks/results/overlap.json and .md (``overlap_<rate>`` with ``--rate``,
``_<N>w`` added for ``--workers N`` other than 2, ``_wire_dtypes`` with ``--wire-dtypes``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

from programs.overlap_worker import WARMUP  # noqa: E402
from results_writer import add_out_dir_option, not_run, write_results  # noqa: E402

from tensorfleet.launch.local_cluster import LocalCluster  # noqa: E402
from tensorfleet.launch.output import Output  # noqa: E402
from tensorfleet.worker.push_overlap import DEFAULT_BUCKET_BYTES  # noqa: E402

WORKER = ROOT / "benchmarks" / "programs" / "overlap_worker.py"
PORT = 2222
#: Seconds a cluster run may take at most.
RUN_TIMEOUT_S = 300.0


def configurations(bucket_sizes: list[int], wire_dtypes: bool = False) -> dict[str, list[str]]:
    """Name -> the worker's overlap (and wire) flags."""
    buckets = ["--bucket-bytes", str(DEFAULT_BUCKET_BYTES)]
    configs = {
        "sequential": ["--bucket-bytes", "0"],
        "buckets": buckets,
        "buckets+prefetch": [*buckets, "--prefetch"],
    }
    if wire_dtypes:
        gradients, values = ["--wire-dtype", "bf16"], ["--values-wire-dtype", "bf16"]
        prefetch = [*buckets, "--prefetch"]
        configs["buckets+prefetch, bf16 gradients"] = [*prefetch, *gradients]
        configs["buckets+prefetch, bf16 values"] = [*prefetch, *values]
        configs["buckets+prefetch, bf16 gradients and values"] = [*prefetch, *gradients, *values]
    for size in bucket_sizes:
        if size != DEFAULT_BUCKET_BYTES:
            configs[f"buckets {size >> 10} KiB"] = ["--bucket-bytes", str(size)]
    return configs


class LoggedOutput(Output):
    """Every task's lines and the launcher's messages, kept in order for a failure's report."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, task: str, text: str) -> None:
        self.lines.append(f"[{task}] {text}")

    def message(self, text: str, level: str = "info") -> None:
        self.lines.append(f"[launcher] {level}: {text}")

    def task_exited(self, task: str, status: str, ok: bool) -> None:
        self.message(f"{task} ended: {status}")


def run_local(command: list[str], workers: int, timeline: Path | None) -> None:
    ps_command = [sys.executable, "-m", "tensorfleet", "server"]
    if timeline is not None:
        ps_command += ["--timeline", str(timeline)]
    output = LoggedOutput()
    cluster = LocalCluster(
        1, workers, command, ps_command=ps_command, output=output, grace_period=20
    )
    try:
        cluster.start()
        code = cluster.wait(timeout=RUN_TIMEOUT_S)
    except BaseException as exc:
        raise RuntimeError(f"the run failed: {exc!r}\n" + "\n".join(output.lines[-200:])) from exc
    finally:
        cluster.stop()
    if code != 0:
        raise RuntimeError(f"the run failed ({code}):\n" + "\n".join(output.lines[-200:]))


def run_namespaces(command: list[str], workers: int, rate: str, timeline: Path | None) -> None:
    """One task per namespace, links limited to ``rate``; every child killed in the end."""
    from ps_sharding_links import limit_links
    from tests.multihost.netns import NetworkNamespaces

    from tensorfleet.wire.secret import generate_secret

    with NetworkNamespaces(1 + workers) as hosts:
        limit_links(hosts, rate)
        cluster = {
            "ps": [f"{hosts.address(0)}:{PORT}"],
            "worker": [f"{hosts.address(1 + i)}:{PORT}" for i in range(workers)],
        }
        env = {
            **os.environ,
            "TENSORFLEET_SECRET": generate_secret(),
            "TENSORFLEET_SHARED_MEMORY": "0",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path]),
        }
        ps_argv = [sys.executable, "-m", "tensorfleet", "server"]
        if timeline is not None:
            ps_argv += ["--timeline", str(timeline)]
        children: list[subprocess.Popen] = []
        try:
            for job, index, argv, host in [
                ("ps", 0, ps_argv, 0),
                *[("worker", i, command, 1 + i) for i in range(workers)],
            ]:
                config = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
                children.append(
                    subprocess.Popen(
                        hosts.exec_argv(host, argv),
                        env={**env, "TF_CONFIG": config},
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                )
            deadline = time.monotonic() + RUN_TIMEOUT_S
            for child in children[1:] + children[:1]:  # the workers, then the ps
                _, err = child.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if child.returncode != 0:
                    raise RuntimeError(f"a task failed ({child.returncode}): {err[-3000:]}")
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait(timeout=30)


def measure(
    model: str,
    flags: list[str],
    steps: int,
    workers: int,
    rate: str | None,
    timeline: Path | None = None,
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.json"
        command = [
            sys.executable, str(WORKER), "--model", model, "--steps", str(steps),
            "--metrics-json", str(metrics), *flags,
        ]  # fmt: skip
        if timeline is not None:
            command += ["--timeline", str(timeline)]
        if rate is None:
            run_local(command, workers, timeline)
        else:
            run_namespaces(command, workers, rate, timeline)
        return json.loads(metrics.read_text())


def too_few_steps(steps: int, workers: int) -> str | None:
    """What is wrong with ``--steps`` when the chief would not pass its warm-up, or None.

    The worker times the chief after ``WARMUP`` local steps; in async mode the chief makes
    about 1/workers of the global steps, so a run needs workers x (warm-up + 1) steps.
    """
    least = workers * (WARMUP + 1)
    if steps >= least:
        return None
    return (
        f"--steps {steps} gives the chief about {steps // workers} local steps on {workers} "
        f"worker(s), not more than the {WARMUP} warm-up steps its clock skips: no figure "
        f"could be measured; pass --steps {least} or more"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=("cnn", "mlp"), default=["cnn", "mlp"])
    parser.add_argument("--steps", type=int, default=300, help="global steps per run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--rate", default=None, help="links between namespaces, e.g. 200mbit")
    parser.add_argument("--bucket-sizes", type=int, nargs="*", default=[], metavar="BYTES")
    parser.add_argument("--timelines", type=Path, default=None, metavar="DIR")
    parser.add_argument("--wire-dtypes", action="store_true", help="add the bf16 wire")
    add_out_dir_option(parser)
    args = parser.parse_args()
    problem = too_few_steps(args.steps, args.workers)
    if problem is not None:
        parser.error(problem)
    if args.rate is not None:
        from tests.multihost.netns import namespaces_available

        reason = namespaces_available()
        if reason is not None:
            return not_run("overlap", f"--rate needs links between network namespaces: {reason}")
    configs = configurations(args.bucket_sizes, args.wire_dtypes)
    runs: dict[str, dict[str, list[dict]]] = {m: {c: [] for c in configs} for m in args.models}
    for round_index in range(args.repeats):
        for model in args.models:
            for name, flags in configs.items():
                timeline = None
                if args.timelines is not None and round_index == 0:
                    label = name.replace("+", "-").replace(" ", "-")
                    timeline = args.timelines / f"{model}-{label}" / "trace.json"
                figures = measure(model, flags, args.steps, args.workers, args.rate, timeline)
                runs[model][name].append(figures)
                print(round_index + 1, model, name, figures, flush=True)
    rows: dict[str, dict] = {}
    table = [
        "| model | configuration | global steps/s median (min-max) | ratio vs sequential (same round) |",
        "|---|---|---|---|",
    ]
    for model, by_config in runs.items():
        base = [r["global_steps_per_s"] for r in by_config["sequential"]]
        for name, points in by_config.items():
            speeds = [p["global_steps_per_s"] for p in points]
            ratios = [s / b for s, b in zip(speeds, base, strict=True)]
            row = {
                "steps_per_s": statistics.median(speeds),
                "steps_per_s_min": min(speeds),
                "steps_per_s_max": max(speeds),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "rounds": points,
            }
            rows[f"{model} {name}"] = row
            table.append(
                f"| {model} | {name} | {row['steps_per_s']:.2f} ({row['steps_per_s_min']:.2f}-"
                f"{row['steps_per_s_max']:.2f}) | {row['ratio']:.2f}x ({row['ratio_min']:.2f}-"
                f"{row['ratio_max']:.2f}) |"
            )
    links = "local (shared memory)" if args.rate is None else f"{args.rate} links (namespaces)"
    load = os.getloadavg()
    result = {
        "benchmark": f"async, 1 ps + {args.workers} worker{'s' if args.workers > 1 else ''}, {links}",
        "steps": args.steps,
        "repeats": args.repeats,
        "load_average_at_end": load,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    heading = (
        f"{result['benchmark']}, {args.steps} global steps per run, {args.repeats} interleaved "
        f"rounds, load average {load[0]:.1f} at the end, {result['date']}"
    )
    name = "overlap" + (f"_{args.rate}" if args.rate else "")
    name += f"_{args.workers}w" if args.workers != 2 else ""
    name += "_wire_dtypes" if args.wire_dtypes else ""
    write_results(name, result, heading, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
