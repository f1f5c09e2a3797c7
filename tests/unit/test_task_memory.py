"""Each task's peak memory: measured (``tensorfleet.task_memory``), left for the launcher in
the run's marker directory, and read back into the summary line
(``tensorfleet.launch.peak_memory``)."""

from __future__ import annotations

from tensorfleet import task_markers, task_memory
from tensorfleet.launch.peak_memory import format_bytes, peak_memory_line


def test_peak_rss_is_this_processes_high_water_mark() -> None:
    before = task_memory.peak_rss_bytes()
    block = bytearray(64 << 20)  # zero-filled: its pages are touched
    after = task_memory.peak_rss_bytes()
    assert len(block) == 64 << 20
    assert after >= before > 1 << 20
    assert after >= 64 << 20


def test_a_tasks_record_reaches_the_summary_line_and_a_missing_one_is_a_question_mark(
    tmp_path,
) -> None:
    markers = task_markers.TaskMarkers()
    markers.directory = tmp_path
    environ = {task_markers.MARKERS_VAR: str(tmp_path)}
    task_memory.write_now("ps:0", environ)
    line = peak_memory_line(["ps:0", "worker:0"], markers)
    assert line is not None
    recorded = markers.read("ps:0", task_memory.PEAK_RSS)
    assert recorded.isdigit()
    # The unit depends on how big this test process has grown (MiB or GiB): compare
    # with the formatting of the number recorded, not with a fixed unit.
    assert line.startswith(f"peak memory (RSS): ps:0 {format_bytes(int(recorded))}")
    assert line.endswith("worker:0 ? (no record)")  # no exit status known: no reason given


def test_a_missing_record_says_why_from_the_tasks_exit_status(tmp_path) -> None:
    markers = task_markers.TaskMarkers()
    markers.directory = tmp_path
    task_memory.write_now("ps:0", {task_markers.MARKERS_VAR: str(tmp_path)})
    line = peak_memory_line(
        ["ps:0", "worker:0", "worker:1"], markers, {"ps:0": 0, "worker:0": -9, "worker:1": 0}
    )
    assert line is not None
    assert "worker:0 ? (no record: ended by SIGKILL)" in line
    assert line.endswith("worker:1 ? (no record: it exited (code 0) without starting a tfl.Server)")


def test_no_record_at_all_gives_no_line(tmp_path) -> None:
    markers = task_markers.TaskMarkers()
    markers.directory = tmp_path
    assert peak_memory_line(["worker:0"], markers) is None


def test_without_a_launcher_nothing_is_registered() -> None:
    task_memory.record_at_exit("worker:7", {})
    assert "worker:7" not in task_memory._registered


def test_format_bytes() -> None:
    assert format_bytes(512 << 10) == "512 KiB"
    assert format_bytes(212 << 20) == "212.0 MiB"
    assert format_bytes(3 << 30) == "3.00 GiB"
