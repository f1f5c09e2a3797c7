"""One rank of the synchronized-batch-norm check: 2 gloo processes on CPU, each with a slice
of one batch (of unequal sizes), against one process's BatchNorm on the whole batch.

Prints one line ``MAXDIFF <name> <value>`` per compared quantity (the largest absolute
difference, divided by the quantity's largest magnitude when that exceeds 1), then ``OK``; exits 1 with
the reason when a difference exceeds the tolerance."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tensorfleet.worker.sync_batch_norm import CpuSyncBatchNorm, convert_sync_batchnorm

TOLERANCE = 1e-5
SLICES = [(0, 10), (10, 16)]  # unequal slices: the global count must weight them


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, bias=False),  # a bias before BN has a zero gradient: noise only
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5, bias=False),
        nn.BatchNorm1d(5, momentum=None),  # the cumulative average
    )
    with torch.no_grad():  # non-trivial affine parameters
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    return net


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        return check(rank)
    finally:
        dist.destroy_process_group()


def check(rank: int) -> int:
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 3, 8, 8, generator=g) * 0.5 + 3.0 for _ in range(3)]
    weights = [torch.randn(16, 5, generator=g) for _ in range(3)]
    start, stop = SLICES[rank]
    reference, synced = model(), convert_sync_batchnorm(model())
    assert isinstance(synced[1], CpuSyncBatchNorm) and isinstance(synced[5], CpuSyncBatchNorm)
    ddp = DistributedDataParallel(convert_sync_batchnorm(model()))  # DDP accepts it on CPU
    diffs: dict[str, float] = {}

    def note(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        # Relative to the quantity's scale when it exceeds 1: a float32 sum of hundreds of
        # terms of size 10 carries rounding of 1e-5 in absolute terms in the reference itself.
        want, got = want.detach(), got.detach()
        scale = max(1.0, float(want.abs().max()))
        diffs[name] = max(diffs.get(name, 0.0), float((got - want).abs().max()) / scale)

    for step, (x, r) in enumerate(zip(batches, weights, strict=True)):
        x_ref = x.clone().requires_grad_(True)
        out_ref = reference(x_ref)
        (out_ref * r).sum().backward()

        x_mine = x[start:stop].clone().requires_grad_(True)
        out = synced(x_mine)
        (out * r[start:stop]).sum().backward()
        note("output", out, out_ref[start:stop])
        note("input grad", x_mine.grad, x_ref.grad[start:stop])
        for (name, p), p_ref in zip(synced.named_parameters(), reference.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # each rank holds its slice's share of the weight gradient
            note(f"grad {name}", grad, p_ref.grad)

        # DDP averages the ranks' gradients: scale the local loss so the mean is the sum.
        x_ddp = x[start:stop].clone().requires_grad_(True)
        out_ddp = ddp(x_ddp)
        (out_ddp * r[start:stop]).sum().mul(dist.get_world_size()).backward()
        note("ddp output", out_ddp, out_ref[start:stop])
        for (name, p), p_ref in zip(
            ddp.module.named_parameters(), reference.parameters(), strict=True
        ):
            note(f"ddp grad {name}", p.grad, p_ref.grad)
        for model_ in (reference, synced, ddp.module):
            model_.zero_grad()
        print(f"step {step} done", flush=True)

    for (name, buf), ref in zip(synced.named_buffers(), reference.buffers(), strict=True):
        note(f"buffer {name}", buf.double(), ref.double())
    for (name, buf), ref in zip(ddp.module.named_buffers(), reference.buffers(), strict=True):
        note(f"ddp buffer {name}", buf.double(), ref.double())
    reference.eval(), synced.eval()
    x = batches[0]
    note("eval output", synced(x[start:stop]), reference(x)[start:stop])

    failed = False
    for name, value in diffs.items():
        print(f"MAXDIFF {name} {value:.3g}", flush=True)
        if not value <= TOLERANCE:
            print(f"FAIL {name}: max difference {value:.3g} > {TOLERANCE}", flush=True)
            failed = True
    if failed:
        return 1
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
