"""How the values in the reply to a push travel: in their variables' dtype (the default), or
float32 values as bfloat16 (``TrainingSession(..., values_wire_dtype="bf16")``).

Why: a step moves the model twice, the gradients to the ps and the new values back. A bf16
wire for the gradients (:mod:`tensorfleet.wire.gradient_encoding`) halves the first; this
halves the second, so a link-bound step (a large dense layer on a 1 Gbit/s link) moves half
the bytes each way, as it does in systems that compress both directions (Horovod's
``Compression.fp16`` compresses the all-reduced gradient both ways; BytePS compresses the push
and the pull).

The rule, one for both ends: a worker that asks for it names the dtype in every push
(``values_dtype``); the ps sends the float32 groups of the values in that reply rounded to
bfloat16 (round to nearest even) and says so in the reply; groups of any other dtype travel
as they are. Only the replies to pushes: a ``pull`` (a worker's first values, after a
recovery, at the end of training), a checkpoint and the moving average stay exact, so the
model a worker holds when training ends and every checkpoint are the ps's float32 values.
The worker checks that a reply carries the dtype it asked for (a ps of another version
would not), and the sizes of the buffers against that dtype, before anything is used.

What it costs: the worker computes its next gradient at weights rounded to 8 bits of
mantissa (relative error at most 2**-9). The ps keeps and updates float32 values, so the
rounding never accumulates: each reply is a fresh rounding of exact values, unlike gradients,
whose rounding error would accumulate and needs error feedback. This is the mixed-precision
recipe (float32 master weights, a low-precision copy for the forward and backward pass),
with the master weights on the ps. A ps that restarts without a checkpoint is re-created from
the chief's values, which are then the rounded ones. The measured effect (bytes, time per
step over rate-limited links, accuracy at equal steps) is in benchmarks/README.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tensorfleet.errors import ConfigError, ProtocolError

#: The dtypes float32 values may travel as, by the name a session uses.
VALUES_WIRE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16}
#: The request and reply field that names it.
FIELD = "values_dtype"


def check_values_wire_dtype(value: object) -> str | None:
    """``value`` if it names a values wire dtype (or is None: the variables' own), else
    ConfigError naming the choices."""
    if value is not None and value not in VALUES_WIRE_DTYPES:
        raise ConfigError(
            f"values_wire_dtype must be None (values in their own dtype) or one of "
            f"{sorted(VALUES_WIRE_DTYPES)}, got {value!r}"
        )
    return value  # type: ignore[return-value]


def request_fields(values_dtype: str | None) -> dict[str, str]:
    """The fields a worker adds to each push (none for values in their own dtype)."""
    return {FIELD: check_values_wire_dtype(values_dtype)} if values_dtype is not None else {}


def requested(body: Mapping[str, Any]) -> str | None:
    """The values dtype a received request asks for (None: their own); ProtocolError for a
    name this end does not know."""
    value = body.get(FIELD)
    if value is not None and (not isinstance(value, str) or value not in VALUES_WIRE_DTYPES):
        raise ProtocolError(
            f"a push asks for its values as {value!r:.40}; this ps sends "
            f"{sorted(VALUES_WIRE_DTYPES)} or the variables' own dtype: run the same "
            "tensorfleet version on every task"
        )
    return value


def encode(values: Sequence[torch.Tensor], values_dtype: str) -> list[torch.Tensor]:
    """``values`` for the wire: each float32 tensor rounded to the wire dtype (a new tensor),
    every other one as it is."""
    wire = VALUES_WIRE_DTYPES[values_dtype]
    return [t.to(wire) if t.dtype == torch.float32 else t for t in values]


def travel_dtype(dtype: torch.dtype, values_dtype: str | None) -> torch.dtype:
    """The dtype the values of a ``dtype`` group arrive in."""
    if values_dtype is not None and dtype == torch.float32:
        return VALUES_WIRE_DTYPES[values_dtype]
    return dtype


def check_reply(body: Mapping[str, Any], asked: str | None, peer: str) -> None:
    """ProtocolError unless a reply from ``peer`` carries its values the way they were
    ``asked`` for."""
    said = body.get(FIELD)
    if said != asked:
        raise ProtocolError(
            f"{peer} sent values as {said or 'their own dtype'!s:.40} where "
            f"{asked or 'their own dtype'} was asked: run the same tensorfleet version on "
            "every task"
        )
