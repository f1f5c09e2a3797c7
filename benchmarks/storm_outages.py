"""A storm's worker recoveries split by whether their parameter server was out at the time.

In a storm (``benchmarks/chaos.py --storm``) a worker's recovery is the time from its fault
(for a SIGSTOP: from its SIGCONT) to its next step line. A worker cannot make a step while
its ps is out: SIGSTOPped (for the storm's ``--stop-seconds``), or killed or preempted and not
yet training again. A worker fault that lands in such an outage is therefore timed by the
ps's outage, not by the worker's own recovery: 10 s into a 15 s SIGSTOP of the ps, the
fastest possible worker needs 5 s. Every 10-minute storm so far had its worker tail exactly
there: each worker recovery over 1.5 s landed in a ps outage, but for the one stuck worker of
seed 6, whose unbounded wait after a SIGTERM is bounded since (docs/reliability.md). The one
table of all recoveries hides that. This module tells the two apart:

* **ps up**: the worker's own recovery (restart or spare take-over, hello, pull, first step);
* **during a ps outage**: bounded below by what was left of the outage.

An outage of the ps is ``[fault, fault + stop seconds)`` for a SIGSTOP and ``[fault, fault +
its recovery)`` for a kill, a SIGTERM, or a SIGSTOP after which the launcher replaced the
stopped ps (``replaced``; its recovery ends at the first step any worker makes after it); a
worker fault belongs to it when its own clock starts inside it.

    .venv/bin/python benchmarks/storm_outages.py benchmarks/results/chaos_storm_10min_seed7.json [...]

prints the split table of each storm's JSON; ``chaos.py --storm`` adds the same table to its
report.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: How the two groups are named in the table.
PS_UP, PS_OUT = "ps up", "during a ps outage"


def ps_outages(
    faults: Sequence[Mapping[str, Any]], stop_seconds: float
) -> list[tuple[float, float]]:
    """``(start, end)`` seconds of every interval in which a ps could not answer: its SIGSTOPs
    (``stop_seconds`` long) and its kills, SIGTERMs and replaced SIGSTOPs until their
    recovery (one not recovered: to the end of the run)."""
    outages = []
    for fault in faults:
        if not str(fault["task"]).startswith("ps"):
            continue
        start = float(fault["at_s"])
        if fault["kind"] == "stop" and not fault.get("replaced"):
            outages.append((start, start + stop_seconds))
        elif fault["recovered_s"] is None:
            outages.append((start, float("inf")))
        else:
            outages.append((start, start + float(fault["recovered_s"])))
    return outages


def split_worker_recoveries(
    faults: Sequence[Mapping[str, Any]], stop_seconds: float
) -> dict[tuple[str, str], list[float]]:
    """The recovered workers' recovery seconds by ``(kind, PS_UP or PS_OUT)``."""
    outages = ps_outages(faults, stop_seconds)
    groups: dict[tuple[str, str], list[float]] = {}
    for fault in faults:
        if not str(fault["task"]).startswith("worker") or fault["recovered_s"] is None:
            continue
        clock_start = float(fault["resumed_at_s"] or fault["at_s"])
        during = any(start <= clock_start < end for start, end in outages)
        groups.setdefault((fault["kind"], PS_OUT if during else PS_UP), []).append(
            float(fault["recovered_s"])
        )
    return groups


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, interpolated between the nearest ranks (the
    one ``chaos.py``'s tables use too)."""
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def split_table(faults: Sequence[Mapping[str, Any]], stop_seconds: float) -> list[str]:
    """Markdown rows: worker recoveries by fault kind, with the ps up and during its outages."""
    rows = [
        "| worker fault | ps at the time | n | p50 (s) | p95 (s) | max (s) |",
        "|---|---|---|---|---|---|",
    ]
    for (kind, when), seconds in sorted(split_worker_recoveries(faults, stop_seconds).items()):
        rows.append(
            f"| {kind} | {when} | {len(seconds)} | {percentile(seconds, 0.5):.1f} | "
            f"{percentile(seconds, 0.95):.1f} | {max(seconds):.1f} |"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", nargs="+", type=Path, help="a storm's JSON (chaos.py --storm)")
    args = parser.parse_args()
    for path in args.results:
        result = json.loads(path.read_text())
        if result.get("mode") != "storm":
            parser.error(f"{path} is not a storm's result (its mode is {result.get('mode')!r})")
        print(f"{path.name} (seed {result['seed']}):")
        print("\n".join(split_table(result["faults"], float(result["stop_seconds"]))))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
