"""The all-reduce group's backend, chosen from where its workers compute: NCCL only when each
has a GPU of its own, gloo when some share one (NCCL refuses that) or compute on the CPU;
each worker's device identity (GPU UUID, or its physical index through CUDA_VISIBLE_DEVICES)
survives the fixed-size encoding of the exchange; a world of one prints its choice; a failed
DDP set-up names the worker, its device and the fix instead of a raw backend traceback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tensorfleet.errors import ClusterConfigError, ConfigError
from tensorfleet.launch.ports import free_port
from tensorfleet.worker.allreduce_updater import AllReduceUpdater
from tensorfleet.worker.client import ClientTimeouts
from tensorfleet.worker.collective_backend import (
    IDENTITY_BYTES,
    DeviceIdentity,
    choose_backend,
    decode_identity,
    device_identity,
    encode_identity,
)

pytestmark = pytest.mark.timeout(60)


def gpu(host: str, key: str) -> DeviceIdentity:
    return DeviceIdentity(host, key, f"GPU {key} (NVIDIA H200) of {host}")


def cpu(host: str) -> DeviceIdentity:
    return DeviceIdentity(host, None, f"the CPU of {host}")


def test_each_worker_on_its_own_gpu_gets_nccl() -> None:
    choice = choose_backend([gpu("a", "GPU-0"), gpu("a", "GPU-1"), gpu("b", "GPU-0")])
    assert choice.backend == "nccl" and not choice.shared
    assert (
        choice.describe(0)
        == "worker 0: all-reduce over nccl: each of the 3 worker(s) has its own GPU"
    )


def test_workers_sharing_a_gpu_get_gloo_naming_them_and_the_gpu() -> None:
    ranks = [gpu("a", "GPU-0"), gpu("a", "GPU-1"), gpu("a", "GPU-0"), gpu("a", "GPU-0")]
    choice = choose_backend(ranks)
    assert choice.backend == "gloo"
    assert choice.shared == {"GPU GPU-0 (NVIDIA H200) of a": (0, 2, 3)}
    assert "workers 0,2,3 on GPU GPU-0 (NVIDIA H200) of a" in choice.reason
    assert "NCCL refuses two workers on one GPU" in choice.reason


def test_cpu_workers_or_a_mix_get_gloo() -> None:
    assert choose_backend([cpu("a"), cpu("a")]).reason == "every worker computes on the CPU"
    mixed = choose_backend([gpu("a", "GPU-0"), cpu("a")])
    assert mixed.backend == "gloo" and "worker(s) 1 compute on the CPU" in mixed.reason
    with pytest.raises(ConfigError, match="at least one rank"):
        choose_backend([])


def test_identity_of_a_gpu_maps_the_process_index_to_the_physical_one() -> None:
    def fake(uuid: str | None, visible: str | None) -> DeviceIdentity:
        return device_identity(
            torch.device("cuda", 1),
            environ={} if visible is None else {"CUDA_VISIBLE_DEVICES": visible},
            hostname=lambda: "node7",
            uuid_of=lambda index: uuid,
            name_of=lambda index: "NVIDIA H200",
        )

    assert fake(None, "4,6") == DeviceIdentity("node7", "index:6", "GPU 6 (NVIDIA H200) of node7")
    assert fake(None, None).gpu == "index:1"
    assert fake("GPU-abc", "4,6").gpu == "GPU-abc"
    # Two processes whose CUDA_VISIBLE_DEVICES both map their cuda:0 to GPU 3 share it.
    same = [
        device_identity(
            torch.device("cuda", 0),
            environ={"CUDA_VISIBLE_DEVICES": "3"},
            hostname=lambda: "h",
            uuid_of=lambda index: None,
            name_of=lambda index: "card",
        )
        for _ in range(2)
    ]
    assert choose_backend(same).backend == "gloo"
    assert device_identity(torch.device("cpu"), hostname=lambda: "h").gpu is None


def test_identity_round_trips_through_its_fixed_size_tensor() -> None:
    identity = gpu("a-host.example.org", "GPU-8f2e")
    encoded = encode_identity(identity)
    assert encoded.shape == (IDENTITY_BYTES,) and encoded.dtype == torch.uint8
    assert decode_identity(encoded) == identity
    huge = DeviceIdentity("h" * 900, "GPU-x", "label " * 200)
    assert decode_identity(encode_identity(huge)).host == "h" * 100


@pytest.fixture
def updater() -> Iterator[AllReduceUpdater]:
    made = AllReduceUpdater(f"127.0.0.1:{free_port()}", 0, 1, ClientTimeouts(connect_s=10.0))
    try:
        yield made
    finally:
        made.close()
        assert not dist.is_initialized()


def test_a_cpu_group_prints_its_backend_and_why(
    updater: AllReduceUpdater, capsys: pytest.CaptureFixture[str]
) -> None:
    updater.connect(torch.device("cpu"))
    assert updater.backend_choice is not None and updater.backend_choice.backend == "gloo"
    assert (
        "worker 0: all-reduce over gloo: every worker computes on the CPU"
        in capsys.readouterr().out
    )


def test_a_failed_ddp_setup_names_the_worker_its_device_and_the_fix(
    updater: AllReduceUpdater, monkeypatch: pytest.MonkeyPatch
) -> None:
    updater.connect(torch.device("cpu"))

    def refuse(*args: object, **kwargs: object) -> None:
        raise dist.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage\n"
            "ncclInvalidUsage: Duplicate GPU detected : rank 2 and rank 0 both on CUDA device 60"
        )

    monkeypatch.setattr("tensorfleet.worker.allreduce_updater.DistributedDataParallel", refuse)
    with pytest.raises(ClusterConfigError) as caught:
        updater.wrap(nn.Linear(2, 1))
    message = str(caught.value)
    assert message.startswith("worker 0 (worker:0, on the CPU of ")
    assert (
        "NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage / ncclInvalidUsage: Duplicate GPU "
        "detected : rank 2 and rank 0 both on CUDA device 60. Fix:" in message
    )
    assert "give each worker its own GPU" in message
