"""bf16 values in the replies to pushes: the ps rounds its float32 values to bf16 for the
reply of a push that asks, and only then; a ``pull`` stays exact; a push asking for a dtype
the ps does not know is refused before it is applied; a reply that does not carry what was
asked is refused by the worker (through a real service and client)."""

from __future__ import annotations

import pytest
import torch

from tensorfleet.errors import ConfigError, ProtocolError, RemoteError
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.update_rules import SGD
from tensorfleet.version import __version__
from tensorfleet.wire import message as wire
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.tensors import as_buffer
from tensorfleet.wire.value_encoding import (
    check_reply,
    check_values_wire_dtype,
    encode,
    request_fields,
    requested,
    travel_dtype,
)
from tensorfleet.worker.client import ClientTimeouts, ParameterClient

from .service_harness import serve_in_thread, stop_services

SECRET = b"value-encoding-unit-test-secret-000001"
TIMEOUT_S = 5.0


def _is_bf16(tensor: torch.Tensor) -> bool:
    return torch.equal(tensor.to(torch.bfloat16).float(), tensor)


def test_only_float32_is_rounded_to_nearest_even_and_names_are_checked() -> None:
    values = [torch.tensor([1.0 + 2.0**-9, 1.0 + 3 * 2.0**-9, -3.3]), torch.arange(3)]
    rounded, integers = encode(values, "bf16")
    assert rounded.dtype == torch.bfloat16
    # Ties go to the even mantissa: 1 + 2**-9 -> 1, 1 + 3 * 2**-9 -> 1 + 2**-7.
    assert rounded.float().tolist()[:2] == [1.0, 1.0 + 2.0**-7]
    assert integers is values[1]
    assert travel_dtype(torch.float32, "bf16") == torch.bfloat16
    assert travel_dtype(torch.float64, "bf16") == torch.float64
    assert travel_dtype(torch.float32, None) == torch.float32
    assert request_fields(None) == {} and request_fields("bf16") == {"values_dtype": "bf16"}
    with pytest.raises(ConfigError, match="values_wire_dtype must be None .* got 'fp8'"):
        check_values_wire_dtype("fp8")
    for bad in ("fp8", 16, ["bf16"]):
        with pytest.raises(ProtocolError, match="asks for its values as"):
            requested({"values_dtype": bad})
    assert requested({}) is None and requested({"values_dtype": "bf16"}) == "bf16"
    check_reply({"values_dtype": "bf16"}, "bf16", "ps:0")
    with pytest.raises(ProtocolError, match="ps:1 sent values as their own dtype where bf16"):
        check_reply({}, "bf16", "ps:1")
    with pytest.raises(ProtocolError, match="ps:1 sent values as bf16 where their own dtype"):
        check_reply({"values_dtype": "bf16"}, None, "ps:1")


def test_push_replies_are_bf16_a_pull_is_exact_and_an_unknown_dtype_is_refused() -> None:
    """SGD on the ps keeps float32 values that bf16 cannot hold; the worker that asks gets
    their bf16 rounding after each push, the exact values from a pull, and a worker that
    does not ask gets them exact after a push too."""
    running = serve_in_thread(
        ServiceConfig(0, ("worker:0", "worker:1"), idle_timeout_s=60.0, end_grace_s=60.0),
        SECRET,
    )
    timeouts = ClientTimeouts(connect_s=TIMEOUT_S, step_s=TIMEOUT_S, recover_s=TIMEOUT_S)
    weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 7))
    exact_weight = torch.nn.Parameter(torch.zeros(7))
    rounded_client = ParameterClient(
        [running.address], SECRET, "worker:0", timeouts, values_dtype="bf16"
    )
    exact_client = ParameterClient([running.address], SECRET, "worker:1", timeouts)
    raw = Channel(running.address, SECRET, "ps:0")
    plan = plan_placement([VariableSpec("w", (7,), "float32", 4)], 1)
    try:
        rounded_client.connect()
        exact_client.connect()
        rounded_client.register([("w", weight)], plan, SGD(lr=0.1), is_chief=True)
        exact_client.register([("w", exact_weight)], plan, SGD(lr=0.1), is_chief=False)
        gradient = torch.tensor([1e-3, 3.3e-2, -0.7, 1.1, 2.0**-12, 5.0, -1e-5])
        for _ in range(3):
            weight.grad = gradient.clone()
            rounded_client.push_pull()
            assert weight.dtype == torch.float32 and _is_bf16(weight.detach())
        after_pushes = weight.detach().clone()
        rounded_client.pull()
        exact = weight.detach().clone()
        assert not _is_bf16(exact), "the ps's values must need more than bf16 here"
        assert torch.equal(exact.to(torch.bfloat16).float(), after_pushes)
        expected = torch.linspace(-1.0, 1.0, 7)
        for _ in range(3):
            expected -= 0.1 * gradient
        assert torch.allclose(exact, expected, rtol=0, atol=1e-6)
        # A worker that does not ask gets float32 values after its push.
        exact_weight.grad = torch.zeros(7)
        exact_client.push_pull()
        assert torch.equal(exact_weight.detach(), exact)
        # A raw push asking for an unknown dtype is refused and not applied.
        hello = {"protocol": wire.PROTOCOL_VERSION, "version": __version__, "task": "worker:1"}
        raw.call("hello", {**hello, "instance": exact_client.instance}, timeout_s=TIMEOUT_S)
        with pytest.raises(RemoteError, match="asks for its values as 'fp8'"):
            raw.call(
                "push",
                {"task": "worker:1", "want_values": True, "values_dtype": "fp8"},
                [as_buffer(torch.ones(7))],
                TIMEOUT_S,
            )
        rounded_client.pull()
        assert torch.equal(weight.detach(), exact), "the refused push must not be applied"
    finally:
        raw.close()
        rounded_client.close()
        exact_client.close()
        stop_services([running])
