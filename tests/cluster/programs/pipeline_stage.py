"""One stage of a 2-stage pipeline across processes, for tests/cluster/test_remote_pipeline.py.

Trains the test MLP (same seed as the reference) for --steps steps of SGD on its stage's
parameters and writes, per step, the last stage's outputs and loss and this stage's gradients,
then its final parameters, to a safetensors file. --exchange: only the leader (stage 0) updates, with the whole model: the follower sends its
gradients there and receives its new values (as a pipeline sharing the ps does).
--die-at-step K: exit abruptly (os._exit)
just before step K's forward, to test that the other stage stops with an error naming it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from tensorfleet.parallel.errors import PipelineFailed
from tensorfleet.parallel.remote_pipeline import RemotePipelineStage, join_process_group
from tensorfleet.parallel.stage_exchange import (
    StageControl,
    StageExchange,
    stage_parameter_names,
)
from tensorfleet.parallel.stages import split_stages


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 10),
    )


def make_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(batch, 32), torch.randint(0, 10, (batch,))) for _ in range(steps)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--die-at-step", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--exchange", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    join_process_group(args.rendezvous, args.rank, 2, timeout_s=args.timeout)
    model = make_model()
    stages = split_stages(model, boundaries=[4])
    stage = RemotePipelineStage(
        stages[args.rank],
        args.rank,
        2,
        n_microbatches=4,
        loss_fn=F.cross_entropy,
        schedule=args.schedule,
        stage_tasks=["worker:0", "worker:1"],
    )
    exchange = None
    if args.exchange:
        names = stage_parameter_names(stages)
        params = dict(
            model.named_parameters() if args.rank == 0 else stage.module.named_parameters()
        )
        exchange = StageExchange(
            names, args.rank, params, stage_names=["stage 0 (worker:0)", "stage 1 (worker:1)"]
        )
    updated = model.parameters() if args.exchange else stage.module.parameters()
    opt = torch.optim.SGD(updated, lr=0.1)
    record: dict[str, torch.Tensor] = {}
    try:
        for step, (x, y) in enumerate(make_batches(args.steps, 32)):
            if step == args.die_at_step:
                print(f"stage {args.rank} dying at step {step}", flush=True)
                os._exit(3)
            result = stage.step(x if args.rank == 0 else None, y if args.rank == 1 else None)
            if result is not None:
                record[f"outputs/{step}"] = result.outputs
                record[f"loss/{step}"] = result.loss.reshape(1)
            if exchange is not None:
                exchange.gather_gradients()
                if args.rank == 0:
                    opt.step()
                control = exchange.scatter_values(StageControl(step + 1, False, True))
                assert control.global_step == step + 1, control
            else:
                for name, p in stage.module.named_parameters():
                    record[f"grad/{step}/{name}"] = p.grad.clone()
                opt.step()
    except PipelineFailed as exc:
        print(f"PIPELINE FAILED: {exc}", file=sys.stderr, flush=True)
        return 4
    if exchange is not None and args.rank == 0:
        for name, p in model.named_parameters():
            record[f"leader/{name}"] = p.detach().clone()
    for name, p in stage.module.named_parameters():
        record[f"param/{name}"] = p.detach().clone()
    save_file(record, args.out)
    torch.distributed.destroy_process_group()
    print(f"stage {args.rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
