"""The worker of ``benchmarks/overlap.py``: a model trained in async mode on synthetic data
(a fixed pool of random batches: no data loading in the measurement), with the overlap
settings of the command line.

    overlap_worker.py --model cnn|mlp --steps N [--bucket-bytes B] [--prefetch]
        [--wire-dtype bf16] [--values-wire-dtype bf16] [--metrics-json PATH] [--timeline FILE]

``--bucket-bytes 0``: no buckets (one push per shard after the backward). The chief writes
its steady-state figures to ``--metrics-json``: global steps/s and its own local steps/s from
its ``WARMUP``-th local step on (a chief that makes no more than ``WARMUP`` local steps is an
error: nothing to time).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from mnist_cnn import ClassicCNN  # noqa: E402

import tensorfleet as tfl  # noqa: E402

#: Local steps before the chief's steady-state clock starts.
WARMUP = 15
#: The MLP with large layers: 784 -> 1024 -> 1024 -> 1024 -> 10 (2.9 M parameters, 11.6 MB).
MLP_WIDTH = 1024


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "cnn":
        return ClassicCNN()
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, MLP_WIDTH), nn.ReLU(),
        nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU(),
        nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU(),
        nn.Linear(MLP_WIDTH, 10),
    )  # fmt: skip


class Clock(tfl.Hook):
    """The chief's steady-state throughput: from its WARMUP-th local step to its last."""

    def __init__(self) -> None:
        self.local_steps = 0
        self.start: tuple[float, int] | None = None
        self.start_global = 0
        self.last: tuple[float, int] = (0.0, 0)

    def after_step(self, session: tfl.TrainingSession, result: tfl.StepResult) -> None:
        self.local_steps += 1
        now = (time.perf_counter(), result.global_step)
        if self.local_steps == WARMUP:
            self.start = (now[0], self.local_steps)
            self.start_global = result.global_step
        self.last = now

    def figures(self, steps: int) -> dict[str, float]:
        """The chief's steady-state figures; ``steps`` is the ``--steps`` asked for.

        Raises ConfigError when the chief's local steps did not pass the warm-up (no time
        elapsed after it: nothing to divide by)."""
        if self.start is None or self.local_steps <= WARMUP:
            needed = math.ceil(steps * (WARMUP + 1) / max(1, self.local_steps))
            raise tfl.ConfigError(
                f"--steps {steps} gave the chief {self.local_steps} local steps, not more than "
                f"the {WARMUP} warm-up steps its clock skips: no figure can be measured; pass "
                f"at least {WARMUP + 1} local steps to the chief (about --steps {needed} here)"
            )
        seconds = self.last[0] - self.start[0]
        return {
            "global_steps_per_s": (self.last[1] - self.start_global) / seconds,
            "local_steps_per_s": (self.local_steps - self.start[1]) / seconds,
            "local_steps": self.local_steps,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=("cnn", "mlp"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--bucket-bytes", type=int, default=tfl.Overlap().bucket_bytes)
    parser.add_argument("--prefetch", action="store_true")
    parser.add_argument("--wire-dtype", choices=("bf16",), default=None)
    parser.add_argument("--values-wire-dtype", choices=("bf16",), default=None)
    parser.add_argument("--metrics-json", type=Path, default=None)
    parser.add_argument("--timeline", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tfl.resolve_task()
    server = tfl.Server(task.cluster, task.job, task.index)
    if task.job == "ps":
        server.join()
        return 0
    model = make_model(args.model)
    generator = torch.Generator().manual_seed(task.index)
    batches = [
        (
            torch.randn(args.batch, 1, 28, 28, generator=generator),
            torch.randint(0, 10, (args.batch,), generator=generator),
        )
        for _ in range(8)
    ]
    clock = Clock()
    with tfl.TrainingSession(
        server,
        model,
        optimizer=tfl.optim.Adam(lr=1e-4),
        hooks=[tfl.StopAtStep(last_step=args.steps), clock],
        overlap=tfl.Overlap(bucket_bytes=args.bucket_bytes or None, prefetch=args.prefetch),
        wire_dtype=args.wire_dtype,
        values_wire_dtype=args.values_wire_dtype,
        timeline=args.timeline,
        progress_secs=None,
    ) as sess:
        step = 0
        while not sess.should_stop():
            x, y = batches[step % len(batches)]
            sess.step(lambda x=x, y=y: F.cross_entropy(model(x), y))
            step += 1
    if sess.is_chief and args.metrics_json is not None:
        args.metrics_json.write_text(json.dumps(clock.figures(args.steps)))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except tfl.TensorfleetError as error:  # a misconfiguration: one clear line, no traceback
        print(f"overlap_worker.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
