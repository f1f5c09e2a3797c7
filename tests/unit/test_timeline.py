"""The timeline (tensorfleet.worker.timeline): a task's steps as a Chrome trace that
Perfetto opens, written by a TrainingSession given ``timeline=``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from tensorfleet.errors import ConfigError
from tensorfleet.launch.ports import free_port
from tensorfleet.optim import SGD
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.session.server import Server, ServerConfig
from tensorfleet.session.training_session import TrainingSession
from tensorfleet.wire.secret import load_secret
from tensorfleet.worker.push_overlap import Overlap
from tensorfleet.worker.timeline import (
    NO_TIMELINE,
    TRACK_TID_BASE,
    Timeline,
    task_path,
    task_timeline,
)

from .service_harness import serve_in_thread, stop_services

SECRET = "timeline-unit-test-secret-000001"


def _check_trace(path: Path, task: str) -> list[dict]:
    """The trace's complete events, after checking the file is Trace Event Format JSON."""
    trace = json.loads(path.read_text())
    assert isinstance(trace["traceEvents"], list)
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert meta[0] == {
        "name": "process_name",
        "ph": "M",
        "pid": meta[0]["pid"],
        "args": {"name": task},
    }
    tracks = meta[1:]  # named tracks (e.g. requests in flight): a thread name each
    for track in tracks:
        assert track["name"] == "thread_name" and track["pid"] == meta[0]["pid"], track
        assert isinstance(track["tid"], int) and isinstance(track["args"]["name"], str)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for event in spans:
        assert set(event) >= {"name", "ph", "ts", "dur", "pid", "tid"}
        assert isinstance(event["ts"], float) and event["dur"] >= 0
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
    used = {event["tid"] for event in spans}
    assert {track["tid"] for track in tracks} <= used  # no track without spans
    return spans


def test_spans_nest_and_are_written_as_trace_event_json(tmp_path: Path) -> None:
    timeline = Timeline("worker:0")
    with timeline.span("step", step=1):
        with timeline.span("inner"):
            pass
    path = timeline.write(tmp_path / "deep" / "t.json")
    spans = _check_trace(path, "worker:0")
    inner, outer = spans  # an inner span ends first
    assert (inner["name"], outer["name"], outer["args"]) == ("inner", "step", {"step": 1})
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert json.loads(path.read_text())["otherData"]["dropped_events"] == 0


def test_a_full_timeline_drops_its_oldest_spans_and_says_so() -> None:
    timeline = Timeline("worker:1", max_events=3)
    for index in range(5):
        timeline.add(f"s{index}", 0, 10)
    assert [e["name"] for e in timeline.events] == ["s2", "s3", "s4"]
    assert timeline.to_json()["otherData"]["dropped_events"] == 2


def test_off_it_records_nothing() -> None:
    with NO_TIMELINE.span("step"):
        NO_TIMELINE.add("x", 0, 1)
    assert NO_TIMELINE.events == [] and not NO_TIMELINE.enabled
    assert task_timeline(None, "worker:0") == (NO_TIMELINE, None)


def test_each_task_gets_its_own_file_and_a_bad_directory_fails_at_once(tmp_path: Path) -> None:
    assert task_path("out/trace.json", "worker:0") == Path("out/trace.worker-0.json")
    assert task_path("trace", "ps:1") == Path("trace.ps-1.json")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot write the timeline of worker:0 to .*a-file"):
        task_timeline(blocker / "trace.json", "worker:0")


def test_a_parent_that_is_a_file_is_named_and_missing_directories_are_made(
    tmp_path: Path,
) -> None:
    """A file where a directory should be is named as such (mkdir alone said only "File
    exists" or "Not a directory"), at once and when writing; missing directories, however
    deep, are created."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for path in (blocker / "trace.json", blocker / "sub" / "deeper" / "trace.json"):
        with pytest.raises(ConfigError, match=r"'[^']*a-file' is a file, not a directory") as e:
            task_timeline(path, "worker:0")
        assert "File exists" not in str(e.value) and "Not a directory" not in str(e.value)
        with pytest.raises(ConfigError, match=r"a-file' is a file, not a directory"):
            Timeline("worker:0").write(path)
    timeline, target = task_timeline(tmp_path / "new" / "deeper" / "trace.json", "ps:0")
    assert target == tmp_path / "new" / "deeper" / "trace.ps-0.json" and target.parent.is_dir()
    assert timeline.write(target).is_file()


def test_a_session_in_async_mode_writes_its_steps_and_exchanges(tmp_path: Path) -> None:
    running = serve_in_thread(
        ServiceConfig(shard_index=0, worker_tasks=("worker:0",)), load_secret(SECRET)
    )
    try:
        server = Server(
            {"ps": [running.address], "worker": ["127.0.0.1:1"]}, "worker", 0, secret=SECRET
        )
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        with TrainingSession(server, model, SGD(lr=0.1), timeline=tmp_path / "trace.json") as sess:
            for _ in range(3):
                sess.step(lambda: ((model(x) - y) ** 2).mean())
        assert sess.timeline_path == tmp_path / "trace.worker-0.json"
        spans = _check_trace(sess.timeline_path, "worker:0")
    finally:
        stop_services([running])
    names = [e["name"] for e in spans]
    for name in ("step", "compute", "backward", "exchange", "pack", "push", "wait", "unpack"):
        assert names.count(name) >= 3, (name, names)
    assert "pull" in names  # the first values, at the start
    steps = [e for e in spans if e["name"] == "step"]
    pushes = [e for e in spans if e["name"] == "push"]
    for step, push in zip(steps, pushes, strict=True):  # each push lies inside its step
        assert step["ts"] <= push["ts"] <= step["ts"] + step["dur"]


def test_pushes_during_the_backward_start_before_it_ends_and_the_ps_records_its_side(
    tmp_path: Path,
) -> None:
    """With buckets, a step's trace shows pushes inside its backward pass; the ps given a
    timeline (ServerConfig(timeline=)) writes its own, with receive, apply and reply."""
    cluster = {"ps": [f"127.0.0.1:{free_port()}"], "worker": ["127.0.0.1:1"]}
    ps = Server(cluster, "ps", 0, secret=SECRET, config=ServerConfig(timeline=tmp_path / "t.json"))
    try:
        server = Server(cluster, "worker", 0, secret=SECRET)
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)
        )
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        with TrainingSession(
            server,
            model,
            SGD(lr=0.1),
            timeline=tmp_path / "t.json",
            overlap=Overlap(bucket_bytes=256),
            progress_secs=None,
        ) as sess:
            for _ in range(3):
                sess.step(lambda: ((model(x) - y) ** 2).mean())
        ps.join(10.0)  # the service ends once its one worker is done, and writes its trace
    finally:
        ps.stop()
    spans = _check_trace(sess.timeline_path, "worker:0")
    backwards = [e for e in spans if e["name"] == "backward"]
    pushes = [e for e in spans if e["name"] == "push"]
    assert len(backwards) == 3
    for backward in backwards:
        end = backward["ts"] + backward["dur"]
        inside = [p for p in pushes if backward["ts"] <= p["ts"] < end]
        assert inside, "no push started during this backward pass"
        buckets = [e for e in spans if e["name"] == "bucket" and backward["ts"] <= e["ts"] < end]
        assert len(buckets) >= 3  # one stretch of the backward per bucket
    in_flight = [e for e in spans if e["name"] == "in flight"]
    assert in_flight and all(e["tid"] >= TRACK_TID_BASE for e in in_flight)
    # Buckets queued behind a full shard (MAX_IN_FLIGHT requests) go out together (as one
    # request), so how many requests a step makes depends on timing; the first (bucket 0)
    # always goes alone.
    assert {e["args"]["bucket"] for e in in_flight} >= {0, 1}
    ps_spans = _check_trace(tmp_path / "t.ps-0.json", "ps:0")
    names = [e["name"] for e in ps_spans]
    applies = [e for e in ps_spans if e["name"] == "apply"]
    assert len(applies) >= 6 and names.count("reply") >= 6  # at least two requests a step
    covered = Counter()  # each of the shard's 6 variables once per step
    for apply in applies:
        start, stop = map(int, apply["args"]["variables"].split("-"))
        covered.update(range(start, stop))
    assert covered == dict.fromkeys(range(6), 3)
    assert names.count("receive") >= len(applies)
