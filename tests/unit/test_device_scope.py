"""tfl.device scopes and tfl.place: TensorFlow's merging, soft placement, the task check, and
the placement report."""

from __future__ import annotations

import re
import sys
import warnings

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.cluster import resolver
from tensorfleet.errors import ClusterConfigError
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.worker.device import SoftPlacementWarning
from tensorfleet.worker.device_scope import current_device_spec, device, place, requested_device
from tensorfleet.worker.placement_report import placement_report, placement_rows

NO_GPU = {"cuda_device_count": lambda: 0}


def test_scopes_nest_and_merge_like_tensorflow():
    with device("/job:worker/task:1", task="worker:1"):
        assert current_device_spec().to_string() == "/job:worker/task:1"
        with device("/cpu:0", task="worker:1") as dev:
            assert dev == torch.device("cpu")
            layer = nn.Linear(2, 2)
            assert current_device_spec().to_string() == "/job:worker/task:1/device:CPU:0"
        assert current_device_spec().to_string() == "/job:worker/task:1"
    assert current_device_spec().to_string() == ""
    assert requested_device(layer).to_string() == "/job:worker/task:1/device:CPU:0"
    untagged = nn.Linear(2, 2)
    assert requested_device(untagged) is None


def test_missing_gpu_is_an_error_naming_it_and_the_devices_present():
    with pytest.raises(
        ClusterConfigError,
        match=re.escape("device '/device:GPU:1' asks for a GPU, but this machine has none")
        + r".*devices present: /device:CPU:0.*soft_placement=True",
    ):
        with device("/gpu:1", **NO_GPU):
            pass
    assert current_device_spec().to_string() == ""  # the failed scope left nothing behind


def test_soft_placement_falls_back_to_cpu_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with device("/device:GPU:7", soft_placement=True, **NO_GPU) as dev:
                layer = nn.Linear(3, 3)
    assert dev == torch.device("cpu") and layer.weight.device.type == "cpu"
    soft = [w for w in caught if issubclass(w.category, SoftPlacementWarning)]
    assert len(soft) == 1, [str(w.message) for w in caught]
    assert "computing on /device:CPU:0 instead" in str(soft[0].message)
    rows = placement_rows(nn.Sequential(layer))
    assert rows[-1].asked == "/device:GPU:7" and rows[-1].device == "/device:CPU:0"


def test_a_spec_naming_another_task_is_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(resolver, "_this_process", None)  # no task resolved in this process
    with pytest.raises(
        ClusterConfigError, match=r"names another task than this process's \(worker:0\)"
    ):
        with device("/job:worker/task:1", task="worker:0"):
            pass
    with pytest.raises(ClusterConfigError, match=r"placement= \('greedy' or 'round_robin'\)"):
        with device("/job:ps/task:0", task="worker:0"):
            pass
    with pytest.raises(ClusterConfigError, match="replica 2"):
        with device("/replica:2/cpu:0", task="worker:0"):
            pass
    with pytest.raises(ClusterConfigError, match="this process's task is unknown"):
        with device("/job:ps"):
            pass


def test_place_moves_and_tags_a_built_module():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    with device("/job:worker", task="worker:0"):
        place(model[2], "/cpu:0")
    assert requested_device(model[2]).to_string() == "/job:worker/device:CPU:0"
    assert requested_device(model[0]) is None
    with pytest.raises(ClusterConfigError, match="unknown device type 'tpu'"):
        place(model, "/tpu:0")


def test_report_lists_every_variable_with_its_shard_and_every_module_with_task_and_device():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    specs = [VariableSpec(n, tuple(p.shape), "float32", 4) for n, p in model.named_parameters()]
    plan = plan_placement(specs, 2, "round_robin")
    text = placement_report(model, plan=plan, task="worker:0", stage_tasks={"2": "worker:1"})
    lines = text.splitlines()
    assert lines[0] == "placement (round_robin, 2 ps shard(s)):"
    table = [line.split() for line in lines[2:]]
    assert table == [
        ["variable", "0.weight", "[8,", "4]", "ps:0", "worker:0", "/device:CPU:0"],
        ["variable", "0.bias", "[8]", "ps:1", "worker:0", "/device:CPU:0"],
        ["variable", "2.weight", "[2,", "8]", "ps:0", "worker:1", "/device:CPU:0"],
        ["variable", "2.bias", "[2]", "ps:1", "worker:1", "/device:CPU:0"],
        ["module", "0", "Linear", "-", "worker:0", "/device:CPU:0"],
        ["module", "2", "Linear", "-", "worker:1", "/device:CPU:0"],
    ]
    local = placement_report(model)
    assert local.splitlines()[0] == "placement (no ps: variables are local):"
    assert "local" in local.splitlines()[2]


def test_partitioned_variable_lists_every_shard():
    model = nn.Sequential(nn.Embedding(100, 8))
    specs = [VariableSpec("0.weight", (100, 8), "float32", 4)]
    plan = plan_placement(specs, 3, partition_threshold_bytes=100)
    assert placement_rows(model, plan=plan)[0].stored_on == "ps:0,ps:1,ps:2"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_scope_builds_on_the_gpu():  # pragma: no cover - GPU machines only
    with device("/gpu:0"):
        layer = nn.Linear(2, 2)
    assert layer.weight.device.type == "cuda"
    assert placement_rows(nn.Sequential(layer))[-1].device == "/device:GPU:0"


def test_a_module_built_under_another_cpu_index_shows_what_it_asked_for():
    with device("/device:CPU:1"):
        layer = nn.Linear(2, 2)
    rows = placement_rows(nn.Sequential(layer))
    assert rows[-1].device == "/device:CPU:0" and rows[-1].asked == "/device:CPU:1", rows
    report = placement_report(nn.Sequential(layer))
    assert "/device:CPU:1" in report and "runs on /device:CPU:0" in report, report
    with device("/device:CPU:0"):
        plain = nn.Linear(2, 2)
    assert placement_rows(nn.Sequential(plain))[-1].asked == ""
    assert "runs on /device:CPU:0" not in placement_report(nn.Sequential(plain))


def test_a_job_and_task_are_checked_against_the_task_resolve_task_found_from_the_flags(
    monkeypatch: pytest.MonkeyPatch,
):
    """A TensorFlow script names its task with --job_name/--task_index: the task
    resolve_task() found from them is the one a device's '/job:' and '/task:' name."""
    monkeypatch.setattr(resolver, "_this_process", None)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    flags = ["--job_name=worker", "--task_index=1", "--ps_hosts=h0:1", "--worker_hosts=h1:1,h2:1"]
    monkeypatch.setattr(sys, "argv", ["trainer.py", *flags])
    task = tfl.resolve_task()
    assert (task.job, task.index) == ("worker", 1)
    with device("/job:worker/task:1/cpu:0"):
        layer = nn.Linear(2, 2)
    assert requested_device(layer).to_string() == "/job:worker/task:1/device:CPU:0"
    with pytest.raises(ClusterConfigError, match=r"another task than this process's \(worker:1\)"):
        with device("/job:worker/task:0"):
            pass
