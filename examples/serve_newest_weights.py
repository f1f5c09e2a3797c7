"""Serving with the newest weights while training goes on (model broadcast).

Two processes: a trainer (a TrainingSession with the ``PublishWeights`` hook: it publishes
the model every 20 steps) and this one, a prediction server that subscribes to the trainer
and answers a stream of prediction requests, each with the newest weights it has. Every
line it prints says which version answered and how accurate the answers were, so you can
watch the answers improve while the trainer trains::

    python examples/serve_newest_weights.py              # starts the trainer itself
    python examples/serve_newest_weights.py --steps 600

Everything crosses the wire authenticated with a fresh secret; no weights touch the disk.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.patterns.broadcast import (
    PublishWeights,
    WeightPublisher,
    WeightSubscriber,
    free_address,
)

CLASSES, FEATURES = 4, 16


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(CLASSES, FEATURES, generator=g)
    g.manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    return centers[labels] + 1.6 * torch.randn(n, FEATURES, generator=g), labels


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def train(address: str, steps: int) -> int:
    """The trainer: publishes its model every 20 steps at ``address``."""
    torch.set_num_threads(1)
    secret = os.environ["TENSORFLEET_SECRET"].encode()
    x, y = data(2048, seed=1)
    net = model()
    with WeightPublisher(address, secret) as publisher:
        hooks = [tfl.StopAtStep(steps), PublishWeights(publisher, every_n_steps=20)]
        with tfl.TrainingSession(None, net, optimizer=tfl.optim.SGD(lr=0.02), hooks=hooks) as sess:
            while not sess.should_stop():
                batch = torch.randint(0, len(x), (64,))
                sess.step(lambda b=batch: F.cross_entropy(net(x[b]), y[b]))
                time.sleep(0.01)  # a slower trainer makes the versions easy to watch
        print(
            f"trainer: done after {steps} steps, {publisher.published} versions published",
            flush=True,
        )
        time.sleep(1.0)  # a moment for the server to take the last version
    return 0


def serve(steps: int) -> int:
    """The prediction server: answers requests with the newest weights."""
    torch.set_num_threads(1)
    address, secret = free_address(), secrets.token_hex(32)
    trainer = subprocess.Popen(
        [sys.executable, __file__, "--train", address, "--steps", str(steps)],
        env=dict(os.environ, TENSORFLEET_SECRET=secret),
    )
    try:
        net = model()
        queries, truth = data(256, seed=2)  # the requests clients send
        deadline = time.monotonic() + 60
        while True:  # the trainer's publisher needs a moment to start
            try:
                subscriber = WeightSubscriber(address, secret.encode(), timeout_s=5)
                break
            except tfl.DeadlineExceeded:
                if time.monotonic() > deadline or trainer.poll() is not None:
                    raise
        with subscriber:
            answered, last_version = 0, 0
            while True:
                try:
                    version = subscriber.load_into(net, wait_s=0.2)
                except tfl.DeadlineExceeded:  # ConnectionLost too: the trainer has ended?
                    try:
                        trainer.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        raise RuntimeError(
                            "the trainer stopped answering but did not exit"
                        ) from None
                    break
                with torch.no_grad():
                    answers = net(queries).argmax(1)  # one batch of prediction requests
                answered += len(answers)
                if version != last_version:
                    accuracy = (answers == truth).float().mean().item()
                    print(
                        f"server: answering with version {version:3d}: accuracy {accuracy:.3f} "
                        f"({answered} answered)",
                        flush=True,
                    )
                    last_version = version
        return trainer.wait(timeout=30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--train", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    return train(args.train, args.steps) if args.train else serve(args.steps)


if __name__ == "__main__":
    raise SystemExit(main())
