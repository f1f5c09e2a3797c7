"""Where every benchmark leaves its figures: ``<out>/<name>.json`` (all numbers) and
``<name>.md`` (a heading line and a markdown table), also printed.

``<out>`` is ``benchmarks/results`` (the directory whose committed tables the docs cite) unless
the script was given ``--out-dir DIR`` or the environment sets ``TENSORFLEET_BENCH_OUT=DIR``:
a run that should not replace the committed tables (a smoke test, a partial run, another
machine) goes there instead. ``run_all.py --out-dir`` passes it on to every benchmark through
the environment.

A benchmark that cannot run here for a reason outside its control (no root for network
namespaces, no TensorFlow) calls :func:`not_run`: it prints ``<name>: not run: <reason>`` and
returns :data:`NOT_RUN_STATUS`, which ``run_all.py`` reports as skipped (with the reason), not
as a failure.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

#: The default directory of the results: the committed tables the docs cite.
RESULTS = Path(__file__).resolve().parent / "results"
#: The environment variable naming another directory for the results.
OUT_ENV = "TENSORFLEET_BENCH_OUT"
#: The exit status of a benchmark that could not run here for a stated reason (automake's
#: "skipped"; 2 is argparse's usage error and 1 a failure, so neither can mean it).
NOT_RUN_STATUS = 77
#: What precedes the reason on the line :func:`not_run` prints.
NOT_RUN_MARK = ": not run: "


def results_dir() -> Path:
    """The directory results go to now: ``$TENSORFLEET_BENCH_OUT`` if set, else ``RESULTS``."""
    chosen = os.environ.get(OUT_ENV)
    return Path(chosen) if chosen else RESULTS


class _OutDir(argparse.Action):
    """``--out-dir DIR``: sets ``TENSORFLEET_BENCH_OUT`` for this process and its children."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[override]
        os.environ[OUT_ENV] = str(Path(values).resolve())
        setattr(namespace, self.dest, Path(values))


def add_out_dir_option(parser: argparse.ArgumentParser) -> None:
    """Give a benchmark's parser ``--out-dir DIR`` (where its results go)."""
    parser.add_argument(
        "--out-dir",
        action=_OutDir,
        metavar="DIR",
        help=f"write the results there instead of {RESULTS.parent.name}/{RESULTS.name}, whose "
        f"committed tables the docs cite (or set {OUT_ENV}=DIR)",
    )


def write_results(name: str, result: dict, heading: str, table: list[str]) -> Path:
    """Write ``result`` as JSON and ``heading`` + ``table`` as markdown in :func:`results_dir`,
    print the table and where it went; returns the markdown's path."""
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    markdown = out / f"{name}.md"
    markdown.write_text(heading + "\n\n" + "\n".join(table) + "\n")
    print("\n".join(table))
    print(f"results: {out / name}.json and .md", flush=True)
    return markdown


def not_run(name: str, reason: str) -> int:
    """Say why benchmark ``name`` cannot run here; return the status that means "skipped"."""
    print(f"{name}{NOT_RUN_MARK}{reason}", flush=True)
    return NOT_RUN_STATUS
