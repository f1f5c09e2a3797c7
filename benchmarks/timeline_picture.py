"""Draw one training step of worker 0 and what ps 0 did meanwhile, before and after the
overlap, from the Chrome traces the tasks wrote (``--timeline``): the picture of
docs/timeline.md.

    .venv/bin/python benchmarks/timeline_picture.py BEFORE_DIR AFTER_DIR -o docs/timeline-overlap.png

Each directory holds ``trace.worker-0.json`` and ``trace.ps-0.json`` of one run (e.g. from
``benchmarks/overlap.py --timelines DIR``). The step drawn is the one of median duration
after the first ``--skip`` steps; both panels share the time axis (ms from the step's start).
Needs matplotlib (``pip install 'tensorfleet[plot]'``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

#: Rows from top to bottom: (label, the span names drawn there, on the worker's own thread).
ROWS = [
    ("worker:0 forward, backward", ("compute", "backward")),
    ("backward, bucket by bucket", ("bucket",)),
    ("worker:0 pack, push, wait, unpack", ("pack", "push", "wait", "unpack")),
    ("pushes in flight to ps:0", ("in flight",)),
    ("ps:0 receive, apply, reply", ("receive", "apply", "reply")),
]
COLORS = {
    "compute": "#4c72b0",
    "backward": "#55a868",
    "bucket": "#8fd19e",
    "pack": "#8172b2",
    "push": "#c44e52",
    "wait": "#cccccc",
    "unpack": "#937860",
    "in flight": "#dd8452",
    "receive": "#64b5cd",
    "apply": "#c44e52",
    "reply": "#dd8452",
}


def _spans(path: Path) -> list[dict]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def one_step(directory: Path, skip: int) -> tuple[dict, list[dict], list[dict]]:
    """The step of median duration (after ``skip``), worker 0's spans and ps 0's in it."""
    worker = _spans(directory / "trace.worker-0.json")
    ps_path = directory / "trace.ps-0.json"
    ps = _spans(ps_path) if ps_path.exists() else []
    steps = [e for e in worker if e["name"] == "step"][skip:]
    if not steps:
        raise SystemExit(f"{directory}: fewer than {skip + 1} steps in trace.worker-0.json")
    middle = statistics.median_low([s["dur"] for s in steps])
    step = next(s for s in steps if s["dur"] == middle)
    start, end = step["ts"], step["ts"] + step["dur"]

    def inside(e: dict) -> bool:
        return e["ts"] < end and e["ts"] + e["dur"] > start

    return step, [e for e in worker if inside(e)], [e for e in ps if inside(e)]


def draw(panels: list[tuple[str, Path]], output: Path, skip: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    chosen = [(title, *one_step(directory, skip)) for title, directory in panels]
    longest = max(step["dur"] for _, step, _, _ in chosen) / 1000
    figure, axes = plt.subplots(len(chosen), 1, figsize=(11, 2.2 * len(chosen) + 0.6), sharex=True)
    for axis, (title, step, worker, ps) in zip(axes, chosen, strict=True):
        origin = step["ts"]
        for row, (_, names) in enumerate(ROWS):
            y = len(ROWS) - 1 - row
            source = ps if names[0] in ("receive", "apply", "reply") else worker
            for event in source:
                if event["name"] not in names:
                    continue
                left = (event["ts"] - origin) / 1000
                axis.broken_barh(
                    [(left, max(event["dur"] / 1000, longest / 800))],
                    (y - 0.38, 0.76),
                    facecolors=COLORS[event["name"]],
                    edgecolor="white" if event["name"] == "in flight" else "none",
                    linewidth=0.5,
                )
        axis.set_yticks(range(len(ROWS)), [label for label, _ in reversed(ROWS)], fontsize=8)
        axis.set_xlim(0, longest * 1.02)
        axis.set_title(f"{title}: one step, {step['dur'] / 1000:.0f} ms", fontsize=10, loc="left")
        axis.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms from the start of the step")
    handles = [Patch(color=color, label=name) for name, color in COLORS.items()]
    figure.legend(handles=handles, loc="lower center", ncol=6, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("before", type=Path, help="traces of the sequential step")
    parser.add_argument("after", type=Path, help="traces with the overlap")
    parser.add_argument("--after-title", default="after: buckets pushed during the backward")
    parser.add_argument("-o", "--output", type=Path, default=Path("timeline-overlap.png"))
    parser.add_argument("--skip", type=int, default=20, help="warm-up steps not considered")
    args = parser.parse_args()
    path = draw(
        [("before: sequential", args.before), (args.after_title, args.after)],
        args.output,
        args.skip,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
