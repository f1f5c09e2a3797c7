"""An entry module that starts a thread when imported: forking after it is unsafe, so the
sweep must run its trials in fresh processes."""

from __future__ import annotations

import json
import os
import threading

from tensorfleet.patterns.trial import Trial

_stop = threading.Event()
threading.Thread(target=_stop.wait, args=(600,), daemon=True).start()
IMPORTED_BY = os.getpid()


def train(trial: Trial) -> float:
    (trial.directory / "where.json").write_text(
        json.dumps({"pid": os.getpid(), "imported_by": IMPORTED_BY})
    )
    return float(trial.params["n"])
