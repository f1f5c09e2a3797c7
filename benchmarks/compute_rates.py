"""The two rates the CNN benchmarks put a step's speed against: the FLOPs of one training step
of the classic CNN (forward and backward, counted by torch's ``FlopCounterMode``: 3.61 GFLOP
at batch 50) and what this machine's BLAS reaches on an fp32 GEMM in the same round (the
ceiling a step's FLOP/s are a share of). A helper module of ``throughput.py`` and ``cnn_compute.py``
(it puts ``examples/`` on ``sys.path`` itself, for ``mnist_cnn``); run alone it prints the two
rates of this machine:

    .venv/bin/python benchmarks/compute_rates.py [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from mnist_cnn import ClassicCNN  # noqa: E402


def cnn_step_flops(batch: int = 50) -> float:
    """FLOPs of one training step of the classic CNN on a batch of ``batch`` images."""
    model = ClassicCNN()
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    return float(counter.get_total_flops())


def gemm_flop_per_s(threads: int | None = None, n: int = 2048) -> float:
    """The best of five fp32 ``n`` x ``n`` ``torch.mm`` in FLOP/s, on ``threads`` threads
    (None: as many as torch uses now)."""
    if threads is not None:
        torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None, help="default: torch's own")
    args = parser.parse_args()
    print(f"one training step of the CNN, batch 50: {cnn_step_flops() / 1e9:.2f} GFLOP")
    gemm = gemm_flop_per_s(args.threads)
    print(f"fp32 2048 GEMM on {torch.get_num_threads()} thread(s): {gemm / 1e9:.1f} GFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
