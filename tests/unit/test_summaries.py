"""Summaries: event files that TensorBoard's own reader accepts (framing, CRCs, protobuf), the
JSON-lines log (round trip, a run killed mid-line, damage), resuming a run, the PNG plot and
``tensorfleet plot``."""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow

from tensorfleet.launch.cli import main
from tensorfleet.summaries import (
    METRICS_FILE,
    EventFileWriter,
    MetricsLog,
    PlotDependencyError,
    SummaryWriter,
    crc32c,
    masked_crc32c,
    plot_metrics,
    read_metrics,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _records(path: Path) -> list[bytes]:
    """The TFRecords of ``path``, each CRC checked with TensorBoard's own implementation."""
    data = path.read_bytes()
    records, pos = [], 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        assert header_crc == pywrap_tensorflow.masked_crc32c(header)
        body = data[pos + 12 : pos + 12 + length]
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        assert body_crc == pywrap_tensorflow.masked_crc32c(body)
        records.append(body)
        pos += 16 + length
    assert pos == len(data)
    return records


def _accumulate(path: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(path))
    accumulator.Reload()
    return accumulator


# -- CRC32C and the event file ------------------------------------------------------------


def test_crc32c_known_vectors() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720, 32 bytes of zeros


def test_masked_crc32c_matches_tensorboard() -> None:
    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 8, 100, 1000):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert masked_crc32c(data) == pywrap_tensorflow.masked_crc32c(data)


def test_event_file_is_read_by_tensorboard_with_exact_tags_steps_and_float32_values(
    tmp_path: Path,
) -> None:
    points = [
        (0, {"loss": 2.302585, "acc/top1": 0.1}),
        (7, {"loss": 1.1, "acc/top1": 1 / 3}),
        (2**40, {"loss": 0.123456789}),  # a step that needs a long varint
    ]
    with EventFileWriter(tmp_path) as writer:
        for i, (step, values) in enumerate(points):
            writer.add_scalars(step, values, wall_time=1_700_000_000.25 + i)
    name = writer.path.name
    assert writer.path.parent == tmp_path
    assert name.startswith("events.out.tfevents.") and name.endswith(f".{os.getpid()}.tensorfleet")

    accumulator = _accumulate(tmp_path)
    assert sorted(accumulator.Tags()["scalars"]) == ["acc/top1", "loss"]
    loss = accumulator.Scalars("loss")
    assert [e.step for e in loss] == [0, 7, 2**40]
    assert [e.value for e in loss] == [float(np.float32(v)) for v in (2.302585, 1.1, 0.123456789)]
    assert [e.wall_time for e in loss] == [1_700_000_000.25, 1_700_000_001.25, 1_700_000_002.25]
    top1 = accumulator.Scalars("acc/top1")
    assert [(e.step, e.value) for e in top1] == [
        (0, float(np.float32(0.1))),
        (7, float(np.float32(1 / 3))),
    ]
    assert accumulator.file_version == 2.0


def test_event_file_records_decode_with_tensorboards_protobuf(tmp_path: Path) -> None:
    with EventFileWriter(tmp_path) as writer:
        writer.add_scalars(-3, {"x": 1e39, "y": -math.inf, "z": math.nan}, wall_time=5.5)
    first, second = (Event.FromString(r) for r in _records(writer.path))
    assert first.file_version == "brain.Event:2" and first.wall_time > 1e9
    assert (second.step, second.wall_time) == (-3, 5.5)
    values = {v.tag: v.simple_value for v in second.summary.value}
    assert values["x"] == math.inf  # beyond float32: an infinity, not an error
    assert values["y"] == -math.inf and math.isnan(values["z"])


def test_each_add_reaches_the_file_before_close(tmp_path: Path) -> None:
    writer = EventFileWriter(tmp_path)
    writer.add_scalars(1, {"loss": 0.5})
    writer.add_scalars(2, {"loss": 0.25})
    try:  # what a crash right now would leave
        assert len(_records(writer.path)) == 3
        assert [e.value for e in _accumulate(tmp_path).Scalars("loss")] == [0.5, 0.25]
    finally:
        writer.close()
    writer.close()  # harmless twice
    with pytest.raises(ValueError, match="is closed"):
        writer.add_scalars(3, {"loss": 0.1})


@pytest.mark.parametrize(
    ("step", "values", "error", "message"),
    [
        (1.5, {"a": 1.0}, TypeError, "step must be an integer (the global step), got 1.5"),
        (True, {"a": 1.0}, TypeError, "step must be an integer"),
        (2**63, {"a": 1.0}, ValueError, "step must fit in an int64"),
        (1, {"": 1.0}, ValueError, "a tag must be a non-empty string, got ''"),
        (1, {3: 1.0}, ValueError, "a tag must be a non-empty string, got 3"),
        (1, {"a": "1.0"}, TypeError, "value of 'a' must be a number, got the string '1.0'"),
        (1, {"a": [1.0, 2.0]}, TypeError, "value of 'a' must be a number (e.g. float(loss))"),
        (1, [("a", 1.0)], TypeError, "values must be a mapping of tag -> number, got list"),
    ],
)
def test_bad_scalars_are_refused_naming_the_value(
    tmp_path: Path, step: object, values: object, error: type, message: str
) -> None:
    with EventFileWriter(tmp_path) as writer, pytest.raises(error) as excinfo:
        writer.add_scalars(step, values)  # type: ignore[arg-type]
    assert message in str(excinfo.value)
    assert len(_records(writer.path)) == 1  # the file-version record only


def test_event_file_writer_needs_an_existing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        EventFileWriter(tmp_path / "missing")


# -- the JSON-lines log ------------------------------------------------------------------


def test_metrics_log_round_trip_with_non_finite_values_as_null(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        log.write(10, {"loss": 0.5, "acc": 0.75}, wall_time=100.5)
        log.write(20, {"loss": math.nan, "acc": math.inf}, wall_time=101.0)
        log.write(30, {"loss": 0.25})
    records = read_metrics(path)
    assert records[:2] == [
        {"step": 10, "wall_time": 100.5, "loss": 0.5, "acc": 0.75},
        {"step": 20, "wall_time": 101.0, "loss": None, "acc": None},
    ]
    assert records[2]["step"] == 30 and records[2]["loss"] == 0.25
    assert records[2]["wall_time"] > 1e9
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    for line in path.read_text().splitlines():
        json.loads(line)  # strict JSON, every line


def test_each_metrics_write_reaches_the_file_before_close(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "m.jsonl")
    try:
        log.write(1, {"loss": 1.0})
        assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [1]
    finally:
        log.close()


def test_reserved_keys_are_refused_as_tags(tmp_path: Path) -> None:
    with MetricsLog(tmp_path / "m.jsonl") as log, pytest.raises(ValueError) as excinfo:
        log.write(1, {"step": 3.0, "loss": 1.0})
    assert "tag(s) ['step'] are reserved" in str(excinfo.value)
    assert (tmp_path / "m.jsonl").read_text() == ""


def test_truncated_last_line_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        log.write(1, {"loss": 1.0}, wall_time=1.0)
        log.write(2, {"loss": 0.5}, wall_time=2.0)
    with open(path, "a") as file:
        file.write('{"step": 3, "wall_time": 3.0, "lo')  # killed mid-write
    with caplog.at_level(logging.WARNING, logger="tensorfleet.summaries.metrics_log"):
        records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]
    assert "partial last line 3" in caplog.text and str(path) in caplog.text


def test_a_complete_last_record_without_its_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "wall_time": 1.0, "loss": 1.0}\n{"step": 2, "wall_time": 2.0}')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"step": 2, "wall_', "Unterminated string"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"wall_time": 2.0}', 'expected an integer "step", got None'),
    ],
)
def test_damaged_line_in_the_middle_is_an_error_naming_file_and_line(
    tmp_path: Path, line: str, reason: str
) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "wall_time": 1.0}\n' + line + '\n{"step": 3, "wall_time": 3.0}\n')
    with pytest.raises(ValueError) as excinfo:
        read_metrics(path)
    text = str(excinfo.value)
    assert text.startswith(f"{path}, line 2: not a metrics record (")
    assert reason in text and "fix or delete that line" in text


# -- SummaryWriter and resuming -------------------------------------------------------------


def test_summary_writer_writes_both_files_and_creates_the_directory(tmp_path: Path) -> None:
    logdir = tmp_path / "runs" / "a"
    with SummaryWriter(logdir) as writer:
        writer.scalars(5, {"loss": 0.5}, wall_time=10.0)
        assert writer.event_file.parent == logdir
    assert read_metrics(logdir / METRICS_FILE) == [{"step": 5, "wall_time": 10.0, "loss": 0.5}]
    loss = _accumulate(logdir).Scalars("loss")
    assert [(e.step, e.wall_time, e.value) for e in loss] == [(5, 10.0, 0.5)]


def test_bad_values_write_neither_file(tmp_path: Path) -> None:
    with SummaryWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match="reserved"):
            writer.scalars(1, {"wall_time": 1.0})
        with pytest.raises(TypeError, match="must be a number"):
            writer.scalars(1, {"loss": "high"})
    assert read_metrics(tmp_path / METRICS_FILE) == []
    assert len(_records(writer.event_file)) == 1


def test_resuming_appends_to_metrics_and_starts_a_new_event_file(tmp_path: Path) -> None:
    with SummaryWriter(tmp_path) as first:
        first.scalars(10, {"loss": 1.0}, wall_time=1.0)
        first.scalars(20, {"loss": 0.8}, wall_time=2.0)
    with open(tmp_path / METRICS_FILE, "a") as file:
        file.write('{"step": 30, "wal')  # the first run was killed mid-write
    with SummaryWriter(tmp_path) as second:
        second.scalars(30, {"loss": 0.6}, wall_time=3.0)
        second.scalars(40, {"loss": 0.4}, wall_time=4.0)

    assert first.event_file != second.event_file
    assert sorted(p.name for p in tmp_path.glob("events.out.tfevents.*")) == sorted(
        [first.event_file.name, second.event_file.name]
    )
    records = read_metrics(tmp_path / METRICS_FILE)  # no damaged line left in the middle
    assert [(r["step"], r["loss"]) for r in records] == [(10, 1.0), (20, 0.8), (30, 0.6), (40, 0.4)]
    loss = _accumulate(tmp_path).Scalars("loss")
    assert [e.step for e in loss] == [10, 20, 30, 40]


# -- plotting -------------------------------------------------------------------------------


def _write_run(logdir: Path) -> None:
    with SummaryWriter(logdir) as writer:
        for step in range(0, 500, 50):
            writer.scalars(step, {"loss": 2.0 / (1 + step / 100), "accuracy": step / 600})
    with SummaryWriter(logdir) as writer:  # resumed
        writer.scalars(550, {"loss": math.nan, "accuracy": 0.93})
        writer.scalars(600, {"loss": 0.2, "global_steps_per_sec": 41.5})


def test_plot_writes_a_real_png(tmp_path: Path) -> None:
    import matplotlib.image

    _write_run(tmp_path)
    path = plot_metrics(tmp_path)
    assert path == tmp_path / "metrics.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 500 and pixels.shape[1] > 500
    colours = np.unique(pixels.reshape(-1, pixels.shape[2]), axis=0)
    assert len(colours) > 1


def test_plot_to_a_chosen_output(tmp_path: Path) -> None:
    _write_run(tmp_path / "run")
    out = tmp_path / "curves.png"
    assert plot_metrics(tmp_path / "run", out) == out
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert not (tmp_path / "run" / "metrics.png").exists()


def test_plot_without_metrics_names_the_file_and_the_hook(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as excinfo:
        plot_metrics(tmp_path / "nowhere")
    text = str(excinfo.value)
    assert str(tmp_path / "nowhere" / METRICS_FILE) in text and "SummaryHook" in text

    (tmp_path / METRICS_FILE).write_text("")
    with pytest.raises(ValueError) as excinfo:
        plot_metrics(tmp_path)
    assert "holds no values to plot" in str(excinfo.value) and "SummaryHook" in str(excinfo.value)


def test_plot_without_matplotlib_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    with pytest.raises(PlotDependencyError) as excinfo:
        plot_metrics(tmp_path)
    assert isinstance(excinfo.value, ImportError)
    assert "pip install 'tensorfleet[plot]'" in str(excinfo.value)


def test_cli_plot_prints_the_png_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path)
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "out.png")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'out.png'}\n"
    assert (tmp_path / "out.png").read_bytes()[:8] == PNG_SIGNATURE


def test_cli_plot_of_a_missing_directory_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(
        f"tensorfleet: error: no metrics file '{tmp_path / 'nowhere' / METRICS_FILE}'"
    )
    assert "SummaryHook" in captured.err
