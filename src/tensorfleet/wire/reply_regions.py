"""``ReplyRegions``: where the replies to a client's same-host requests are written, and when
that memory is offered again or given back.

The client offers a reply region with each request that goes through shared memory; the
service writes the reply's payload there, and the client hands it out where it lies (often
as the model's parameters: ``FusedParameters.scatter``). This module decides which region a
request offers (a free one of the reply's size, else a new one carved from a large
segment), when a region is free again (nothing references the payload handed out of it), and
when a region's pages go back to the OS. The rest of the path, and why payloads may travel
this way: :mod:`tensorfleet.wire.shared_memory`.
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

from tensorfleet.wire.buffer_pool import ALIGN, storage_users
from tensorfleet.wire.memfd_segment import Segment

#: Reply regions are carved out of segments of at least this size (a larger reply gets a
#: segment of its own). With the gradients pushed in buckets of 1 MiB, a step of a large model
#: has hundreds of replies, each adopted as some parameters' storage until the next step's
#: replace them: hundreds of files and mappings would cost descriptors and the service's map
#: slots; a few large segments cost neither.
REPLY_SEGMENT_BYTES = 64 << 20
#: A free reply region gives its pages back once no reply has taken it for this many times
#: as many replies as there are regions (:class:`ReplyRegions`). Measured with the BERT-base-
#: sized model (``benchmarks/big_model.py --steps 8 --warmup 2 --runs torch ps1``, 1 ps + 1
#: worker, 2026-11-26): with 0 (at every new region) the worker's peak RSS was 0.78x the
#: one-process loop's and the ps faulted 180k pages a step in again; with 1, 0.93x and 128k;
#: with 2, 1.17x and 112k; before, nothing given back, 1.12-1.35x and 100-115k.
RECLAIM_AFTER_ROUNDS = 1


class ReplyRegions:
    """A client's reply regions: ranges of its reply segments, each its own torch storage
    (so that its use count tells whether a payload handed out of it is still referenced),
    reused for replies of their size.

    A region is carved (bump allocation) from the newest segment of at least
    :data:`REPLY_SEGMENT_BYTES`, and never returned to it: replies of one request kind have
    one size step after step (a bucket's values), so regions are reused by size. At the peak
    the regions hold what the caller references (the parameters) plus the replies in flight
    (one step's; two with prefetch, whose next step pushes while the replies of the one
    before are still coming); ``max_bytes`` (None: no limit) bounds them, beyond which a reply comes
    in frames.

    Memory of sizes no longer asked for goes back to the OS: whenever a reply needs a new
    region, the free regions of *other* sizes that no reply has taken for a while (for
    :data:`RECLAIM_AFTER_ROUNDS` times as many replies as there are regions) first give up
    their pages (``madvise(MADV_REMOVE)``, which frees a shared file's pages for every
    process mapping it, the service's too; the region stays carved, and its next reply fills
    fresh pages). Why: a worker's first reply is the whole model (the initial pull), after
    which its parameters live in its buckets' regions; and buckets queued behind a request
    in flight go as one request, so reply sizes vary from step to step and new regions keep
    being carved now and then. Kept forever, such regions added up to a model's size and more
    on top of the worker's peak (a BERT-base-sized model: 2.5-3.0 GiB for the worker, 3.9-4.5
    GiB for its ps, in runs of 8-10 steps). Why not at once: a region of a size asked for
    again soon (the next merge of the same buckets) would be faulted in again each time.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self._segments: list[Segment] = []
        self._fill = 0
        self._by_size: dict[int, list[ReplyRegion]] = {}
        self._held: dict[int, ReplyRegion] = {}  # by the request that holds it
        self._bytes = 0
        self.reclaimed_bytes = 0
        self._takes = 0
        """Bytes of free regions whose pages were given back to the OS, in all."""

    @property
    def regions(self) -> int:
        return sum(len(regions) for regions in self._by_size.values())

    @property
    def segments(self) -> int:
        return len(self._segments)

    def take(self, size: int, request_id: int) -> ReplyRegion | None:
        """A region of ``size`` bytes (rounded up to :data:`ALIGN`) that no request holds and
        nothing references, now held by ``request_id``: a free one of that size, else a new
        one; None past ``max_bytes``."""
        size = -(-size // ALIGN) * ALIGN
        regions = self._by_size.setdefault(size, [])
        for region in regions:
            if region.free():
                return self._hold(region, request_id)
        if self.max_bytes is not None and self._bytes + size > self.max_bytes:
            return None
        self._reclaim_other_sizes(size)
        if not self._segments or self._fill + size > self._segments[-1].size:
            self._segments.append(Segment(max(REPLY_SEGMENT_BYTES, size)))
            self._fill = 0
        region = ReplyRegion(self._segments[-1], self._fill, size)
        self._fill += size
        self._bytes += size
        regions.append(region)
        return self._hold(region, request_id)

    def _reclaim_other_sizes(self, size: int) -> None:
        """Give back the pages of every free region not of ``size`` bytes (see the class
        docstring): a new region of ``size`` is about to be carved."""
        stale_before = self._takes - RECLAIM_AFTER_ROUNDS * max(1, self.regions)
        for other, regions in self._by_size.items():
            if other != size:
                for region in regions:
                    if not region.reclaimed and region.taken_at < stale_before and region.free():
                        self.reclaimed_bytes += region.reclaim()

    def _hold(self, region: ReplyRegion, request_id: int) -> ReplyRegion:
        region.holder = request_id
        region.reclaimed = False  # the service's reply fills its pages again
        self._takes += 1
        region.taken_at = self._takes
        self._held[request_id] = region
        return region

    def held_by(self, request_id: object) -> ReplyRegion | None:
        """The region request ``request_id`` holds, or None."""
        return self._held.get(request_id) if isinstance(request_id, int) else None

    def release(self, request_id: object) -> None:
        """Request ``request_id`` was answered: it no longer holds its region (the payload
        handed out of it keeps it taken while referenced)."""
        region = self._held.pop(request_id, None) if isinstance(request_id, int) else None
        if region is not None:
            region.holder = None

    def close(self) -> None:
        """Close every segment; memory the caller still references stays mapped until it
        lets go."""
        self._by_size.clear()
        self._held.clear()
        for segment in self._segments:
            segment.close()
        self._segments = []


class ReplyRegion:
    """``size`` bytes at ``start`` of a reply segment, as a torch storage of their own; the
    request that holds it (None: none) and the storage's use count when only the region
    references it."""

    def __init__(self, segment: Segment, start: int, size: int) -> None:
        self.segment, self.start, self.size = segment, start, size
        self.bytes = torch.frombuffer(
            memoryview(segment.map)[start : start + size], dtype=torch.uint8
        )
        self.holder: int | None = None
        self.reclaimed = False
        """Whether its pages were given back (:meth:`reclaim`) since it was last taken."""
        self.taken_at = 0
        """The count of replies its :class:`ReplyRegions` had placed when it was last taken."""
        self._alone = storage_users(self.bytes)

    def describe(self) -> dict[str, Any]:
        """What the service needs to write the reply here (goes into an authenticated
        header): the segment, and the range in it."""
        return {**self.segment.describe(), "offset": self.start, "length": self.size}

    def reclaim(self) -> int:
        """Give the pages wholly inside this region back to the OS (``MADV_REMOVE``: for
        every process mapping the segment; reading them afterwards gives zeros), keeping the
        region; the bytes given back. Only for a :meth:`free` region."""
        page = mmap.PAGESIZE
        first = -(-self.start // page) * page
        end = (self.start + self.size) // page * page
        if end > first:
            self.segment.map.madvise(mmap.MADV_REMOVE, first, end - first)
        self.reclaimed = True
        return max(0, end - first)

    def free(self) -> bool:
        """Whether the service may write into it: no request holds it and no reply payload
        handed out of it is referenced any more (unknown use counts: never reused)."""
        return (
            self.holder is None
            and self._alone is not None
            and storage_users(self.bytes) == self._alone
        )
