"""The process of a trial whose program is a Python entry point (``module:function``).

``python -m tensorfleet.patterns.trial_main MODULE:FUNCTION METRIC`` imports the function and
calls it with the :class:`~tensorfleet.patterns.trial.Trial` (its ``params``, ``report``,
``should_stop``). What it returns is the trial's result: a number (the value of the sweep's
metric), or a mapping of metrics. An exception is written to ``error.json`` (type, message,
traceback) for the sweep's table, and the process exits 1.

Why a fresh process per trial rather than a function call in the sweep: a trial that crashes,
leaks memory, hangs or is killed takes nothing else with it, its slot is freed by ending one
process, and nothing has to be pickled to send the function anywhere: it is named, imported.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from tensorfleet.errors import ConfigError, ConfigTypeError
from tensorfleet.patterns.trial import (
    ERROR_FILE,
    Trial,
    TrialPruned,
    current_trial,
    is_chief_process,
)

#: Exit status of a trial that ended itself as pruned (raised TrialPruned).
PRUNED_EXIT = 3


def load_entry_point(entry: str) -> Callable[[Trial], Any]:
    """The function named by ``module:function`` (``function`` may be dotted)."""
    module_name, sep, qualname = entry.partition(":")
    if not sep or not module_name or not qualname:
        raise ConfigError(f"entry point {entry!r} must be 'module:function'")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise ConfigTypeError(f"entry point {entry!r} is a {type(target).__name__}, not a function")
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(
            "usage: python -m tensorfleet.patterns.trial_main MODULE:FUNCTION METRIC",
            file=sys.stderr,
        )
        return 2
    entry, metric = args
    trial = current_trial()
    try:
        function = load_entry_point(entry)
        result = function(trial)
        if not is_chief_process():
            pass  # in a trial of several workers, the chief's result is the trial's
        elif isinstance(result, Mapping):
            trial.report(None, **result)
        elif result is not None:
            trial.report(None, **{metric: result})
    except TrialPruned:
        return PRUNED_EXIT
    except BaseException as exc:  # recorded for the sweep's table, then the process fails
        record = {
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": traceback.format_exc(),
        }
        (trial.directory / ERROR_FILE).write_text(json.dumps(record))
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
