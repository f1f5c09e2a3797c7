"""One rank of the same-host all-reduce check: gloo processes on CPU average a sequence of
buckets of varying sizes (one larger than a slot, which goes over gloo) with
``HostAllReduce.average``; the results must equal the rank-order mean computed here, bit for
bit, on every rank. Also the whole path under DDP: the gradients of a small model averaged
through the hook equal those of ``TENSORFLEET_SHARED_MEMORY=0``'s gloo within 1e-6.

Prints ``CALLS <n> OVERSIZED <k>`` then ``OK``; exits 1 with the reason on a mismatch. With
``DIE_AT=<call>`` in its environment, rank 2 exits at that call (the others must fail with the
barrier's error, naming the bucket, within the group's 5 s deadline). With
``REFUSE_MAP=<rank>``, that rank cannot map the others' segments (as under a hardened
``/proc``): every rank must stay on gloo, print ``GLOO <its reason>`` and exit 0."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tensorfleet.errors import DeadlineExceeded, ProtocolError
from tensorfleet.wire.shared_memory import PeerSegments
from tensorfleet.worker.host_allreduce import HostAllReduce

#: Bucket sizes (elements) in call order: different sizes reuse the two slots, the last is
#: larger than a slot (the slot is sized for the 2,000-element parameter below).
SIZES = [1000, 7, 2000, 1, 1999, 64, 2000, 3, 500] * 3 + [5000]


def values(rank: int, call: int, size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(size, generator=generator)


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    die_at = int(os.environ.get("DIE_AT", "-1"))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=5),
    )
    if os.environ.get("REFUSE_MAP") == str(rank):  # as a hardened /proc would refuse it
        refused = ProtocolError("/proc/PID/fd/N cannot be opened (refused for the test)")

        def refuse(self: PeerSegments, description: object) -> torch.Tensor:
            raise refused

        PeerSegments.bytes_of = refuse  # type: ignore[method-assign]
    host, problem = HostAllReduce.form(
        rank, world, [torch.zeros(2000, requires_grad=True)], torch.device("cpu")
    )
    if host is None:
        if "REFUSE_MAP" in os.environ:
            print(f"GLOO {problem}", flush=True)
            dist.destroy_process_group()
            return 0
        print(f"FAIL: the path was not formed: {problem}", flush=True)
        return 1
    try:
        for call, size in enumerate(SIZES):
            if rank == 2 and call == die_at:
                os._exit(3)
            tensor = values(rank, call, size)
            try:
                averaged = host.average(tensor, call)
            except DeadlineExceeded as exc:
                print(f"DEADLINE {exc}", flush=True)
                return 4
            expected = values(0, call, size) / world
            for other in range(1, world):
                expected = expected + values(other, call, size) / world
            oversized = size * 4 > host.slot  # over gloo: its ring's own order of sums
            if not (
                torch.allclose(averaged, expected, rtol=0, atol=1e-6)
                if oversized
                else torch.equal(averaged, expected)
            ):
                difference = (averaged - expected).abs().max().item()
                print(f"FAIL: call {call} ({size} elements) differs by {difference}", flush=True)
                return 1
        print(f"CALLS {len(SIZES)} OVERSIZED {host.oversized_buckets}", flush=True)
        gradients = {}
        for through_host in (True, False):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(40, 50), nn.Tanh(), nn.Linear(50, 3))
            ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)  # several buckets
            if through_host:
                host.attach(ddp)
            for step in range(3):  # DDP re-forms its buckets after the first step
                ddp.zero_grad()
                generator = torch.Generator().manual_seed(10 * step + rank)
                ddp(torch.randn(8, 40, generator=generator)).square().mean().backward()
            gradients[through_host] = [p.grad.clone() for p in model.parameters()]
        difference = max(
            (a - b).abs().max().item()
            for a, b in zip(gradients[True], gradients[False], strict=True)
        )
        if difference > 1e-6:
            print(f"FAIL: DDP's gradients through the hook differ from gloo's by {difference}")
            return 1
        print(f"DDP {difference:.1e}", flush=True)
    finally:
        host.close()
    dist.destroy_process_group()
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
