"""What the three device examples share: the MLP, the Fashion-MNIST batches of a worker, the
command-line options, and the accuracy on the test set.

The MLP is an ``nn.Sequential`` (784-512-512-256-10), so that a pipeline can cut it into
stages; its parameters are the same whichever pattern trains it.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.datasets import BatchStream, load_mnist, normalize


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=300, help="global steps to train")
    p.add_argument("--batch", type=int, default=64, help="batch size of each worker")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--data-dir", default=None, help="where the Fashion-MNIST files are")
    p.add_argument("--mode", default="async", help="update mode: async or sync (with ps tasks)")
    return p


def batches(args: argparse.Namespace, shard: int, shards: int) -> BatchStream:
    images, labels = load_mnist("fashion-mnist", args.data_dir, "train")
    train = normalize(images)
    mean, std = train.mean(), train.std()
    return BatchStream(
        (train - mean) / std, labels, args.batch, shard_index=shard, num_shards=shards
    )


def test_accuracy(model: nn.Module, args: argparse.Namespace) -> float:
    images, labels = load_mnist("fashion-mnist", args.data_dir, "test")
    train_images, _ = load_mnist("fashion-mnist", args.data_dir, "train")
    reference = normalize(train_images)
    x = (normalize(images) - reference.mean()) / reference.std()
    model.eval()
    with torch.no_grad():
        correct = sum(
            int((model(x[i : i + 1000]).argmax(1) == labels[i : i + 1000]).sum())
            for i in range(0, len(labels), 1000)
        )
    return correct / len(labels)


def run_ps_if_ps(task: tfl.ResolvedTask | None) -> bool:
    """A ps task serves until training is over; True when this process was one."""
    if task is not None and task.job == "ps":
        tfl.Server(task.cluster, task.job, task.index).join()
        return True
    return False
