"""FusedParameters.gather: the model's gradients or values packed into each shard's buffers,
into its own send buffers or straight into buffers the transport lends (shared memory)."""

from __future__ import annotations

import pytest
import torch

from tensorfleet.errors import ConfigError
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.worker.fused_parameters import FusedParameters


def _model() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    params = [
        ("embedding", torch.nn.Parameter(torch.randn(40, 8))),  # partitioned by rows
        ("weight", torch.nn.Parameter(torch.randn(8, 3).t())),  # not contiguous
        ("bias", torch.nn.Parameter(torch.randn(3))),
        ("steps", torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))),  # a second dtype
    ]
    for _, p in params[:-1]:
        p.grad = torch.randn_like(p)
    return params


def _fused(params: list[tuple[str, torch.Tensor]]) -> FusedParameters:
    specs = [
        VariableSpec(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.element_size())
        for n, p in params
    ]
    return FusedParameters(params, plan_placement(specs, 2, partition_threshold_bytes=512))


def _expected(params: list[tuple[str, torch.Tensor]], fused: FusedParameters) -> list[list[bytes]]:
    """What gather must produce, computed independently: each member's slice at its offset."""
    out = []
    for shard, layout in enumerate(fused.layouts):
        buffers = []
        for group, members in zip(layout.groups, fused._members[shard], strict=True):
            flat = torch.full((group.numel,), float("nan"), dtype=members[0].param.dtype)
            for m in members:
                grad = m.param.grad if m.param.grad is not None else torch.zeros_like(m.param)
                rows = grad if m.whole else grad[m.row_start : m.row_stop]
                flat[m.offset : m.offset + m.numel] = rows.reshape(-1)
            buffers.append(flat.numpy().tobytes())
        out.append(buffers)
    return out


def test_gather_into_lent_buffers_equals_gather_into_its_own() -> None:
    params = _model()
    fused = _fused(params)
    assert any(not m.whole for shard in fused._members for g in shard for m in g)
    expected = _expected(params, fused)
    for shard in range(fused.num_shards):
        own = [bytes(b) for b in fused.gather(shard, values=False)]
        assert own == expected[shard]
        lent = [memoryview(bytearray(n)) for n in fused.group_nbytes(shard)]
        returned = fused.gather(shard, values=False, into=lent)
        assert returned == lent
        assert [bytes(b) for b in lent] == expected[shard]  # a missing gradient is zeros


def test_gather_of_values_into_lent_buffers() -> None:
    params = _model()
    fused = _fused(params)
    by_name = dict(params)
    for shard in range(fused.num_shards):
        lent = [memoryview(bytearray(n)) for n in fused.group_nbytes(shard)]
        fused.gather(shard, values=True, into=lent)
        assembled = fused.assemble(
            [lent if s == shard else fused.gather(s, values=True) for s in range(2)]
        )
        for name, tensor in assembled.items():
            assert torch.equal(tensor, by_name[name].detach())


def test_values_are_not_kept_in_the_send_buffers() -> None:
    """The chief's values (its create) go into buffers of their own: packed into the send
    buffers, they made a copy of the model resident for the worker's life (on one host no
    push uses the send buffers: gradients go into shared memory), and a later push into the
    send buffers overwrote them."""
    params = _model()
    fused = _fused(params)
    by_name = dict(params)
    values = [fused.gather(s, values=True) for s in range(fused.num_shards)]
    own = [
        (flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size())
        for buffers in fused._send_buffers
        for flat in buffers
    ]
    for buffers in values:
        for buffer in buffers:
            address = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
            assert not any(lo <= address < hi for lo, hi in own)
    for shard in range(fused.num_shards):
        fused.gather(shard, values=False)  # a push into the send buffers
    for name, tensor in fused.assemble(values).items():
        assert torch.equal(tensor, by_name[name].detach())


def test_gather_into_a_buffer_of_the_wrong_size_or_read_only_is_refused() -> None:
    fused = _fused(_model())
    sizes = fused.group_nbytes(0)
    wrong = [memoryview(bytearray(n + 4)) for n in sizes]
    with pytest.raises(ConfigError, match="must be writable and"):
        fused.gather(0, values=False, into=wrong)
    with pytest.raises(ConfigError, match="read-only"):
        fused.gather(0, values=False, into=[memoryview(bytes(n)) for n in sizes])


def test_scatter_keeps_a_channels_last_parameter_in_its_memory_order() -> None:
    """The values a shard sends are adopted as a contiguous parameter's storage (no copy),
    but copied into a parameter with other strides, which keeps them: channels-last, also
    for one input channel, whose channels-last strides differ from NCHW's only in the
    size-1 dimension (adopting the received memory would make it NCHW for oneDNN)."""
    one_channel = torch.randn(4, 1, 2, 2)
    params = [
        ("conv", torch.nn.Parameter(torch.randn(4, 3, 2, 2))),
        ("first", torch.nn.Parameter(one_channel)),
        ("bias", torch.nn.Parameter(torch.randn(4))),
    ]
    for _, p in params[:2]:
        p.data = torch.empty_like(p.data, memory_format=torch.channels_last).copy_(p.data)
    strides = {name: p.stride() for name, p in params}
    assert strides["first"] == (4, 1, 2, 1)
    specs = [VariableSpec(n, tuple(p.shape), "float32", 4) for n, p in params]
    fused = FusedParameters(params, plan_placement(specs, 1))
    new = {name: torch.randn(p.shape) for name, p in params}
    flat = torch.empty(fused.layouts[0].groups[0].numel)
    for member, (variable, offset) in zip(
        fused._members[0][0], fused.layouts[0].groups[0].members, strict=True
    ):
        name = next(n for n, p in params if p is member.param)
        flat[offset : offset + variable.numel] = new[name].reshape(-1)
    fused.scatter(0, [flat.numpy().tobytes()])
    for name, p in params:
        assert p.stride() == strides[name], name
        assert torch.equal(p.detach(), new[name]), name
