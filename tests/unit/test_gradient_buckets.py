"""The buckets of a push during the backward pass (tensorfleet.worker.gradient_buckets):
contiguous ranges of a shard's variables cut from the end, at most ``bucket_bytes`` (a larger
variable alone), and a bucket complete exactly when all its parameters' gradients are."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from torch import nn

from tensorfleet.errors import ConfigError, ConfigTypeError
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.worker.bucketed_push import BucketedPush
from tensorfleet.worker.fused_parameters import FusedParameters
from tensorfleet.worker.gradient_buckets import Bucket, BucketFill, BucketPlan
from tensorfleet.worker.push_overlap import Overlap, checked_overlap


def _plan(
    params: list[tuple[str, torch.Tensor]], bucket_bytes: int | None, shards: int = 1, **kw: int
) -> BucketPlan:
    specs = [VariableSpec(n, tuple(p.shape), "float32", 4) for n, p in params]
    plan = plan_placement(specs, shards, "round_robin", **kw)
    return BucketPlan(FusedParameters(params, plan), [p for _, p in params], bucket_bytes)


def _params(*sizes: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


def test_buckets_are_cut_from_the_last_variables_once_they_hold_bucket_bytes() -> None:
    # bytes: 40, 400, 40, 40, 4000, 40, 40: the large variable closes the bucket it joins
    plan = _plan(_params(10, 100, 10, 10, 1000, 10, 10), bucket_bytes=500)
    ranges = [(b.start, b.stop, b.nbytes) for b in plan.shards[0]]
    assert ranges == [(4, 7, 4080), (0, 4, 520)]
    assert [b.position for b in plan.shards[0]] == [0, 1]
    assert [b.params for b in plan.shards[0]] == [{4, 5, 6}, {0, 1, 2, 3}]
    assert not any(plan.is_whole(b) for b in plan.shards[0])
    assert plan.is_whole(plan.whole[0]) and plan.whole[0].nbytes == 4600
    small = _plan(_params(10, 100, 10), bucket_bytes=1000)  # the first variables: the rest
    assert [(b.start, b.stop) for b in small.shards[0]] == [(0, 3)]
    assert small.is_whole(small.shards[0][0])


def test_without_bucket_bytes_each_shard_is_one_bucket_and_an_empty_shard_has_one_too() -> None:
    plan = _plan(_params(10, 20), bucket_bytes=None, shards=3)
    assert [[(b.start, b.stop) for b in s] for s in plan.shards] == [[(0, 1)], [(0, 1)], [(0, 0)]]
    assert all(plan.is_whole(s[0]) for s in plan.shards)
    assert plan.shards[2][0].params == frozenset()  # never complete: sent after the backward


def test_a_bucket_completes_when_its_last_parameter_does_even_across_shards() -> None:
    # p1 (8 x 4 floats, 128 bytes) is cut in two row ranges over two shards.
    params = [("p0", nn.Parameter(torch.zeros(4))), ("p1", nn.Parameter(torch.zeros(8, 4)))]
    plan = _plan(params, bucket_bytes=1, shards=2, partition_threshold_bytes=64)
    holding_p1 = plan.of_param(1)
    assert sorted(b.shard for b in holding_p1) == [0, 1]
    fill = BucketFill(plan)
    assert sorted(b.shard for b in fill.add(1)) == [0, 1]  # both of its buckets at once
    assert fill.add(1) == []  # a bucket completes once
    assert [b.params for b in fill.add(0)] == [{0}]


def test_bucket_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="bucket_bytes must be >= 1 byte"):
        Overlap(bucket_bytes=0)
    with pytest.raises(ConfigTypeError, match="bucket_bytes must be an int"):
        Overlap(bucket_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigTypeError, match="prefetch must be True or False"):
        Overlap(prefetch=1)  # type: ignore[arg-type]
    assert not Overlap(bucket_bytes=None, prefetch=False).active
    with pytest.raises(ConfigTypeError, match="overlap must be a tensorfleet.Overlap"):
        checked_overlap(True)
    assert checked_overlap(None) is None


def test_queued_buckets_that_join_into_one_range_go_as_one_request() -> None:
    def bucket(position: int, start: int, stop: int) -> Bucket:
        return Bucket(0, position, start, stop, 4 * (stop - start), frozenset({position}))

    queue = deque([bucket(1, 4, 6), bucket(3, 0, 2), bucket(0, 6, 8), bucket(2, 2, 4)])
    taken = BucketedPush._adjacent(queue)
    assert [b.position for b in taken] == [1, 0, 2, 3]  # the head, then what touches the range
    merged = BucketedPush._merged(taken)
    assert (merged.position, merged.start, merged.stop, merged.nbytes) == (0, 0, 8, 32)
    assert merged.params == {0, 1, 2, 3}
    apart = deque([bucket(0, 6, 8), bucket(2, 0, 2)])  # not adjacent: the head goes alone
    assert BucketedPush._adjacent(apart) == [apart[0]]
