"""Training throughput of the CNN: one-process PyTorch against a tensorfleet cluster.

Measured in one run, on the same machine, same model, batch and optimizer:

* ``pytorch_single``: a plain PyTorch loop (no tensorfleet), 2 threads: the baseline;
* ``tensorfleet_single``: the example in one process (TrainingSession without a cluster);
* ``tensorfleet_async``: the example on a local 1 ps + 3 worker cluster (global steps/s);
* ``tensorflow_async`` / ``tensorflow_single``: TensorFlow's own runtime on the same example
  (benchmarks/tf_reference), when a Python with tensorflow is available (``TF_PYTHON`` or
  the separate venv ``.venv-tf`` that ``make tf-reference`` makes); otherwise the row says why
  it is missing.

One run is not a measurement on a shared machine whose speed drifts: every row runs
``--repeats`` times, interleaved (one of each per round), and the table gives the median,
the spread (min-max) and the ratio to one-process PyTorch measured in the same round
(median over rounds).

    .venv/bin/python benchmarks/throughput.py [--steps 600 --repeats 3]

Writes benchmarks/results/throughput.json and .md.
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

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "src"))

from mnist_cnn import ClassicCNN  # noqa: E402
from results_writer import write_results  # noqa: E402

from tensorfleet.datasets import BatchStream, load_mnist, normalize  # noqa: E402
from tensorfleet.launch.local_cluster import LocalCluster  # noqa: E402
from tensorfleet.launch.output import Output  # noqa: E402

TF_REFERENCE = ROOT / "benchmarks" / "tf_reference" / "run.sh"
WARMUP = 20


def pytorch_single(steps: int, threads: int = 2) -> float:
    """Steps/s of a plain PyTorch training loop (the baseline)."""
    torch.set_num_threads(threads)
    images, labels = load_mnist("fashion-mnist", None, "train")
    batches = BatchStream(normalize(images), labels, 50)
    torch.manual_seed(0)
    model = ClassicCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    start = 0.0
    for i in range(steps + WARMUP):
        if i == WARMUP:
            start = time.perf_counter()
        x, y = next(batches)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return steps / (time.perf_counter() - start)


def example_run(steps: int, num_ps: int, num_workers: int, extra: tuple[str, ...] = ()) -> dict:
    """The example's own figures (the chief's steady-state global steps/s)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.json"
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "cnn_training.py"),
            "--steps",
            str(steps),
            "--metrics-json",
            str(metrics),
            *extra,
        ]
        if num_workers == 1 and num_ps == 0:
            env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
        else:
            cluster = LocalCluster(num_ps, num_workers, command, output=Output(), grace_period=20)
            try:
                cluster.start()
                code = cluster.wait(timeout=1800)
            finally:
                cluster.stop()
            if code != 0:
                raise RuntimeError(
                    f"the cluster run failed with {code}: {cluster.recent_lines('worker:0')}"
                )
        return json.loads(metrics.read_text())


def tensorflow_reference(steps: int, mode: str) -> dict:
    """TensorFlow's runtime on the same example, or {"missing": why}."""
    python = os.environ.get("TF_PYTHON", str(ROOT / ".venv-tf" / "bin" / "python"))
    if not TF_REFERENCE.exists():
        return {"missing": f"{TF_REFERENCE} not found"}
    probe = (
        subprocess.run([python, "-c", "import tensorflow"], capture_output=True)
        if Path(python).exists()
        else None
    )
    if probe is None or probe.returncode != 0:
        return {"missing": "no Python with tensorflow (run `make tf-reference`, or set TF_PYTHON)"}
    out = subprocess.run(
        ["bash", str(TF_REFERENCE), str(steps), "3", mode],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_PYTHON": python},
        timeout=3600,
    )
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    chief = [line for line in lines if "global_steps_per_s" in line]
    if not chief:
        return {
            "missing": f"the reference printed no figures (exit {out.returncode}): {out.stderr[-500:]}"
        }
    return chief[0]


def one_round(steps: int, tensorflow: bool) -> dict[str, dict]:
    """Every row once."""
    rows: dict[str, dict] = {"pytorch_single": {"steps_per_s": pytorch_single(steps)}}
    print("pytorch_single", rows["pytorch_single"], flush=True)
    single = example_run(steps, 0, 1)
    rows["tensorfleet_single"] = {
        "steps_per_s": single["steady_global_steps_per_s"],
        "test_accuracy": single["test_accuracy"],
    }
    print("tensorfleet_single", rows["tensorfleet_single"], flush=True)
    distributed = example_run(steps, 1, 3)
    rows["tensorfleet_async_1ps_3w"] = {
        "steps_per_s": distributed["steady_global_steps_per_s"],
        "test_accuracy": distributed["test_accuracy"],
    }
    print("tensorfleet_async", rows["tensorfleet_async_1ps_3w"], flush=True)
    if tensorflow:
        for mode in ("single", "async"):
            reference = tensorflow_reference(steps, mode)
            rows[f"tensorflow_{mode}"] = (
                reference
                if "missing" in reference
                else {
                    "steps_per_s": reference["global_steps_per_s"],
                    "test_accuracy": reference.get("test_accuracy"),
                }
            )
            print(f"tensorflow_{mode}", rows[f"tensorflow_{mode}"], flush=True)
    baseline = rows["pytorch_single"]["steps_per_s"]
    tf_single = rows.get("tensorflow_single", {}).get("steps_per_s")
    for row in rows.values():
        if "steps_per_s" in row:
            row["ratio_vs_pytorch_single"] = row["steps_per_s"] / baseline
            if tf_single:
                row["ratio_vs_tensorflow_single"] = row["steps_per_s"] / tf_single
    return rows


def combine(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Medians and spreads over the rounds, row by row."""
    combined: dict[str, dict] = {}
    for name in rounds[0]:
        measured = [r[name] for r in rounds if "steps_per_s" in r.get(name, {})]
        if not measured:
            combined[name] = {"missing": rounds[0][name].get("missing", "not measured")}
            continue
        row: dict = {"rounds": measured}
        for key in (
            "steps_per_s",
            "ratio_vs_pytorch_single",
            "ratio_vs_tensorflow_single",
            "test_accuracy",
        ):
            values = [m[key] for m in measured if m.get(key) is not None]
            if values:
                row[key] = statistics.median(values)
                row[f"{key}_min"], row[f"{key}_max"] = min(values), max(values)
        combined[name] = row
    return combined


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=600, help="global steps per measured run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--skip-tensorflow", action="store_true")
    args = parser.parse_args()
    rounds = []
    for index in range(args.repeats):
        print(f"round {index + 1} of {args.repeats}", flush=True)
        rounds.append(one_round(args.steps, not args.skip_tensorflow))
    rows = combine(rounds)
    result = {
        "benchmark": "CNN training throughput (batch 50, Adam 1e-4, Fashion-MNIST)",
        "steps": args.steps,
        "repeats": args.repeats,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    table = [
        "| run | steps/s median (min-max) | ratio vs one-process PyTorch (same round; median, min-max) "
        "| ratio vs one-process TensorFlow | test accuracy median |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        if "missing" in row:
            table.append(f"| {name} | not measured: {row['missing']} | | | |")
            continue
        accuracy = f"{row['test_accuracy']:.3f}" if "test_accuracy" in row else ""
        versus_tf = (
            f"{row['ratio_vs_tensorflow_single']:.2f}x"
            if "ratio_vs_tensorflow_single" in row
            else ""
        )
        table.append(
            f"| {name} | {row['steps_per_s']:.2f} ({row['steps_per_s_min']:.2f}-"
            f"{row['steps_per_s_max']:.2f}) | {row['ratio_vs_pytorch_single']:.2f}x "
            f"({row['ratio_vs_pytorch_single_min']:.2f}-{row['ratio_vs_pytorch_single_max']:.2f}) "
            f"| {versus_tf} | {accuracy} |"
        )
    heading = (
        f"{result['benchmark']}, {args.steps} steps, {args.repeats} interleaved rounds, "
        f"{result['date']}"
    )
    write_results("throughput", result, heading, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
