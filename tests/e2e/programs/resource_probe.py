"""A task that reports, from inside, the resources it runs with: torch's thread pools, the
GPUs it may see, and the thread variables the launcher set. Workers go through tfl.Server
(which applies the resources); a ps task (run with --ps-runs-script) applies them directly,
since a ps Server would wait for training."""

from __future__ import annotations

import json
import os

import torch

import tensorfleet as tfl
from tensorfleet.worker.task_resources import apply_task_resources

task = tfl.resolve_task()
if task.job == "ps":
    applied = apply_task_resources()
else:
    applied = tfl.Server(task.cluster, task.job, task.index).resources
print(
    "RESOURCES "
    + json.dumps(
        {
            "task": f"{task.job}:{task.index}",
            "intra": torch.get_num_threads(),
            "inter": torch.get_num_interop_threads(),
            "applied_intra": applied.intra_op_threads,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "omp_spin": os.environ.get("GOMP_SPINCOUNT"),
            "cuda_devices": applied.cuda_devices,
        }
    ),
    flush=True,
)
