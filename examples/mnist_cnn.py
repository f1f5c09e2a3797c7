"""The classic distributed CNN example, on tensorfleet.

One script for every task. On one machine:

    tensorfleet launch --ps 1 --workers 3 -- python examples/mnist_cnn.py --steps 3000

On several machines, run it on each with the cluster and the task's identity (and the same
secret everywhere: ``TENSORFLEET_SECRET``, or ``--secret-file PATH``; ``--encrypt`` on every
task encrypts the traffic):

    python examples/mnist_cnn.py --cluster '{"ps": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}' \\
        --job_name worker --task_index 0

or with the classic host lists instead of ``--cluster`` (``--ps_hosts=h0:2222
--worker_hosts=h1:2222,h2:2222``), or with ``TF_CONFIG`` set (Kubeflow's TFJob does that), or
under Slurm. Without any of these it trains in this one process. Data: MNIST-format idx files
(Fashion-MNIST by default).

With ``--logdir DIR`` the chief keeps checkpoints in ``DIR/checkpoints`` (every
``--checkpoint-steps`` global steps and at the end), writes TensorBoard scalars and
``DIR/metrics.jsonl`` and, at the end, the curves in ``DIR/metrics.png``. Running the same
command again resumes from the newest checkpoint (every worker also resumes its place in its
data); ``--fresh`` deletes ``DIR`` first and starts over.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.datasets import BatchStream, load_mnist, normalize
from tensorfleet.launch.task_flags import add_security_flags, task_security

#: The classic Distributed TensorFlow flags, passed on to tfl.resolve_task.
CLASSIC_FLAGS = ("job_name", "task_index", "cluster", "ps_hosts", "worker_hosts", "chief_hosts")


class ClassicCNN(nn.Module):
    """conv 5x5x32, max-pool, conv 5x5x64, max-pool, fc 500, fc 10, initialized as the
    TensorFlow version is: weights normal with std sqrt(2 / fan_in) (He), biases zero."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(7 * 7 * 64, 500)
        self.fc2 = nn.Linear(500, 10)
        for layer in (self.conv1, self.conv2, self.fc1, self.fc2):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")  # std sqrt(2 / fan_in)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def gradient_age(text: str) -> int | str:
    """``--max-gradient-age``: ``auto``, ``off`` or a whole number (the session checks it)."""
    return text if text in ("auto", "off") else int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = p.add_argument
    add("--steps", type=int, default=3000, help="global steps to train")
    add("--batch", type=int, default=50, help="batch size per worker step")
    add("--lr", type=float, default=1e-4, help="Adam learning rate")
    add("--dataset", choices=("fashion-mnist", "mnist"), default="fashion-mnist")
    add("--data-dir", default=None, help="directory with the four idx(.gz) files")
    add("--train-limit", type=int, default=None, help="use the first N training examples")
    add("--test-limit", type=int, default=None, help="evaluate on the first N test examples")
    add("--log-every", type=int, default=100, help="a progress line every N global steps")
    add("--progress-secs", type=float, default=10.0, help="chief: a progress line every S s")
    add("--threads", type=int, default=None, help="torch threads (2 alone, 1 in a cluster)")
    add("--seed", type=int, default=0)
    add("--device", default="/cpu:0", help="where this worker computes, e.g. /gpu:0")
    add("--mode", choices=("async", "sync", "allreduce"), default="async")
    add("--replicas-to-aggregate", type=int, default=None, help="sync: gradients per step")
    add("--max-staleness", type=int, default=None, help="async: bound on the fastest's lead")
    add(
        "--max-gradient-age",
        type=gradient_age,
        default=None,
        help="async: drop a push computed on values more than N updates old; 'auto' (the "
        "default: 16 per worker, at least 64) or 'off'",
    )
    add("--placement", choices=("greedy", "round_robin"), default="greedy")
    add("--log-placement", action="store_true", help="print where each variable lives")
    add("--logdir", type=Path, default=None, help="checkpoints, summaries, curves; resumes")
    add("--checkpoint-steps", type=int, default=500, help="checkpoint every N global steps")
    add("--summary-steps", type=int, default=100, help="summaries every N global steps")
    add("--fresh", action="store_true", help="delete --logdir first: start over")
    add("--timeline", type=Path, default=None, help="Chrome trace per task: FILE.<task>.json")
    add("--channels-last", action="store_true", help="compute in channels-last memory order")
    add("--compile", action="store_true", help="torch.compile the model (slower here: see docs)")
    add("--autocast", choices=("bf16",), default=None, help="forward pass in bf16 autocast")
    add(
        "--fused-optimizer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch's fused Adam kernel: the default where torch has it (--no-fused-optimizer: "
        "torch's default kernel, bit for bit a plain torch.optim.Adam)",
    )
    add("--wire-dtype", choices=("bf16",), default=None, help="gradients sent as bf16 (ps modes)")
    add(
        "--values-wire-dtype",
        choices=("bf16",),
        default=None,
        help="the values in each push's reply sent as bf16 (ps modes)",
    )
    add(
        "--bucket-bytes",
        type=int,
        default=tfl.Overlap().bucket_bytes,
        help="async: push the gradients during the backward in buckets of N bytes; 0: after it",
    )
    add(
        "--prefetch",
        action="store_true",
        help="async: the next forward starts before the last reply (at most one step stale)",
    )
    add("--job_name", default=None)  # the classic flags, read by tfl.resolve_task
    add("--task_index", default=None)
    add("--cluster", default=None, help="cluster spec: JSON text or a JSON file")
    add("--ps_hosts", default=None, help="instead of --cluster: the ps tasks' h:p,h:p,...")
    add("--worker_hosts", default=None, help="instead of --cluster: the workers' h:p,h:p,...")
    add("--chief_hosts", default=None, help="instead of --cluster: the chief's h:p")
    add_security_flags(p)  # --secret-file, --encrypt: as `tensorfleet server` has them
    return p


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


@dataclass(frozen=True)
class Result:
    """What the chief reports at the end."""

    test_accuracy: float
    global_step: int
    workers: int


def train(args: argparse.Namespace, extra_hooks: Sequence[tfl.Hook] = ()) -> Result | None:
    """Run this task (a ps serves; a worker trains); the chief's result, None elsewhere."""
    # What does not depend on which task this is comes before resolve_task: the data and the
    # layers of tensorfleet a worker uses (imported on first use). A warm spare of
    # `tensorfleet launch` (--spares) has done it all when it takes over a worker that died.
    images, labels = load_mnist(args.dataset, args.data_dir, "train")
    images, labels = images[: args.train_limit], labels[: args.train_limit]
    # Standardized inputs (statistics of the training set) converge faster than [0, 1] ones.
    train_images = normalize(images)
    mean, std = train_images.mean(), train_images.std()
    train_images = (train_images - mean) / std
    for name in ("Server", "TrainingSession", "StopAtStep", "LoggingHook", "ProgressHook"):
        getattr(tfl, name)

    classic = [f"--{k}={v}" for k in CLASSIC_FLAGS if (v := getattr(args, k))]
    task = tfl.resolve_task(argv=classic, allow_none=True)
    torch.set_num_threads(args.threads or (2 if task is None else 1))
    server = None
    if task is not None:
        if task.job == "ps":  # the lines `tensorfleet server` prints (Python shows WARNING only)
            logging.basicConfig(level=logging.INFO, format="%(message)s")
        security = task_security(args)  # --secret-file, --encrypt: as tensorfleet server reads them
        server = tfl.Server(
            task.cluster, task.job, task.index,
            secret=security.secret, config=tfl.ServerConfig(encrypt=security.encrypt),
        )  # fmt: skip
        if task.job == "ps":
            server.join()
            return None
    elif args.secret_file is not None or args.encrypt:
        print("--secret-file and --encrypt are ignored: no cluster, one process", flush=True)

    worker_index = task.index if task is not None else 0
    num_workers = task.num_workers if task is not None else 1
    is_chief = server is None or server.is_chief

    batches = BatchStream(
        train_images, labels, args.batch,
        shard_index=worker_index, num_shards=num_workers, seed=args.seed,
    )  # fmt: skip

    device = tfl.torch_device(args.device)
    torch.manual_seed(args.seed)
    model = ClassicCNN().to(device)

    def progress_line(sess: tfl.TrainingSession, result: tfl.StepResult) -> str:
        return f"Worker: {worker_index}, Step: {result.global_step}, Accuracy (batch): {result.aux:.2f}"

    hooks: list[tfl.Hook] = [
        tfl.StopAtStep(last_step=args.steps),
        tfl.LoggingHook(args.log_every, progress_line, print_fn=lambda s: print(s, flush=True)),
        *extra_hooks,
        tfl.ProgressHook(args.progress_secs),  # chief only; the last step is StopAtStep's
    ]
    checkpoints: dict[str, object] = {}
    if args.logdir is not None:
        if args.fresh and is_chief and args.logdir.exists():
            shutil.rmtree(args.logdir)
            print(f"--fresh: deleted {args.logdir}", flush=True)
        hooks.append(
            tfl.SummaryHook(args.logdir, args.summary_steps, metrics=lambda r: {"accuracy": r.aux})
        )
        checkpoints = {  # every mode checkpoints: the ps shards, the replicas, or this process
            "checkpoint_dir": args.logdir / "checkpoints",
            "save_checkpoint_steps": args.checkpoint_steps,
            "data": batches,  # each worker's place in its data is saved and resumed
        }
    result = None
    with tfl.TrainingSession(
        server, model, optimizer=tfl.optim.Adam(lr=args.lr, fused=args.fused_optimizer),
        mode=args.mode, hooks=hooks, replicas_to_aggregate=args.replicas_to_aggregate,
        max_staleness=args.max_staleness, placement=args.placement,
        max_gradient_age=args.max_gradient_age if args.mode == "async" else None,
        log_placement=args.log_placement, timeline=args.timeline, wire_dtype=args.wire_dtype,
        values_wire_dtype=args.values_wire_dtype,
        compute=tfl.ComputeOptions(args.channels_last, args.compile, args.autocast),
        overlap=tfl.Overlap(bucket_bytes=args.bucket_bytes or None, prefetch=args.prefetch),
        **checkpoints,
    ) as sess:  # fmt: skip
        while not sess.should_stop():
            x, y = (t.to(device) for t in next(batches))

            def loss_and_accuracy(x=x, y=y) -> tuple[torch.Tensor, float]:  # noqa: ANN001
                logits = sess.model(x)  # the DDP wrapper in allreduce mode
                return F.cross_entropy(logits, y), float((logits.argmax(1) == y).float().mean())

            sess.step(loss_and_accuracy)
        if sess.is_chief:
            final_step = sess.pull()
            test_images, test_labels = load_mnist(args.dataset, args.data_dir, "test")
            test_images, test_labels = (
                test_images[: args.test_limit],
                test_labels[: args.test_limit],
            )
            test = (normalize(test_images) - mean) / std
            accuracy = evaluate(model, test.to(device), test_labels.to(device))
            print(f"Test accuracy: {accuracy:.4f} (global step {final_step})", flush=True)
            result = Result(accuracy, final_step, num_workers)
    # The session has closed: the summary hook wrote its last point, the chief its final checkpoint.
    if is_chief and args.logdir is not None and (args.logdir / "metrics.jsonl").exists():
        try:
            print(f"Curves: {tfl.plot_metrics(args.logdir)}", flush=True)
        except ImportError as error:  # matplotlib is optional
            print(f"no curves: {error}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    train(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except tfl.TensorfleetError as error:  # a misconfiguration: one clear line, no traceback
        print(f"mnist_cnn.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
