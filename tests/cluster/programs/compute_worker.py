"""A worker for the fast-compute test: a small CNN trained with ``ComputeOptions`` (and,
in the ps modes, bf16 gradients on the wire and the fused Adam), checkpoints in a directory.
The chief writes its losses, the loss of its initial and of its final parameters on the batch
every worker trains on, its parameter names and shapes and the global step to the JSON file
given.

    compute_worker.py OUT CHECKPOINT_DIR MODE STEPS [--channels-last] [--autocast bf16]
                      [--wire-dtype bf16] [--values-wire-dtype bf16] [--fused]

With ``--values-wire-dtype`` the chief also records, after each step, whether every float32
parameter held a bf16 value (what a push's reply brings), and whether, after the session,
its model held values bf16 cannot (the exact pull at the end).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.worker.compute_options import channels_last_strides

BATCH = 16


class SmallCNN(nn.Module):
    """The model of tests/unit/test_compute_options.py."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, kernel_size=5, padding=2)
        self.fc = nn.Linear(8 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("mode")
    parser.add_argument("steps", type=int)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--autocast", default=None)
    parser.add_argument("--wire-dtype", default=None)
    parser.add_argument("--values-wire-dtype", default=None)
    parser.add_argument("--fused", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tfl.resolve_task(argv=[])
    server = tfl.Server(task.cluster, task.job, task.index)
    torch.manual_seed(0)
    model = SmallCNN()
    generator = torch.Generator().manual_seed(5)  # one fixed batch: the loss must go down
    x = torch.randn(BATCH, 1, 8, 8, generator=generator)
    y = torch.randint(0, 3, (BATCH,), generator=generator)
    with torch.no_grad():  # the initial parameters' loss (the chief's are the ps's first values)
        initial_loss = F.cross_entropy(model(x), y).item()
    losses = []
    rounded_after_step: list[bool] = []
    with tfl.TrainingSession(
        server,
        model,
        optimizer=tfl.optim.Adam(lr=3e-3, fused=args.fused),
        mode=args.mode,
        hooks=[tfl.StopAtStep(last_step=args.steps)],
        checkpoint_dir=args.checkpoint_dir,
        progress_secs=None,
        wire_dtype=args.wire_dtype,
        values_wire_dtype=args.values_wire_dtype,
        compute=tfl.ComputeOptions(channels_last=args.channels_last, autocast=args.autocast),
    ) as sess:
        while not sess.should_stop():
            losses.append(sess.step(lambda: F.cross_entropy(sess.model(x), y)).loss)
            rounded_after_step.append(all(_is_bf16(p) for p in model.parameters()))
        stats = sess.cluster_stats()
    if sess.is_chief:
        with torch.no_grad():  # the values the session ended with: every worker's updates
            final_loss = F.cross_entropy(model(x), y).item()
        with open(args.out, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "initial_loss": initial_loss,
                    "final_loss": final_loss,
                    "rounded_after_step": rounded_after_step,
                    "exact_at_end": not all(_is_bf16(p) for p in model.parameters()),
                    "names": [[n, list(p.shape)] for n, p in model.named_parameters()],
                    "channels_last": all(
                        p.stride() == channels_last_strides(p)
                        for p in model.parameters()
                        if p.dim() == 4
                    ),
                    "refused": sum(s.get("refused", 0) for s in stats),
                },
                f,
            )
    return 0


def _is_bf16(param: torch.Tensor) -> bool:
    values = param.detach()
    return torch.equal(values.to(torch.bfloat16).float(), values)


if __name__ == "__main__":
    raise SystemExit(main())
