"""Draw a run's metrics as a PNG, without TensorBoard: ``tensorfleet plot LOGDIR``.

Reads ``LOGDIR/metrics.jsonl`` (written by the chief when training runs with a
``SummaryHook``, or by any ``SummaryWriter``) and draws one panel per tag against the global
step. A resumed run appended to the same file, so its points simply continue the curves.
matplotlib is an optional dependency (``pip install 'tensorfleet[plot]'``), imported only
here, with the non-interactive Agg canvas: no display is needed and pyplot's global state is
left alone.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.summaries.metrics_log import RESERVED_KEYS, read_metrics
from tensorfleet.summaries.summary_writer import METRICS_FILE

#: Default name of the picture, in the log directory.
PLOT_FILE = "metrics.png"
_HOW_TO_GET_METRICS = (
    "the chief writes it during training when a SummaryHook(logdir) is among its hooks"
)


class PlotDependencyError(TensorfleetError, ImportError):
    """matplotlib, needed to draw the metrics, is not installed."""


def plot_metrics(
    logdir: str | os.PathLike[str], output: str | os.PathLike[str] | None = None
) -> Path:
    """Draw ``logdir/metrics.jsonl`` as a PNG at ``output`` (default: ``logdir/metrics.png``);
    return the path written.

    Raises ``FileNotFoundError`` if there is no metrics file, ``ValueError`` if it holds no
    values (or a damaged line), :class:`PlotDependencyError` if matplotlib is missing.
    """
    metrics_path = Path(logdir) / METRICS_FILE
    if not metrics_path.is_file():
        raise FileNotFoundError(f"no metrics file {str(metrics_path)!r}: {_HOW_TO_GET_METRICS}")
    records = read_metrics(metrics_path)
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        for tag, value in record.items():
            if tag in RESERVED_KEYS:
                continue
            steps, values = series.setdefault(tag, ([], []))
            steps.append(record["step"])
            values.append(math.nan if value is None else float(value))  # null: a gap
    if not series:
        raise ConfigError(
            f"metrics file {str(metrics_path)!r} holds no values to plot: {_HOW_TO_GET_METRICS}"
        )

    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotDependencyError(
            f"plotting needs matplotlib, which is not installed ({exc}): "
            "pip install 'tensorfleet[plot]'"
        ) from exc

    figure = Figure(figsize=(8, 2.4 * len(series)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (tag, (steps, values)) in zip(axes, series.items(), strict=True):
        ax.plot(steps, values, marker="." if len(steps) <= 50 else None, linewidth=1.2)
        ax.set_ylabel(tag)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("global step")
    figure.suptitle(str(Path(logdir)))

    path = Path(output) if output is not None else Path(logdir) / PLOT_FILE
    figure.savefig(path, format="png", dpi=100)
    return path
