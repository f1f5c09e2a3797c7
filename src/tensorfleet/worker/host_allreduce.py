"""``HostAllReduce``: the gradients of all-reduce workers on one host averaged through shared
memory instead of gloo's TCP ring, as a ``DistributedDataParallel`` communication hook.

Why: workers on one host that cannot use NCCL (several workers sharing one GPU, the first
thing a user with one GPU tries, or workers computing on the CPU) all-reduce over gloo, whose
ring moves every bucket through loopback TCP in ``2 (n - 1)`` hops, each a copy into and out
of the kernel; for CUDA gradients gloo stages them in host memory besides. On one host the
bytes need not travel at all: every worker writes its (pre-divided) bucket into its own
shared-memory slot, waits at one barrier, and reads the others' slots straight from memory.

How, per bucket (DDP hands the hook its buckets in the same order on every worker):

1. ``bucket / world_size`` goes into this worker's slot of its own segment (from the GPU: one
   device-to-host copy, into memory registered with CUDA where that works, so the copy is a
   DMA without a bounce buffer);
2. one barrier of the group (gloo's, with the group's deadline: a worker that died or stalled
   makes the others fail with an error naming the bucket, never wait forever);
3. every worker sums the slots **in rank order** (``((s0 + s1) + s2) ...``): each addition is
   IEEE's correctly rounded one on the CPU and on a GPU alike, so every replica gets
   bit-identical gradients and the replicas stay equal, as with gloo.

Each worker's segment holds two slots and consecutive buckets alternate between them: a
worker may write bucket ``k + 1`` while a slower one still reads bucket ``k``, and it cannot
reach bucket ``k + 2`` (the first slot again) before every worker has passed the barrier of
``k + 1``, i.e. finished reading ``k``. A slot is as large as the largest bucket DDP can cut
(:func:`slot_bytes`); a bucket larger than that (none is expected) goes over gloo, on every
worker alike since they see the same sizes.

The segments are the same-host path's memfd files (:mod:`tensorfleet.wire.memfd_segment`,
reached through ``/proc/<pid>/fd``; nothing is left behind by a killed worker), exchanged
once when the group forms. The path is taken when every worker is on one host
(:func:`~tensorfleet.wire.shared_memory.host_identity`: same boot, pid namespace and user),
the group has two workers or more, the gradients do not go over NCCL, and
``TENSORFLEET_SHARED_MEMORY`` is not ``0``; where a worker cannot map the others' segments
(a hardened ``/proc``), the whole group stays on gloo and says why.

The alternative kept for other cases: gloo (several hosts, or the path turned off). The
measured reason (``benchmarks/gpu.py``, docs/gpu.md): the example's CNN with 3 workers
sharing one H200 ran at 0.90x one process through this path, 0.68x over gloo in the same
run. On this project's 2-core CPU machine, one bucket over 3 processes
(``benchmarks/host_allreduce.py``): 1.66x gloo's speed at 1 MB, 1.39x at 8 MB, 1.42x at
32 MB; all-reduce mode on the CNN 1.12x DDP used directly (``benchmarks/modes.py``), where
the step is mostly its compute.
Not chosen: a reduce-scatter, each worker summing a third and copying the result back after
a second barrier; it does a third of the additions but adds a barrier and a copy per
bucket, and on a GPU the additions are the GPU's, not the CPU's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tensorfleet.errors import DeadlineExceeded, ProtocolError
from tensorfleet.wire.buffer_pool import ALIGN
from tensorfleet.wire.memfd_segment import Segment
from tensorfleet.wire.shared_memory import PeerSegments

#: DDP's bucket size, passed to it explicitly so that the slots fit its buckets (its default).
BUCKET_CAP_MB = 25
#: Bytes of one worker's description in the exchange when the group forms (JSON, padded).
DESCRIPTION_BYTES = 512


def slot_bytes(params: Sequence[torch.Tensor], cap_bytes: int = BUCKET_CAP_MB << 20) -> int:
    """The bytes of one slot: the largest bucket DDP can cut from ``params`` (it closes a
    bucket once it holds ``cap_bytes`` or more, so a bucket is at most the cap plus one
    tensor), and never more than all of them together; rounded up to the alignment."""
    sizes = [p.numel() * p.element_size() for p in params if p.requires_grad]
    if not sizes:
        return ALIGN
    largest = min(sum(sizes), cap_bytes + max(sizes))
    return -(-largest // ALIGN) * ALIGN


@dataclass(frozen=True)
class HostPathChoice:
    """Whether the group averages its gradients through shared memory, and why (or why not)."""

    use: bool
    reason: str

    def describe(self, rank: int) -> str:
        """The log line the chief prints."""
        how = "through shared memory" if self.use else "over the group's backend"
        return f"worker {rank}: gradients averaged {how}: {self.reason}"


def choose_host_path(
    hosts: Sequence[str | None], enabled: Sequence[bool], nccl: bool
) -> HostPathChoice:
    """The choice for a group whose workers (index = rank) report ``hosts``
    (:func:`~tensorfleet.wire.shared_memory.host_identity`) and whether the path is
    ``enabled`` in each; ``nccl``: the gradients go over NCCL (faster between GPUs of their
    own: left alone). A pure function, so every worker decides alike."""
    world = len(hosts)
    if nccl:
        return HostPathChoice(False, "NCCL between GPUs of their own")
    if world < 2:
        return HostPathChoice(False, "one worker: nothing to exchange")
    off = [rank for rank, on in enumerate(enabled) if not on]
    if off:
        return HostPathChoice(
            False,
            f"TENSORFLEET_SHARED_MEMORY=0 (or no memfd) in worker(s) {','.join(map(str, off))}",
        )
    if None in hosts or len(set(hosts)) != 1:
        return HostPathChoice(False, f"the {world} workers are not all on one host")
    return HostPathChoice(
        True, f"all {world} workers on one host (TENSORFLEET_SHARED_MEMORY=0 for gloo)"
    )


class HostAllReduce:
    """One worker's side of the same-host all-reduce: its segment, the others' mappings, and
    :meth:`hook` for ``DistributedDataParallel.register_comm_hook``. Build it with
    :meth:`form` (collective: every worker of the group calls it)."""

    def __init__(self, rank: int, world_size: int, slot: int, own: Segment | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.slot = slot
        self._own = own
        self._peers = PeerSegments(max_mapped=max(world_size, 1))
        self._segments: list[torch.Tensor] = []
        self._registered: list[int] = []
        self._calls = 0
        #: Buckets that went over gloo for want of room in a slot (none expected).
        self.oversized_buckets = 0

    @classmethod
    def form(
        cls, rank: int, world_size: int, params: Sequence[torch.Tensor], device: torch.device
    ) -> tuple[HostAllReduce | None, str]:
        """*Collective*: every worker creates its segment, the descriptions are exchanged over
        the group, every worker maps the others'; the group takes the path only if every
        worker could (one all-reduce of the outcome). Returns the path (None: stay on gloo)
        and, when None, this worker's reason."""
        slot = slot_bytes(params)
        problem = ""
        try:
            own: Segment | None = Segment(2 * slot)
        except OSError as exc:  # no memory for it: the others must not wait for its name
            own, problem = None, f"worker {rank} could not create its shared memory: {exc}"
        made = cls(rank, world_size, slot, own)
        mine = _encode(json.dumps(own.describe() if own is not None else {}).encode())
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine)
        try:
            for peer, raw in enumerate(gathered):
                if own is not None and peer == rank:
                    made._segments.append(own.bytes)
                    continue
                description = json.loads(raw.numpy().tobytes().rstrip(b"\0"))
                made._segments.append(made._peers.bytes_of(description))
        except (ProtocolError, ValueError) as exc:
            problem = problem or f"worker {rank} could not map the others' shared memory: {exc}"
        everyone = torch.tensor([0 if problem else 1], dtype=torch.int32)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
        if not int(everyone[0]):
            made.close()
            return (
                None,
                problem or "another worker could not map the shared memory (its output says why)",
            )
        if device.type == "cuda":
            made._register_with_cuda()
        return made, ""

    def _register_with_cuda(self) -> None:
        """Pin every mapped segment for DMA (``cudaHostRegister``), as NCCL's shared-memory
        transport does: copies to and from the GPU then skip the driver's bounce buffer.
        Where CUDA refuses, the copies stay pageable (slower, still correct) and one line
        says so."""
        cudart = torch.cuda.cudart()
        for segment in self._segments:
            pointer, size = segment.data_ptr(), segment.numel()
            code = cudart.cudaHostRegister(pointer, size, 0)
            if int(code) != 0:
                print(
                    f"worker {self.rank}: the shared-memory all-reduce's segments could not be "
                    f"pinned for the GPU (cudaHostRegister gave {code}); its copies go through "
                    "pageable memory",
                    flush=True,
                )
                return
            self._registered.append(pointer)

    def _slot(self, rank: int, parity: int, like: torch.Tensor) -> torch.Tensor:
        """``rank``'s slot ``parity`` as a flat CPU tensor of ``like``'s dtype and length."""
        start = parity * self.slot
        nbytes = like.numel() * like.element_size()
        return self._segments[rank][start : start + nbytes].view(like.dtype)

    def attach(self, model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Make :meth:`hook` ``model``'s communication hook. (Through a closure without
        annotations: DDP compares the hook's annotations with its own types, and this
        module's are strings, ``from __future__ import annotations``.)"""
        model.register_comm_hook(None, lambda state, bucket: self.hook(state, bucket))

    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's communication hook: ``bucket``'s buffer averaged over the group, in place."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(self.average(bucket.buffer(), bucket.index()))
        return future

    def average(self, tensor: torch.Tensor, bucket_index: int = 0) -> torch.Tensor:
        """*Collective*: ``tensor`` (a flat bucket) replaced by its mean over the group, and
        returned; every worker must call this with tensors of the same size, in the same
        order."""
        if tensor.numel() * tensor.element_size() > self.slot:
            self.oversized_buckets += 1
            tensor.div_(self.world_size)
            dist.all_reduce(tensor)
            return tensor
        parity = self._calls % 2
        self._calls += 1
        mine = self._slot(self.rank, parity, tensor)
        if tensor.is_cuda:
            tensor.div_(self.world_size)
            mine.copy_(tensor)
        else:
            torch.div(tensor, self.world_size, out=mine)
        self._barrier(bucket_index)
        slots = [self._slot(rank, parity, tensor) for rank in range(self.world_size)]
        if tensor.is_cuda:
            tensor.copy_(slots[0])
            scratch = torch.empty_like(tensor)
            for other in slots[1:]:
                scratch.copy_(other)
                tensor.add_(scratch)
        else:
            torch.add(slots[0], slots[1], out=tensor)
            for other in slots[2:]:
                tensor.add_(other)
        return tensor

    def _barrier(self, bucket_index: int) -> None:
        try:
            dist.barrier()
        except RuntimeError as exc:
            raise DeadlineExceeded(
                f"worker {self.rank}: the same-host all-reduce of gradient bucket {bucket_index} "
                f"found a worker missing at its barrier: {exc}. A worker has died or stalled "
                "(its output says why); the launcher restarts the group from the checkpoint"
            ) from exc

    def close(self) -> None:
        """Unpin, unmap and close (the memory is freed once every worker has closed)."""
        if self._registered:
            cudart = torch.cuda.cudart()
            for pointer in self._registered:
                cudart.cudaHostUnregister(pointer)
            self._registered = []
        self._segments = []
        self._peers.close()
        if self._own is not None:
            self._own.close()
            self._own = None


def _encode(raw: bytes) -> torch.Tensor:
    """``raw`` as a zero-padded uint8 tensor of :data:`DESCRIPTION_BYTES` (for all_gather)."""
    buffer = torch.zeros(DESCRIPTION_BYTES, dtype=torch.uint8)
    buffer[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buffer


def encode_host(host: str | None, enabled: bool) -> torch.Tensor:
    """This worker's host identity and whether the path is enabled in it, for the exchange
    that :func:`choose_host_path` decides from (:func:`decode_host` reads it)."""
    return _encode(json.dumps({"host": host, "enabled": enabled}).encode())


def decode_host(buffer: torch.Tensor) -> tuple[str | None, bool]:
    """The host identity and flag :func:`encode_host` wrote; anything else reads as an
    unknown host with the path off (so the group stays on gloo)."""
    try:
        fields = json.loads(buffer.numpy().tobytes().rstrip(b"\0"))
    except ValueError:
        return None, False
    if not isinstance(fields, dict):
        return None, False
    host = fields.get("host")
    return (host if isinstance(host, str) else None), fields.get("enabled") is True
