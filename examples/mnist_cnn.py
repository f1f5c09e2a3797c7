"""The classic distributed CNN example, on tensorfleet.

One script for every task. On one machine:

    tensorfleet launch --ps 1 --workers 3 -- python examples/mnist_cnn.py --steps 3000

On several machines, run it on each with the cluster and the task's identity (and the same
``TENSORFLEET_SECRET`` everywhere):

    python examples/mnist_cnn.py --cluster '{"ps": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}' \\
        --job_name worker --task_index 0

or with ``TF_CONFIG`` set (Kubeflow's TFJob does that), or under Slurm. Without any of these it
trains in this one process. Data: MNIST-format idx files (Fashion-MNIST by default).

With ``--logdir DIR`` the chief keeps checkpoints in ``DIR/checkpoints`` (every
``--checkpoint-steps`` global steps and at the end), writes TensorBoard scalars and
``DIR/metrics.jsonl`` and, at the end, the curves in ``DIR/metrics.png``. Running the same
command again resumes from the newest checkpoint (every worker also resumes its place in its
data); ``--fresh`` deletes ``DIR`` first and starts over.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.datasets import BatchStream, load_mnist, normalize

#: Local steps after which the chief starts its steady-state throughput clock.
WARMUP_STEPS = 20


class ClassicCNN(nn.Module):
    """conv 5x5x32, max-pool, conv 5x5x64, max-pool, fc 500, fc 10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(7 * 7 * 64, 500)
        self.fc2 = nn.Linear(500, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=3000, help="global steps to train (default 3000)")
    p.add_argument("--batch", type=int, default=50, help="batch size per worker step (default 50)")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate (default 1e-4)")
    p.add_argument("--dataset", choices=("fashion-mnist", "mnist"), default="fashion-mnist")
    p.add_argument("--data-dir", default=None, help="directory with the four idx(.gz) files")
    p.add_argument(
        "--train-limit", type=int, default=None, help="use only the first N training examples"
    )
    p.add_argument(
        "--test-limit", type=int, default=None, help="evaluate on the first N test examples"
    )
    p.add_argument(
        "--log-every", type=int, default=100, help="print a progress line every N global steps"
    )
    p.add_argument(
        "--progress-secs",
        type=float,
        default=10.0,
        help="the chief prints its progress (step, bar, steps/s, time left) every S seconds",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: 2 alone, 1 in a cluster)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        default="/cpu:0",
        help="where this worker computes, e.g. /gpu:0 (default /cpu:0)",
    )
    p.add_argument(
        "--mode",
        choices=("async", "sync", "allreduce"),
        default="async",
        help="update discipline (default async)",
    )
    p.add_argument(
        "--replicas-to-aggregate",
        type=int,
        default=None,
        help="sync: gradients per step (fewer than the workers makes backups)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="async: bound on how far the fastest worker runs ahead",
    )
    p.add_argument(
        "--straggler",
        type=int,
        default=None,
        metavar="INDEX",
        help="slow this worker down (benchmarks)",
    )
    p.add_argument(
        "--straggler-slowdown",
        type=float,
        default=4.0,
        help="how many times slower the straggler computes",
    )
    p.add_argument("--placement", choices=("greedy", "round_robin"), default="greedy")
    p.add_argument("--log-placement", action="store_true", help="print where each variable lives")
    p.add_argument(
        "--metrics-json", type=Path, default=None, help="the chief writes its final figures here"
    )
    p.add_argument(
        "--logdir",
        type=Path,
        default=None,
        help="checkpoints, TensorBoard scalars, metrics.jsonl and metrics.png go here; the run "
        "resumes from its newest checkpoint",
    )
    p.add_argument(
        "--checkpoint-steps", type=int, default=500, help="checkpoint every N global steps"
    )
    p.add_argument(
        "--summary-steps", type=int, default=100, help="write summaries every N global steps"
    )
    p.add_argument(
        "--fresh", action="store_true", help="delete --logdir first: start over, do not resume"
    )
    # The classic flags; tfl.resolve_task reads them from this list.
    p.add_argument("--job_name", default=None)
    p.add_argument("--task_index", default=None)
    p.add_argument("--cluster", default=None, help="cluster spec: JSON text or a JSON file")
    return p.parse_args(argv)


def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy of ``model`` on a whole dataset, in batches of 1000."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(labels), 1000):
            logits = model(images[start : start + 1000])
            correct += int((logits.argmax(1) == labels[start : start + 1000]).sum())
    model.train()
    return correct / len(labels)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    classic = [
        f"--{k}={v}"
        for k, v in (
            ("job_name", args.job_name),
            ("task_index", args.task_index),
            ("cluster", args.cluster),
        )
        if v is not None
    ]
    task = tfl.resolve_task(argv=classic, allow_none=True)

    if task is not None and task.job == "ps":
        torch.set_num_threads(args.threads or 1)
        tfl.Server(task.cluster, task.job, task.index).join()
        return 0

    torch.set_num_threads(args.threads or (2 if task is None else 1))
    server = tfl.Server(task.cluster, task.job, task.index) if task is not None else None
    worker_index = task.index if task is not None else 0
    num_workers = task.num_workers if task is not None else 1

    images, labels = load_mnist(args.dataset, args.data_dir, "train")
    if args.train_limit:
        images, labels = images[: args.train_limit], labels[: args.train_limit]
    # Standardized inputs (statistics of the training set) converge faster than [0, 1] ones.
    train = normalize(images)
    mean, std = train.mean(), train.std()
    batches = BatchStream(
        (train - mean) / std,
        labels,
        args.batch,
        shard_index=worker_index,
        num_shards=num_workers,
        seed=args.seed,
    )

    device = tfl.torch_device(args.device)
    torch.manual_seed(args.seed)
    model = ClassicCNN().to(device)

    def progress_line(sess: tfl.TrainingSession, result: tfl.StepResult) -> str:
        return f"Worker: {worker_index}, Step: {result.global_step}, Accuracy (batch): {result.aux:.2f}"

    hooks: list[tfl.Hook] = [
        tfl.StopAtStep(last_step=args.steps),
        tfl.LoggingHook(args.log_every, progress_line, print_fn=lambda s: print(s, flush=True)),
        tfl.ProgressHook(args.progress_secs),  # chief only; the last step is StopAtStep's
    ]
    checkpoints: dict[str, object] = {}
    is_chief = server is None or server.is_chief
    if args.logdir is not None:
        if args.fresh and is_chief and args.logdir.exists():
            shutil.rmtree(args.logdir)
            print(f"--fresh: deleted {args.logdir}", flush=True)
        hooks.append(
            tfl.SummaryHook(args.logdir, args.summary_steps, metrics=lambda r: {"accuracy": r.aux})
        )
        # Every mode checkpoints: the ps shards, all-reduce replicas, or this one process.
        checkpoints = {
            "checkpoint_dir": args.logdir / "checkpoints",
            "save_checkpoint_steps": args.checkpoint_steps,
            "data": batches,  # each worker's place in its data is saved and resumed
        }
    started = time.perf_counter()
    local_steps = 0
    steady_from: tuple[float, int] | None = None  # (time, global step) after the warm-up steps
    slow = args.straggler is not None and args.straggler == worker_index
    with tfl.TrainingSession(
        server,
        model,
        optimizer=tfl.optim.Adam(lr=args.lr),
        mode=args.mode,
        hooks=hooks,
        replicas_to_aggregate=args.replicas_to_aggregate,
        max_staleness=args.max_staleness,
        placement=args.placement,
        log_placement=args.log_placement,
        **checkpoints,
    ) as sess:
        first_step = sess.global_step
        while not sess.should_stop():
            x, y = (t.to(device) for t in next(batches))

            def loss_and_accuracy(
                x: torch.Tensor = x, y: torch.Tensor = y
            ) -> tuple[torch.Tensor, float]:
                logits = sess.model(x)  # the DDP wrapper in allreduce mode
                return F.cross_entropy(logits, y), float((logits.argmax(1) == y).float().mean())

            step_started = time.perf_counter()
            result = sess.step(loss_and_accuracy)
            if slow:  # a straggler: as if its hardware were this many times slower
                time.sleep((args.straggler_slowdown - 1) * (time.perf_counter() - step_started))
            local_steps += 1
            if local_steps == WARMUP_STEPS:
                steady_from = (time.perf_counter(), result.global_step)
        elapsed = time.perf_counter() - started
        if sess.is_chief:
            final_step = sess.pull()
            test_images, test_labels = load_mnist(args.dataset, args.data_dir, "test")
            if args.test_limit:
                test_images, test_labels = (
                    test_images[: args.test_limit],
                    test_labels[: args.test_limit],
                )
            test = (normalize(test_images) - mean) / std
            accuracy = evaluate(model, test.to(device), test_labels.to(device))
            print(
                f"Test accuracy: {accuracy:.4f} (global step {final_step}, {elapsed:.1f} s)",
                flush=True,
            )
            if args.metrics_json:
                steady_s, steady_step = steady_from if steady_from else (started, first_step)
                figures = {
                    "global_steps": final_step - first_step,
                    "seconds": elapsed,
                    "global_steps_per_s": (final_step - first_step) / elapsed,
                    "steady_global_steps_per_s": (final_step - steady_step)
                    / (started + elapsed - steady_s),
                    "chief_local_steps": local_steps,
                    "test_accuracy": accuracy,
                    "workers": num_workers,
                    "mode": args.mode,
                }
                args.metrics_json.write_text(json.dumps(figures))
    # After the session closed: the summary hook wrote its last point, the chief its final
    # checkpoint.
    if is_chief and args.logdir is not None and (args.logdir / "metrics.jsonl").exists():
        try:
            print(f"Curves: {tfl.plot_metrics(args.logdir)}", flush=True)
        except ImportError as error:  # matplotlib is optional
            print(f"no curves: {error}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except tfl.TensorfleetError as error:  # a misconfiguration: one clear line, no traceback
        print(f"mnist_cnn.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
