"""How the ps combines pushed buffers: defaults per mode and dtype, overrides, the rules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tensorfleet.errors import TensorfleetError
from tensorfleet.ps.buffer_policies import (
    BufferPolicy,
    BufferPolicyError,
    combine,
    default_policy,
    persistent_buffers,
    resolve_policies,
)

BN = {"bn.running_mean": torch.float32, "bn.running_var": torch.float32}
COUNT = {"bn.num_batches_tracked": torch.int64}


def test_defaults_per_mode_and_dtype() -> None:
    assert default_policy("sync", torch.float32) == BufferPolicy("mean")
    assert default_policy("async", torch.float64) == BufferPolicy("latest")
    assert default_policy("sync", torch.int64) == BufferPolicy("max")
    assert default_policy("async", torch.int64) == BufferPolicy("max")
    with pytest.raises(BufferPolicyError, match="modes"):
        default_policy("allreduce", torch.float32)


def test_overrides_by_name_and_pattern() -> None:
    policies = resolve_policies(
        {**BN, **COUNT, "head.bn.running_var": torch.float32},
        "sync",
        {"*.running_var": "latest", "head.bn.running_var": BufferPolicy("running_mean", 0.5),
         "*num_batches*": "latest"},
    )  # fmt: skip
    assert policies == {
        "bn.running_mean": BufferPolicy("mean"),
        "bn.running_var": BufferPolicy("latest"),
        "bn.num_batches_tracked": BufferPolicy("latest"),
        "head.bn.running_var": BufferPolicy("running_mean", 0.5),
    }


@pytest.mark.parametrize(
    "buffers,mode,overrides,words",
    [
        (BN, "sync", {"bn.runing_mean": "latest"}, r"\['bn.runing_mean'\] name no buffer"),
        (COUNT, "sync", {"*": "mean"}, "torch.int64: policy 'mean' would average integers"),
        (BN, "async", {"bn.running_var": "mean"}, "each push arrives alone"),
        (BN, "sync", {"bn.running_var": "median"}, "must be one of"),
    ],
)
def test_bad_overrides_are_refused_with_the_fix(buffers, mode, overrides, words) -> None:
    with pytest.raises(BufferPolicyError, match=words) as info:
        resolve_policies(buffers, mode, overrides)
    assert isinstance(info.value, TensorfleetError) and isinstance(info.value, ValueError)
    with pytest.raises(BufferPolicyError, match="running_mean only"):
        BufferPolicy("mean", rate=0.5)


def test_combine_rules() -> None:
    current = torch.tensor([0.0, 4.0])
    pushed = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 8.0])]
    assert combine("b", BufferPolicy("mean"), current, pushed, 2).tolist() == [2.0, 5.0]
    assert combine("b", BufferPolicy("latest"), current, pushed, 2).tolist() == [3.0, 8.0]
    assert combine("b", BufferPolicy("max"), current, pushed, 2).tolist() == [3.0, 8.0]
    # running_mean: current + rate * (mean of pushes - current); rate defaults to 1/workers.
    assert combine("b", BufferPolicy("running_mean"), current, pushed, 4).tolist() == [0.5, 4.25]
    assert combine("b", BufferPolicy("running_mean", 1.0), current, pushed[:1], 4).tolist() == [
        1,
        2,
    ]
    counts = [torch.tensor(7), torch.tensor(9), torch.tensor(8)]
    assert combine("n", BufferPolicy("max"), torch.tensor(6), counts, 3).item() == 9
    assert combine("b", BufferPolicy("mean"), current, [], 2).tolist() == current.tolist()
    # Pure: nothing passed in changes, and the result is not an alias of a pushed tensor.
    out = combine("b", BufferPolicy("latest"), current, pushed, 2)
    out.add_(1)
    assert pushed[1].tolist() == [3.0, 8.0] and current.tolist() == [0.0, 4.0]


def test_combine_refuses_a_push_that_does_not_fit() -> None:
    with pytest.raises(
        BufferPolicyError,
        match=r"'bn.running_var' is torch.float32 \[2\] on the ps, a worker pushed torch.float32 \[3\]",
    ):
        combine("bn.running_var", BufferPolicy("mean"), torch.zeros(2), [torch.zeros(3)], 1)


def test_sync_mean_of_running_mean_equals_one_process_on_the_whole_batch() -> None:
    torch.manual_seed(0)
    whole = torch.randn(16, 3) * 2 + 1
    reference = nn.BatchNorm1d(3)
    reference(whole)
    workers = [nn.BatchNorm1d(3) for _ in range(4)]
    for worker, part in zip(workers, whole.chunk(4), strict=True):
        worker(part)
    pushed = [w.running_mean for w in workers]
    combined = combine("running_mean", BufferPolicy("mean"), torch.zeros(3), pushed, 4)
    torch.testing.assert_close(combined, reference.running_mean, rtol=0, atol=1e-6)


def test_persistent_buffers_leave_out_local_ones() -> None:
    model = nn.Sequential(
        nn.Linear(2, 2), nn.BatchNorm1d(2), nn.BatchNorm1d(2, track_running_stats=False)
    )
    model[0].register_buffer("scratch", torch.zeros(1), persistent=False)
    model[0].register_buffer("scale", torch.ones(1))
    assert sorted(persistent_buffers(model)) == [
        "0.scale",
        "1.num_batches_tracked",
        "1.running_mean",
        "1.running_var",
    ]
