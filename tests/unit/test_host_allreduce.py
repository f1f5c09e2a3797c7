"""The same-host all-reduce's rule (which groups take it, and why) and its slot size; the
path itself with real processes: tests/cluster/test_host_allreduce.py."""

from __future__ import annotations

import torch

from tensorfleet.wire.buffer_pool import ALIGN
from tensorfleet.worker.host_allreduce import (
    BUCKET_CAP_MB,
    choose_host_path,
    decode_host,
    encode_host,
    slot_bytes,
)


def test_workers_on_one_host_off_nccl_take_the_path_and_say_how_to_leave_it() -> None:
    choice = choose_host_path(["boot/1/0"] * 3, [True] * 3, nccl=False)
    assert choice.use
    assert choice.describe(0) == (
        "worker 0: gradients averaged through shared memory: all 3 workers on one host "
        "(TENSORFLEET_SHARED_MEMORY=0 for gloo)"
    )


def test_nccl_one_worker_two_hosts_an_unknown_host_or_the_path_off_keep_the_backend() -> None:
    cases = {
        "NCCL between GPUs of their own": (["h"] * 2, [True] * 2, True),
        "one worker: nothing to exchange": (["h"], [True], False),
        "the 2 workers are not all on one host": (["h", "g"], [True] * 2, False),
        "the 3 workers are not all on one host": (["h", None, "h"], [True] * 3, False),
        "TENSORFLEET_SHARED_MEMORY=0 (or no memfd) in worker(s) 1": (
            ["h"] * 2, [True, False], False,
        ),
    }  # fmt: skip
    for reason, (hosts, enabled, nccl) in cases.items():
        choice = choose_host_path(hosts, enabled, nccl=nccl)
        assert not choice.use and choice.reason == reason, (reason, choice)
        assert choice.describe(1).startswith("worker 1: gradients averaged over the group's")


def test_a_slot_holds_the_largest_bucket_ddp_can_cut_and_no_more_than_the_model() -> None:
    cap = BUCKET_CAP_MB << 20
    small = [torch.zeros(10, requires_grad=True), torch.zeros(3, requires_grad=True)]
    assert slot_bytes(small) == ALIGN  # 52 bytes, rounded up
    two = [torch.zeros(cap // 4, requires_grad=True), torch.zeros(1 << 20, requires_grad=True)]
    assert slot_bytes(two) == cap + (4 << 20)  # both together: less than the bound
    three = [torch.zeros(cap // 4, requires_grad=True) for _ in range(3)]
    assert slot_bytes(three) == cap + cap  # the cap plus the largest tensor
    frozen = [torch.zeros(1 << 20), torch.zeros(100, requires_grad=True)]
    assert slot_bytes(frozen) == 448  # only what has a gradient travels
    assert slot_bytes([torch.zeros(8, dtype=torch.float64, requires_grad=True)]) == ALIGN


def test_the_host_exchange_round_trips_and_reads_anything_else_as_unknown() -> None:
    assert decode_host(encode_host("boot/4026531836/0", True)) == ("boot/4026531836/0", True)
    assert decode_host(encode_host(None, False)) == (None, False)
    for junk in (b"\xff\xfe", b"[1, 2]", b'{"host": 7, "enabled": "yes"}'):
        buffer = torch.zeros(512, dtype=torch.uint8)
        buffer[: len(junk)] = torch.frombuffer(bytearray(junk), dtype=torch.uint8)
        assert decode_host(buffer) == (None, False)
