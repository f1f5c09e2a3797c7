"""Delta checkpoints of an embedding table against full ones: bytes written and seconds,
when few rows changed between two checkpoints (``full_checkpoint_every=K``).

Each round builds, in this process, the two ps shards' part of a table of ``--rows`` rows
x ``--dim`` float32 with Adagrad (one optimizer slot per row), every row created, as the
ps holds them (:class:`~tensorfleet.ps.shard_tables.ShardTables`), then:

* ``full``: a full checkpoint (the baseline): each shard's document (the table's document
  in a shard document, as a ps answers ``save``) written by the chief's
  :class:`~tensorfleet.session.checkpoints.CheckpointDirectory` (files fsynced, manifest
  last);
* one update of ``--touched`` of the rows (1% by default, drawn uniformly);
* ``delta``: the next checkpoint as a delta since the full one, written the same way;
* ``restore``: the chain (full + delta) read back, verified and folded into whole tables
  (``read_chain``), against reading the full checkpoint alone (``restore_full``).

Runs: ``hashed`` (a table of row numbers, ``RowStore``) and ``raw`` (a table of raw int64
ids, every id admitted: a delta also carries every live id, 8 B each, to record
evictions). Seconds are the median over ``--repeats`` rounds (each round builds the tables
afresh; ratios within a round). Bytes are those of the checkpoint's files on disk.

    .venv/bin/python benchmarks/delta_checkpoints.py [--rows 1000000] [--dim 32]

Writes benchmarks/results/delta_checkpoints.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import torch  # noqa: E402
from results_writer import add_out_dir_option, write_results  # noqa: E402

from tensorfleet.ps.layout import FusedLayout  # noqa: E402
from tensorfleet.ps.row_initializer import RowInitializer  # noqa: E402
from tensorfleet.ps.row_partition import HASH, RowPartition, TableSpec  # noqa: E402
from tensorfleet.ps.shard_checkpoint import encode_shard  # noqa: E402
from tensorfleet.ps.shard_tables import ShardTables  # noqa: E402
from tensorfleet.ps.sparse_rows import SparseRows  # noqa: E402
from tensorfleet.ps.sparse_update_rules import SparseRowRule  # noqa: E402
from tensorfleet.session.checkpoints import (  # noqa: E402
    CheckpointDirectory,
    read_chain,
    read_checkpoint,
)
from tensorfleet.session.delta_checkpoints import DeltaPlan  # noqa: E402

RULE = SparseRowRule("adagrad", {"lr": 0.1})
SHARDS = 2
CHUNK = 65_536


def _tables(rows: int, dim: int, raw: bool, ids: torch.Tensor) -> list[ShardTables]:
    """The two shards' tables, every row (every id of ``ids``) created."""
    spec = TableSpec("table", rows, dim, "float32", RowInitializer("normal", 0.1), raw_ids=raw)
    partition = RowPartition(rows, SHARDS, HASH if raw else "mod")
    shards = [ShardTables(k, SHARDS) for k in range(SHARDS)]
    owner = partition.shard_of(ids)
    for k, shard in enumerate(shards):
        shard.create(spec, partition, RULE)
        mine = ids[owner == k]
        for start in range(0, mine.numel(), CHUNK):
            shard.pull("table", mine[start : start + CHUNK])
    return shards


def _update(shards: list[ShardTables], ids: torch.Tensor, dim: int) -> None:
    """One update of rows ``ids`` (their shard's part on each shard; every shard counts a
    step, as a ps does)."""
    partition = shards[0].store("table").partition
    owner = partition.shard_of(ids)
    for k, shard in enumerate(shards):
        mine = torch.sort(ids[owner == k]).values
        shard.apply("table", SparseRows(mine, torch.full((mine.numel(), dim), 0.01)))


def _checkpoint(
    directory: CheckpointDirectory, plan: DeltaPlan, shards: list[ShardTables], step: int
) -> tuple[Path, float, int]:
    """Save every shard (full or delta, as ``plan`` asks) and write the checkpoint: its
    directory, the seconds it took (encoding + writing), and its files' bytes."""
    started = time.perf_counter()
    since = plan.since(step)
    documents = [
        encode_shard(
            shard=k,
            global_step=step,
            version=0,
            rule={"name": "sgd", "hyper": {}},
            layout=FusedLayout.of([]),
            values={},
            ema=None,
            optimizer={},
            worker_data={},
            tables=shard.save(None if since is None else since[k]),
        )
        for k, shard in enumerate(shards)
    ]
    fields = plan.manifest_fields(documents, step)
    assert fields is not None
    path = directory.write(step, documents, {}, fields)
    plan.written(path, documents, step)
    seconds = time.perf_counter() - started
    return path, seconds, sum(f.stat().st_size for f in path.iterdir())


def one_round(raw: bool, rows: int, dim: int, touched: int, seed: int, root: Path) -> dict:
    generator = torch.Generator().manual_seed(seed)
    if raw:
        ids = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=generator).unique()
        table_rows = 2 * rows  # the capacity: room for every id
    else:
        ids, table_rows = torch.arange(rows), rows
    shards = _tables(table_rows, dim, raw, ids)
    directory = CheckpointDirectory(root / f"{'raw' if raw else 'hashed'}-{seed}", keep=5)
    plan = DeltaPlan(10)
    full_path, full_s, full_bytes = _checkpoint(directory, plan, shards, 1)
    _update(shards, ids[torch.randperm(ids.numel(), generator=generator)[:touched]], dim)
    delta_path, delta_s, delta_bytes = _checkpoint(directory, plan, shards, 2)
    started = time.perf_counter()
    read_checkpoint(full_path)
    restore_full_s = time.perf_counter() - started
    started = time.perf_counter()
    read_chain(delta_path)
    restore_chain_s = time.perf_counter() - started
    return {
        "full_bytes": full_bytes,
        "delta_bytes": delta_bytes,
        "full_s": full_s,
        "delta_s": delta_s,
        "restore_full_s": restore_full_s,
        "restore_chain_s": restore_chain_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the table")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument(
        "--touched", type=int, default=None, help="rows updated between the checkpoints (1%%)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    add_out_dir_option(parser)
    args = parser.parse_args()
    touched = args.touched if args.touched is not None else max(1, args.rows // 100)
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {"hashed": [], "raw": []}
    with tempfile.TemporaryDirectory(prefix="delta-checkpoints-") as tmp:
        for seed in range(args.repeats):
            for name in runs:
                runs[name].append(
                    one_round(name == "raw", args.rows, args.dim, touched, seed, Path(tmp))
                )
    result: dict = {
        "rows": args.rows,
        "dim": args.dim,
        "touched": touched,
        "rule": RULE.name,
        "shards": SHARDS,
        "repeats": args.repeats,
        "rounds": runs,
    }
    table = [
        "| table | full: bytes, s | delta: bytes, s | delta/full bytes | delta/full s | "
        "restore full s | restore chain s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rounds in runs.items():
        median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        bytes_ratio = statistics.median(r["delta_bytes"] / r["full_bytes"] for r in rounds)
        seconds_ratio = statistics.median(r["delta_s"] / r["full_s"] for r in rounds)
        result[name] = {**median, "delta_vs_full_bytes": bytes_ratio}
        result[name]["delta_vs_full_seconds"] = seconds_ratio
        table.append(
            f"| {name} | {median['full_bytes']:,.0f} B, {median['full_s']:.2f} | "
            f"{median['delta_bytes']:,.0f} B, {median['delta_s']:.3f} | {bytes_ratio:.4f}x | "
            f"{seconds_ratio:.3f}x | {median['restore_full_s']:.2f} | "
            f"{median['restore_chain_s']:.2f} |"
        )
    heading = (
        f"A table of {args.rows:,} rows x {args.dim} float32 with Adagrad on {SHARDS} ps "
        f"shards, {touched:,} rows updated between a full checkpoint and the next (a delta); "
        f"medians of {args.repeats} rounds, 1 thread"
    )
    write_results("delta_checkpoints", result, heading, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
