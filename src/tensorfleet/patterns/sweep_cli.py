"""``tensorfleet sweep CONFIG``: the command-line face of :mod:`tensorfleet.patterns.sweep`.

Kept here, next to the sweep, so that the launcher's CLI only registers it (one call) and
knows nothing of sweeps.

Exit status: 0 when at least one trial completed (failed or pruned trials do not change it:
they are in the results); :data:`NO_TRIAL_COMPLETED` (1) when the sweep ran to its end but no
trial completed; 2 for a configuration refused before anything started (the ``tensorfleet``
CLI's usage error); 130 when interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from tensorfleet.patterns.search import COMPLETE
from tensorfleet.patterns.sweep import run_sweep
from tensorfleet.patterns.sweep_config import load_config

#: Exit status of a sweep that ran to its end without one completed trial.
NO_TRIAL_COMPLETED = 1


def add_sweep_command(commands: argparse._SubParsersAction) -> None:
    """Register ``sweep`` among the ``tensorfleet`` subcommands."""
    sweep = commands.add_parser(
        "sweep",
        help="run a hyperparameter sweep: many trials, as many at once as there are slots",
        description="Run the trials of the sweep described in CONFIG (YAML or JSON: the "
        "trial program, the parameter space, the metric and its direction, the search, the "
        "slots), as many at once as there are slots, with live progress; write results.csv, "
        "results.json (with the best configuration) and metric_vs_params.png to the sweep "
        "directory. Running the same command again resumes an interrupted sweep. Exit "
        "status: 0 when at least one trial completed, 1 when none did, 2 for an invalid "
        "config. See docs/patterns.md.",
        epilog="example: tensorfleet sweep sweep.yaml --dir runs/sweep --slots 2",
    )
    sweep.add_argument("config", metavar="CONFIG", help="the sweep's YAML or JSON file")
    sweep.add_argument(
        "--dir",
        metavar="DIR",
        help="sweep directory: trials, study, results (default: runs/<name> of the config)",
    )
    sweep.add_argument(
        "--slots", type=int, metavar="N", help="trials at once (default: the config's slots)"
    )
    sweep.add_argument(
        "--no-live", action="store_true", help="plain progress lines, even on a terminal"
    )
    sweep.set_defaults(handler=_sweep)


def _sweep(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.slots is not None:
        config.slots = args.slots
        config.validate()
    directory = Path(args.dir) if args.dir else Path("runs") / config.name
    if threading.current_thread() is threading.main_thread():
        # SIGTERM ends the sweep like Ctrl-C: the running trials are stopped first.
        def interrupt(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, interrupt)
    try:
        result = run_sweep(config, directory, live=False if args.no_live else None)
    except KeyboardInterrupt:
        print(
            f"sweep: interrupted; the trials that finished are kept in {directory}: run the "
            "same command again to resume",
            file=sys.stderr,
        )
        raise
    print(json.dumps({"best": result.best, "results": str(result.results_json)}))
    if not any(r.state == COMPLETE for r in result.records):
        print(
            f"tensorfleet: error: no trial of the sweep completed ({len(result.records)} "
            f"trial(s), none complete); each trial's error is in {result.results_csv}",
            file=sys.stderr,
        )
        return NO_TRIAL_COMPLETED
    return 0
