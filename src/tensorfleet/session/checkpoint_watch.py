"""An evaluator's view of a training run: each new checkpoint as it appears
(:func:`checkpoints_iterator`, TensorFlow's ``tf.train.checkpoints_iterator``).

What. An evaluation program, beside the cluster and not a task of it (TensorFlow's
``evaluator`` task, which Estimator and Kubeflow start outside the training cluster), loops
over the run's checkpoint directory: it waits for a checkpoint newer than the last one it
evaluated, verifies it (its files against the manifest's checksums, a delta's bases too), and
hands its directory to ``tfl.load_checkpoint``. When several appeared meanwhile only the
newest is handed out, as TensorFlow's iterator does: an evaluator that is slower than the
checkpoints evaluates the freshest model, not a backlog.

Why a program of its own and not a task of the cluster: it reads only files, so it needs no
identity, no secret and no port, runs anywhere the directory is (another machine, after the
run), and a slow or failed evaluation never holds training back. Every wait has a deadline:
the iteration ends after ``timeout_s`` without a new checkpoint, or once it handed out the
checkpoint of ``last_step`` (the run's last step, when the evaluator knows it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from tensorfleet.errors import CheckpointError, ConfigError
from tensorfleet.session.checkpoints import CheckpointDirectory, read_chain

log = logging.getLogger("tensorfleet.session")


def checkpoints_iterator(
    checkpoint_dir: str | os.PathLike[str],
    *,
    timeout_s: float = 600.0,
    poll_s: float = 1.0,
    last_step: int | None = None,
) -> Iterator[Path]:
    """Yield the directory of each new valid checkpoint of the run in ``checkpoint_dir``
    (the session's ``checkpoint_dir``), the newest one when several appeared since the last.

    Ends when ``timeout_s`` seconds pass without a new one (saying so in one log line), or
    right after yielding one at or past global step ``last_step``. A checkpoint that fails
    its checksums (being pruned while read, a torn copy) is passed over with a warning and
    the older valid one is not handed out again. ``poll_s``: the pause between looks."""
    if timeout_s <= 0 or poll_s <= 0:
        raise ConfigError(
            f"timeout_s and poll_s must be > 0 seconds, got timeout_s={timeout_s}, poll_s={poll_s}"
        )
    directory = CheckpointDirectory(checkpoint_dir)
    seen = -1
    deadline = time.monotonic() + timeout_s
    while True:
        newer = [(step, path) for step, path in directory.step_directories() if step > seen]
        for step, path in newer:  # newest first
            try:
                read_chain(path)
            except CheckpointError as exc:
                log.warning("%s; passing over it", exc)
                continue
            seen = max(step for step, _ in newer)  # the ones older than it are not wanted
            yield path
            if last_step is not None and step >= last_step:
                return
            deadline = time.monotonic() + timeout_s
            break
        else:
            if newer:  # every new one failed its checks: do not read them again
                seen = newer[0][0]
        if time.monotonic() >= deadline:
            log.info(
                "no new checkpoint in %s for %g s: the evaluation ends", checkpoint_dir, timeout_s
            )
            return
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
