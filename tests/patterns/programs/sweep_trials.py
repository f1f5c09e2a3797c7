"""Trial programs for the sweep tests (imported by the trial processes, by name)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tensorfleet.patterns.trial import Trial, TrialPruned

#: A file the gated trials wait for; its path comes from the test through the environment.
GATE_VAR = "SWEEP_TEST_GATE"
#: A file every trial appends "x=<value>" to when it completes.
COMPLETIONS_VAR = "SWEEP_TEST_COMPLETIONS"


def quadratic(trial: Trial) -> float:
    """(x - 1)^2, after reporting three intermediate values; misbehaves on request."""
    x = trial.params["x"]
    mode = trial.params.get("mode", "ok")
    for step in range(3):
        trial.report(step, loss=(x - 1) ** 2 + 1.0 / (step + 1))
    if mode == "raise":
        raise ValueError(f"trial with x={x} fails on purpose")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "prune":
        raise TrialPruned()
    return (x - 1) ** 2


def gated(trial: Trial) -> float:
    """Trials with x >= 2 wait for the gate file (at most 60 s); each completion is logged."""
    x = trial.params["x"]
    (trial.directory / "pid").write_text(str(os.getpid()))
    trial.report(0, loss=100.0)
    gate = Path(os.environ[GATE_VAR])
    deadline = time.monotonic() + 60
    while x >= 2 and not gate.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the test never opened the gate")
        time.sleep(0.02)
    with open(os.environ[COMPLETIONS_VAR], "a") as f:
        f.write(f"x={x}\n")
    return float(x)


def slow_curve(trial: Trial) -> float:
    """A learning curve at the level of x: large x is worse at every step (pruned by a median
    rule once two trials completed). Honours the stop request."""
    x = trial.params["x"]
    value = float(x)
    for step in range(15):
        if trial.should_stop():
            raise TrialPruned()
        value = x + 1.0 / (step + 1)
        trial.report(step, loss=value)
        time.sleep(0.1)
    return value
