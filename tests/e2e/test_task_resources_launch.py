"""Per-task resources through the launcher, checked from inside each task: the thread budget
(the host's cores divided among the tasks), disjoint CUDA_VISIBLE_DEVICES sets, and a GPU
request the host cannot meet refused before anything starts."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet import environment
from tensorfleet.cluster.resources import plan_resources
from tensorfleet.cluster.thread_budget import thread_budget
from tensorfleet.launch.local_cluster import LocalCluster
from tensorfleet.launch.output import PlainOutput

pytestmark = pytest.mark.e2e

PROBE = Path(__file__).parent / "programs" / "resource_probe.py"
SHORT = {"grace_period": 2.0, "kill_timeout": 1.0}


def reports(text: str) -> dict[str, dict]:
    found = {}
    for match in re.finditer(r"^\[(\w+:\d+)\] RESOURCES (.*)$", text, re.MULTILINE):
        found[match.group(1)] = json.loads(match.group(2))
    return found


@pytest.mark.timeout(60)
def test_cli_thread_budget_is_seen_inside_every_task() -> None:
    argv = [
        sys.executable,
        "-m",
        "tensorfleet",
        "launch",
        "--no-live",
        "--ps",
        "1",
        "--workers",
        "3",
        "--ps-runs-script",
        "--gpus-per-worker",
        "0",  # every task on the CPU, also on a host with GPUs
        "--grace-period",
        "2",
        "--",
        sys.executable,
        str(PROBE),
    ]
    result = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=50
    )
    text = result.stdout
    assert result.returncode == 0, text
    found = reports(text)
    assert sorted(found) == ["ps:0", "worker:0", "worker:1", "worker:2"], text
    budget = thread_budget(environment.host_cpu_count(), 4)  # workers first, then the ps
    expected = dict(zip(["worker:0", "worker:1", "worker:2", "ps:0"], budget, strict=True))
    for name, info in found.items():
        assert info["intra"] == info["applied_intra"] == expected[name], (name, text)
        assert info["inter"] == expected[name], (name, text)
        assert info["omp"] == str(expected[name]), (name, text)
        assert info["omp_spin"] == os.environ.get("GOMP_SPINCOUNT", "20000"), (name, text)
        assert info["cuda_visible_devices"] == "", (name, text)  # --gpus-per-worker 0
        assert info["cuda_devices"] == 0, (name, text)
    assert text.startswith("[launcher] GPUs: none (--gpus-per-worker 0)"), text


@pytest.mark.timeout(60)
def test_default_gives_each_worker_one_gpu_and_says_so_first() -> None:
    """Two GPUs faked through the launcher's CUDA_VISIBLE_DEVICES (physical ids 3 and 5),
    three workers: each worker's environment holds one of them, round-robin; the ps sees
    none; the launcher's first line says so, and a second that two workers share GPU 3."""
    argv = [
        sys.executable,
        "-m",
        "tensorfleet",
        "launch",
        "--no-live",
        "--ps",
        "1",
        "--workers",
        "3",
        "--ps-runs-script",
        "--grace-period",
        "2",
        "--",
        sys.executable,
        str(PROBE),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3,5"}
    result = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=50, env=env
    )
    text = result.stdout
    assert result.returncode == 0, text
    found = reports(text)
    assert {n: i["cuda_visible_devices"] for n, i in found.items()} == {
        "worker:0": "3",
        "worker:1": "5",
        "worker:2": "3",
        "ps:0": "",
    }, text
    lines = text.splitlines()
    assert lines[0].startswith("[launcher] GPUs: one per worker, round-robin (the default)"), text
    assert "GPU 3: worker 0,2; GPU 5: worker 1." in lines[0], text
    assert lines[1].startswith("[launcher] 3 workers share 2 GPU(s)"), text


@pytest.mark.timeout(60)
def test_disjoint_visible_gpus_per_worker() -> None:
    plan = plan_resources(1, 3, host_cores=2, host_gpus=(0, 1, 2, 3, 4, 5), gpus_per_worker=2)
    log = io.StringIO()
    cluster = LocalCluster(
        1,
        3,
        [sys.executable, str(PROBE)],
        ps_command=[sys.executable, str(PROBE)],
        task_env={name: res.to_env() for name, res in plan.items()},
        output=PlainOutput(log, log),
        **SHORT,
    )
    with cluster:
        status = cluster.wait(timeout=50)
    text = log.getvalue()
    assert status == 0, text
    found = reports(text)
    assert {n: i["cuda_visible_devices"] for n, i in found.items()} == {
        "worker:0": "0,1",
        "worker:1": "2,3",
        "worker:2": "4,5",
        "ps:0": "",
    }, text
    assert {i["intra"] for i in found.values()} == {1}, text


@pytest.mark.timeout(30)
def test_more_gpus_than_the_host_has_is_refused_before_anything_starts(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    program = f"open({str(marker)!r}, 'w').close()"
    argv = [
        sys.executable,
        "-m",
        "tensorfleet",
        "launch",
        "--no-live",
        "--workers",
        "2",
        "--gpus-per-worker",
        "64",
        "--",
        sys.executable,
        "-c",
        program,
    ]
    result = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=25
    )
    assert result.returncode == 2, result.stdout
    assert "64 GPU(s) per worker x 2 worker(s) = 128 GPU(s), but this host has" in result.stdout
    assert "nothing was started" in result.stdout
    assert not marker.exists()
