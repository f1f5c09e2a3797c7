"""What a sweep shows and leaves behind: live progress, the results table, the plot.

* Progress: one line per trial. On a terminal, a live ``rich`` table (every trial's state,
  step, latest metric, time); otherwise plain lines as things happen (started, each new
  metric at most once every few seconds per trial, the end), for logs and CI.
* ``results.csv`` and ``results.json``: one row per trial (number, state, value, params,
  seconds, error) and, in the JSON, the best configuration under the sweep's direction.
* ``metric_vs_params.png``: the metric against each parameter, one panel per parameter
  (matplotlib, optional: without it the sweep says so and writes the tables only; with no
  trial that reported the metric there is nothing to plot, and the sweep says that instead).
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

#: A plain progress line per trial for new metrics at most this often.
PLAIN_METRIC_EVERY_S = 5.0


@dataclass
class TrialRecord:
    """One trial as the tables show it (also its ``result.json``)."""

    number: int
    params: dict[str, Any]
    state: str = "running"
    value: float | None = None
    step: int | None = None
    seconds: float = 0.0
    error: str | None = None
    slot: int | None = None
    started: float = field(default_factory=time.monotonic, repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("started")
        return out


def _short(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={_fmt(v)}" for k, v in params.items())


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class PlainProgress:
    """Progress as plain lines (not a terminal, or asked for)."""

    def __init__(self, metric: str, stream: TextIO | None = None) -> None:
        self.metric = metric
        self.stream = stream or sys.stdout
        self._last_line: dict[int, float] = {}

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def _say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        self._say(f"sweep: {text}")

    def started(self, record: TrialRecord) -> None:
        self._say(f"trial {record.number:4d} started  (slot {record.slot}) {_short(record.params)}")

    def updated(self, record: TrialRecord) -> None:
        now = time.monotonic()
        if now - self._last_line.get(record.number, 0.0) < PLAIN_METRIC_EVERY_S:
            return
        self._last_line[record.number] = now
        step = "" if record.step is None else f" step {record.step}"
        self._say(f"trial {record.number:4d}{step} {self.metric}={_fmt(record.value)}")

    def finished(self, record: TrialRecord) -> None:
        detail = f"{self.metric}={_fmt(record.value)}" if record.value is not None else ""
        if record.error:
            detail += f" error: {record.error}"
        self._say(
            f"trial {record.number:4d} {record.state:<8} {detail} ({record.seconds:.1f} s) "
            f"{_short(record.params)}"
        )


class LiveProgress(PlainProgress):
    """Progress as a live table on a terminal (rich), one row per trial."""

    def __init__(self, metric: str) -> None:
        super().__init__(metric)
        from rich.console import Console
        from rich.live import Live

        self.console = Console()
        self._records: dict[int, TrialRecord] = {}
        self._live = Live(self._table(), console=self.console, refresh_per_second=4)

    def __enter__(self) -> LiveProgress:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.update(self._table())
        self._live.__exit__(None, None, None)

    def _table(self) -> Any:
        from rich.table import Table

        table = Table(title="sweep", expand=False)
        for column in ("trial", "state", "step", self.metric, "s", "params / error"):
            table.add_column(column)
        styles = {"complete": "green", "failed": "red", "pruned": "yellow", "running": "cyan"}
        for record in self._records.values():
            seconds = (
                record.seconds if record.state != "running" else time.monotonic() - record.started
            )
            table.add_row(
                str(record.number),
                f"[{styles.get(record.state, '')}]{record.state}",
                "" if record.step is None else str(record.step),
                "" if record.value is None else _fmt(record.value),
                f"{seconds:.0f}",
                _short(record.params) + (f"  [red]{record.error}" if record.error else ""),
            )
        return table

    def message(self, text: str) -> None:
        self.console.print(f"sweep: {text}")

    def started(self, record: TrialRecord) -> None:
        self._records[record.number] = record
        self._live.update(self._table())

    def updated(self, record: TrialRecord) -> None:
        self._live.update(self._table())

    def finished(self, record: TrialRecord) -> None:
        self._records[record.number] = record
        self._live.update(self._table())


def choose_progress(metric: str, live: bool | None = None) -> PlainProgress:
    """A live table on a terminal (unless ``live`` is False), plain lines otherwise."""
    if live is None:
        live = sys.stdout.isatty() and os.environ.get("TERM") != "dumb"
    return LiveProgress(metric) if live else PlainProgress(metric)


def best_trial(records: list[TrialRecord], direction: str) -> TrialRecord | None:
    """The complete trial with the best value (lowest for minimize, highest for maximize)."""
    complete = [r for r in records if r.state == "complete" and r.value is not None]
    if not complete:
        return None
    pick = min if direction == "minimize" else max
    return pick(
        complete,
        key=lambda r: (r.value, r.number) if direction == "minimize" else (r.value, -r.number),
    )


def write_results(
    directory: Path, records: list[TrialRecord], metric: str, direction: str
) -> dict[str, Any]:
    """Write ``results.csv`` and ``results.json`` in ``directory``; return the JSON document."""
    records = sorted(records, key=lambda r: r.number)
    interrupted = interrupted_trials(directory, {r.number for r in records})
    names = sorted({k for r in records for k in r.params})
    rows = [
        (
            r.number,
            [
                r.number,
                r.state,
                "" if r.value is None else repr(r.value),
                *[r.params.get(n, "") for n in names],
                f"{r.seconds:.2f}",
                r.error or "",
            ],
        )
        for r in records
    ]
    rows += [
        (
            t["trial"],
            [
                t["trial"],
                INTERRUPTED,
                "",
                *[t["params"].get(n, "") for n in names],
                "",
                t["why"],
            ],
        )
        for t in interrupted
    ]
    with open(directory / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", "state", metric, *names, "seconds", "error"])
        for _, row in sorted(rows, key=lambda row: row[0]):
            writer.writerow(row)
    best = best_trial(records, direction)
    document = {
        "metric": metric,
        "direction": direction,
        "best": None
        if best is None
        else {"trial": best.number, "value": best.value, "params": best.params},
        "counts": {s: sum(r.state == s for r in records) for s in ("complete", "pruned", "failed")},
        "trials": [r.as_dict() for r in records],
        "interrupted": interrupted,
    }
    (directory / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    return document


def _plotted(records: list[TrialRecord]) -> list[TrialRecord]:
    """The trials a plot shows: those with a (finite) value, whatever their state."""
    return [r for r in records if r.value is not None and math.isfinite(r.value)]


def why_no_plot(records: list[TrialRecord], metric: str) -> str:
    """Why :func:`plot_results` drew nothing, for the sweep's last line."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "pip install matplotlib"
    if not _plotted(records):
        return f"no trial reported a value of {metric!r}"
    return "no parameters to plot against"


#: The state of a results.csv row for a trial a killed sweep interrupted and that was not run
#: again under its number (an Optuna study runs its configuration again as a new trial).
INTERRUPTED = "interrupted"


def interrupted_trials(directory: Path, recorded: set[int]) -> list[dict[str, Any]]:
    """Trials whose numbers have no result because a killed sweep interrupted them and their
    configuration ran again under another number (Optuna: the study marks the interrupted
    trial failed and enqueues its parameters as a new trial). Grid, random and list searches
    run an interrupted trial again under its own number, so it never shows here."""
    found: dict[int, dict[str, Any]] = {}
    aside = directory / "interrupted"
    if not aside.is_dir():
        return []
    for left in sorted(aside.iterdir()):
        number_text, _, _ = left.name.partition("-")
        if not number_text.isdigit() or int(number_text) in recorded:
            continue
        number = int(number_text)
        try:
            params = json.loads((left / "params.json").read_text())["params"]
        except (OSError, ValueError, KeyError, TypeError):
            params = {}
        found[number] = {
            "trial": number,
            "params": params,
            "left": f"interrupted/{left.name}",
            "why": (
                "interrupted when the sweep was killed; the study counts it as failed and ran "
                f"its configuration again as a new trial (what it left: interrupted/{left.name})"
            ),
        }
    return [found[n] for n in sorted(found)]


def prepare_plot() -> None:
    """Import matplotlib (about 1-2 s) ahead of :func:`plot_results`, e.g. while the last
    trials run; nothing when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        pass


def plot_results(
    path: Path, records: list[TrialRecord], metric: str, direction: str
) -> Path | None:
    """The metric against each parameter, one panel each; None without matplotlib or without
    a trial that reported the metric (:func:`why_no_plot` says which)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    done = _plotted(records)
    names = sorted({k for r in records for k in r.params})
    if not done or not names:
        return None
    best = best_trial(records, direction)
    width, height = 4.0 * len(names), 3.2  # inches
    fig, axes = plt.subplots(1, len(names), figsize=(width, height), squeeze=False)
    # Fixed margins (in inches: room for tick labels, axis labels and the title), not
    # tight_layout, which measures every label by drawing the figure once more: 0.45 s of a
    # 1 s plot, paid after the last trial.
    fig.subplots_adjust(
        left=0.8 / width,
        right=1 - 0.2 / width,
        bottom=0.6 / height,
        top=1 - 0.45 / height,
        wspace=1.0 / (4.0 - 1.0),
    )
    for ax, name in zip(axes[0], names, strict=True):
        values = [r.params.get(name) for r in done]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if numeric:
            xs = values
        else:
            labels = sorted({str(v) for v in values})
            xs = [labels.index(str(v)) for v in values]
            ax.set_xticks(range(len(labels)), labels)
        colors = ["tab:orange" if r.state == "pruned" else "tab:blue" for r in done]
        ax.scatter(xs, [r.value for r in done], c=colors, s=18)
        if best is not None and best.value is not None:
            bx = best.params.get(name)
            ax.scatter(
                [bx if numeric else xs[done.index(best)]],
                [best.value],
                marker="*",
                s=120,
                c="tab:red",
            )
        if numeric and all(v > 0 for v in values) and max(values) / max(min(values), 1e-300) > 50:
            ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel(metric)
    fig.suptitle(f"{metric} ({direction}); star = best, orange = pruned")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
