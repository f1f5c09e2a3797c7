"""A worker for the delta-checkpoint fault test: a table of raw ids (admission, expiry) and
a hashed table on the ps shards, checkpointed every 10 steps with
``full_checkpoint_every=3`` (a full checkpoint, then two deltas), a little sleep per step so
that a test has time to kill a ps between two checkpoints.

Usage: delta_table_worker.py CHECKPOINT_DIR RESULT_JSON LAST_STEP

Prints ``progress worker=I global_step=S`` every 10th global step. The chief writes
``{"global_step", "loss_before", "loss_after"}`` (the loss on a fixed batch) to RESULT_JSON.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl

DIM, VOCAB, BATCH = 8, 300, 32
STEP_SLEEP_S = 0.02
#: Raw ids over the int64 range; each one's label is a function of its place.
IDS = torch.randint(-(2**62), 2**62, (VOCAB,), generator=torch.Generator().manual_seed(1))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = tfl.EmbeddingTable(
            4 * VOCAB, DIM, ids="raw", admit_after=1, expire_after_steps=60,
            initializer=tfl.RowInitializer("normal", 0.5, seed=2),
            admission_filter=tfl.AdmissionFilter(10_000),  # its deltas: the counters changed
        )  # fmt: skip
        self.items = tfl.EmbeddingTable(VOCAB, DIM, initializer=tfl.RowInitializer("normal", 0.5))
        self.head = nn.Linear(2 * DIM, 3)

    def forward(self, places: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.users(IDS[places]), self.items(places)], -1))


def main() -> int:
    checkpoint_dir, result_path, last_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("tensorfleet.session").setLevel(logging.INFO)
    torch.set_num_threads(1)
    task = tfl.resolve_task()
    server = tfl.Server(task.cluster, task.job, task.index)
    torch.manual_seed(0)
    model = Net()
    generator = torch.Generator().manual_seed(10 + task.index)
    fixed = torch.arange(0, VOCAB, 3)
    with tfl.TrainingSession(
        server,
        model,
        optimizer=tfl.optim.Adam(lr=0.02),
        sparse_optimizer=tfl.optim.SparseRowRule("adagrad", {"lr": 0.3}),
        hooks=[tfl.StopAtStep(last_step=last_step)],
        checkpoint_dir=checkpoint_dir,
        save_checkpoint_steps=10,
        full_checkpoint_every=3,
        keep_checkpoints=3,
        timeouts=tfl.ClientTimeouts(ps_silence_s=5.0, recover_s=90.0),
    ) as sess:
        with torch.no_grad():
            before = F.cross_entropy(model(fixed), fixed % 3).item()
        while not sess.should_stop():
            places = torch.randint(0, VOCAB, (BATCH,), generator=generator)
            result = sess.step(lambda places=places: F.cross_entropy(model(places), places % 3))
            if result.made_step and result.global_step % 10 == 0:
                print(f"progress worker={task.index} global_step={result.global_step}", flush=True)
            time.sleep(STEP_SLEEP_S)
        if sess.is_chief:
            sess.pull()
            with torch.no_grad():
                after = F.cross_entropy(model(fixed), fixed % 3).item()
            with open(result_path, "w") as f:
                json.dump(
                    {"global_step": sess.global_step, "loss_before": before, "loss_after": after},
                    f,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
