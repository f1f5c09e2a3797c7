"""Tensors as raw buffers: the dtype allow-list and zero-copy conversions both ways."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from tensorfleet.errors import ConfigError, ProtocolError
from tensorfleet.wire.auth import Buffer

#: The dtypes that may cross the wire, by their wire name. Anything else is refused.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

#: Whether torch has given, under our filter, its warning that a buffer is read-only. torch
#: gives it once per process (``TORCH_WARN_ONCE``), so only the first read-only read needs
#: the filter: after it, reads skip ``warnings.catch_warnings`` (a copy of the process's
#: warning filters, about 5 us of every received tensor, several per request).
_readonly_warning_spent = False


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; ValueError for a dtype that may not cross the wire."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ConfigError(f"dtype {dtype} cannot be sent; supported: {sorted(DTYPES)}") from None


def parse_dtype(name: object) -> torch.dtype:
    """The torch dtype of a wire name received from a peer (ProtocolError if not allowed)."""
    if not isinstance(name, str) or name not in DTYPES:
        raise ProtocolError(f"dtype {name!r} is not allowed; allowed: {sorted(DTYPES)}")
    return DTYPES[name]


def parse_shape(shape: object, max_dims: int = 16) -> tuple[int, ...]:
    """A shape received from a peer: a list of at most ``max_dims`` non-negative ints."""
    if not isinstance(shape, (list, tuple)) or len(shape) > max_dims:
        raise ProtocolError(f"shape must be a list of at most {max_dims} ints, got {shape!r}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape):
        raise ProtocolError(f"shape must hold non-negative ints, got {shape!r}")
    return tuple(shape)


def as_buffer(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the tensor must stay unchanged
    until the message has been sent)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ConfigError("only contiguous CPU tensors can be sent without a copy")
    # reshape(-1) is a view of a contiguous tensor; it lets 0-dim tensors be viewed as bytes.
    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")


def from_buffer(
    buffer: Buffer, dtype: torch.dtype, shape: Sequence[int] | None = None
) -> torch.Tensor:
    """A tensor over received bytes, without a copy. The tensor is read-only in spirit:
    the caller copies it wherever it must live. Raises ProtocolError when the byte length
    does not match ``dtype`` and ``shape``."""
    global _readonly_warning_spent
    view = memoryview(buffer)
    itemsize = dtype.itemsize
    if view.nbytes % itemsize:
        raise ProtocolError(f"{view.nbytes} bytes is not a whole number of {dtype} elements")
    numel = view.nbytes // itemsize
    if shape is not None:
        expected = 1
        for dim in shape:
            expected *= dim
        if expected != numel:
            raise ProtocolError(
                f"{view.nbytes} bytes hold {numel} {dtype} elements, but shape {list(shape)} needs {expected}"
            )
    if numel == 0:
        flat = torch.empty(0, dtype=dtype)
    elif view.readonly and not _readonly_warning_spent:
        with warnings.catch_warnings():
            # Received frames are read-only memory; we never write through these tensors.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(view, dtype=dtype)
        _readonly_warning_spent = True
    else:
        flat = torch.frombuffer(view, dtype=dtype)
    return flat if shape is None else flat.view(tuple(shape))  # tuple: () works too
