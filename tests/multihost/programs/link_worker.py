"""A ridge-regression worker that trains long enough to have its network link cut mid-run.

Like ``tests/cluster/programs/ridge_worker.py`` (every worker takes full-batch gradient steps
on the same deterministic dataset, so asynchronous training converges to the closed-form ridge
solution, and the chief writes the final weights as JSON to the path given as its first
argument), with a pause after each step so that the run lasts many seconds, and progress on
stdout::

    start worker=1 pid=4242
    progress worker=1 pid=4242 global_step=140 local_steps=61
    done worker=1 pid=4242 global_step=1200 local_steps=597

One ``progress`` line each time the global step reaches a new multiple of
:data:`PROGRESS_EVERY`, flushed at once. SIGUSR1 prints every thread's stack to stderr (the
test asks for that before it kills a worker that hangs). Arguments:
``OUT_JSON STEPS [STEP_SLEEP_S]``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import tensorfleet as tfl

# The dataset and the loss constants are ridge_worker's (tests/cluster/programs), whose
# closed_form() the test compares the chief's weights with: one definition for both.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cluster" / "programs"))
from ridge_worker import FEATURES, OUTPUTS, RIDGE, dataset  # noqa: E402

#: A progress line each time the global step passes a multiple of this.
PROGRESS_EVERY = 20


def main() -> int:
    """Train until the global step reaches ``STEPS``; the chief writes the weights."""
    out_path, steps = sys.argv[1], int(sys.argv[2])
    step_sleep_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.01
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    task = tfl.resolve_task(argv=[])
    me = f"worker={task.index} pid={os.getpid()}"
    print(f"start {me}", flush=True)
    server = tfl.Server(task.cluster, task.job, task.index)
    torch.manual_seed(task.index)  # different local inits: the chief's must win
    model = nn.Linear(FEATURES, OUTPUTS, bias=False)
    x, y = dataset()
    local_steps = 0
    last_reported = 0
    with tfl.TrainingSession(
        server,
        model,
        optimizer=tfl.optim.SGD(lr=0.1),
        hooks=[tfl.StopAtStep(last_step=steps)],
    ) as sess:
        while not sess.should_stop():
            sess.step(
                lambda: ((model(x) - y) ** 2).mean() * OUTPUTS + RIDGE * (model.weight**2).sum()
            )
            local_steps += 1
            if sess.global_step // PROGRESS_EVERY > last_reported // PROGRESS_EVERY:
                last_reported = sess.global_step
                print(
                    f"progress {me} global_step={sess.global_step} local_steps={local_steps}",
                    flush=True,
                )
            time.sleep(step_sleep_s)
        if sess.is_chief:
            sess.pull()
            with open(out_path, "w") as f:
                json.dump(
                    {
                        "weight": model.weight.detach().double().tolist(),
                        "global_step": sess.global_step,
                    },
                    f,
                )
    print(f"done {me} global_step={sess.global_step} local_steps={local_steps}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
