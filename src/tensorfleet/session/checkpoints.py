"""Checkpoints on disk: a directory per checkpoint, one safetensors file per ps shard and a
JSON manifest, written so that a crash at any moment leaves every earlier checkpoint intact.

Layout of a checkpoint directory (``<checkpoint_dir>/step-00001200/``)::

    shard-0-of-2.safetensors   what ps:0 sent for ``save`` (variables, optimizer, EMA, ...)
    shard-1-of-2.safetensors
    manifest.json              global step, time, placement, SHA-256 and size of each file

How it is written (:meth:`CheckpointDirectory.write`): everything goes into a temporary
directory first; each file is written, flushed and fsynced; the manifest is written last;
then the temporary directory is renamed to its final name (the commit: a rename is atomic)
and the parent directory is fsynced. A directory that exists under its final name is
complete. The newest ``keep`` are kept; older ones and leftover temporary directories of
crashed writers are removed.

How it is read (:meth:`CheckpointDirectory.newest_valid`): newest first, each file's size and
SHA-256 are checked against the manifest; a checkpoint that fails (truncated, corrupt,
missing file, unreadable manifest) is skipped with a warning naming what is wrong, and the
previous one is tried.

Delta checkpoints (``full_checkpoint_every=K``, :mod:`tensorfleet.session.delta_checkpoints`):
a manifest may say ``"kind": "delta"`` and name its ``"base"`` directory; its embedding
tables then hold only what changed since that base. :func:`read_chain` reads and verifies
every checkpoint back to a full one and folds the tables whole, so every reader here
(restore, :func:`load_checkpoint`, :func:`load_table_rows`) sees complete documents; a
delta whose base is missing or corrupt is refused, and :meth:`CheckpointDirectory.newest_valid`
falls back to an older complete chain. Pruning keeps the bases a kept delta needs.

Why the chief writes the files, not the ps tasks: the ps sends its shard's document in the
reply to ``save``, so checkpoints need no filesystem shared between machines (a Kubernetes
pod or a Slurm node can keep ``checkpoint_dir`` on its own disk), a ps never writes to a path
it was sent over the network, and one process orders the writes so the manifest is last.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tensorfleet.errors import CheckpointError, ConfigError, ProtocolError
from tensorfleet.ps.raw_id_rows import decode_store
from tensorfleet.ps.row_store import RowStore
from tensorfleet.ps.shard_checkpoint import decode_shard
from tensorfleet.session.delta_checkpoints import merge_chain
from tensorfleet.version import __version__

log = logging.getLogger("tensorfleet.checkpoints")

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint found on disk and verified: its directory, step, manifest and files."""

    path: Path
    global_step: int
    manifest: dict[str, Any]
    documents: list[bytes]
    """One safetensors document per ps shard, verified against the manifest."""


def shard_file_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard}-of-{num_shards}.safetensors"


class CheckpointDirectory:
    """The checkpoints of one training run under ``root``."""

    def __init__(self, root: str | os.PathLike[str], keep: int = 5) -> None:
        if keep < 1:
            raise ConfigError(f"keep must be >= 1 checkpoint, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def write(
        self,
        global_step: int,
        documents: Sequence[bytes | bytearray | memoryview],
        placement: Mapping[str, Any],
        info: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write one checkpoint atomically (see the module docstring); returns its directory."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            final = self.root / f"step-{global_step:08d}"
            staging = (
                self.root / f"{_TMP_PREFIX}step-{global_step:08d}-{os.getpid()}-{time.time_ns()}"
            )
            staging.mkdir()
            shards = []
            for shard, document in enumerate(documents):
                name = shard_file_name(shard, len(documents))
                _write_durably(staging / name, document)
                shards.append(
                    {
                        "file": name,
                        "bytes": memoryview(document).nbytes,
                        "sha256": hashlib.sha256(document).hexdigest(),
                    }
                )
            manifest = {
                "format": MANIFEST_FORMAT,
                "global_step": global_step,
                "time": time.time(),
                "tensorfleet": __version__,
                "shards": shards,
                "placement": dict(placement),
                **dict(info or {}),
            }
            _write_durably(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync_directory(staging)
            if final.exists():  # the same step saved again (e.g. by a restarted chief)
                replaced = self.root / f"{_TMP_PREFIX}replaced-{final.name}-{time.time_ns()}"
                final.rename(replaced)
                staging.rename(final)
                shutil.rmtree(replaced, ignore_errors=True)
            else:
                staging.rename(final)
            _fsync_directory(self.root)
        except OSError as exc:
            raise CheckpointError(
                f"cannot write the checkpoint of step {global_step} under {self.root}: {exc}. "
                "Check that the directory is writable and the disk is not full; earlier "
                "checkpoints are untouched"
            ) from exc
        self._prune(keep_also=final)
        return final

    def step_directories(self) -> list[tuple[int, Path]]:
        """Complete checkpoint directories (by name), newest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                found.append((int(match.group(1)), entry))
        return sorted(found, reverse=True)

    def newest_valid(self) -> Checkpoint | None:
        """The newest checkpoint whose files (and, for a delta, every base's back to a full
        checkpoint: :func:`read_chain`) all match their manifests; corrupt ones and deltas of
        a missing or corrupt base are skipped with a warning. None when there is none."""
        for _, path in self.step_directories():
            try:
                return read_chain(path)
            except CheckpointError as exc:
                log.warning("%s; skipping it and trying the previous checkpoint", exc)
        return None

    def _prune(self, keep_also: Path) -> None:
        """Remove all but the newest ``keep`` checkpoints and the bases the kept deltas are
        made against (back to their full checkpoints), and temporary directories left by
        writers that died (never the one just written)."""
        found = self.step_directories()
        kept = {path for _, path in found[: self.keep]} | {keep_also}
        for path in list(kept):
            while (base := _base_of(path)) is not None and base not in kept:
                kept.add(base)
                path = base
        for _, path in found:
            if path not in kept:
                shutil.rmtree(path, ignore_errors=True)
        for entry in self.root.iterdir():
            if entry.name.startswith(_TMP_PREFIX) and f"-{os.getpid()}-" not in entry.name:
                shutil.rmtree(entry, ignore_errors=True)


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and verify one checkpoint directory (CheckpointError naming what is wrong)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} has no readable manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"checkpoint {path}: unknown manifest format")
    step, shards = manifest.get("global_step"), manifest.get("shards")
    if not isinstance(step, int) or not isinstance(shards, list) or not shards:
        raise CheckpointError(f"checkpoint {path}: the manifest lacks global_step or shards")
    documents = []
    for entry in shards:
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise CheckpointError(f"checkpoint {path}: a shard entry of the manifest is malformed")
        file = path / Path(entry["file"]).name
        try:
            document = file.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path}: cannot read {file.name}: {exc}") from None
        if len(document) != entry.get("bytes"):
            raise CheckpointError(
                f"checkpoint {path}: {file.name} has {len(document)} bytes, the manifest says "
                f"{entry.get('bytes')} (truncated?)"
            )
        digest = hashlib.sha256(document).hexdigest()
        if digest != entry.get("sha256"):
            raise CheckpointError(
                f"checkpoint {path}: {file.name} is corrupt (SHA-256 {digest[:16]}..., the "
                f"manifest says {str(entry.get('sha256'))[:16]}...)"
            )
        documents.append(document)
    return Checkpoint(path, step, manifest, documents)


def _base_of(path: Path) -> Path | None:
    """The directory a delta checkpoint was made against (None: a full one, or no readable
    manifest)."""
    try:
        base = json.loads((path / MANIFEST).read_text()).get("base")
    except (OSError, ValueError, AttributeError):
        return None
    return path.parent / base if isinstance(base, str) and _STEP_DIR.match(base) else None


def read_chain(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and verify one checkpoint directory; for a delta checkpoint (its manifest names
    a ``base``), also every base back to a full checkpoint, and return the newest's
    documents with every embedding table whole
    (:func:`~tensorfleet.session.delta_checkpoints.merge_chain`). CheckpointError naming
    the missing or corrupt file and the fix."""
    newest = read_checkpoint(path)
    chain = [newest]
    while (base := chain[-1].manifest.get("base")) is not None:
        current = chain[-1]
        if not isinstance(base, str) or not _STEP_DIR.match(base):
            raise CheckpointError(f"checkpoint {current.path}: the manifest's base {base!r:.80}")
        base_path = current.path.parent / base
        if not (base_path / MANIFEST).is_file():
            raise CheckpointError(
                f"checkpoint {newest.path} is a delta of the embedding tables whose chain "
                f"needs {base_path / MANIFEST}, which is missing (deleted by hand, or never "
                f"completed); fix: restore an earlier checkpoint (the newest complete chain is "
                f"used when restoring from the checkpoint_dir), or start fresh"
            )
        try:
            older = read_checkpoint(base_path)
        except CheckpointError as exc:
            raise CheckpointError(
                f"checkpoint {newest.path} is a delta of the embedding tables whose chain "
                f"needs {base_path}, which is unusable ({exc}); fix: restore an earlier "
                f"checkpoint, or start fresh"
            ) from None
        if older.global_step >= current.global_step:
            raise CheckpointError(
                f"checkpoint {current.path} names base {base_path}, which is not older"
            )
        chain.append(older)
    if len(chain) == 1:
        return newest
    documents = merge_chain([(c.path, c.documents) for c in chain])
    return Checkpoint(newest.path, newest.global_step, newest.manifest, documents)


def _table_names(path: str | os.PathLike[str]) -> list[str]:
    """The embedding tables a checkpoint holds (in any shard's document), sorted."""
    names: set[str] = set()
    for document in _find(path).documents:
        try:
            names.update(decode_shard(document).tables)
        except ProtocolError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from None
    return sorted(names)


def _find(path: str | os.PathLike[str]) -> Checkpoint:
    """A checkpoint directory (a delta's chain read whole), or the newest valid one under a
    ``checkpoint_dir``."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return read_chain(path)
    checkpoint = CheckpointDirectory(path).newest_valid()
    if checkpoint is None:
        raise CheckpointError(
            f"no valid checkpoint in {path}: give a checkpoint directory (with {MANIFEST}) or "
            "the checkpoint_dir of a run that saved at least one"
        )
    return checkpoint


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    *,
    moving_average: bool = False,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """The model's state from a checkpoint (parameters and persistent buffers, by their
    ``state_dict`` names), with no cluster.

    ``path`` is a checkpoint directory or a run's ``checkpoint_dir`` (its newest valid
    checkpoint is used). Partitioned variables are put back together. With ``model``, the
    values are also loaded into it (``load_state_dict(..., strict=strict)``).
    ``moving_average=True`` returns the exponential moving average instead (when the run
    kept one)."""
    checkpoint = _find(path)
    placement = checkpoint.manifest.get("placement", {})
    pieces: dict[str, list[tuple[int, int | None, torch.Tensor]]] = {}
    buffers: dict[str, torch.Tensor] = {}  # persistent buffers: whole, the same in both views
    mirrored = _mirrored_weights(placement)
    table_rows: dict[str, list[bytes]] = {name: [] for name in mirrored}
    for document in checkpoint.documents:
        try:
            shard = decode_shard(document)
        except ProtocolError as exc:
            raise CheckpointError(f"checkpoint {checkpoint.path}: {exc}") from None
        for table in mirrored:
            if table in shard.tables:
                table_rows[table].append(shard.tables[table])
        source = shard.values
        if moving_average:
            if shard.ema is None:
                raise CheckpointError(
                    f"checkpoint {checkpoint.path} has no moving average (train with ema_decay)"
                )
            source = shard.ema
        buffers.update(shard.buffers)
        for stored_name, tensor in source.items():
            where = placement.get(stored_name, {"param": stored_name, "rows": None})
            rows = where.get("rows")
            pieces.setdefault(where["param"], []).append(
                (rows[0] if rows else 0, rows[1] if rows else None, tensor)
            )
    state = {}
    for name, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        state[name] = (
            parts[0][2]
            if len(parts) == 1 and parts[0][1] is None
            else torch.cat([tensor for _, _, tensor in parts])
        )
    for table, entry in mirrored.items():
        state[str(entry["param"])] = _assemble_rows(
            checkpoint.path, table, entry, table_rows[table]
        )
    state.update(buffers)
    if model is not None:
        result = model.load_state_dict(state, strict=strict)
        if strict is False and (result.missing_keys or result.unexpected_keys):
            log.warning(
                "load_checkpoint: missing %s, unexpected %s",
                result.missing_keys,
                result.unexpected_keys,
            )
    return state


def load_table_rows(path: str | os.PathLike[str], table: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of embedding table ``table`` saved in a checkpoint: ``(ids, values)``, the
    int64 ids of every row created so far (ascending) and their ``[len(ids), dim]`` values.

    ``path`` is a checkpoint directory or a run's ``checkpoint_dir`` (its newest valid
    checkpoint: every file's size and SHA-256 checked against the manifest, as
    :func:`load_checkpoint` does). The rows are gathered from every shard's document (a
    one-process run has one). Rows that were never looked up were never created and are not
    in the checkpoint: their value is the table's initializer's
    (``table.initializer.rows(ids, dim, dtype)``; a table of raw ids: ``..., raw_ids=True``). ``table`` is the table's name, by default
    its place in the model (``embedding``, ``towers.user``); a ``sparse=True`` embedding
    weight held as rows is a table too, named after its parameter (``embedding.weight``).
    CheckpointError names the tables the checkpoint holds when ``table`` is not one of them,
    and the shards missing when the documents do not hold all of it."""
    checkpoint = _find(path)
    documents: list[bytes] = []
    held: set[str] = set()
    for document in checkpoint.documents:
        try:
            shard = decode_shard(document)
        except ProtocolError as exc:
            raise CheckpointError(f"checkpoint {checkpoint.path}: {exc}") from None
        held.update(shard.tables)
        if table in shard.tables:
            documents.append(shard.tables[table])
    if not documents:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} holds no embedding table {table!r}; it holds "
            f"{sorted(held) or 'none'} (a table is named after its place in the model unless "
            f"given name=...)"
        )
    stores = [decode_store(document) for document in documents]
    shards = stores[0].partition.num_shards
    missing = sorted(set(range(shards)) - {store.shard for store in stores})
    if missing or len(stores) != shards:
        raise CheckpointError(
            f"checkpoint {checkpoint.path}: table {table!r} is split over {shards} shard(s), "
            f"the documents hold shards {sorted(store.shard for store in stores)} (missing "
            f"{missing}): the checkpoint is incomplete"
        )
    held_rows = [store.rows() for store in stores]
    ids = torch.cat([rows for rows, _ in held_rows])
    values = torch.cat([rows for _, rows in held_rows])
    order = torch.argsort(ids)
    return ids[order], values[order]


def _mirrored_weights(placement: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The manifest's tables that are the weight of a parameter (``table/<name>`` entries
    with ``param``: a ``sparse=True`` embedding weight the ps held as rows), by table."""
    return {
        str(entry["table"]): entry
        for key, entry in placement.items()
        if key.startswith("table/") and isinstance(entry, dict) and "param" in entry
    }


def _assemble_rows(
    path: Path, table: str, entry: Mapping[str, Any], documents: list[bytes]
) -> torch.Tensor:
    """The whole weight of ``table`` from the shards' row documents: every row exactly once
    (CheckpointError naming the table and what is missing)."""
    num_rows, dim = entry.get("num_rows"), entry.get("dim")
    if not isinstance(num_rows, int) or not isinstance(dim, int) or num_rows < 1 or dim < 1:
        raise CheckpointError(f"checkpoint {path}: table/{table} has no valid num_rows and dim")
    weight: torch.Tensor | None = None
    seen = torch.zeros(num_rows, dtype=torch.bool)
    for document in documents:
        store = RowStore.decode(document)
        if (store.table.num_rows, store.table.dim) != (num_rows, dim):
            raise CheckpointError(
                f"checkpoint {path}: table {table!r} is {store.table.num_rows} x "
                f"{store.table.dim} in a shard document, {num_rows} x {dim} in the manifest"
            )
        ids = store.created_rows()
        if weight is None:
            weight = torch.empty((num_rows, dim), dtype=store.table.torch_dtype)
        weight[ids] = store.pull(ids)
        seen[ids] = True
    missing = int((~seen).sum())
    if weight is None or missing:
        raise CheckpointError(
            f"checkpoint {path}: the weight {entry['param']!r} (table {table!r}) lacks "
            f"{missing if weight is not None else num_rows} of its {num_rows} rows in the "
            f"shard documents: the checkpoint is incomplete"
        )
    return weight


def export_checkpoint(
    path: str | os.PathLike[str], output: str | os.PathLike[str], *, moving_average: bool = False
) -> Path:
    """Write the parameters of a checkpoint to one safetensors file (parameter names as in
    the model's ``state_dict``), for serving or sharing without tensorfleet, and the rows of
    each embedding table (``tfl.EmbeddingTable``) as two tensors, ``<table>.ids`` (int64,
    ascending) and ``<table>.rows`` (their values), as :func:`load_table_rows` returns them;
    rows never created are not in it (their value is the table initializer's)."""
    state = load_checkpoint(path, moving_average=moving_average)
    for table in _table_names(path):
        if table in state:  # a sparse=True weight held as rows: in the state, whole
            continue
        ids, rows = load_table_rows(path, table)
        for name, tensor in ((f"{table}.ids", ids), (f"{table}.rows", rows)):
            if name in state:
                raise CheckpointError(
                    f"cannot export table {table!r}: its {name!r} is also a parameter's name; "
                    f"rename the table (EmbeddingTable(..., name=...))"
                )
            state[name] = tensor
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in state.items()}, str(staging))
    with open(staging, "rb") as f:
        os.fsync(f.fileno())
    os.replace(staging, output)
    return output


def _write_durably(path: Path, data: bytes | bytearray | memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
