"""Training summaries: scalars written as TensorBoard event files and JSON lines, and plotted.

This package depends on nothing else in tensorfleet (but its errors), so that anything, a
session hook or a script, can write summaries. TensorBoard files are written in pure Python
(no tensorflow, tensorboard or protobuf needed); plotting needs the optional matplotlib
(``pip install 'tensorfleet[plot]'``).
"""

from __future__ import annotations

from tensorfleet.summaries.event_file import EventFileWriter, crc32c, masked_crc32c
from tensorfleet.summaries.metrics_log import MetricsLog, read_metrics
from tensorfleet.summaries.plot import PlotDependencyError, plot_metrics
from tensorfleet.summaries.summary_writer import METRICS_FILE, SummaryWriter

__all__ = [
    "METRICS_FILE",
    "EventFileWriter",
    "MetricsLog",
    "PlotDependencyError",
    "SummaryWriter",
    "crc32c",
    "masked_crc32c",
    "plot_metrics",
    "read_metrics",
]
