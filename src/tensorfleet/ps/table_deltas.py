"""Delta documents of an embedding table: only the rows (and, for a table of raw ids, the
map entries) changed since an earlier save, and how a chain of them is folded back into a
full document.

Why: a large table is mostly untouched between two checkpoints (a recommender's step looks
up a few thousand of millions of rows), yet a full document copies every row, its optimizer
slots and its id map each time. A delta copies what changed.

**What marks a change.** Every document a store writes carries its *tag*
``[incarnation, clock]``: ``incarnation`` is a random number drawn when the store is built
or restored, ``clock`` says how far the store had come. A delta *since* a tag holds what
changed after the document of that tag:

* a :class:`~tensorfleet.ps.row_store.RowStore` keeps a clock (``save_clock``) that moves
  on at the first change after each document it writes, and remembers per row the clock when it last changed (created by a
  lookup, updated, filled): the delta holds the rows marked after the clock of the tag,
  exactly the rows changed since;
* a :class:`~tensorfleet.ps.raw_id_rows.RawIdRowStore` does the same per id of its map
  (marked wherever its ``last_seen`` is set: every lookup and update of the id, the only
  things that change its count or its row): the delta holds the map entries marked after
  the tag and their rows, plus ``live_keys``, every id in the map now (8 B per id), which
  records the ids evicted or forgotten since: the ones the base holds and ``live_keys``
  does not; and its admission filter's counters, when it has one: those changed since the
  base (``admission_filter_at``, ``admission_filter_counts``) when the base is the document
  written last and they are few, else the whole filter.

Nothing is kept on the ps for the chief, so a save that the chief failed to write costs
nothing: the next delta is asked since the last checkpoint written.

A delta is only made for a tag of the store that answers (the same ``incarnation``, the
clock not past its own); otherwise (the ps restarted, or was restored, since) the full document
is written, and the chief sees which it got from the document itself.

**Folding** (:func:`merge`): the base's rows whose id the delta holds, or (raw ids) whose id
is no longer live, are replaced or dropped, the delta's are added, all in id order: the
result is byte for byte the document the store would have written in full (checked by the
tests), which :func:`~tensorfleet.ps.raw_id_rows.decode_store` then checks as any other.
Safetensors and JSON only.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from tensorfleet.errors import CheckpointError, ProtocolError
from tensorfleet.ps.raw_id_rows import RawIdRowStore
from tensorfleet.ps.row_store import METADATA_KEY, RowStore

DELTA_KEY = "tensorfleet_table_delta"
"""The metadata key of a delta document (a full one has ``tensorfleet_table``)."""
_MAP = ("keys", "count", "last_seen")


def header_metadata(document: bytes | memoryview) -> tuple[dict[str, Any], bool]:
    """A table document's metadata and whether it is a delta (CheckpointError when it is
    neither kind), read from its header alone."""
    view = memoryview(document)
    length = int.from_bytes(bytes(view[:8]), "little")
    if length > view.nbytes - 8:
        raise CheckpointError(
            f"a table document cannot be read: a {length}-byte header in {view.nbytes} bytes"
        )
    try:
        metadata = json.loads(bytes(view[8 : 8 + length])).get("__metadata__") or {}
        if DELTA_KEY in metadata:
            return json.loads(metadata[DELTA_KEY]), True
        return json.loads(metadata[METADATA_KEY]), False
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"a table document cannot be read: {exc!r:.200}") from None


def tag_of(metadata: dict[str, Any]) -> list[int] | None:
    """The tag a document was saved at (None: written before tags)."""
    tag = metadata.get("tag")
    if isinstance(tag, list) and len(tag) == 2 and all(isinstance(v, int) for v in tag):
        return tag
    return None


def check_since(table: str, since: object) -> list[int] | None:
    """A request's tag to save ``table`` since: ``[incarnation, clock]`` or None
    (ProtocolError when malformed)."""
    if since is None:
        return None
    if not (
        isinstance(since, list)
        and len(since) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in since)
        and since[1] >= 0
    ):
        raise ProtocolError(
            f"table {table!r}: a save since an earlier checkpoint names its tag [incarnation, "
            f"clock], got {since!r:.80}"
        )
    return since


def table_document(store: RowStore | RawIdRowStore, since: list[int] | None) -> bytes:
    """The store's document for a checkpoint: a delta since ``since`` when that tag is of
    this store, else the full document."""
    now = store.metadata()["tag"]
    if since is None or since[0] != now[0] or since[1] > now[1]:
        return store.encode()
    return encode_delta(store, since[1])


def encode_delta(store: RowStore | RawIdRowStore, since: int) -> bytes:
    """What changed in ``store`` after its document tagged ``since`` (module docstring)."""
    metadata = store.metadata()
    tensors = {name: t.contiguous() for name, t in store.changed_state(since).items()}
    store.note_saved()
    metadata["since"] = [metadata["tag"][0], since]
    return safetensors_save(tensors, {DELTA_KEY: json.dumps(metadata)})


def merge(base: bytes, delta: bytes, where: str) -> bytes:
    """The full document of ``base`` (a full document) updated by ``delta`` (a delta since
    ``base``'s tag). CheckpointError, naming ``where`` (the checkpoint and table), when the
    delta was not made against this base or does not fit it."""
    base_meta, base_is_delta = header_metadata(base)
    delta_meta, is_delta = header_metadata(delta)
    if base_is_delta or not is_delta:
        raise CheckpointError(f"{where}: merge takes a full document and a delta, in that order")
    if delta_meta.get("since") != tag_of(base_meta):
        raise CheckpointError(
            f"{where}: the delta was saved since tag {delta_meta.get('since')}, "
            f"its base holds {tag_of(base_meta)}: the base is not the checkpoint this delta was "
            f"made against (replaced by hand?); fix: restore an older complete checkpoint, or "
            f"start fresh"
        )
    for key in ("table", "partition", "shard", "rule", "format"):
        if base_meta.get(key) != delta_meta.get(key):
            raise CheckpointError(
                f"{where}: the delta's {key} {delta_meta.get(key)!r:.120} differs from its "
                f"base's {base_meta.get(key)!r:.120}"
            )
    try:
        old, new = safetensors_load(bytes(base)), safetensors_load(bytes(delta))
    except Exception as exc:  # safetensors raises its own error types for bad documents
        raise CheckpointError(
            f"{where}: a table document's tensors cannot be read: {exc}"
        ) from None
    rows = [name for name in old if name == "values" or name.startswith("slot/")]
    raw = "live_keys" in new
    want = {"ids", *rows, *((*_MAP, "live_keys") if raw else ())}
    if "admission_filter" in old:  # whole, or the counters changed since the base
        changed = {"admission_filter_at", "admission_filter_counts"}
        want |= changed if changed <= set(new) else {"admission_filter"}
    if set(new) != want or "ids" not in old:
        raise CheckpointError(
            f"{where}: the delta holds {sorted(new)}, its base {sorted(old)}: they do not fit"
        )
    for name in ("ids", "keys", "live_keys") if raw else ("ids",):
        ids = new[name]
        if ids.dim() != 1 or (ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all())):
            raise CheckpointError(f"{where}: the delta's {name} are not ascending and unique")
    try:
        replaced = new["keys"] if raw else new["ids"]
        drop = torch.isin(old["ids"], replaced)
        if raw:
            drop |= ~torch.isin(old["ids"], new["live_keys"])
        merged = _union(old, new, ["ids", *rows], ~drop)
        if raw:
            keep = ~torch.isin(old["keys"], new["keys"]) & torch.isin(old["keys"], new["live_keys"])
            merged.update(_union(old, new, list(_MAP), keep))
        if "admission_filter" in old:
            merged["admission_filter"] = _filter_merged(old, new, where)
    except RuntimeError as exc:  # shapes or dtypes that do not fit (cat, isin)
        raise CheckpointError(f"{where}: the delta does not fit its base: {exc}") from None
    metadata = {key: value for key, value in delta_meta.items() if key != "since"}
    return safetensors_save(merged, {METADATA_KEY: json.dumps(metadata)})


def _filter_merged(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], where: str
) -> torch.Tensor:
    """The admission filter's counters after a delta: the delta's whole filter, or the
    base's with the changed counters set (CheckpointError when they do not fit)."""
    if "admission_filter" in new:
        return new["admission_filter"]
    counters, at, values = (
        old["admission_filter"],
        new["admission_filter_at"],
        new["admission_filter_counts"],
    )
    if (
        at.dtype != torch.int64
        or values.dtype != torch.uint8
        or at.dim() != 1
        or values.shape != at.shape
        or (at.numel() and (int(at.min()) < 0 or int(at.max()) >= counters.numel()))
    ):
        raise CheckpointError(
            f"{where}: the delta's admission filter changes ({at.dtype} {list(at.shape)}, "
            f"{values.dtype} {list(values.shape)}) do not fit its base's "
            f"{counters.numel()} counters"
        )
    merged = counters.clone()
    merged[at] = values
    return merged


def _union(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], names: list[str], keep: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``old``'s entries where ``keep`` and all of ``new``'s, ordered by the first name's
    values (the ids or keys: ascending and unique in both, none in both once ``keep`` is
    applied): each entry's place is its place in its own side plus the number of entries
    of the other side below it, so every tensor is written once, not sorted."""
    kept = torch.nonzero(keep).flatten()
    old_keys, new_keys = old[names[0]].index_select(0, kept), new[names[0]]
    at_old = torch.arange(old_keys.numel()) + torch.searchsorted(new_keys, old_keys)
    at_new = torch.arange(new_keys.numel()) + torch.searchsorted(old_keys, new_keys)
    merged = {}
    for name in names:
        source = old[name]
        out = source.new_empty((kept.numel() + new[name].shape[0], *source.shape[1:]))
        out.index_copy_(0, at_old, source.index_select(0, kept))
        out.index_copy_(0, at_new, new[name])
        merged[name] = out
    return merged
