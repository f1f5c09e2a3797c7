"""One ps shard's state as a safetensors document: what a checkpoint holds of the shard.

The shard encodes its variables, their optimizer state, the moving average, the global
step and the workers' data positions into one safetensors byte string; the chief writes it
to disk unchanged and sends it back to restore. safetensors because it is a format that
cannot carry code (no pickle) and whose header is plain JSON, so a document from disk or
from the network is parsed without executing anything and checked before it is used.

Tensor names:

* ``value/<variable>``: the variable's values;
* ``ema/<variable>``: its moving average, when the shard keeps one;
* ``optim/<variable>/<key>``: one tensor of the optimizer's state for that variable (for
  Adam ``exp_avg``, ``exp_avg_sq``, ``step``).

The ``__metadata__`` map has one key, ``tensorfleet_shard``, a JSON object: format version,
shard index, global step, update count, the update rule, the variables in layout order,
and ``worker_data`` (each worker's last reported data position).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as safetensors_load

from tensorfleet.errors import ProtocolError
from tensorfleet.ps.layout import FusedLayout, StoredVariable

SHARD_FORMAT = 1
METADATA_KEY = "tensorfleet_shard"
#: Largest safetensors header accepted (names and shapes of many thousand variables fit).
MAX_HEADER_BYTES = 64 << 20
#: Optimizer state keys are short identifiers (``exp_avg``, ``momentum_buffer``, ``step``).
STATE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
MAX_STATE_KEYS = 8
MAX_BUFFERS = 100_000
"""At most this many persistent buffers in one document."""
#: A worker's data position is a small map; bigger ones are refused.
MAX_WORKER_DATA_BYTES = 4096
#: safetensors' names of the dtypes a shard holds.
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}


@dataclass
class ShardState:
    """The decoded, validated content of a shard document."""

    shard: int
    global_step: int
    version: int
    rule: dict[str, Any]
    variables: list[StoredVariable]
    values: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None
    optimizer: dict[str, dict[str, torch.Tensor]]
    worker_data: dict[str, dict[str, Any]] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """The model's persistent buffers (BatchNorm statistics ...) this shard holds, by name."""
    tables: dict[str, bytes] = field(default_factory=dict)
    """This shard's part of each embedding table: a row store document by table name."""

    @property
    def layout(self) -> FusedLayout:
        return FusedLayout.of(self.variables)


def encode_shard(
    *,
    shard: int,
    global_step: int,
    version: int,
    rule: dict[str, Any],
    layout: FusedLayout,
    values: dict[str, torch.Tensor],
    ema: dict[str, torch.Tensor] | None,
    optimizer: dict[str, dict[str, torch.Tensor]],
    worker_data: dict[str, dict[str, Any]],
    buffers: dict[str, torch.Tensor] | None = None,
    tables: dict[str, bytes] | None = None,
) -> bytearray:
    """The safetensors document of one shard. The tensors may be views of the shard's
    storage: each is copied once, straight into the document."""
    return _safetensors_document(
        *_shard_tensors(
            shard, global_step, version, rule, layout, values, ema, optimizer, worker_data,
            buffers, tables,
        )
    )  # fmt: skip


def encode_shard_pieces(
    *,
    shard: int,
    global_step: int,
    version: int,
    rule: dict[str, Any],
    layout: FusedLayout,
    values: dict[str, torch.Tensor],
    ema: dict[str, torch.Tensor] | None,
    optimizer: dict[str, dict[str, torch.Tensor]],
    worker_data: dict[str, dict[str, Any]],
) -> list[memoryview]:
    """The document :func:`encode_shard` would make (without buffers or tables), as the
    pieces that written one after the other are it: its header, then each tensor's bytes,
    uncopied (views of the shard's storage: to be written before the store changes). For the
    update log's snapshots, which go straight to a file: the one copy is the write's."""
    tensors, metadata = _shard_tensors(
        shard, global_step, version, rule, layout, values, ema, optimizer, worker_data, None, None
    )
    return _safetensors_pieces(tensors, metadata)


def _shard_tensors(
    shard: int,
    global_step: int,
    version: int,
    rule: dict[str, Any],
    layout: FusedLayout,
    values: dict[str, torch.Tensor],
    ema: dict[str, torch.Tensor] | None,
    optimizer: dict[str, dict[str, torch.Tensor]],
    worker_data: dict[str, dict[str, Any]],
    buffers: dict[str, torch.Tensor] | None,
    tables: dict[str, bytes] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A shard document's tensors by safetensors name, and its metadata."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        tensors[f"value/{name}"] = value
    for name, average in (ema or {}).items():
        tensors[f"ema/{name}"] = average
    for name, state in optimizer.items():
        for key, tensor in state.items():
            tensors[f"optim/{name}/{key}"] = tensor
    for name, buffer in (buffers or {}).items():
        tensors[f"buffer/{name}"] = buffer
    for name, document in (tables or {}).items():  # a row store's own checked document
        tensors[f"table/{name}"] = torch.frombuffer(bytearray(document), dtype=torch.uint8)
    metadata = {
        "format": SHARD_FORMAT,
        "shard": shard,
        "global_step": global_step,
        "version": version,
        "rule": rule,
        "variables": [v.to_wire() for v in layout.variables],
        "has_ema": ema is not None,
        "worker_data": worker_data,
    }
    return tensors, {METADATA_KEY: json.dumps(metadata)}


def _safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors document's first bytes: the header's length, the header (padded so
    that the data starts 8-byte aligned, as safetensors writes it)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def _tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in C order, as uint8 (a copy only where it is not already so)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _safetensors_pieces(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> list[memoryview]:
    """The safetensors encoding of ``tensors`` as pieces: the header, each tensor's bytes."""
    pieces = [memoryview(_safetensors_header(tensors, metadata))]
    for tensor in tensors.values():
        if tensor.numel():
            pieces.append(memoryview(_tensor_bytes(tensor).numpy()))
    return pieces


def _safetensors_document(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytearray:
    """The safetensors encoding of ``tensors`` (C order, no holes; the machine's byte order,
    little-endian on every platform torch ships for), written in
    one pass into one buffer. ``safetensors.torch.save`` does the same with an extra copy of
    every tensor: 27 ms instead of 4 for the CNN's 19.5 MB with Adam state; this is what a
    checkpoint costs the ps's single thread. :func:`decode_shard` reads it with safetensors'
    own parser (and the tests check that the two agree)."""
    head = _safetensors_header(tensors, metadata)
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    document = bytearray(len(head) + total)
    document[: len(head)] = head
    data = (
        torch.frombuffer(document, dtype=torch.uint8, offset=len(head), count=total)
        if total
        else None
    )
    position = 0
    for tensor in tensors.values():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            data[position : position + nbytes].copy_(_tensor_bytes(tensor))
        position += nbytes
    return document


def read_metadata(document: bytes | memoryview) -> dict[str, Any]:
    """The tensorfleet metadata of a shard document, without loading its tensors."""
    view = memoryview(document)
    if view.nbytes < 8:
        raise ProtocolError(f"a shard document of {view.nbytes} bytes is too short")
    (header_bytes,) = struct.unpack("<Q", view[:8])
    if header_bytes > min(MAX_HEADER_BYTES, view.nbytes - 8):
        raise ProtocolError(
            f"a shard document declares a {header_bytes}-byte header in {view.nbytes} bytes"
        )
    try:
        header = json.loads(bytes(view[8 : 8 + header_bytes]))
        metadata = json.loads(header["__metadata__"][METADATA_KEY])
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ProtocolError(f"not a tensorfleet shard document: {exc!r:.200}") from None
    if not isinstance(metadata, dict) or metadata.get("format") != SHARD_FORMAT:
        raise ProtocolError(
            f"shard document format {metadata.get('format') if isinstance(metadata, dict) else None!r}, "
            f"this tensorfleet reads format {SHARD_FORMAT}"
        )
    return metadata


def decode_shard(document: bytes | memoryview) -> ShardState:
    """Parse and check a shard document (ProtocolError naming what is wrong)."""
    metadata = read_metadata(document)
    try:
        tensors = safetensors_load(bytes(document))
    except Exception as exc:  # safetensors raises its own error types for bad documents
        raise ProtocolError(f"the shard document's tensors cannot be read: {exc}") from None
    variables = metadata.get("variables")
    if not isinstance(variables, list):  # empty: a shard holding only table rows
        raise ProtocolError(
            f"the shard document's 'variables' must be a list, got {variables!r:.80}"
        )
    parsed = [StoredVariable.from_wire(v) for v in variables]
    layout = FusedLayout.of(parsed)  # also refuses duplicate names
    for key in ("shard", "global_step", "version"):
        value = metadata.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ProtocolError(f"shard document field {key!r} must be an int >= 0, got {value!r}")
    rule = metadata.get("rule")
    if not isinstance(rule, dict):
        raise ProtocolError(f"shard document field 'rule' must be a map, got {rule!r}")

    values: dict[str, torch.Tensor] = {}
    ema: dict[str, torch.Tensor] | None = {} if metadata.get("has_ema") is True else None
    optimizer: dict[str, dict[str, torch.Tensor]] = {v.name: {} for v in layout.variables}
    by_name = {v.name: v for v in layout.variables}
    buffers: dict[str, torch.Tensor] = {}
    tables: dict[str, bytes] = {}
    for tensor_name, tensor in tensors.items():
        kind, _, rest = tensor_name.partition("/")
        if kind in ("value", "ema"):
            var = by_name.get(rest)
            if var is None or (kind == "ema" and ema is None):
                raise ProtocolError(f"unexpected tensor {tensor_name!r} in the shard document")
            _check_like(tensor_name, tensor, var)
            (values if kind == "value" else ema)[rest] = tensor
        elif kind == "optim":
            var_name, _, key = rest.rpartition("/")
            var = by_name.get(var_name)
            if var is None or not STATE_KEY.match(key):
                raise ProtocolError(f"unexpected tensor {tensor_name!r} in the shard document")
            if not tensor.dtype.is_floating_point or (
                tensor.dim() != 0 and tuple(tensor.shape) != var.shape
            ):
                raise ProtocolError(
                    f"optimizer state {tensor_name!r} is {list(tensor.shape)} {tensor.dtype}; "
                    f"it must be a float scalar or shaped like {var.name!r} {list(var.shape)}"
                )
            optimizer[var_name][key] = tensor
            if len(optimizer[var_name]) > MAX_STATE_KEYS:
                raise ProtocolError(f"too many optimizer state tensors for {var_name!r}")
        elif kind == "buffer" and rest and len(buffers) < MAX_BUFFERS:
            buffers[rest] = tensor
        elif kind == "table" and rest and tensor.dtype == torch.uint8 and tensor.dim() == 1:
            tables[rest] = tensor.numpy().tobytes()
        else:
            raise ProtocolError(f"unexpected tensor {tensor_name!r} in the shard document")
    for var in layout.variables:
        if var.name not in values:
            raise ProtocolError(f"the shard document has no values for {var.name!r}")
        if ema is not None and var.name not in ema:
            raise ProtocolError(f"the shard document has no moving average for {var.name!r}")
    return ShardState(
        shard=metadata["shard"],
        global_step=metadata["global_step"],
        version=metadata["version"],
        rule=rule,
        variables=parsed,
        values=values,
        ema=ema,
        optimizer={k: v for k, v in optimizer.items() if v},
        worker_data=check_worker_data_map(metadata.get("worker_data", {})),
        buffers=buffers,
        tables=tables,
    )


def check_worker_data(task: str, data: object) -> dict[str, Any]:
    """A worker's data position, checked: a small JSON-like map (ProtocolError otherwise)."""
    if not isinstance(data, dict):
        raise ProtocolError(f"{task}: a data position must be a map, got {type(data).__name__}")
    try:
        encoded = json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{task}: the data position is not plain JSON data: {exc}") from None
    if len(encoded) > MAX_WORKER_DATA_BYTES:
        raise ProtocolError(
            f"{task}: the data position has {len(encoded)} bytes as JSON, at most "
            f"{MAX_WORKER_DATA_BYTES} are kept (it should be a few counters and seeds)"
        )
    return data


def check_worker_data_map(data: object) -> dict[str, dict[str, Any]]:
    if not isinstance(data, dict) or len(data) > 100_000:
        raise ProtocolError("the shard document's worker_data must be a map of task -> map")
    return {str(task): check_worker_data(str(task), value) for task, value in data.items()}


def _check_like(name: str, tensor: torch.Tensor, var: StoredVariable) -> None:
    if tuple(tensor.shape) != var.shape or str(tensor.dtype).removeprefix("torch.") != var.dtype:
        raise ProtocolError(
            f"tensor {name!r} is {list(tensor.shape)} {tensor.dtype} in the shard document, "
            f"the variable is {list(var.shape)} {var.dtype}"
        )
