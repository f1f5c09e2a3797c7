"""A worker for the device-engine exactness tests: exact_worker.py's model and data, trained
in sync mode with one of the engines. Every ps replica (a worker, or a pipeline's leader)
takes its slice of each global batch; the chief writes the final parameters to OUT.

    exact_engine_worker.py OUT ENGINE RULE STEPS      ENGINE: replicas | local_pipeline | task_pipeline
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import tensorfleet as tfl

sys.path.insert(0, os.path.dirname(__file__))
from exact_worker import make_data, make_model, rule, worker_batch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("engine", choices=("replicas", "local_pipeline", "task_pipeline"))
    parser.add_argument("rule")
    parser.add_argument("steps", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tfl.resolve_task(argv=[])
    server = tfl.Server(task.cluster, task.job, task.index)
    model = make_model()
    if tfl.pipeline_stage_of(server) != 0:
        tfl.serve_pipeline_stage(server, model)
        return 0
    replicas = task.num_workers // server.pipeline_stages
    replica = task.index // server.pipeline_stages
    options = {
        "replicas": {"replica_devices": ["/cpu:0", "/cpu:1"]},
        "local_pipeline": {"stage_devices": ["/cpu:0", "/cpu:1"], "microbatches": 4},
        "task_pipeline": {"microbatches": 4},
    }[args.engine]
    x, y = make_data(args.steps, replicas)
    with tfl.TrainingSession(
        server, model, optimizer=rule(args.rule), mode="sync",
        hooks=[tfl.StopAtStep(last_step=args.steps)], **options,
    ) as sess:  # fmt: skip
        while not sess.should_stop():
            xb, yb = worker_batch(x, y, sess.global_step, replica, replicas)
            sess.step(lambda xb=xb, yb=yb: F.cross_entropy(sess.model(xb), yb))
        if sess.is_chief:
            sess.pull()
            result = {
                "params": {k: v.detach().tolist() for k, v in model.state_dict().items()},
                "global_step": sess.global_step,
            }
            with open(args.out, "w") as f:
                json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
