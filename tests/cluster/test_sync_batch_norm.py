"""Synchronized batch norm on CPU over 2 gloo processes equals one process's BatchNorm on the
whole batch: outputs, input and weight gradients, running statistics (to 1e-5), also under
DistributedDataParallel (which refuses torch's SyncBatchNorm on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensorfleet.worker.sync_batch_norm import CpuSyncBatchNorm, convert_sync_batchnorm

from .conftest import PROGRAMS, run_gloo_ranks

TIMEOUT_S = 120


@pytest.mark.cluster
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_two_cpu_processes_equal_one_process_on_the_whole_batch() -> None:
    ranks = run_gloo_ranks(PROGRAMS / "sync_bn_rank.py", 2, TIMEOUT_S)
    assert ranks.codes == [0, 0], ranks.transcript
    for out in ranks.outputs:
        assert out.rstrip().endswith("OK"), ranks.transcript
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
