"""Trial programs for the warm-executor tests: each trial writes which processes ran it."""

from __future__ import annotations

import json
import os
import signal
import time

from tensorfleet.patterns.trial import Trial

#: The process that imported this module (the slot's executor, when trials are forked).
IMPORTED_BY = os.getpid()
#: A module global a trial changes: the next trial must not see the change.
STATE = {"touched_by": None}


def _parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (the executor's: the sweep, or the preloaded
    interpreter that forked it), from /proc; None when it is gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def where(trial: Trial) -> float:
    """Record the trial's pid, its parent, the importing process; misbehave on request."""
    seen = dict(STATE)
    STATE["touched_by"] = trial.params["n"]
    record = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "imported_by": IMPORTED_BY,
        "state_seen": seen["touched_by"],
        "slot": os.environ.get("TENSORFLEET_TRIAL_SLOT"),
        "executor_parent": _parent_of(os.getppid()),
        "flag": os.environ.get("TENSORFLEET_TEST_FLAG"),
        "runtime_flag": os.environ.get("SWEEP_RUNTIME_FLAG"),
        "cwd": os.getcwd(),
    }
    (trial.directory / "where.json").write_text(json.dumps(record))
    mode = trial.params["mode"]
    print(f"trial {trial.params['n']} in pid {os.getpid()}")
    if mode == "raise":
        raise RuntimeError(f"trial {trial.params['n']} raises on purpose")
    if mode == "exit":
        os._exit(7)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        time.sleep(120)
    if mode == "meet":  # runs only beside its partner trial (n xor 1): two slots at once
        (trial.directory.parent / f"met-{trial.params['n']}").touch()
        partner = trial.directory.parent / f"met-{trial.params['n'] ^ 1}"
        deadline = time.monotonic() + 60
        while not partner.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"trial {trial.params['n']} ran alone: no {partner.name} in 60 s"
                )
            time.sleep(0.01)
    if mode == "kill_executor":
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(120)  # killed with it (parent-death signal)
    return float(trial.params["n"])
