"""What the pieces of a GPU worker's exchange with a ps cost, one at a time, for the
example's CNN (1.6 M parameters, 6.5 MB): the floors a 1 ps + 1 GPU worker step is built on.

* **Gradients off the GPU**: one copy per tensor into pageable host memory (what
  ``FusedParameters.gather`` does today, straight into a request's shared-memory segment),
  against the tensors packed on the GPU into one flat buffer and moved by one non-blocking
  copy into memory pinned for DMA (then one host copy into pageable memory, as into a
  segment).
* **Values onto the GPU**: one copy per tensor from pageable memory (``scatter`` today),
  against one host copy into pinned memory, one non-blocking copy of the flat buffer, and
  the tensors filled from it on the GPU.
* **A host copy of 6.5 MB** (pageable to pageable), for scale.
* **The ps's Adam on the CPU** over the same parameters, torch's fused kernel and its
  ``foreach`` one, at 1, 4, 8 and 16 threads (those the host has).
* **One step in one process on the GPU** (forward, backward, Adam on the GPU; batch 64), and
  the forward and backward alone: what a 1 ps + 1 worker step must come close to.

Each figure is the median of ``--repeats`` timed runs after one untimed one, in
milliseconds, synchronised with the GPU around each. ``benchmarks/gpu.py`` runs this as its
``transfers`` part; alone::

    python benchmarks/programs/gpu_transfers.py [--device cuda|cpu] [--repeats 50]

Prints one JSON object. ``--device cpu`` measures only what needs no GPU (Adam on the CPU):
the rows that need one are left out and ``needs_cuda`` names them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import mnist_cnn  # noqa: E402

#: Thread counts for the ps's Adam (those above the host's cores are left out).
ADAM_THREADS = (1, 4, 8, 16)
#: The rows that need a CUDA GPU.
CUDA_ROWS = (
    "gradients_off_gpu_per_tensor_pageable_ms",
    "gradients_off_gpu_flat_pinned_ms",
    "gradients_off_gpu_flat_pinned_then_host_copy_ms",
    "values_onto_gpu_per_tensor_pageable_ms",
    "values_onto_gpu_host_copy_pinned_flat_ms",
    "host_copy_ms",
    "one_process_step_ms",
    "one_process_forward_backward_ms",
)


def median_ms(run: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    """The median wall time of ``run`` in milliseconds, ``sync`` before and after each."""
    run()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 3)


def copies(params: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """The copy rows (CUDA ``params`` with gradients)."""
    numel = sum(p.numel() for p in params)
    pageable = torch.empty(numel)
    pinned = torch.empty(numel, pin_memory=True)
    flat = torch.empty(numel, device=params[0].device)
    offsets = []
    offset = 0
    for p in params:
        offsets.append(offset)
        offset += p.numel()
    sync = torch.cuda.synchronize

    def gradients_per_tensor() -> None:
        for p, o in zip(params, offsets, strict=True):
            pageable[o : o + p.numel()].view(p.shape).copy_(p.grad)

    def gradients_flat_pinned() -> None:
        for p, o in zip(params, offsets, strict=True):
            flat[o : o + p.numel()].view(p.shape).copy_(p.grad)
        pinned.copy_(flat, non_blocking=True)

    def gradients_flat_pinned_then_host_copy() -> None:
        gradients_flat_pinned()
        torch.cuda.current_stream().synchronize()
        pageable.copy_(pinned)

    def values_per_tensor() -> None:
        with torch.no_grad():
            for p, o in zip(params, offsets, strict=True):
                p.copy_(pageable[o : o + p.numel()].view(p.shape))

    def values_pinned_flat() -> None:
        pinned.copy_(pageable)
        flat.copy_(pinned, non_blocking=True)
        with torch.no_grad():
            for p, o in zip(params, offsets, strict=True):
                p.copy_(flat[o : o + p.numel()].view(p.shape))

    def host_copy() -> None:
        pageable.copy_(pinned)

    rows = {
        "gradients_off_gpu_per_tensor_pageable_ms": gradients_per_tensor,
        "gradients_off_gpu_flat_pinned_ms": gradients_flat_pinned,
        "gradients_off_gpu_flat_pinned_then_host_copy_ms": gradients_flat_pinned_then_host_copy,
        "values_onto_gpu_per_tensor_pageable_ms": values_per_tensor,
        "values_onto_gpu_host_copy_pinned_flat_ms": values_pinned_flat,
        "host_copy_ms": host_copy,
    }
    return {name: median_ms(run, repeats, sync) for name, run in rows.items()}


def one_process_step(model: torch.nn.Module, repeats: int) -> dict[str, float]:
    """The example's step on the GPU in one process (batch 64)."""
    device = next(model.parameters()).device
    x = torch.randn(64, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def forward_backward() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()

    def step() -> None:
        optimizer.zero_grad()
        forward_backward()
        optimizer.step()

    sync = torch.cuda.synchronize
    return {
        "one_process_step_ms": median_ms(step, repeats, sync),
        "one_process_forward_backward_ms": median_ms(forward_backward, repeats, sync),
    }


def adam_on_the_cpu(shapes: list[torch.Size], repeats: int, cores: int) -> dict[str, float]:
    """The ps's Adam over tensors of ``shapes`` on the CPU, by kernel and thread count."""
    weights = [torch.zeros(shape) for shape in shapes]
    for weight in weights:
        weight.grad = torch.randn_like(weight)
    rows = {}
    threads_before = torch.get_num_threads()
    try:
        for threads in (t for t in ADAM_THREADS if t <= cores):
            torch.set_num_threads(threads)
            for kernel in ("fused", "foreach"):
                optimizer = torch.optim.Adam(weights, lr=1e-3, **{kernel: True})
                rows[f"cpu_adam_{kernel}_{threads}_threads_ms"] = median_ms(
                    optimizer.step, repeats, lambda: None
                )
    finally:
        torch.set_num_threads(threads_before)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per figure")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = mnist_cnn.ClassicCNN()
    params = list(model.parameters())
    result: dict = {
        "numel": sum(p.numel() for p in params),
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "device": args.device,
        "repeats": args.repeats,
    }
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA GPU here (torch.cuda.is_available() is False)")
        model = model.cuda()
        params = list(model.parameters())
        for p in params:
            p.grad = torch.randn_like(p)
        result["card"] = torch.cuda.get_device_name(0)
        result.update(copies(params, args.repeats))
        result.update(one_process_step(model, args.repeats))
    else:
        result["needs_cuda"] = list(CUDA_ROWS)
    cores = len(os.sched_getaffinity(0))
    result["cores"] = cores
    result.update(adam_on_the_cpu([p.shape for p in params], args.repeats, cores))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
