"""Where one-process PyTorch spends the CNN's training step, and what each fast-compute option
changes: the step's compute alone (no tensorfleet, no data loading), on one thread.

Each variant is a plain PyTorch loop (forward, loss, backward, Adam) over one fixed batch of
50 of the classic CNN (``examples/mnist_cnn.py``):

* ``plain``: as ``benchmarks/throughput.py``'s baseline;
* ``fused_adam``: ``torch.optim.Adam(..., fused=True)`` (``tfl.optim.Adam(fused=True)``);
* ``channels_last``: parameters and input in channels-last order
  (``tfl.ComputeOptions(channels_last=True)``);
* ``channels_last_fused_adam``: both (the fp32 options of the throughput table);
* ``compile``: those plus ``torch.compile`` of the model;
* ``autocast_bf16``: those plus the forward pass under bf16 autocast;
* ``tensorflow``: TensorFlow's one-process runtime on the same example with one thread
  (benchmarks/tf_reference, when ``.venv-tf`` or ``TF_PYTHON`` has tensorflow).

One thread, because the step's arithmetic is what is compared (a cluster's workers run one
thread each), and because a one-thread process is the least disturbed by a shared machine.
Variants run interleaved, ``--rounds`` times; the table gives the median ms per step, the
GFLOP/s (3.61 GFLOP per step, counted by torch's FlopCounterMode) and their share of a
2048 x 2048 fp32 ``torch.mm`` on one thread measured in the same run. ``--profile`` adds, per
variant, the ops that take the most time (torch.profiler).

    .venv/bin/python benchmarks/cnn_compute.py [--steps 40 --rounds 5] [--profile]

Writes benchmarks/results/cnn_compute.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from compute_rates import cnn_step_flops, gemm_flop_per_s  # noqa: E402
from mnist_cnn import ClassicCNN  # noqa: E402
from results_writer import add_out_dir_option, write_results  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

BATCH = 50
#: Each variant's options: (channels_last, fused Adam, torch.compile, bf16 autocast).
VARIANTS: dict[str, tuple[bool, bool, bool, bool]] = {
    "plain": (False, False, False, False),
    "fused_adam": (False, True, False, False),
    "channels_last": (True, False, False, False),
    "channels_last_fused_adam": (True, True, False, False),
    "compile": (True, True, True, False),
    "autocast_bf16": (True, True, False, True),
}


def make_step(name: str) -> Callable[[], None]:
    """One training step of variant ``name`` over a fixed batch (same seed every variant)."""
    channels_last, fused, compiled, autocast = VARIANTS[name]
    torch.manual_seed(0)
    model = ClassicCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=fused or None)
    x, y = torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(forward(x), y)
        loss.backward()
        optimizer.step()

    return step


def tensorflow_ms(steps: int) -> float | None:
    """TensorFlow's one-process runtime, one thread, ms per step (None without tensorflow)."""
    python = os.environ.get("TF_PYTHON", str(ROOT / ".venv-tf" / "bin" / "python"))
    if not Path(python).exists():
        return None
    script = ROOT / "benchmarks" / "tf_reference" / "classic_example_tf.py"
    out = subprocess.run(
        [python, str(script), "--single", "--steps", str(steps + 20), "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    rates = [line["global_steps_per_s"] for line in lines if "global_steps_per_s" in line]
    return 1e3 / rates[0] if rates else None


def top_ops(step: Callable[[], None], steps: int = 10, rows: int = 8) -> list[dict]:
    """The ops that take the most time in ``steps`` steps (self CPU time, ms per step)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls": e.count}
        for e in events[:rows]
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    parser.add_argument("--profile", action="store_true", help="the top ops of each variant")
    parser.add_argument("--skip-tensorflow", action="store_true")
    add_out_dir_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    flops = cnn_step_flops(BATCH)
    steps = {name: make_step(name) for name in VARIANTS}
    for step in steps.values():  # warm-up (compiles)
        for _ in range(5):
            step()
    times: dict[str, list[float]] = {name: [] for name in [*VARIANTS, "tensorflow"]}
    gemms = []
    for index in range(args.rounds):
        print(f"round {index + 1} of {args.rounds}", flush=True)
        gemms.append(gemm_flop_per_s())
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append(1e3 * (time.perf_counter() - start) / args.steps)
        if not args.skip_tensorflow and (ms := tensorflow_ms(args.steps * 3)) is not None:
            times["tensorflow"].append(ms)
    gemm = statistics.median(gemms)
    rows: dict[str, dict] = {}
    for name, measured in times.items():
        if not measured:
            rows[name] = {"missing": "no Python with tensorflow (make tf-reference)"}
            continue
        ms = statistics.median(measured)
        rows[name] = {
            "ms_per_step": ms,
            "ms_min": min(measured),
            "ms_max": max(measured),
            "gflop_per_s": flops / ms / 1e6,
            "share_of_gemm": flops / (ms / 1e3) / gemm,
            "rounds": measured,
        }
        if args.profile and name in steps:
            rows[name]["top_ops"] = top_ops(steps[name])
    plain = rows["plain"]["ms_per_step"]
    table = [
        "| variant (one thread) | ms per step median (min-max) | vs plain | GFLOP/s "
        "(share of a 2048 fp32 GEMM) |",
        "|---|---|---|---|",
    ]
    for name, row in rows.items():
        if "missing" in row:
            table.append(f"| {name} | not measured: {row['missing']} | | |")
            continue
        table.append(
            f"| {name} | {row['ms_per_step']:.1f} ({row['ms_min']:.1f}-{row['ms_max']:.1f}) "
            f"| {plain / row['ms_per_step']:.2f}x | {row['gflop_per_s']:.0f} "
            f"({100 * row['share_of_gemm']:.0f}%) |"
        )
    if args.profile:
        for name in steps:
            table += ["", f"{name}: " + ", ".join(
                f"{op['op']} {op['ms_per_step']:.1f} ms" for op in rows[name]["top_ops"]
            )]  # fmt: skip
    result = {
        "benchmark": "the CNN's training step, compute only, one thread (batch 50, Adam)",
        "flop_per_step": flops,
        "gemm_gflop_per_s_one_thread": gemm / 1e9,
        "steps": args.steps,
        "rounds": args.rounds,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "bf16_instructions": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "load_average_at_start": os.getloadavg(),
        },
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    heading = (
        f"{result['benchmark']}, {args.rounds} interleaved rounds of {args.steps} steps, "
        f"{result['date']}; one-thread 2048 fp32 GEMM {gemm / 1e9:.0f} GFLOP/s"
    )
    write_results("cnn_compute", result, heading, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
