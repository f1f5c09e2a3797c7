"""A PBT run's lineage: every member's score and hyperparameters after each round, and every
exploit (who copied whom, at which step, at which version of the source); written as
``lineage.json``, ``lineage.csv`` and ``lineage.png`` in the run directory.

The lineage is the record Ray Tune's users missed when PBT restored the wrong checkpoint: here
each copy is a ps operation whose reply names the source's version (its update count at the
copy), and that version is what the lineage keeps. It is also part of the run's state
(``pbt_state.json``), so a resumed run continues it instead of starting another.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("tensorfleet.pbt")

LINEAGE_JSON = "lineage.json"
LINEAGE_CSV = "lineage.csv"
LINEAGE_PNG = "lineage.png"


@dataclass
class MemberRound:
    """One member at the end of one round, after the round's exploit and explore."""

    round: int
    member: str
    global_step: int
    score: float
    """Its score at the end of the round, before any exploit (lower is better)."""
    hyperparameters: dict[str, float]
    """Its hyperparameters for the next round (explored, when it exploited)."""
    copied_from: str | None = None
    source_version: int | None = None
    """The source's update count at the copy: the target's state equals the source's there."""
    source_global_step: int | None = None
    source_score: float | None = None


@dataclass
class Lineage:
    """The whole record of a run, round by round."""

    members: list[str]
    rounds: list[list[MemberRound]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"members": self.members, "rounds": [[asdict(m) for m in r] for r in self.rounds]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Lineage:
        return cls(list(data["members"]), [[MemberRound(**m) for m in r] for r in data["rounds"]])

    def exploits(self) -> list[MemberRound]:
        """Every copy, in order."""
        return [m for r in self.rounds for m in r if m.copied_from is not None]

    def write(self, directory: Path) -> dict[str, Path | None]:
        """Write lineage.json, lineage.csv and (matplotlib permitting) lineage.png."""
        paths: dict[str, Path | None] = {}
        paths["json"] = write_json(directory / LINEAGE_JSON, self.to_json())
        paths["csv"] = self._write_csv(directory / LINEAGE_CSV)
        try:
            paths["png"] = self._plot(directory / LINEAGE_PNG)
        except ImportError as exc:
            log.warning("no %s: matplotlib is not installed (%s)", LINEAGE_PNG, exc)
            paths["png"] = None
        return paths

    def _write_csv(self, path: Path) -> Path:
        names = sorted({k for r in self.rounds for m in r for k in m.hyperparameters})
        tmp = path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(
                ["round", "member", "global_step", "score", "copied_from", "source_version",
                 "source_global_step", *names]
            )  # fmt: skip
            for r in self.rounds:
                for m in r:
                    writer.writerow(
                        [m.round, m.member, m.global_step, m.score, m.copied_from or "",
                         "" if m.source_version is None else m.source_version,
                         "" if m.source_global_step is None else m.source_global_step,
                         *(m.hyperparameters.get(n, "") for n in names)]
                    )  # fmt: skip
        os.replace(tmp, path)
        return path

    def _plot(self, path: Path) -> Path:
        """Score and each hyperparameter (after the round's explore: the next round's)
        per member against the global step; an arrow for each copy, from the source's point
        to the target's (score: the target's before the copy; hyperparameter: explored)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        names = sorted({k for r in self.rounds for m in r for k in m.hyperparameters})
        figure = Figure(figsize=(8, 2.6 * (1 + len(names))), layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots(1 + len(names), 1, sharex=True, squeeze=False)[:, 0]
        panels: list[tuple[str, Any]] = [("score", None), *((n, n) for n in names)]
        colors = {member: f"C{i}" for i, member in enumerate(self.members)}
        for ax, (label, key) in zip(axes, panels, strict=True):
            for member in self.members:
                points = [m for r in self.rounds for m in r if m.member == member]
                ys = [
                    m.score if key is None else m.hyperparameters.get(key, math.nan) for m in points
                ]
                ax.plot([m.global_step for m in points], ys, marker=".", color=colors[member],
                        label=member, linewidth=1.2)  # fmt: skip
            for m in self.exploits():
                source = next(s for s in self.rounds[m.round] if s.member == m.copied_from)
                y0 = source.score if key is None else source.hyperparameters.get(key)
                y1 = m.score if key is None else m.hyperparameters.get(key)
                ax.annotate("", xy=(m.global_step, y1), xytext=(source.global_step, y0),
                            arrowprops={"arrowstyle": "->", "color": colors[m.member],
                                        "alpha": 0.6})  # fmt: skip
            ax.set_yscale("log")
            ax.set_ylabel(label if key is None else f"{label} (for the next round)")
            ax.grid(True, alpha=0.3)
        axes[0].legend(fontsize="small", ncols=min(4, len(self.members)))
        axes[-1].set_xlabel("member's global step")
        figure.suptitle(f"PBT lineage: {len(self.exploits())} exploits (arrows: copied from)")
        figure.savefig(path, format="png", dpi=100)
        return path


def write_json(path: Path, data: Any) -> Path:
    """Write ``data`` as JSON at ``path`` atomically (a reader sees the old or the new file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def best(rounds: Sequence[MemberRound]) -> MemberRound:
    """The member of a round with the lowest score (a NaN, a diverged member, ranks last)."""
    return min(rounds, key=lambda m: math.inf if math.isnan(m.score) else m.score)
