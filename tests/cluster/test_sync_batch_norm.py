"""Synchronized batch norm on CPU over 2 gloo processes equals one process's BatchNorm on the
whole batch: outputs, input and weight gradients, running statistics (to 1e-5), also under
DistributedDataParallel (which refuses torch's SyncBatchNorm on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from tensorfleet.launch.ports import free_port
from tensorfleet.worker.sync_batch_norm import CpuSyncBatchNorm, convert_sync_batchnorm

from .conftest import PROGRAMS

TIMEOUT_S = 120


@pytest.mark.cluster
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_two_cpu_processes_equal_one_process_on_the_whole_batch() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, str(PROGRAMS / "sync_bn_rank.py")],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in ranks:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        outputs.append("(timed out)")
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    transcript = "\n".join(f"--- rank {k} ---\n{out}" for k, out in enumerate(outputs))
    assert [proc.returncode for proc in ranks] == [0, 0], transcript
    for out in outputs:
        assert out.rstrip().endswith("OK"), transcript
        assert "MAXDIFF buffer 1.running_var" in out and "MAXDIFF ddp grad 1.weight" in out


def test_converter_picks_ours_on_cpu_and_keeps_parameters() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.BatchNorm2d(2)))
    weight, mean = model[1].weight, model[1].running_mean
    converted = convert_sync_batchnorm(model)
    assert isinstance(converted[1], CpuSyncBatchNorm) and isinstance(
        converted[2][0], CpuSyncBatchNorm
    )
    assert converted[1].weight is weight and converted[1].running_mean is mean
    single = convert_sync_batchnorm(nn.BatchNorm1d(3, affine=False))
    assert isinstance(single, CpuSyncBatchNorm) and single.weight is None
    assert sorted(converted.state_dict()) == sorted(model.state_dict())


def test_without_a_process_group_it_is_batch_norm() -> None:
    torch.manual_seed(0)
    plain = nn.BatchNorm2d(3)
    synced = convert_sync_batchnorm(nn.BatchNorm2d(3))
    x = torch.randn(4, 3, 5, 5) * 2 + 1
    torch.testing.assert_close(synced(x), plain(x), rtol=0, atol=1e-5)
    torch.testing.assert_close(synced.running_var, plain.running_var, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        synced(torch.randn(1, 3))
    with pytest.raises(ValueError, match="3 features, the input has 2 channels"):
        synced(torch.randn(4, 2))
