"""``tensorfleet pbt CONFIG``: the command-line face of :mod:`tensorfleet.patterns.pbt`.

Kept here, next to PBT, so that the launcher's CLI only registers it (one call); torch and
the PBT driver are imported only when the command runs.

Exit status: 0 when the run ended (its result in ``DIR/result.json``); 2 for a configuration
refused before anything started (the ``tensorfleet`` CLI's usage error); a failed member
step or ps raises, and the same command resumes the run from its last complete round.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_pbt_command(commands: argparse._SubParsersAction) -> None:
    """Register ``pbt`` among the ``tensorfleet`` subcommands."""
    pbt = commands.add_parser(
        "pbt",
        help="population-based training: members on one ps task, the worst copy the best",
        description="Run the population-based training described in CONFIG (YAML or JSON: "
        "the problem's factory, the members, the rounds and steps per round, the update rule, "
        "the hyperparameters to search and how to perturb them). Every round the worst "
        "members copy a best member's variables and optimizer state on the ps and perturb "
        "its hyperparameters. Writes lineage.json, lineage.csv, lineage.png and result.json "
        "to the run directory; running the same command again resumes a killed run from "
        "its last complete round. See docs/patterns.md.",
        epilog="example: tensorfleet pbt examples/pbt_schedule.yaml --dir runs/pbt",
    )
    pbt.add_argument("config", metavar="CONFIG", help="the PBT run's YAML or JSON file")
    pbt.add_argument(
        "--dir", metavar="DIR", help="run directory (default: runs/<name> of the config)"
    )
    pbt.add_argument(
        "--rounds", type=int, metavar="N", help="rounds in all (default: the config's)"
    )
    pbt.add_argument(
        "--no-exploit",
        action="store_true",
        help="keep every member's initial hyperparameters (the fixed-hyperparameter runs)",
    )
    pbt.set_defaults(handler=_pbt)


def _pbt(args: argparse.Namespace) -> int:
    from tensorfleet.patterns.pbt import run_pbt
    from tensorfleet.patterns.pbt_config import load_config

    config = load_config(args.config)
    if args.rounds is not None:
        config.rounds = args.rounds
    if args.no_exploit:
        config.exploit = False
    config.validate()
    directory = Path(args.dir) if args.dir else Path("runs") / config.name
    result = run_pbt(config, directory)
    print(
        json.dumps(
            {
                "best_member": result.best_member,
                "best_score": result.best_score,
                "best_hyperparameters": result.best_hyperparameters,
                "result": str(directory / "result.json"),
            }
        )
    )
    return 0
