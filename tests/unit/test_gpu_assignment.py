"""Which GPUs each worker gets from the launcher: one each by default (round-robin, shared when
there are more workers than GPUs), N each with --gpus-per-worker N, none with 0; the host's
GPUs found without torch (CUDA_VISIBLE_DEVICES, nvidia-smi -L, the driver's /proc entries)."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import pytest

from tensorfleet.cluster.gpu_assignment import HostGpus, assign_gpus, host_gpus
from tensorfleet.errors import ClusterConfigError
from tensorfleet.launch.resource_flags import add_resource_flags, launch_resources


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("workers", range(1, 17))
def test_default_gives_each_worker_one_gpu_round_robin(gpus: int, workers: int) -> None:
    host = HostGpus(tuple(range(10, 10 + gpus)), "CUDA_VISIBLE_DEVICES=...")
    assignment = assign_gpus(workers, host, None)
    assert assignment is not None and assignment.default
    assert assignment.per_worker == tuple((10 + i % gpus,) for i in range(workers))
    load = Counter(gpu for (gpu,) in assignment.per_worker)
    assert max(load.values()) - min(load.values()) <= 1  # balanced
    assert len(load) == min(gpus, workers)  # every GPU used before any is shared
    assert assignment.shared == (workers > gpus)
    line = assignment.describe()
    assert line.startswith(f"GPUs: one per worker, round-robin (the default), of the {gpus}")
    assert ("share" in line) == (workers > gpus), line
    assert (f"{gpus - workers} GPU(s) left unused" in line) == (workers < gpus), line
    assert line.count("\n") == (1 if workers > gpus else 0), line


def test_the_line_names_each_gpus_workers() -> None:
    assignment = assign_gpus(3, HostGpus((0, 1), "nvidia-smi -L"), None)
    assert assignment is not None
    assert assignment.workers_by_gpu() == {0: [0, 2], 1: [1]}
    first, second = assignment.describe().splitlines()
    assert "(nvidia-smi -L): GPU 0: worker 0,2; GPU 1: worker 1." in first
    assert second.startswith("3 workers share 2 GPU(s)")


def test_no_gpu_or_zero_per_worker_assigns_nothing() -> None:
    assert assign_gpus(4, HostGpus((), "no NVIDIA driver found"), None) is None
    assert assign_gpus(4, HostGpus((0, 1), "nvidia-smi -L"), 0) is None


def test_explicit_count_gives_disjoint_blocks_or_is_refused() -> None:
    assignment = assign_gpus(2, HostGpus((4, 5, 6, 7), "nvidia-smi -L"), 2)
    assert assignment is not None and not assignment.shared and not assignment.default
    assert assignment.per_worker == ((4, 5), (6, 7))
    with pytest.raises(ClusterConfigError, match=r"= 3 GPU\(s\), but this host has 2"):
        assign_gpus(3, HostGpus((0, 1), "nvidia-smi -L"), 1)
    with pytest.raises(ClusterConfigError, match="must be an integer >= 0, got -1"):
        assign_gpus(3, HostGpus((0, 1), "nvidia-smi -L"), -1)


def test_a_refusal_names_the_inherited_visible_devices_that_limit_the_count() -> None:
    # CUDA_VISIBLE_DEVICES= hides every GPU: the refusal said 'no GPU torch can use'
    hidden = HostGpus((), "CUDA_VISIBLE_DEVICES=")
    with pytest.raises(ClusterConfigError) as refused:
        assign_gpus(1, hidden, 1)
    assert "this host has 0 (none: CUDA_VISIBLE_DEVICES='' hides every GPU)" in str(refused.value)
    assert "unset CUDA_VISIBLE_DEVICES or list more GPUs in it" in str(refused.value)
    with pytest.raises(ClusterConfigError) as refused:
        assign_gpus(2, HostGpus((3,), "CUDA_VISIBLE_DEVICES=3"), 1)
    assert "this host has 1 (GPU ids 3, from CUDA_VISIBLE_DEVICES=3)" in str(refused.value)
    with pytest.raises(ClusterConfigError) as refused:  # what the launcher says
        launch_resources(_args("--gpus-per-worker", "1"), 0, 1, find_host_gpus=lambda: hidden)
    assert "CUDA_VISIBLE_DEVICES='' hides every GPU" in str(refused.value)


def test_host_gpus_from_visible_devices_nvidia_smi_or_proc(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "3,1"}).ids == (3, 1)
    assert host_gpus({"CUDA_VISIBLE_DEVICES": ""}).ids == ()
    smi = ["GPU 0: NVIDIA H200 (UUID: GPU-a)", "GPU 1: NVIDIA H200 (UUID: GPU-b)"]
    found = host_gpus({}, nvidia_smi=lambda: smi, proc_dir=absent)
    assert found == HostGpus((0, 1), "nvidia-smi -L")
    for bus in ("0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0"):
        (tmp_path / "gpus" / bus).mkdir(parents=True)
    assert host_gpus({}, nvidia_smi=lambda: None, proc_dir=tmp_path / "gpus").ids == (0, 1, 2)
    assert host_gpus({}, nvidia_smi=lambda: None, proc_dir=absent).ids == ()
    with pytest.raises(ClusterConfigError, match="'GPU-1234' is not a GPU index"):
        host_gpus({"CUDA_VISIBLE_DEVICES": "GPU-1234"})


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_resource_flags(parser)
    return parser.parse_args(list(argv))


def test_launcher_environments_follow_the_assignment() -> None:
    def two() -> HostGpus:
        return HostGpus((0, 1), "nvidia-smi -L")

    planned = launch_resources(_args(), 1, 3, find_host_gpus=two)
    visible = {name: env.get("CUDA_VISIBLE_DEVICES") for name, env in planned.envs.items()}
    assert visible == {"worker:0": "0", "worker:1": "1", "worker:2": "0", "ps:0": ""}
    assert planned.gpu_line is not None and "3 workers share 2 GPU(s)" in planned.gpu_line
    explicit = launch_resources(_args("--gpus-per-worker", "1"), 0, 2, find_host_gpus=two)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in explicit.envs.values()] == ["0", "1"]
    assert explicit.gpu_line is not None and "share" not in explicit.gpu_line
    off = launch_resources(_args("--gpus-per-worker", "0"), 1, 3, find_host_gpus=two)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in off.envs.values()] == ["", "", "", ""]
    assert off.gpu_line is not None and off.gpu_line.startswith("GPUs: none (--gpus-per-worker 0)")
    with pytest.raises(ClusterConfigError, match="--gpus-per-worker 0 gives no task a GPU"):
        launch_resources(_args("--gpus-per-worker", "0", "--gpu-memory-fraction", "0.5"), 1, 3)
    none = launch_resources(_args(), 1, 3, find_host_gpus=lambda: HostGpus((), "none"))
    assert all("CUDA_VISIBLE_DEVICES" not in env for env in none.envs.values())
    assert none.gpu_line is None
