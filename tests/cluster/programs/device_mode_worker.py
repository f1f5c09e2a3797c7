"""A worker for the device tests of every update mode: a small model on DEVICE (``cpu`` or
``cuda``: every worker of the cluster computes on the same GPU, sharing it), trained for
STEPS global steps on exact_worker.py's deterministic data in one of the modes. The chief
writes the final state (parameters, persistent buffers, and a tfl.EmbeddingTable's rows
read back through a lookup) on the CPU, the device its parameters ended on, and the global
step, to OUT.

    device_mode_worker.py OUT CASE DEVICE STEPS

CASE: async | sync | backup | staleness | allreduce | replicas | stages | sparse | table | bn.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl

sys.path.insert(0, str(Path(__file__).parent))
from exact_worker import BATCH, CLASSES, FEATURES, HIDDEN, make_data, worker_batch  # noqa: E402, F401

#: Rows of the embedding cases; ids are drawn from the features.
ROWS, DIM = 40, 4
CASES = ("async", "sync", "backup", "staleness", "allreduce", "replicas", "stages", "sparse",
         "table", "bn")  # fmt: skip


class Embedded(nn.Module):
    """Each feature's bucket looked up in an embedding (nn.Embedding(sparse=True), or a
    tfl.EmbeddingTable held by the ps as rows), averaged, then a linear layer."""

    def __init__(self, table: bool) -> None:
        super().__init__()
        self.embedding: nn.Module = (
            tfl.EmbeddingTable(ROWS, DIM, initializer=tfl.RowInitializer("normal", 1.0, seed=3))
            if table
            else nn.Embedding(ROWS, DIM, sparse=True)
        )
        self.out = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = ((x * 7).floor().long() % ROWS).to(x.device)
        return self.out(self.embedding(ids).mean(1))


def make_model(case: str) -> nn.Module:
    """The model of ``case`` (seeded: every process builds the same one)."""
    torch.manual_seed(7)
    if case in ("sparse", "table"):
        return Embedded(table=case == "table")
    if case == "bn":
        return nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh(),
            nn.Linear(HIDDEN, CLASSES),
        )  # fmt: skip
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def session_options(case: str, device: str) -> dict:
    """The TrainingSession options of ``case``; engines put both replicas/stages on the GPU."""
    engine_devices = ["/gpu:0", "/gpu:0"] if device == "cuda" else ["/cpu:0", "/cpu:1"]
    return {
        "async": {"mode": "async"},
        "sync": {"mode": "sync"},
        "backup": {"mode": "sync", "replicas_to_aggregate": 1},
        "staleness": {"mode": "async", "max_staleness": 1},
        "allreduce": {"mode": "allreduce"},
        "replicas": {"mode": "sync", "replica_devices": engine_devices},
        "stages": {"mode": "sync", "stage_devices": engine_devices, "microbatches": 2},
        "sparse": {"mode": "sync"},
        "table": {"mode": "sync"},
        "bn": {"mode": "sync"},
    }[case]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("case", choices=CASES)
    parser.add_argument("device", choices=("cpu", "cuda"))
    parser.add_argument("steps", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tfl.resolve_task(argv=[])
    server = tfl.Server(task.cluster, task.job, task.index)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    model = make_model(args.case).to(device)
    x, y = make_data(args.steps, task.num_workers)
    with tfl.TrainingSession(
        server,
        model,
        optimizer=tfl.optim.SGD(lr=0.1),
        hooks=[tfl.StopAtStep(last_step=args.steps)],
        **session_options(args.case, args.device),
    ) as sess:
        while not sess.should_stop():
            xb, yb = worker_batch(x, y, sess.global_step, task.index, task.num_workers)
            xb, yb = xb.to(device), yb.to(device)
            sess.step(lambda xb=xb, yb=yb: F.cross_entropy(sess.model(xb), yb))
        if sess.is_chief:
            sess.pull()
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            if args.case == "table":
                model.eval()
                with torch.no_grad():
                    state["embedding.rows"] = model.embedding(torch.arange(ROWS, device=device))
            result = {
                "state": {k: v.cpu().double().tolist() for k, v in state.items()},
                "devices": sorted({p.device.type for p in model.parameters()}),
                "global_step": sess.global_step,
            }
            Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
