"""bf16 gradients on the wire: the worker's error feedback keeps the sum of what was sent
equal to the sum of the true gradients up to the last residual; the ps decodes only what the
worker declared, at the declared size, and applies exactly the upcast of what was sent
(through a real service and client)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tensorfleet.errors import ConfigError, ProtocolError, RemoteError
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.update_rules import SGD
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.gradient_encoding import (
    ErrorFeedback,
    GradientDecoder,
    check_wire_dtype,
    travel_dtype,
)
from tensorfleet.wire.tensors import as_buffer
from tensorfleet.worker.client import ClientTimeouts, ParameterClient

from .service_harness import serve_in_thread, stop_services

SECRET = b"gradient-encoding-unit-test-secret-0001"
TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Group:
    dtype: str
    numel: int


def _gradients(step: int, numel: int) -> torch.Tensor:
    """Components over twelve orders of magnitude, so that bf16 rounding loses some."""
    generator = torch.Generator().manual_seed(step)
    scale = 10.0 ** torch.randint(-8, 4, (numel,), generator=generator).float()
    return torch.randn(numel, generator=generator) * scale


def test_the_sum_sent_equals_the_sum_of_the_gradients_up_to_the_last_residual() -> None:
    numel, steps = 4096, 50
    encoder = ErrorFeedback("bf16")
    sent_sum = torch.zeros(numel, dtype=torch.float64)
    true_sum = torch.zeros(numel, dtype=torch.float64)
    bound = torch.zeros(numel, dtype=torch.float64)
    for step in range(steps):
        gradient = _gradients(step, numel)
        true_sum += gradient.double()
        (buffer,) = encoder.encode(0, [Group("float32", numel)], [as_buffer(gradient.clone())])
        sent = torch.frombuffer(buffer, dtype=torch.bfloat16)
        assert sent.numel() == numel and memoryview(buffer).nbytes == 2 * numel
        sent_sum += sent.double()
        residual = encoder.residual(0, 0)
        assert residual is not None
        # The residual is what rounding removed: at most half a bf16 ulp of what was sent.
        assert bool((residual.abs() <= sent.float().abs() * 2.0**-8 + 1e-38).all())
        # float32 rounds each step's ``gradient + residual`` once: half a float32 ulp.
        bound += (gradient.abs() + residual.abs()).double() * 2.0**-24
    residual = encoder.residual(0, 0).double()
    error = (sent_sum + residual - true_sum).abs()
    assert bool((error <= bound * 2 + 1e-300).all()), float((error - 2 * bound).max())
    # Without the feedback the small components would be lost for good: plain rounding of
    # the same gradients misses the true sum by far more than the residual.
    plain = sum(_gradients(s, numel).to(torch.bfloat16).double() for s in range(steps))
    assert (plain - true_sum).abs().sum() > 10 * error.sum()


def test_a_constant_gradient_below_the_bf16_resolution_is_delivered() -> None:
    # 1 + 2**-10 is 1 in bf16: plain rounding would send 1.0 for ever.
    encoder = ErrorFeedback("bf16")
    value = 1.0 + 2.0**-10
    total = 0.0
    for _ in range(1024):
        (buffer,) = encoder.encode("s", [Group("float32", 1)], [as_buffer(torch.tensor([value]))])
        total += float(torch.frombuffer(buffer, dtype=torch.bfloat16)[0])
    assert abs(total - 1024 * value) <= 2.0**-7  # the last residual, at most half an ulp


def test_other_dtypes_travel_as_they_are_and_staging_buffers_are_used() -> None:
    encoder = ErrorFeedback("bf16")
    groups = [Group("float32", 3), Group("float64", 2)]
    f32, f64 = torch.tensor([1.0, 2.5, -3.0]), torch.tensor([0.1, 0.2], dtype=torch.float64)
    staged = [bytearray(6), bytearray(16)]
    asked: list[list[int]] = []

    def staging(sizes: list[int]) -> list[memoryview]:
        asked.append(sizes)
        return [memoryview(b) for b in staged]

    out = encoder.encode(1, groups, [as_buffer(f32.clone()), as_buffer(f64.clone())], staging)
    assert asked == [[6, 16]]
    assert torch.equal(torch.frombuffer(staged[0], dtype=torch.bfloat16).float(), f32)
    assert torch.equal(torch.frombuffer(staged[1], dtype=torch.float64), f64)
    assert [memoryview(b).nbytes for b in out] == [6, 16]
    assert travel_dtype("float32", "bf16") == "bfloat16"
    assert travel_dtype("float64", "bf16") == "float64"
    assert travel_dtype("float32", None) == "float32"


def test_the_decoder_refuses_what_was_not_declared() -> None:
    decoder = GradientDecoder()
    groups = [Group("float32", 4), Group("float64", 1)]
    bf16 = as_buffer(torch.tensor([1.0, 2.0, 3.0, 4.0]).to(torch.bfloat16))
    f32 = as_buffer(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    f64 = as_buffer(torch.tensor([5.0], dtype=torch.float64))
    decoder.declare("worker:0", "bf16")
    decoded = decoder.decode(groups, "worker:0", "bf16", [bf16, f64])
    assert [t.dtype for t in decoded] == [torch.float32, torch.float64]
    assert decoded[0].tolist() == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ProtocolError, match="pushed gradients as 'their own dtype' but declared"):
        decoder.decode(groups, "worker:0", None, [f32, f64])
    with pytest.raises(ProtocolError, match=r"float32 buffer \(sent as bfloat16\) has 16 bytes"):
        decoder.decode(groups, "worker:0", "bf16", [f32, f64])
    with pytest.raises(ProtocolError, match="pushed gradients as 'bf16' but declared"):
        decoder.decode(groups, "worker:1", "bf16", [bf16, f64])  # worker:1 declared nothing
    with pytest.raises(ProtocolError, match="declares gradients on the wire as 'fp8'"):
        decoder.declare("worker:1", "fp8")
    with pytest.raises(ConfigError, match="wire_dtype must be None .* got 'fp8'"):
        check_wire_dtype("fp8")


def test_a_client_pushes_bf16_through_a_real_service_which_applies_the_upcast() -> None:
    """SGD with lr 1 on the ps: the values move by exactly the decoded gradient, which is the
    bf16 rounding of gradient + residual; a raw push that contradicts the hello is refused."""
    running = serve_in_thread(
        ServiceConfig(0, ("worker:0",), idle_timeout_s=60.0, end_grace_s=60.0), SECRET
    )
    weight = torch.nn.Parameter(torch.zeros(5))
    timeouts = ClientTimeouts(connect_s=TIMEOUT_S, step_s=TIMEOUT_S, recover_s=TIMEOUT_S)
    client = ParameterClient([running.address], SECRET, "worker:0", timeouts, gradient_dtype="bf16")
    raw = Channel(running.address, SECRET, "ps:0")
    try:
        client.connect()
        plan = plan_placement([VariableSpec("w", (5,), "float32", 4)], 1)
        client.register([("w", weight)], plan, SGD(lr=1.0), is_chief=True)
        gradient = torch.tensor([1.0 + 2.0**-10, 3e-9, -2.0, 0.5, 1e4 + 1.0])
        for _ in range(3):
            weight.grad = gradient.clone()
            before = weight.detach().clone()
            client.push_pull()
            moved = before - weight.detach()
            assert weight.dtype == torch.float32
            # Exactly a bf16 value per component: what was sent, upcast, applied by SGD.
            assert torch.equal(moved.to(torch.bfloat16).float(), moved)
        assert not torch.equal(-weight.detach(), 3 * gradient)  # some rounding was owed ...
        residual = client._encoder.residual(0, 0)
        total = -weight.detach().double() + residual.double()  # ... and is in the residual
        assert torch.allclose(total, 3 * gradient.double(), rtol=1e-6, atol=1e-12)
        # The same process says hello again without a wire dtype: its bf16 push is refused.
        hello = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": "worker:0"}
        raw.call("hello", {**hello, "instance": client.instance}, timeout_s=TIMEOUT_S)
        with pytest.raises(RemoteError, match="pushed gradients as 'bf16' but declared"):
            raw.call(
                "push",
                {"task": "worker:0", "gradient_dtype": "bf16"},
                [as_buffer(gradient.to(torch.bfloat16))],
                TIMEOUT_S,
            )
    finally:
        raw.close()
        client.close()
        stop_services([running])
