"""The buckets of a push made during the backward pass: which of a shard's variables travel
together, and when a bucket has all its gradients.

A bucket is a contiguous range ``[start, stop)`` of one shard's variables in layout order
(the model's registration order: :class:`~tensorfleet.ps.placement.PlacementPlan`), so that
it is one slice of each dtype group's fused buffer on both ends
(:meth:`~tensorfleet.ps.layout.FusedLayout.part_slices`). Buckets are cut from the end of
the shard's variables, because the backward pass produces the gradients of the last layers
first: bucket 0 holds the shard's last variables, and a bucket is closed as soon as it holds
``bucket_bytes`` or more (as ``DistributedDataParallel`` cuts its buckets), so a large
variable joins the small ones after it instead of waiting behind a bucket of its own (the
cut was chosen when one request was in flight per shard: a tiny bucket sent first held the
large one back for a round trip; buckets now go beside each other, and fewer, larger
requests still cost fewer messages). ``bucket_bytes`` None makes one bucket per shard (the whole push). A shard without dense variables (its part of the model is only table rows)
still has one, empty bucket: its push carries the progress every shard answers with.

:class:`BucketFill` follows one backward pass: told each parameter whose gradient is
complete (a post-accumulate-grad hook), it says which buckets that completes. A parameter
cut into row ranges on several shards belongs to one bucket of each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tensorfleet.errors import ConfigError
from tensorfleet.wire.tensors import DTYPES
from tensorfleet.worker.fused_parameters import FusedParameters


@dataclass(frozen=True)
class Bucket:
    """Variables ``[start, stop)`` of ``shard``; ``position`` 0 fills first."""

    shard: int
    position: int
    start: int
    stop: int
    nbytes: int
    params: frozenset[int]
    """The parameters (indices into the registered ``named_params``) whose gradients it needs."""

    @property
    def part(self) -> tuple[int, int]:
        return self.start, self.stop


class BucketPlan:
    """Every shard's buckets, from :class:`FusedParameters` and the registered parameters."""

    def __init__(
        self,
        fused: FusedParameters,
        params: Sequence[torch.Tensor],
        bucket_bytes: int | None,
    ) -> None:
        if bucket_bytes is not None and bucket_bytes < 1:
            raise ConfigError(f"bucket_bytes must be >= 1 (or None), got {bucket_bytes}")
        index_of = {id(param): index for index, param in enumerate(params)}
        self.shards: list[list[Bucket]] = []
        self.whole: list[Bucket] = []
        """Each shard's variables as one bucket (the push of a step sent after the backward)."""
        self._of_param: dict[int, list[Bucket]] = {}
        for shard, layout in enumerate(fused.layouts):
            owners = [index_of[id(p)] for p in fused.variable_params(shard)]
            sizes = [v.numel * DTYPES[v.dtype].itemsize for v in layout.variables]
            count = len(layout.variables)
            self.whole.append(Bucket(shard, 0, 0, count, sum(sizes), frozenset(owners)))
            if bucket_bytes is None or count == 0:
                self.shards.append([self.whole[-1]])
                continue
            buckets: list[Bucket] = []
            stop, nbytes = count, 0
            for index in range(count - 1, -1, -1):
                nbytes += sizes[index]
                if nbytes >= bucket_bytes:
                    buckets.append(self._bucket(shard, len(buckets), index, stop, sizes, owners))
                    stop, nbytes = index, 0
            if stop > 0:  # the first variables, fewer than bucket_bytes
                buckets.append(self._bucket(shard, len(buckets), 0, stop, sizes, owners))
            self.shards.append(buckets)
        for buckets in self.shards:
            for bucket in buckets:
                for param in bucket.params:
                    self._of_param.setdefault(param, []).append(bucket)

    @staticmethod
    def _bucket(
        shard: int, position: int, start: int, stop: int, sizes: list[int], owners: list[int]
    ) -> Bucket:
        return Bucket(
            shard, position, start, stop, sum(sizes[start:stop]), frozenset(owners[start:stop])
        )

    def of_param(self, param: int) -> list[Bucket]:
        """The buckets that hold (a part of) parameter ``param``."""
        return self._of_param.get(param, [])

    def is_whole(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` covers all of its shard's variables (a plain push)."""
        return bucket.start == 0 and bucket.stop == self.whole[bucket.shard].stop


class BucketFill:
    """One backward pass: which buckets have all their gradients."""

    def __init__(self, plan: BucketPlan) -> None:
        self._plan = plan
        self._missing = {
            (b.shard, b.position): set(b.params) for buckets in plan.shards for b in buckets
        }

    def add(self, param: int) -> list[Bucket]:
        """Parameter ``param``'s gradient is complete: the buckets that completes."""
        complete = []
        for bucket in self._plan.of_param(param):
            missing = self._missing[(bucket.shard, bucket.position)]
            if param in missing:
                missing.discard(param)
                if not missing:
                    complete.append(bucket)
        return complete
