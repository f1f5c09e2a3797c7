"""Where every benchmark leaves its figures: ``benchmarks/results/<name>.json`` (all numbers)
and ``<name>.md`` (a heading line and a markdown table), also printed."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, result: dict, heading: str, table: list[str]) -> None:
    """Write ``result`` as JSON and ``heading`` + ``table`` as markdown, and print the table."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"{name}.md").write_text(heading + "\n\n" + "\n".join(table) + "\n")
    print("\n".join(table))
