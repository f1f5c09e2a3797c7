"""One task of a pipeline across processes driven by its leader (the step-closure API), for
tests/cluster/test_driven_pipeline.py. Rank 0 is the leader: it trains the whole model with
SGD for --steps steps, calling the pipeline like a module, and writes per step the outputs and
the whole model's gradients, then the final parameters. Other ranks serve their stage and
write their final parameters. --die-at-step K (a stage): exit abruptly at step K."""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tensorfleet.parallel.driven_pipeline import PipelineLeader, PipelinePlan, serve_stage
from tensorfleet.parallel.errors import PipelineFailed
from tensorfleet.parallel.remote_pipeline import join_process_group
from tensorfleet.parallel.stage_exchange import StageControl

sys.path.insert(0, os.path.dirname(__file__))
from pipeline_stage import make_batches, make_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--die-at-step", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    join_process_group(args.rendezvous, args.rank, args.world, timeout_s=20)
    names = [f"stage {i} (worker:{i})" for i in range(args.world)]
    model = make_model()
    if args.rank != 0:  # a stage's own initial values are overwritten by the leader's
        with torch.no_grad():
            for p in model.parameters():
                p.uniform_(-1, 1)
    record: dict[str, torch.Tensor] = {}
    try:
        if args.rank == 0:
            boundaries = (4,) if args.world == 2 else (2, 4)
            leader = PipelineLeader(model, PipelinePlan(boundaries, 4, tuple(names)))
            leader.configure()
            leader.send_values(StageControl(0, False, False))
            module = leader.module()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step, (x, y) in enumerate(make_batches(args.steps, 32)):
                opt.zero_grad()
                out = module(x)
                F.cross_entropy(out, y).backward()
                leader.gather_gradients()
                record[f"outputs/{step}"] = out.detach()
                for name, p in model.named_parameters():
                    record[f"grad/{step}/{name}"] = p.grad.clone()
                opt.step()
                leader.send_values(StageControl(step + 1, False, True))
            leader.end()
        else:
            if args.die_at_step >= 0:  # die in the middle of a step's forward pass
                calls = {"n": 0}

                def die_at(module, inputs):  # type: ignore[no-untyped-def]
                    if calls["n"] == args.die_at_step * 4 + 1:  # 4 micro-batches per step
                        print(f"stage {args.rank} dying at step {args.die_at_step}", flush=True)
                        os._exit(3)
                    calls["n"] += 1

                model[-1].register_forward_pre_hook(die_at)
            steps = serve_stage(model, args.rank, names)
            print(f"served {steps} steps", flush=True)
    except PipelineFailed as exc:
        print(f"PIPELINE FAILED: {exc}", file=sys.stderr, flush=True)
        return 4
    for name, p in model.named_parameters():
        record[f"param/{name}"] = p.detach().clone()
    save_file(record, args.out)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
