"""The process of a trial whose program is a Python entry point (``module:function``).

``python -m tensorfleet.patterns.trial_main MODULE:FUNCTION METRIC`` imports the function and
calls it with the :class:`~tensorfleet.patterns.trial.Trial` (its ``params``, ``report``,
``should_stop``). What it returns is the trial's result: a number (the value of the sweep's
metric), or a mapping of metrics. An exception is written to ``error.json`` (type, message,
traceback) for the sweep's table, and the process exits 1.

``python -m tensorfleet.patterns.trial_main --check MODULE:FUNCTION`` is what the sweep runs
once before its first trial (:func:`check_entry`): it imports the module and looks the
function up exactly as a trial would (same interpreter, working directory and ``PYTHONPATH``)
so that a misspelled entry is one error up front, not the same failure in every trial. It
runs in a process of its own so that the module's import-time code runs where a trial's
would, never in the sweep.

Why a fresh process per trial rather than a function call in the sweep: a trial that crashes,
leaks memory, hangs or is killed takes nothing else with it, its slot is freed by ending one
process, and nothing has to be pickled to send the function anywhere: it is named, imported.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from tensorfleet.errors import ConfigError, ConfigTypeError
from tensorfleet.patterns.search_space import SweepConfigError
from tensorfleet.patterns.trial import (
    ERROR_FILE,
    Trial,
    TrialPruned,
    current_trial,
    is_chief_process,
)

#: Exit status of a trial that ended itself as pruned (raised TrialPruned).
PRUNED_EXIT = 3
#: Starts the last output line of ``--check``; the JSON verdict follows it.
CHECK_MARK = "tensorfleet-entry-check: "
#: How long the sweep waits for the entry check (importing the module) before going on
#: without it (and saying so).
ENTRY_CHECK_TIMEOUT_S = 120.0


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


def find_entry_problem(entry: str) -> dict[str, str] | None:
    """Import ``entry``'s module and look its function up in this process; None when it is
    there, else ``{"missing": "module" | "function" | "", "message": ...}`` (``""``: the
    module exists but importing it raised, which a trial's environment may not)."""
    module_name, _, qualname = entry.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            return {"missing": "module", "message": f"there is no module {exc.name!r}"}
        return {"missing": "", "message": f"importing {module_name!r} raised {exc!r}"}
    except BaseException as exc:  # the module's own code failed: reported, not judged
        return {"missing": "", "message": f"importing {module_name!r} raised {exc!r}"}
    owner = module_name
    where = getattr(target, "__file__", None) or module_name
    for part in qualname.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
            return {
                "missing": "function",
                "message": f"{owner!r} ({where}) has no attribute {part!r}{hint}",
            }
        target = getattr(target, part)
        owner = f"{owner}.{part}"
    if not callable(target):
        return {
            "missing": "function",
            "message": f"{owner!r} is a {type(target).__name__}, not a function",
        }
    return None


def check_entry(entry: str, env: Mapping[str, str], pythonpath: list[str]) -> str | None:
    """Check, in a child process with the trials' ``env``, that ``entry`` can be imported.

    Raises :class:`SweepConfigError` naming the entry, what is missing and the fix when its
    module or function does not exist. Returns a note for the sweep to print when the check
    could not decide (importing the module raised something else, or took longer than
    :data:`ENTRY_CHECK_TIMEOUT_S`): the trials then run and show what happens. None: found.
    """
    return finish_entry_check(start_entry_check(entry, env), entry, pythonpath)


def start_entry_check(entry: str, env: Mapping[str, str]) -> subprocess.Popen[str]:
    """Start :func:`check_entry`'s child process and return at once, so that the sweep can
    prepare its directory and study while the child imports the module; then
    :func:`finish_entry_check`."""
    argv = [sys.executable, "-m", "tensorfleet.patterns.trial_main", "--check", entry]
    return subprocess.Popen(
        argv,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_entry_check(
    process: subprocess.Popen[str], entry: str, pythonpath: list[str]
) -> str | None:
    """Wait (at most :data:`ENTRY_CHECK_TIMEOUT_S` from now) for the check started by
    :func:`start_entry_check`, and judge it as :func:`check_entry` says."""
    try:
        stdout, stderr = process.communicate(timeout=ENTRY_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return (
            f"entry {entry!r} not checked: importing it took more than "
            f"{ENTRY_CHECK_TIMEOUT_S:g} s; the trials start anyway and show any error"
        )
    marks = [ln for ln in stdout.splitlines() if ln.startswith(CHECK_MARK)]
    if not marks:
        tail = " | ".join((stdout + stderr).strip().splitlines()[-3:])[-300:]
        return (
            f"entry {entry!r} not checked: the check process exited with status "
            f"{process.returncode} ({tail}); the trials start anyway and show any error"
        )
    return entry_check_verdict(entry, json.loads(marks[-1][len(CHECK_MARK) :]), pythonpath)


def entry_check_verdict(
    entry: str, problem: Mapping[str, str] | None, pythonpath: list[str]
) -> str | None:
    """What :func:`find_entry_problem`'s ``problem`` means for the sweep: raise
    :class:`SweepConfigError` when the module or function is missing, a note when the check
    could not decide, None when the entry is there. Shared by :func:`check_entry` and the
    preloaded executors (:mod:`tensorfleet.patterns.warm_executor`), which import the entry
    themselves."""
    if problem is None:
        return None
    if problem["missing"] == "module":
        raise SweepConfigError(
            f"entry {entry!r}: {problem['message']} on the trials' path (the sweep's working "
            f"directory {os.getcwd()} and pythonpath {pythonpath}); fix the module name, or "
            "add the directory that holds it to pythonpath (in a config file, relative to the "
            "file), or run the sweep from that directory"
        )
    if problem["missing"] == "function":
        raise SweepConfigError(
            f"entry {entry!r}: {problem['message']}; fix the function name after the ':' "
            "(entry: 'module:function', the function called with the trial)"
        )
    return (
        f"entry {entry!r} not checked: {problem['message']} outside a trial; the trials start "
        "anyway and show any error"
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--check":
        print("\n" + CHECK_MARK + json.dumps(find_entry_problem(args[1])), flush=True)
        return 0
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
    except BaseException as exc:  # recorded for the sweep's table, then the process fails
        return record_error(trial, exc)
    return run_entry(function, trial, metric)


def run_entry(function: Callable[[Trial], Any], trial: Trial, metric: str) -> int:
    """Call the entry point with ``trial``, report what it returns; the exit status of the
    trial: 0, :data:`PRUNED_EXIT`, or 1 after writing the exception to ``error.json``."""
    try:
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
        return record_error(trial, exc)
    return 0


def record_error(trial: Trial, exc: BaseException) -> int:
    """Write ``exc`` (type, message, traceback) to the trial's ``error.json`` for the sweep's
    table, print the traceback to the trial's output; the exit status 1."""
    record = {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
    (trial.directory / ERROR_FILE).write_text(json.dumps(record))
    traceback.print_exception(exc)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
