"""Plain PyTorch DistributedDataParallel on the CNN, no tensorfleet: the baseline for the
all-reduce mode. One process per worker; rank and rendezvous come from TF_CONFIG (as the
local launcher sets it). The chief prints one JSON line with its steady-state steps/s.

    tensorfleet launch --ps 0 --workers 3 -- .venv/bin/python benchmarks/ddp_baseline.py --steps 300
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cnn_training import WARMUP_STEPS  # noqa: E402  (the same warm-up as tensorfleet's runs)
from mnist_cnn import ClassicCNN  # noqa: E402

from tensorfleet.datasets import BatchStream, load_mnist, normalize  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=300, help=f"steps, the first {WARMUP_STEPS} not timed"
    )
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(
            f"--steps {args.steps} leaves no step to time: the first {WARMUP_STEPS} are the "
            f"warm-up; pass --steps {WARMUP_STEPS + 1} or more"
        )
    if "TF_CONFIG" not in os.environ:
        parser.error(
            "TF_CONFIG is not set: run it under the launcher, e.g. `tensorfleet launch --ps 0 "
            "--workers 3 -- .venv/bin/python benchmarks/ddp_baseline.py --steps 300`"
        )
    config = json.loads(os.environ["TF_CONFIG"])
    workers = config["cluster"]["worker"]
    rank, world = config["task"]["index"], len(workers)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{workers[0]}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    images, labels = load_mnist("fashion-mnist", None, "train")
    batches = BatchStream(normalize(images), labels, 50, shard_index=rank, num_shards=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(ClassicCNN())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    start = 0.0
    for step in range(args.steps):
        if step == WARMUP_STEPS:
            start = time.perf_counter()
        x, y = next(batches)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"steps_per_s": (args.steps - WARMUP_STEPS) / elapsed}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
