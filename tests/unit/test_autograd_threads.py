"""Which device's autograd thread runs a backward node, and which work stays on it."""

from __future__ import annotations

import torch

from tensorfleet.parallel.autograd_threads import backward_thread_device, same_device


def test_a_cpu_gradient_runs_on_the_callers_thread_so_nothing_stays_inline():
    assert backward_thread_device(torch.zeros(2)) is None
    assert not same_device(torch.device("cpu"), None)


def test_devices_compare_by_type_and_index():
    assert same_device(torch.device("cpu"), torch.device("cpu"))
    assert same_device(torch.device("cuda", 1), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not same_device(torch.device("cpu"), torch.device("cuda", 0))
    assert backward_thread_device(torch.zeros(2, device="meta")) == torch.device("meta")
