"""Delta checkpoints of the embedding tables: which checkpoints the chief writes as deltas,
and how a chain of them is read back as one checkpoint.

``TrainingSession(..., full_checkpoint_every=K)`` (K >= 2) writes a full checkpoint, then
K - 1 checkpoints in which each embedding table holds only what changed since the
checkpoint before (:mod:`tensorfleet.ps.table_deltas`), then a full one again. The dense
variables, optimizer state, buffers and data positions are small next to a large table and
stay whole in every checkpoint; only the tables' documents are deltas.

The chief keeps, of the checkpoint it wrote last, its directory name and each table's tag
(``[incarnation, step]``, read from the documents themselves) and asks each ps for the
tables since those tags (:class:`DeltaPlan`). A delta checkpoint's manifest says
``"kind": "delta"`` and ``"base"``: the directory of the checkpoint it was made against (a
full one or another delta); a full one says ``"kind": "full"``. After a restore the next
checkpoint is full. A ps that restarted since (its tables restored, a new incarnation)
answers its tables in full: they simply end the chain there.

Reading (:func:`merge_chain`): the newest checkpoint's shard documents, each delta table
document folded onto its base's, back to the full one; every checkpoint of the chain is
verified (sizes and SHA-256) as any checkpoint is, and a delta whose base is missing or
corrupt is refused naming the file (:mod:`tensorfleet.session.checkpoints`, which then
falls back to an older complete chain).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load

from tensorfleet.errors import CheckpointError, ConfigError
from tensorfleet.ps.shard_checkpoint import METADATA_KEY, _safetensors_document
from tensorfleet.ps.table_deltas import header_metadata, merge, tag_of

FULL, DELTA = "full", "delta"


def table_documents(document: bytes | bytearray | memoryview) -> dict[str, memoryview]:
    """The embedding-table documents inside a shard document, by table name, as views
    (read from the safetensors header; nothing is copied or decoded)."""
    view = memoryview(document).cast("B")
    try:
        (length,) = struct.unpack("<Q", view[:8])
        header = json.loads(bytes(view[8 : 8 + length]))
    except (struct.error, ValueError) as exc:
        raise CheckpointError(f"a shard document's header cannot be read: {exc}") from None
    start = 8 + length
    tables = {}
    for name, entry in header.items():
        if name.startswith("table/") and isinstance(entry, dict):
            begin, end = entry["data_offsets"]
            tables[name.removeprefix("table/")] = view[start + begin : start + end]
    return tables


@dataclass(frozen=True)
class _Written:
    """A checkpoint the chief wrote: its directory name, global step, each shard's table
    tags, and how many deltas it is after its full checkpoint (0: it is the full one)."""

    name: str
    global_step: int
    tags: list[dict[str, list[int]]]
    deltas: int


class DeltaPlan:
    """What the chief asks for at its next checkpoint: a full one every
    ``full_checkpoint_every`` checkpoints, deltas since the last one written between.

    A checkpoint of the same global step as the last one replaces it (the final checkpoint
    after the hook's of the same step): it is then a delta since the one before that, or
    full when there is none."""

    def __init__(self, full_checkpoint_every: int) -> None:
        if (
            not isinstance(full_checkpoint_every, int)
            or isinstance(full_checkpoint_every, bool)
            or full_checkpoint_every < 1
        ):
            raise ConfigError(
                f"full_checkpoint_every must be an int >= 1 (1: every checkpoint full; K: a "
                f"full one, then K - 1 deltas of the embedding tables), got "
                f"{full_checkpoint_every!r}"
            )
        self.full_every = full_checkpoint_every
        self._written: list[_Written] = []
        """The last two checkpoints written (a delta's base, and the one before it)."""
        self._base: _Written | None = None

    def since(self, global_step: int | None = None) -> list[dict[str, list[int]]] | None:
        """Per shard, each table's tag to save since (None: a full checkpoint is due), for
        a checkpoint of ``global_step`` (None: not known yet; a later one)."""
        written = self._written
        if written and global_step is not None and global_step <= written[-1].global_step:
            written = written[:-1]  # that checkpoint is replaced: its base is the one before
        base = written[-1] if written else None
        if self.full_every == 1 or base is None or base.deltas + 1 >= self.full_every:
            base = None
        self._base = base
        return None if base is None else [dict(tags) for tags in base.tags]

    def manifest_fields(
        self, documents: Sequence[bytes | bytearray | memoryview], global_step: int
    ) -> dict[str, str] | None:
        """``kind`` (and ``base`` for a delta) for the manifest of a checkpoint of
        ``documents`` at ``global_step`` (a delta when any table document is one). None:
        a delta whose base is of the same step (it would replace its own base): ask again
        with :meth:`since` of ``global_step``."""
        delta = False
        base = self._base
        for shard, document in enumerate(documents):
            for name, table in table_documents(document).items():
                metadata, is_delta = header_metadata(table)
                if not is_delta:
                    continue
                asked = base.tags[shard].get(name) if base is not None else None
                if metadata.get("since") != asked:
                    raise CheckpointError(
                        f"ps:{shard} saved table {name!r} as a delta since "
                        f"{metadata.get('since')}, the chief asked since {asked}: refusing to "
                        f"write a checkpoint whose base is not the one written last"
                    )
                delta = True
        if not delta or base is None:
            return {"kind": FULL}
        if global_step <= base.global_step:
            return None
        return {"kind": DELTA, "base": base.name}

    def written(
        self, path: Path, documents: Sequence[bytes | bytearray | memoryview], global_step: int
    ) -> None:
        """Checkpoint ``path`` of ``documents`` was written: the base of the next delta."""
        tags: list[dict[str, list[int]]] = []
        full = True
        for document in documents:
            shard_tags = {}
            for name, table in table_documents(document).items():
                metadata, is_delta = header_metadata(table)
                full = full and not is_delta
                tag = tag_of(metadata)
                if tag is not None:
                    shard_tags[name] = tag
            tags.append(shard_tags)
        written = [w for w in self._written if w.name != path.name]  # replaced: same step
        deltas = 0 if full or self._base is None else self._base.deltas + 1
        self._written = [*written, _Written(path.name, global_step, tags, deltas)][-2:]

    def reset(self) -> None:
        """The tables were restored (new incarnations): the next checkpoint is full."""
        self._written, self._base = [], None


def merge_chain(chain: Sequence[tuple[Path, Sequence[bytes]]]) -> list[bytes]:
    """The shard documents of the newest checkpoint of ``chain`` (newest first: each
    checkpoint's directory and shard documents, then its base's, back to a full one) with
    every table whole: each delta table document folded onto its base's."""
    newest_path, newest = chain[0]
    for path, documents in chain[1:]:
        if len(documents) != len(newest):
            raise CheckpointError(
                f"checkpoint {newest_path} has {len(newest)} shard files, its base {path} "
                f"{len(documents)}: the chain does not fit together"
            )
    merged = []
    for shard, document in enumerate(newest):
        tables = table_documents(document)
        replaced: dict[str, bytes] = {}
        for name, table in tables.items():
            if not header_metadata(table)[1]:
                continue
            pending = [table]  # newest first, back to a full document
            for path, documents in chain[1:]:
                older = table_documents(documents[shard]).get(name)
                if older is None:
                    raise CheckpointError(
                        f"checkpoint {newest_path}: table {name!r} is a delta, its base {path} "
                        f"holds no such table: the chain does not fit together"
                    )
                pending.append(older)
                if not header_metadata(older)[1]:
                    break
            else:
                raise CheckpointError(
                    f"checkpoint {newest_path}: table {name!r} of shard {shard} is a delta "
                    f"back to {chain[-1][0]}, which holds no full document of it"
                )
            whole = bytes(pending[-1])
            for step, delta in enumerate(reversed(pending[:-1])):
                where = (
                    f"checkpoint {newest_path} (table {name!r}, shard {shard}, delta {step + 1})"
                )
                whole = merge(whole, bytes(delta), where)
            replaced[name] = whole
        merged.append(_with_tables(bytes(document), replaced) if replaced else bytes(document))
    return merged


def _with_tables(document: bytes, tables: dict[str, bytes]) -> bytes:
    """``document`` (a shard document) with the table documents ``tables`` put in place."""
    tensors: dict[str, torch.Tensor] = dict(safetensors_load(document))
    for name, table in tables.items():
        tensors[f"table/{name}"] = torch.frombuffer(bytearray(table), dtype=torch.uint8)
    (length,) = struct.unpack("<Q", document[:8])
    metadata: dict[str, Any] = json.loads(document[8 : 8 + length]).get("__metadata__", {})
    if METADATA_KEY not in metadata:
        raise CheckpointError("a shard document of a delta checkpoint has no tensorfleet metadata")
    return bytes(_safetensors_document(tensors, metadata))
