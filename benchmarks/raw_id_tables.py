"""A ps shard's cost per step for a table of raw int64 ids (``ids="raw"``: an id map,
admission, expiry) against a hashed table of the same size (``hash_ids=True``: a row
number per id, ``RowStore``), measured on the shard's store in this process.

What differs between the two is the shard's work only (both send the batch's unique ids
and their rows, the same bytes on the wire): for each id the raw table finds its row in a
sorted id map (``torch.searchsorted``) where the hashed table indexes an array. Each round
holds ``--known`` ids on the shard (every id has a row: pulled once before timing), then
times ``--steps`` steps of a batch of ``--batch`` unique ids drawn from them: one
``pull`` (the lookup) and one ``apply`` (the update, Adagrad) per step. Runs, interleaved
over ``--repeats`` rounds (medians; ratios within a round):

* ``hashed``: ``RowStore`` of a table of ``known`` rows, the batch's ids hashed into them
  (the worker's ``hash_int_ids``, timed too, as the worker pays it);
* ``raw``: ``RawIdRowStore``, ``admit_after=0``, no expiry, ``known`` ids already admitted;
* ``raw_expiry``: the same with ``expire_after_steps`` (every update scans the map's
  ``last_seen`` for ids to evict; none is old enough: the scan's cost alone);
* ``raw_new_ids``: every step's ids are new (``admit_after=0``): each lookup merges
  ``batch`` ids into the map and creates their rows (the admission path's cost);
* ``raw_long_tail`` and ``raw_long_tail_filter``: ``admit_after=2``, the ``known`` ids
  admitted; every step's batch is half known ids and half new ids seen once (a click log's
  long tail), counted toward admission exactly (each update merges them into the map, which
  grows by ``batch / 2`` a step) or in an admission filter sized for ``2 * known`` ids at
  1 % (``tfl.AdmissionFilter``: the map holds only ids with rows). The results also give
  what counting toward admission holds after the steps (``admission_bytes``: the map's
  entries of ids without rows, or the filter) and how much it grew per step.

    .venv/bin/python benchmarks/raw_id_tables.py [--known 1000000] [--batch 4096]

Writes benchmarks/results/raw_id_tables.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import torch  # noqa: E402
from results_writer import add_out_dir_option, write_results  # noqa: E402

from tensorfleet.ps.admission_filter import AdmissionFilter  # noqa: E402
from tensorfleet.ps.id_hashing import hash_int_ids  # noqa: E402
from tensorfleet.ps.raw_id_rows import RawIdRowStore  # noqa: E402
from tensorfleet.ps.row_partition import HASH, RowPartition, TableSpec  # noqa: E402
from tensorfleet.ps.row_store import RowStore  # noqa: E402
from tensorfleet.ps.sparse_rows import SparseRows  # noqa: E402
from tensorfleet.ps.sparse_update_rules import SparseRowRule  # noqa: E402

DIM = 64
RULE = SparseRowRule("adagrad", {"lr": 0.1})
CHUNK = 65_536


def _spec(
    name: str,
    rows: int,
    raw: bool,
    expire: int | None = None,
    admit_after: int = 0,
    admission_filter: AdmissionFilter | None = None,
) -> TableSpec:
    from tensorfleet.ps.row_initializer import RowInitializer

    return TableSpec(
        name,
        rows,
        DIM,
        "float32",
        RowInitializer("zeros"),
        raw_ids=raw,
        expire_after_steps=expire,
        admit_after=admit_after,
        admission_filter=admission_filter,
    )


def _filled_hashed(known: int) -> RowStore:
    store = RowStore(_spec("hashed", known, False), RowPartition(known, 1), 0, RULE)
    for start in range(0, known, CHUNK):
        store.pull(torch.arange(start, min(known, start + CHUNK)))
    return store


def _filled_raw(ids: torch.Tensor, expire: int | None) -> RawIdRowStore:
    known = ids.numel()
    store = RawIdRowStore(
        _spec("raw", 2 * known, True, expire), RowPartition(2 * known, 1, HASH), 0, RULE
    )
    for start in range(0, known, CHUNK):
        store.pull(ids[start : start + CHUNK])
    return store


def _admitted_after_two(
    ids: torch.Tensor, admission_filter: AdmissionFilter | None
) -> RawIdRowStore:
    """A store of ``admit_after=2`` holding a row for each of ``ids`` (two updates each)."""
    known = ids.numel()
    spec = _spec("tail", 2 * known, True, admit_after=2, admission_filter=admission_filter)
    store = RawIdRowStore(spec, RowPartition(2 * known, 1, HASH), 0, RULE)
    for start in range(0, known, CHUNK):
        chunk = torch.sort(ids[start : start + CHUNK]).values
        zeros = torch.zeros((chunk.numel(), DIM))
        for _ in range(2):
            store.apply(SparseRows(chunk, zeros))
    return store


def _timed(steps: int, step: Callable[[int], None]) -> float:
    """Median milliseconds of ``step(k)`` over ``steps`` calls (after 3 warm-up calls)."""
    for k in range(3):
        step(k)
    times = []
    for k in range(steps):
        started = time.perf_counter()
        step(3 + k)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def one_round(known: int, batch: int, steps: int, seed: int) -> dict[str, float]:
    """The median ms/step of each run over one round (the stores built afresh)."""
    generator = torch.Generator().manual_seed(seed)
    raw_ids = torch.randint(-(2**63), 2**63 - 1, (known,), generator=generator).unique()
    known = raw_ids.numel()
    grad = torch.full((batch, DIM), 0.01)
    batches = [
        torch.randperm(known, generator=generator)[:batch] for _ in range(steps + 3)
    ]  # positions among the known ids: unique

    hashed = _filled_hashed(known)

    def hashed_step(k: int) -> None:
        rows = hash_int_ids(raw_ids[batches[k]], known)
        unique = torch.unique(rows)  # hashing folds some ids together: the worker coalesces
        hashed.pull(unique)
        hashed.apply(SparseRows(unique, grad[: unique.numel()]))

    def raw_step_of(store: RawIdRowStore) -> Callable[[int], None]:
        def step(k: int) -> None:
            ids = torch.sort(raw_ids[batches[k]]).values
            hash_int_ids(ids, 1)  # the worker's shard choice (one shard here)
            store.pull(ids)
            store.apply(SparseRows(ids, grad))

        return step

    results = {"hashed": _timed(steps, hashed_step)}
    results["raw"] = _timed(steps, raw_step_of(_filled_raw(raw_ids, None)))
    results["raw_expiry"] = _timed(steps, raw_step_of(_filled_raw(raw_ids, 10 * steps)))
    fresh = _filled_raw(raw_ids, None)
    fresh_ids = torch.randint(-(2**63), 2**63 - 1, ((steps + 3) * batch,), generator=generator)

    def new_ids_step(k: int) -> None:
        ids = torch.unique(fresh_ids[k * batch : (k + 1) * batch])
        fresh.pull(ids)
        fresh.apply(SparseRows(ids, grad[: ids.numel()]))

    results["raw_new_ids"] = _timed(steps, new_ids_step)
    tail_ids = torch.randint(-(2**63), 2**63 - 1, ((steps + 3) * batch,), generator=generator)
    half = batch // 2

    def long_tail_step_of(store: RawIdRowStore) -> Callable[[int], None]:
        def step(k: int) -> None:
            seen = raw_ids[batches[k][:half]]
            ids = torch.unique(torch.cat([seen, tail_ids[k * half : (k + 1) * half]]))
            store.pull(ids)
            store.apply(SparseRows(ids, grad[: ids.numel()]))

        return step

    sized = AdmissionFilter(2 * known, 0.01)
    for name, given in (("raw_long_tail", None), ("raw_long_tail_filter", sized)):
        store = _admitted_after_two(raw_ids, given)
        before = store.admission_bytes
        results[name] = _timed(steps, long_tail_step_of(store))
        results[f"{name}_bytes"] = float(store.admission_bytes)
        results[f"{name}_bytes_per_step"] = (store.admission_bytes - before) / (steps + 3)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--known", type=int, default=1_000_000, help="ids held by the shard")
    parser.add_argument("--batch", type=int, default=4096, help="unique ids per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    add_out_dir_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = [one_round(args.known, args.batch, args.steps, seed) for seed in range(args.repeats)]
    runs = [name for name in rounds[0] if "_bytes" not in name]
    held = {
        name: statistics.median(r[name] for r in rounds) for name in rounds[0] if "_bytes" in name
    }
    medians = {name: statistics.median(r[name] for r in rounds) for name in runs}
    ratios = {
        f"{name}_vs_hashed_step_time": statistics.median(r[name] / r["hashed"] for r in rounds)
        for name in runs
        if name != "hashed"
    }
    result = {
        "known_ids": args.known,
        "batch": args.batch,
        "dim": DIM,
        "rule": RULE.name,
        "steps": args.steps,
        "repeats": args.repeats,
        "step_ms_median": medians,
        "store_bytes_after": held,
        "rounds": rounds,
        **ratios,
    }
    table = [
        "| run | ms/step (pull + update) median | vs hashed |",
        "|---|---|---|",
    ]
    for name in runs:
        ratio = "1.00x" if name == "hashed" else f"{ratios[f'{name}_vs_hashed_step_time']:.2f}x"
        table.append(f"| {name} | {medians[name]:.2f} | {ratio} |")
    heading = (
        f"One ps shard holding {args.known:,} ids x {DIM} float32, Adagrad, {args.batch:,} "
        f"unique ids per step (lookup + update), {args.repeats} interleaved rounds, 1 thread"
    )
    table += [
        "",
        "| long-tail store | counting toward admission: bytes after the steps | grown per step |",
        "|---|---|---|",
        *(
            f"| {name} | {held[f'{name}_bytes']:,.0f} | {held[f'{name}_bytes_per_step']:,.0f} |"
            for name in ("raw_long_tail", "raw_long_tail_filter")
        ),
    ]
    write_results("raw_id_tables", result, heading, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
