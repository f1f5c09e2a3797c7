"""A worker for the exactness tests: a small deterministic MLP trained for a fixed number of
steps on a deterministic dataset, each worker on its own slice of every global batch.
The chief writes the final parameters (and the ps's stats) to the JSON file given.

    exact_worker.py OUT MODE RULE STEPS [--clip C] [--ema D] [--replicas K]
                    [--max-staleness S] [--slow-worker I --slow-seconds T] [--step-seconds T]
                    [--checkpoint-dir DIR --checkpoint-steps N] [--stop-at N] [--hidden H]
                    [--step-lr N]

STEPS sizes the dataset; training stops at global step STEPS, or at --stop-at.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl

FEATURES, HIDDEN, CLASSES, BATCH = 6, 16, 3, 8


def make_model(hidden: int = HIDDEN) -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, CLASSES))


def make_data(steps: int, num_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    n = (steps + 16) * num_workers * BATCH  # async may run a few steps past the last
    return torch.randn(n, FEATURES, generator=generator), torch.randint(
        0, CLASSES, (n,), generator=generator
    )


def rule(name: str) -> tfl.optim.UpdateRule:
    return tfl.optim.SGD(lr=0.1) if name == "sgd" else tfl.optim.Adam(lr=0.01)


def worker_batch(
    x: torch.Tensor, y: torch.Tensor, step: int, worker: int, num_workers: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s slice of global batch ``step`` (global batches are consecutive)."""
    start = (step * num_workers + worker) * BATCH
    return x[start : start + BATCH], y[start : start + BATCH]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode")
    parser.add_argument("rule")
    parser.add_argument("steps", type=int)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--ema", type=float, default=None)
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--max-staleness", type=int, default=None)
    parser.add_argument("--slow-worker", type=int, default=None)
    parser.add_argument("--slow-seconds", type=float, default=0.0)
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, help="every worker's extra time per step"
    )
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-steps", type=int, default=None)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument(
        "--hidden", type=int, default=HIDDEN, help="hidden units (wide: payloads of 100s of KB)"
    )
    parser.add_argument(
        "--step-lr", type=int, default=None, help="halve the learning rate every N steps (StepLR)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tfl.resolve_task(argv=[])
    server = tfl.Server(task.cluster, task.job, task.index)
    model = make_model(args.hidden)
    x, y = make_data(args.steps, task.num_workers)
    with tfl.TrainingSession(
        server, model, optimizer=rule(args.rule), mode=args.mode,
        hooks=[tfl.StopAtStep(last_step=args.stop_at or args.steps)], clip_grad_norm=args.clip, ema_decay=args.ema,
        replicas_to_aggregate=args.replicas, max_staleness=args.max_staleness,
        checkpoint_dir=args.checkpoint_dir, save_checkpoint_steps=args.checkpoint_steps,
    ) as sess:  # fmt: skip
        made, dropped = 0, 0
        schedule = (
            None
            if args.step_lr is None
            else torch.optim.lr_scheduler.StepLR(sess.optimizer, args.step_lr, gamma=0.5)
        )
        while not sess.should_stop():
            xb, yb = worker_batch(x, y, sess.global_step, task.index, task.num_workers)
            result = sess.step(lambda xb=xb, yb=yb: F.cross_entropy(sess.model(xb), yb))
            made, dropped = made + result.made_step, dropped + result.dropped
            if schedule is not None:
                schedule.step()
            time.sleep(args.slow_seconds if task.index == args.slow_worker else args.step_seconds)
        print(
            json.dumps({"task": str(task.task_id), "made_steps": made, "dropped": dropped}),
            flush=True,
        )
        if sess.is_chief:
            sess.pull()
            result = {
                "params": {k: v.detach().tolist() for k, v in model.state_dict().items()},
                "global_step": sess.global_step,
                "stats": sess.cluster_stats(),
            }
            if args.ema is not None:
                result["ema"] = {k: v.tolist() for k, v in sess.moving_average().items()}
            with open(args.out, "w") as f:
                json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
