"""Tensors on the wire: the dtype allow-list, shape parsing, and zero-copy conversions between
tensors and buffers in both directions."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from tensorfleet.errors import ProtocolError
from tensorfleet.wire.tensors import (
    DTYPES,
    as_buffer,
    dtype_name,
    from_buffer,
    parse_dtype,
    parse_shape,
)


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic values of every bit pattern class the dtype has (incl. NaN, -0.0, inf)."""
    generator = torch.Generator().manual_seed(1234)
    numel = 1
    for dim in shape:
        numel *= dim
    if dtype == torch.bool:
        return (torch.randint(0, 2, (numel,), generator=generator) == 1).reshape(shape)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        values = torch.randint(info.min, info.max, (numel,), generator=generator, dtype=dtype)
        return values.reshape(shape)
    values = torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)
    specials = torch.tensor([float("nan"), -0.0, float("inf"), float("-inf")], dtype=dtype)
    values[: min(numel, 4)] = specials[: min(numel, 4)]
    return values.reshape(shape)


def _bits(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


ALL_DTYPES = sorted(DTYPES.items())


@pytest.mark.parametrize(("name", "dtype"), ALL_DTYPES, ids=[n for n, _ in ALL_DTYPES])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 0, 4)], ids=str)
def test_every_allowed_dtype_round_trips_bit_for_bit_without_copies(
    name: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    tensor = _sample(dtype, shape)
    buffer = as_buffer(tensor)
    assert buffer.nbytes == tensor.numel() * tensor.element_size()
    assert bytes(buffer) == _bits(tensor)

    back = from_buffer(buffer, parse_dtype(name), shape)
    assert back.dtype == dtype
    assert back.shape == tensor.shape
    assert _bits(back) == _bits(tensor)
    if tensor.numel():
        # Same memory on both sides: as_buffer and from_buffer are views, not copies.
        assert back.data_ptr() == tensor.data_ptr()
        with torch.no_grad():
            tensor.reshape(-1)[0] = tensor.reshape(-1)[-1]
        assert _bits(back) == _bits(tensor)


@pytest.mark.parametrize(("name", "dtype"), ALL_DTYPES, ids=[n for n, _ in ALL_DTYPES])
def test_dtype_names_round_trip(name: str, dtype: torch.dtype) -> None:
    assert dtype_name(dtype) == name
    assert parse_dtype(name) is dtype


def test_from_buffer_over_bytes_and_without_shape() -> None:
    source = torch.arange(6, dtype=torch.int32)
    raw = bytes(as_buffer(source))
    flat = from_buffer(raw, torch.int32)
    assert flat.shape == (6,)
    assert torch.equal(flat, source)
    assert torch.equal(from_buffer(bytearray(raw), torch.int32, [2, 3]), source.view(2, 3))
    empty = from_buffer(b"", torch.float64)
    assert empty.shape == (0,) and empty.dtype == torch.float64


@pytest.mark.parametrize(
    "dtype",
    [torch.complex64, torch.int8, torch.int16, torch.uint16, torch.float8_e4m3fn, torch.qint8],
)
def test_dtypes_outside_the_allow_list_cannot_be_sent(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="cannot be sent; supported"):
        dtype_name(dtype)


@pytest.mark.parametrize(
    "name",
    ["complex64", "int8", "float", "Float32", "torch.float32", "object", "", None, 3, b"float32"],
)
def test_disallowed_dtype_names_from_peers_are_protocol_errors(name: object) -> None:
    with pytest.raises(ProtocolError, match="is not allowed; allowed"):
        parse_dtype(name)


@pytest.mark.parametrize("shape", [[], [0], [3, 4], (5,), [1] * 16, [(1 << 40) - 1]])
def test_valid_shapes_parse_to_tuples(shape: list[int]) -> None:
    assert parse_shape(shape) == tuple(shape)


@pytest.mark.parametrize(
    "shape",
    [
        "3,4",
        3,
        None,
        {"0": 3},
        [1] * 17,
        [-1],
        [1 << 40],
        [2.0],
        [True],
        ["3"],
        [[3]],
    ],
    ids=repr,
)
def test_invalid_shapes_from_peers_are_protocol_errors(shape: object) -> None:
    with pytest.raises(ProtocolError, match="shape must"):
        parse_shape(shape)


def test_max_dims_is_configurable() -> None:
    assert parse_shape([1, 2], max_dims=2) == (1, 2)
    with pytest.raises(ProtocolError):
        parse_shape([1, 2, 3], max_dims=2)


@pytest.mark.parametrize(
    ("nbytes", "dtype", "shape", "match"),
    [
        (7, torch.float32, None, "not a whole number"),
        (6, torch.float64, (1,), "not a whole number"),
        (12, torch.float32, (2, 2), "hold 3 .* needs 4"),
        (16, torch.float32, (3,), "hold 4 .* needs 3"),
        (0, torch.float32, (), "hold 0 .* needs 1"),
        (4, torch.float32, (0,), "hold 1 .* needs 0"),
        (8, torch.int64, (2,), "hold 1 .* needs 2"),
    ],
)
def test_byte_length_that_does_not_fit_dtype_and_shape_is_a_protocol_error(
    nbytes: int, dtype: torch.dtype, shape: tuple[int, ...] | None, match: str
) -> None:
    with pytest.raises(ProtocolError, match=match):
        from_buffer(b"\0" * nbytes, dtype, shape)


def test_only_contiguous_cpu_tensors_can_be_sent() -> None:
    with pytest.raises(ValueError, match="contiguous CPU"):
        as_buffer(torch.zeros(3, 4).t())
    with pytest.raises(ValueError, match="contiguous CPU"):
        as_buffer(torch.zeros(4)[::2])
    with pytest.raises(ValueError, match="contiguous CPU"):
        as_buffer(torch.zeros(3, device="meta"))


def test_received_read_only_frames_become_tensors_without_warnings() -> None:
    frame = bytes(as_buffer(torch.tensor([1.5, -2.0])))  # bytes are read-only memory
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = from_buffer(frame, torch.float32, (2,))
    assert tensor.tolist() == [1.5, -2.0]


def test_no_read_only_warning_reaches_the_user_in_a_fresh_process() -> None:
    """torch warns once per process about a read-only buffer; from_buffer filters only
    that first read and skips the filter's cost afterwards. In a fresh interpreter, with
    every warning an error, read-only reads after the first must stay silent too (a torch
    that warned at every read would fail here)."""
    program = (
        "import torch\n"
        "from tensorfleet.wire.tensors import as_buffer, from_buffer\n"
        "frame = bytes(as_buffer(torch.tensor([1.5, -2.0])))\n"
        "for _ in range(3):\n"
        "    assert from_buffer(frame, torch.float32, (2,)).tolist() == [1.5, -2.0]\n"
        "assert from_buffer(bytearray(frame), torch.float32).tolist() == [1.5, -2.0]\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
