"""Training throughput of the CNN: one-process PyTorch against a tensorfleet cluster.

Measured in one run, on the same machine, same model, batch and optimizer:

* ``pytorch_single``: a plain PyTorch loop (no tensorfleet), 2 threads: the baseline;
* ``tensorfleet_single``: the example in one process (TrainingSession without a cluster);
* ``tensorfleet_async_1ps_3w``: the example on a local 1 ps + 3 worker cluster (global
  steps/s);
* the same with the fast-compute options (docs/compute.md): ``_fast_fp32`` (channels-last
  order and the fused Adam: fp32, compared with TensorFlow's fp32 runtime), ``_compile``
  (those plus ``torch.compile``, one process), and, reported apart, ``_wire_bf16``
  (gradients sent as bf16 with error feedback), ``_values_bf16`` (the values in the replies
  to pushes sent as bf16), ``_wire_and_values_bf16`` (both) and ``_autocast_bf16`` (the
  forward pass in bf16 autocast);
* ``tensorflow_async`` / ``tensorflow_single``: TensorFlow's own runtime on the same example
  (benchmarks/tf_reference), when a Python with tensorflow is available (``TF_PYTHON`` or
  the separate venv ``.venv-tf`` that ``make tf-reference`` makes); otherwise the row says why
  it is missing.

Each row also gives its test accuracy after the same number of global steps, its FLOP/s
(global steps/s times the step's FLOPs, which torch's FlopCounterMode counts: 3.61 GFLOP
for a batch of 50) and their share of what a 2048 x 2048 fp32 ``torch.mm`` on 2 threads
reaches in the same round, and, for the ps rows, the bytes the chief's transport sent per
step and the chief's time per local step.

One run is not a measurement on a shared machine whose speed drifts: every row runs
``--repeats`` times, interleaved (one of each per round), and the table gives the median,
the spread (min-max) and the ratios to the baselines measured in the same round (median
over rounds).

    .venv/bin/python benchmarks/throughput.py [--steps 600 --repeats 3] [--rows NAME ...]

Writes benchmarks/results/throughput.json and .md (``--name`` for another name, e.g. a
longer run for the accuracy at equal steps).
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

from cnn_training import WARMUP_STEPS  # noqa: E402
from compute_rates import cnn_step_flops, gemm_flop_per_s  # noqa: E402
from mnist_cnn import ClassicCNN  # noqa: E402
from results_writer import add_out_dir_option, write_results  # noqa: E402

from tensorfleet.datasets import BatchStream, load_mnist, normalize  # noqa: E402
from tensorfleet.launch.local_cluster import LocalCluster  # noqa: E402
from tensorfleet.launch.output import Output  # noqa: E402

TF_REFERENCE = ROOT / "benchmarks" / "tf_reference" / "run.sh"
WARMUP = 20
#: The fp32 fast-compute options (docs/compute.md): channels-last order, the fused Adam.
FAST_FP32 = ("--channels-last", "--fused-optimizer")


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


#: The tensorfleet rows: name -> (ps tasks, workers, the example's flags, what is in bf16).
#: fp32 rows compare with TensorFlow's fp32 runtime; the bf16 rows are reported separately.
TENSORFLEET_ROWS: dict[str, tuple[int, int, tuple[str, ...], str]] = {
    "tensorfleet_single": (0, 1, (), "fp32"),
    "tensorfleet_single_fast_fp32": (0, 1, FAST_FP32, "fp32"),
    "tensorfleet_single_compile": (0, 1, (*FAST_FP32, "--compile"), "fp32"),
    "tensorfleet_async_1ps_3w": (1, 3, (), "fp32"),
    "tensorfleet_async_1ps_3w_fast_fp32": (1, 3, FAST_FP32, "fp32"),
    "tensorfleet_async_1ps_3w_wire_bf16": (1, 3, (*FAST_FP32, "--wire-dtype", "bf16"), "bf16 wire"),
    "tensorfleet_async_1ps_3w_values_bf16": (
        1,
        3,
        (*FAST_FP32, "--values-wire-dtype", "bf16"),
        "bf16 values on the wire",
    ),
    "tensorfleet_async_1ps_3w_wire_and_values_bf16": (
        1,
        3,
        (*FAST_FP32, "--wire-dtype", "bf16", "--values-wire-dtype", "bf16"),
        "bf16 gradients and values on the wire",
    ),
    "tensorfleet_async_1ps_3w_autocast_bf16": (
        1,
        3,
        (*FAST_FP32, "--autocast", "bf16"),
        "bf16 compute",
    ),
}


def too_few_steps(steps: int, names: list[str]) -> str | None:
    """What is wrong with ``--steps`` when a row's chief would not pass its warm-up, or None.

    The tensorfleet rows time the chief after ``WARMUP_STEPS`` local steps; in async mode it
    makes about 1/workers of the global steps, so a row needs workers x (warm-up + 1) steps.
    """
    least = {name: TENSORFLEET_ROWS[name][1] * (WARMUP_STEPS + 1) for name in names}
    short = {name: n for name, n in least.items() if steps < n}
    if not short:
        return None
    name = max(short, key=lambda row: short[row])
    return (
        f"--steps {steps} is too few for {name}: its chief makes about "
        f"{steps // TENSORFLEET_ROWS[name][1]} local steps, not more than the {WARMUP_STEPS} "
        f"warm-up steps its clock skips, so no figure could be measured; pass --steps "
        f"{short[name]} or more"
    )


def one_round(steps: int, tensorflow: bool, names: list[str], flops: float) -> dict[str, dict]:
    """Every row once, and this round's GEMM."""
    gemm = gemm_flop_per_s(threads=2)
    rows: dict[str, dict] = {"pytorch_single": {"steps_per_s": pytorch_single(steps)}}
    print("pytorch_single", rows["pytorch_single"], flush=True)
    for name in names:
        num_ps, workers, flags, precision = TENSORFLEET_ROWS[name]
        figures = example_run(steps, num_ps, workers, flags)
        rows[name] = {
            "steps_per_s": figures["steady_global_steps_per_s"],
            "test_accuracy": figures["test_accuracy"],
            "options": " ".join(flags) or "none",
            "precision": precision,
            "chief_ms_per_step": figures.get("steady_local_ms_per_step"),
            "sent_bytes_per_step": figures.get("sent_bytes_per_step"),
        }
        print(name, rows[name], flush=True)
    if tensorflow:
        for mode in ("single", "async"):
            reference = tensorflow_reference(steps, mode)
            rows[f"tensorflow_{mode}"] = (
                reference
                if "missing" in reference
                else {
                    "steps_per_s": reference["global_steps_per_s"],
                    "test_accuracy": reference.get("test_accuracy"),
                    "precision": "fp32",
                }
            )
            print(f"tensorflow_{mode}", rows[f"tensorflow_{mode}"], flush=True)
    baseline = rows["pytorch_single"]["steps_per_s"]
    tf_single = rows.get("tensorflow_single", {}).get("steps_per_s")
    tf_async = rows.get("tensorflow_async", {}).get("steps_per_s")
    for row in rows.values():
        if "steps_per_s" in row:
            row["ratio_vs_pytorch_single"] = row["steps_per_s"] / baseline
            row["gflop_per_s"] = row["steps_per_s"] * flops / 1e9
            row["share_of_gemm"] = row["steps_per_s"] * flops / gemm
            row["gemm_gflop_per_s"] = gemm / 1e9
            if tf_single:
                row["ratio_vs_tensorflow_single"] = row["steps_per_s"] / tf_single
            if tf_async:
                row["ratio_vs_tensorflow_async"] = row["steps_per_s"] / tf_async
    return rows


#: The figures combined over rounds as medians (with their min and max).
MEDIAN_KEYS = (
    "steps_per_s",
    "ratio_vs_pytorch_single",
    "ratio_vs_tensorflow_single",
    "ratio_vs_tensorflow_async",
    "test_accuracy",
    "gflop_per_s",
    "share_of_gemm",
    "gemm_gflop_per_s",
    "chief_ms_per_step",
    "sent_bytes_per_step",
)


def combine(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Medians and spreads over the rounds, row by row."""
    combined: dict[str, dict] = {}
    for name in rounds[0]:
        measured = [r[name] for r in rounds if "steps_per_s" in r.get(name, {})]
        if not measured:
            combined[name] = {"missing": rounds[0][name].get("missing", "not measured")}
            continue
        row: dict = {"rounds": measured}
        for key in ("options", "precision"):
            if key in measured[0]:
                row[key] = measured[0][key]
        for key in MEDIAN_KEYS:
            values = [m[key] for m in measured if m.get(key) is not None]
            if values:
                row[key] = statistics.median(values)
                row[f"{key}_min"], row[f"{key}_max"] = min(values), max(values)
        combined[name] = row
    return combined


def _ratio(row: dict, key: str) -> str:
    if key not in row:
        return ""
    return f"{row[key]:.2f}x ({row[key + '_min']:.2f}-{row[key + '_max']:.2f})"


def markdown_table(rows: dict[str, dict]) -> list[str]:
    """The table of the JSON's rows (medians over the rounds; ratios taken within a round)."""
    table = [
        "| run | precision, options | steps/s median (min-max) | vs one-process PyTorch "
        "| vs TensorFlow one process | vs TensorFlow distributed | GFLOP/s (share of a 2048 "
        "fp32 GEMM) | test accuracy | MB sent per step | chief ms per step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        if "missing" in row:
            table.append(f"| {name} | | not measured: {row['missing']} | | | | | | | |")
            continue
        accuracy = f"{row['test_accuracy']:.3f}" if "test_accuracy" in row else ""
        sent = f"{row['sent_bytes_per_step'] / 1e6:.2f}" if "sent_bytes_per_step" in row else ""
        chief_ms = f"{row['chief_ms_per_step']:.1f}" if "chief_ms_per_step" in row else ""
        options = row.get("precision", "fp32")
        if row.get("options") not in (None, "none"):
            options += f", `{row['options']}`"
        table.append(
            f"| {name} | {options} | {row['steps_per_s']:.2f} ({row['steps_per_s_min']:.2f}-"
            f"{row['steps_per_s_max']:.2f}) | {_ratio(row, 'ratio_vs_pytorch_single')} "
            f"| {_ratio(row, 'ratio_vs_tensorflow_single')} "
            f"| {_ratio(row, 'ratio_vs_tensorflow_async')} "
            f"| {row['gflop_per_s']:.0f} ({100 * row['share_of_gemm']:.0f}%) | {accuracy} "
            f"| {sent} | {chief_ms} |"
        )
    return table


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=600, help="global steps per measured run")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--skip-tensorflow", action="store_true")
    parser.add_argument(
        "--rows",
        nargs="*",
        choices=sorted(TENSORFLEET_ROWS),
        default=list(TENSORFLEET_ROWS),
        help="the tensorfleet rows to run (default: all)",
    )
    parser.add_argument(
        "--name", default="throughput", help="results file name (benchmarks/results/NAME.json)"
    )
    add_out_dir_option(parser)
    args = parser.parse_args()
    problem = too_few_steps(args.steps, args.rows)
    if problem is not None:
        parser.error(problem)
    flops = cnn_step_flops()
    rounds = []
    for index in range(args.repeats):
        print(f"round {index + 1} of {args.repeats}", flush=True)
        rounds.append(one_round(args.steps, not args.skip_tensorflow, args.rows, flops))
    rows = combine(rounds)
    result = {
        "benchmark": "CNN training throughput (batch 50, Adam 1e-4, Fashion-MNIST)",
        "steps": args.steps,
        "repeats": args.repeats,
        "flop_per_step": flops,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average_at_start": os.getloadavg(),
        },
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    heading = (
        f"{result['benchmark']}, {args.steps} steps, {args.repeats} interleaved rounds, "
        f"{result['date']}, {flops / 1e9:.2f} GFLOP per step"
    )
    write_results(args.name, result, heading, markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
