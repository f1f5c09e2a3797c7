"""``tfl.EmbeddingTable``: an embedding whose rows live on the ps shards, never whole on a worker.

The API choice. A table is its own module, ``tfl.EmbeddingTable(num_rows, dim, ...)``, and
not an ``nn.Embedding`` that tensorfleet would take over above a size threshold, because:

* ``nn.Embedding(10_000_000, 64)`` allocates and initializes its 2.4 GiB weight in the
  constructor, on every worker, before tensorfleet sees the model: the memory the ps is
  there to save is spent anyway. ``EmbeddingTable`` allocates nothing.
* A table needs what ``nn.Embedding`` has no words for: hashing of unbounded ids (int64 or
  strings), rows created lazily with a stated initializer, a row partition, a row-sparse
  update rule. A threshold would change a model's semantics silently at some size.
* ``nn.Embedding(sparse=True)`` keeps working as what it is: a dense variable held whole by
  one ps (or partitioned by row blocks), whose sparse gradients are pushed as rows.

How a step works. The forward takes the unique ids of the batch (after hashing), pulls
exactly those rows from every shard holding any of them (all asked at once, one round trip),
and looks the batch up in that small ``[unique, dim]`` tensor; autograd then gives the
gradient of those rows only, which :meth:`EmbeddingTable.take_gradient` returns coalesced (a
table used twice in a step gets one gradient) for the session to push, one part per shard (empty parts included: each
shard counts every step of the table, see :mod:`tensorfleet.ps.sparse_update_rules`).

Where the rows come from is a :class:`RowSource`: the ps shards in a cluster, or
:class:`~tensorfleet.worker.local_row_source.LocalRowSource` (the same row stores in this
process) when training in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tensorfleet.errors import ConfigError, ProtocolError, TensorfleetError, UsageError
from tensorfleet.ps.admission_filter import AdmissionFilter
from tensorfleet.ps.id_hashing import hash_int_ids, hash_string_ids
from tensorfleet.ps.row_initializer import RowInitializer
from tensorfleet.ps.row_partition import HASH, RowPartition, TableSpec
from tensorfleet.ps.row_partition import SCHEMES as PARTITION_SCHEMES
from tensorfleet.ps.sparse_rows import SparseGradientError, SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.worker.lookup_ahead import LookupAhead, LookupsAhead
from tensorfleet.worker.sparse_gradient import coalesce_gradient, split_rows

_TORCH_DTYPES = {torch.float32: "float32", torch.float64: "float64"}


def _describe_rule(rule: object) -> str:
    """A rule in messages: its name and type (``the dense rule 'sgd' (UpdateRule)``)."""
    name = getattr(rule, "name", None)
    if isinstance(name, str):
        return f"the dense rule {name!r} ({type(rule).__name__})"
    return type(rule).__name__


class TableNotAttached(TensorfleetError, RuntimeError):
    """An EmbeddingTable was used before a session gave it somewhere to read rows from."""


class RowSource(Protocol):
    """Where a table's rows live: ``pull_rows`` of one shard, ``push_rows`` of every shard.
    ``read_only=True`` is passed (only then) for a lookup nothing is trained on: a source
    that keeps a clock of use (a table of raw ids' expiry) does not count it."""

    def pull_rows(
        self, table: str, shard: int, ids: torch.Tensor, read_only: bool = False
    ) -> torch.Tensor: ...

    def push_rows(self, table: str, parts: Sequence[SparseRows]) -> None: ...

    # A source in this process may also have ``push_own_rows(table, parts)``: the table's
    # own gradient, applied without the checks made for a peer's bytes (LocalRowSource).


class EmbeddingTable(nn.Module):
    """A ``num_rows`` x ``dim`` embedding held by the ps shards, row-partitioned.

    ``ids``: any int64 tensor (or, with ``hash_ids=True``, a list of strings); the output has
    shape ``ids.shape + (dim,)``. Without hashing, ids must lie in ``[0, num_rows)``; with it,
    any int64 or string is mapped to ``hash(id) mod num_rows``
    (:mod:`tensorfleet.ps.id_hashing`). New rows start from ``initializer`` (default
    ``RowInitializer("normal", 0.01)``). ``partition``: ``mod`` (default) or ``range``.
    ``rule``: the table's own row-sparse rule (e.g. ``tfl.optim.SparseAdam(lr=0.01)``); None
    (default): the session's ``sparse_optimizer``, else its optimizer's row-sparse twin.

    ``ids="raw"``: every int64 id gets a row of its own (no collisions), on the shard its hash
    picks; ``num_rows`` is then the table's capacity (rows live at once). ``admit_after=N``:
    an id gets its row once N updates carried it (lookups return zeros and its gradients are
    dropped before; 0: at its first lookup); ``expire_after_steps=T``: an id not seen for T
    updates loses its row, slots and count (None: never). ``admission_filter=
    tfl.AdmissionFilter(expected_ids, false_positive_rate=0.01)``: the counts toward
    ``admit_after`` kept in a counting Bloom filter of a fixed size instead of per id (an id
    is then admitted by its N-th update at the latest, and keeps its count when its row
    expires). See :mod:`tensorfleet.ps.raw_id_rows`, :mod:`tensorfleet.ps.admission_filter`
    and docs/sparse.md.

    >>> table = tfl.EmbeddingTable(1000, 8, name="user")
    >>> source = tfl.LocalRowSource([table], num_shards=2, rule=tfl.optim.SparseRowRule("sgd", {"lr": 0.1}))
    >>> table(torch.tensor([[3, 999], [3, 4]])).shape
    torch.Size([2, 2, 8])
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        *,
        name: str | None = None,
        hash_ids: bool = False,
        hash_seed: int = 0,
        initializer: RowInitializer | None = None,
        dtype: torch.dtype = torch.float32,
        partition: str = "mod",
        rule: SparseRowRule | None = None,
        ids: str = "rows",
        admit_after: int = 0,
        expire_after_steps: int | None = None,
        admission_filter: AdmissionFilter | None = None,
    ) -> None:
        super().__init__()
        self.num_rows, self.dim, self.hash_ids, self.hash_seed = num_rows, dim, hash_ids, hash_seed
        self.table_name = name
        if ids not in ("rows", "raw"):
            raise ConfigError(
                f"{self._label()}: ids must be 'rows' (ids are row numbers, or hashed into "
                f"them with hash_ids=True) or 'raw' (any int64 id gets a row of its own), got "
                f"{ids!r}"
            )
        self.raw_ids = ids == "raw"
        """Rows keyed by raw int64 ids, one per admitted id (``ids="raw"``)."""
        if self.raw_ids and (hash_ids or partition != "mod"):
            given = [f"hash_ids={hash_ids}"] if hash_ids else []
            given += [f"partition={partition!r}"] if partition != "mod" else []
            raise ConfigError(
                f"{self._label()}: ids='raw' gives every id a row of its own on the shard its "
                f"hash picks; {' and '.join(given)} {'does' if len(given) == 1 else 'do'} not "
                f"apply; fix: leave {'it' if len(given) == 1 else 'them'} out"
            )
        self.admit_after, self.expire_after_steps = admit_after, expire_after_steps
        self.admission_filter = admission_filter
        if dtype not in _TORCH_DTYPES:
            raise ConfigError(
                f"{self._label()}: dtype must be torch.float32 or torch.float64, got {dtype}; "
                f"fix: dtype=torch.float32"
            )
        if partition not in PARTITION_SCHEMES:
            raise ConfigError(
                f"{self._label()}: partition must be one of {PARTITION_SCHEMES} ('mod': row r "
                f"on shard r mod n; 'range': contiguous blocks of rows), got {partition!r}; "
                f"fix: partition='mod' (the default) or partition='range'"
            )
        if rule is not None and not isinstance(rule, SparseRowRule):
            raise ConfigError(
                f"{self._label()}: rule must be a row-sparse rule such as "
                f"tfl.optim.SparseAdam(lr=0.01) or tfl.optim.SparseRowRule('adagrad', "
                f"{{'lr': 0.1}}), got {_describe_rule(rule)}"
            )
        self.rule = rule
        """The table's own row-sparse rule (None: the session decides, see the class doc)."""
        self.bound_rule: SparseRowRule | None = None
        """The rule its rows were created with (set when a source creates them)."""
        self.initializer = initializer or RowInitializer()
        if self.initializer.kind == "given":
            raise ConfigError(
                "an EmbeddingTable creates its rows on first use from its initializer (normal, "
                "uniform or zeros); kind 'given' is for the ps's copy of an "
                "nn.Embedding(sparse=True) weight, whose rows the chief sends"
            )
        self.dtype = dtype
        self.partition_scheme = HASH if self.raw_ids else partition
        self._spec_of(name or "unnamed")  # checks the arguments now (ConfigError)
        self._spec: TableSpec | None = None
        """The spec under :attr:`table_name`, built once (every lookup and push names it)."""
        self._source: RowSource | None = None
        self._partition: RowPartition | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._released: str | None = None
        self._ahead = LookupsAhead()
        """The lookups prefetched and sent ahead (:mod:`tensorfleet.worker.lookup_ahead`)."""

    def spec(self) -> TableSpec:
        """The table as the ps shards hold it (needs a name: given, or set by the session)."""
        if not self.table_name:
            raise TableNotAttached(
                f"{self._label()} has no name yet, and rows are held by table name; fix: "
                f"build it with name=..., or let a TrainingSession name it after its place in "
                f"the model (it does when it starts)"
            )
        if self._spec is None or self._spec.name != self.table_name:
            self._spec = self._spec_of(self.table_name)
        return self._spec

    def _spec_of(self, name: str) -> TableSpec:
        return TableSpec(
            name,
            self.num_rows,
            self.dim,
            _TORCH_DTYPES[self.dtype],
            self.initializer,
            raw_ids=self.raw_ids,
            admit_after=self.admit_after,
            expire_after_steps=self.expire_after_steps,
            admission_filter=self.admission_filter,
        )

    def attach(self, source: RowSource, num_shards: int, name: str | None = None) -> None:
        """Read and write rows through ``source`` (split over ``num_shards`` shards)."""
        if name is not None:
            self.table_name = name
        self._partition = RowPartition(self.num_rows, num_shards, self.partition_scheme)
        self._source = source
        self._pending = []
        self._released = None
        self._ahead.clear()

    def release(self, where: str) -> None:
        """The rows' holder is gone (``where``: e.g. ``the ps shards``): the session that
        attached the table has ended. Every later lookup or push raises ``UsageError`` naming
        the fix, instead of talking to shards that ended with the training."""
        self._source = None
        self._pending = []
        self._released = where
        self._ahead.clear()

    @property
    def attached(self) -> bool:
        """Whether the table reads and writes its rows somewhere (a session or a source)."""
        return self._source is not None

    @property
    def source(self) -> RowSource | None:
        """Where the table's rows live now (None: not attached)."""
        return self._source

    @property
    def partition(self) -> RowPartition:
        if self._partition is None:
            raise TableNotAttached(self._not_attached())
        return self._partition

    def rows_of(self, ids: torch.Tensor | Sequence[str | bytes]) -> torch.Tensor:
        """The table rows of ``ids`` (hashed, or checked to be in range; raw ids: the ids
        themselves, uint64 ids as the int64 of the same bits): int64, same shape."""
        if self.raw_ids:
            if isinstance(ids, torch.Tensor) and ids.dtype == torch.uint64:
                return ids.view(torch.int64)  # one to one: the same bits, read as int64
            if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
                fix = (
                    "ids.long(), if they hold whole numbers"
                    if isinstance(ids, torch.Tensor)
                    else "map strings to int64 first (e.g. tensorfleet.ps.id_hashing."
                    "hash_string_ids(ids, 2**63 - 1))"
                )
                raise SparseGradientError(
                    f"table {self.table_name!r} (ids='raw'): ids must be an int64, uint64 or "
                    f"int32 tensor, got "
                    f"{type(ids).__name__ if not isinstance(ids, torch.Tensor) else ids.dtype}"
                    f"; fix: {fix}"
                )
            return ids.to(torch.int64)
        if self.hash_ids:
            if isinstance(ids, torch.Tensor):
                return hash_int_ids(ids, self.num_rows, self.hash_seed)
            return hash_string_ids(list(ids), self.num_rows, self.hash_seed)
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise SparseGradientError(
                f"table {self.table_name!r}: ids must be an int64 tensor, got "
                f"{type(ids).__name__ if not isinstance(ids, torch.Tensor) else ids.dtype}; fix: "
                f"pass hash_ids=True to look up strings or unbounded ids"
            )
        ids = ids.to(torch.int64)
        low, high = torch.aminmax(ids) if ids.numel() else (0, 0)
        if int(low) < 0 or int(high) >= self.num_rows:
            bad = ids[(ids < 0) | (ids >= self.num_rows)]
            raise SparseGradientError(
                f"table {self.table_name!r}: id {int(bad[0])} is out of range "
                f"[0, {self.num_rows}) ({bad.numel()} of {ids.numel()} ids are); fix: pass "
                f"hash_ids=True to hash unbounded ids into the table, or make num_rows larger"
            )
        return ids

    @property
    def lookups_ahead(self) -> dict[str, int]:
        """What became of the lookups :meth:`prefetch` sent ahead: ``used`` (the next lookup
        took their rows), ``missed`` (it looked up other ids: dropped, asked again), ``lost``
        (a recovery lost them: asked again)."""
        return dict(self._ahead.counts)

    def prefetch(self, ids: torch.Tensor | Sequence[str | bytes]) -> None:
        """Say that this table's first lookup after the next step's exchange will be of
        ``ids`` (the next batch's, as the forward will pass them): that exchange asks the
        shards for their rows without waiting, and that lookup takes the answers instead of
        asking and waiting (:mod:`tensorfleet.worker.lookup_ahead`). Call it before
        ``sess.step(...)`` of the batch before, e.g.::

            batch = next(batches)
            while not sess.should_stop():
                upcoming = next(batches)
                model.items.prefetch(upcoming.ids)  # rides with this step's exchange
                sess.step(lambda batch=batch: loss_of(model, batch))
                batch = upcoming

        The rows are those the lookup would have read (async: they carry this worker's
        update of the step; sync and ``max_staleness``: bit for bit the same). A later call
        before that exchange replaces the ids. The ids are checked now, as a lookup checks
        them. In one process (``LocalRowSource``) the rows are in memory: nothing to do."""
        if self._source is None:
            self._refuse_released()
            raise TableNotAttached(self._not_attached())
        flat = self.rows_of(ids).reshape(-1).cpu()
        if getattr(self._source, "send_rows_of", None) is None:
            return  # a source in this process: a lookup waits for nothing
        if flat.numel() == 0:
            self._ahead.next = None
            return
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        places, parts = self._split(unique)
        self._ahead.next = LookupAhead(flat, unique, inverse, places, parts)

    def send_ahead(self) -> None:
        """Send the lookup :meth:`prefetch` named (the session calls this in a step's
        exchange, :mod:`tensorfleet.worker.lookup_ahead` says where). A lookup sent by the
        exchange before and taken by no lookup since (a step that did not look this table
        up) is dropped first."""
        ahead = self._ahead
        if ahead.sent is not None:
            self._source.receive_rows_of(ahead.sent.asked)  # type: ignore[union-attr]
            ahead.sent = None
            ahead.missed(self._label())
        prefetched, ahead.next = ahead.next, None
        if prefetched is None or self._source is None:
            return
        prefetched.asked = self._source.send_rows_of(self.spec().name, prefetched.parts)  # type: ignore[attr-defined]
        if prefetched.asked is None:
            ahead.counts["lost"] += 1
        else:
            ahead.sent = prefetched

    def _arrived_ahead(self, flat: torch.Tensor) -> tuple[LookupAhead, dict] | None:
        """The lookup sent ahead and its rows by shard, when it asked for exactly ``flat``
        (the batch's ids, flattened; None: ask). A lookup sent ahead is taken by this lookup
        whatever its ids; one only prefetched, of these ids, is dropped (this is its lookup,
        and nothing was sent)."""
        ahead = self._ahead
        taken, ahead.sent = ahead.sent, None
        if taken is None:
            if ahead.next is not None and torch.equal(ahead.next.flat, flat):
                ahead.next = None
            return None
        pulled = self._source.receive_rows_of(taken.asked)  # type: ignore[union-attr]
        if not torch.equal(taken.flat, flat):
            ahead.missed(self._label())
            return None
        if pulled is None:
            ahead.counts["lost"] += 1
            return None
        ahead.used()
        return taken, pulled

    def _split(
        self, unique: torch.Tensor
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Where each shard's rows sit among ``unique`` (positions), and its ids."""
        partition = self.partition
        if partition.num_shards == 1:
            return {0: torch.arange(unique.numel())}, {0: unique}
        shard_of = partition.shard_of(unique)
        places = {}
        for shard in range(partition.num_shards):
            where = torch.nonzero(shard_of == shard).flatten()
            if where.numel():
                places[shard] = where
        return places, {shard: unique.index_select(0, where) for shard, where in places.items()}

    def _gathered(
        self, places: dict[int, torch.Tensor], pulled: dict[int, torch.Tensor], count: int
    ) -> torch.Tensor:
        """The ``count`` unique rows, from each shard's answer ``pulled[k]`` (checked: one
        row per id asked) put at its ``places[k]``."""
        gathered = torch.empty((count, self.dim), dtype=self.dtype)
        for shard, where in places.items():
            if pulled[shard].shape != (where.numel(), self.dim):
                raise ProtocolError(
                    f"ps:{shard} answered the lookup of {where.numel()} rows of table "
                    f"{self.spec().name!r} with rows of shape {tuple(pulled[shard].shape)}, "
                    f"not ({where.numel()}, {self.dim})"
                )
            gathered.index_copy_(0, where, pulled[shard])
        return gathered

    def forward(self, ids: torch.Tensor | Sequence[str | bytes]) -> torch.Tensor:
        if self._source is None:
            self._refuse_released()
            raise TableNotAttached(self._not_attached())
        rows = self.rows_of(ids)
        # The rows live in host memory (the ps, or this process's store): ids on a GPU are
        # looked up on the CPU, and the batch's rows come to the ids' device for the lookup
        # (their gradient leaves it again in take_gradient).
        device, flat = rows.device, rows.reshape(-1).cpu()
        trained = torch.is_grad_enabled() and self.training  # else read only: changes nothing
        arrived = self._arrived_ahead(flat) if self._ahead.sent or self._ahead.next else None
        if arrived is not None:  # asked with the step before's exchange: here meanwhile
            taken, pulled = arrived
            unique, inverse = taken.unique, taken.inverse
            gathered = self._gathered(taken.places, pulled, unique.numel())
        else:
            unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
            gathered = self._looked_up(unique, read_only=not trained)
        gathered, inverse = gathered.to(device), inverse.to(device)
        if trained:
            gathered.requires_grad_(True)
            self._pending.append((unique, gathered))
        if gathered.device.type == "cpu":
            # The gradient bit for bit the same as F.embedding's (checked over 500 random
            # cases, repeated ids, 1 and 2 threads), by index_add_ instead of a sort: 50 us
            # instead of 82 us for the click model's 512 ids, about a twentieth of its step.
            looked_up = gathered.index_select(0, inverse)
        else:  # on a GPU index_add_ adds repeated ids in any order (atomics); embedding's not
            looked_up = F.embedding(inverse, gathered)
        return looked_up.view(*rows.shape, self.dim)

    def _looked_up(self, unique: torch.Tensor, read_only: bool = False) -> torch.Tensor:
        """The rows of ``unique`` (ascending), asked from the source now; ``read_only``: a
        lookup nothing is trained on (under ``no_grad`` or ``eval()``), which a table of raw
        ids does not count as a use (it neither creates rows nor keeps them from expiring)."""
        name, partition = self.spec().name, self.partition
        asked = {"read_only": True} if read_only else {}  # a source may not know the word
        if partition.num_shards == 1:  # the shard's rows are the batch's rows, in order
            pull_own_rows = getattr(self._source, "pull_own_rows", None)
            if pull_own_rows is not None:  # a source in this process: ids checked above
                return pull_own_rows(name, 0, unique, **asked)
            return self._source.pull_rows(name, 0, unique, **asked)
        places, parts = self._split(unique)
        pull_rows_of = getattr(self._source, "pull_rows_of", None)
        if pull_rows_of is not None:  # every shard asked at once: one round trip
            pulled = pull_rows_of(name, parts, **asked)
        else:
            pulled = {k: self._source.pull_rows(name, k, ids, **asked) for k, ids in parts.items()}
        return self._gathered(places, pulled, unique.numel())

    def take_gradient(self) -> SparseRows:
        """The coalesced gradient of the rows used since the last call (after backward), and
        forget them.

        A lookup that the backward reached gives all its rows, zero gradients included (as
        ``nn.Embedding(sparse=True)``'s gradient lists every looked-up id). A lookup that no
        backward reached (its output never entered a loss, e.g. a metric computed in training
        mode) gives no rows, as torch gives no gradient for it: a zero-gradient row would
        still move under a rule with moments (``sparse_adam`` decays them and steps)."""
        pending = [(unique, g) for unique, g in self._pending if g.grad is not None]
        self._pending = []
        if not pending:
            return SparseRows(
                torch.empty(0, dtype=torch.int64), torch.empty((0, self.dim), dtype=self.dtype)
            )
        if len(pending) == 1:  # one lookup: its unique ids, ascending, and their gradient
            unique, gathered = pending[0]
            return SparseRows(unique, gathered.grad.detach().cpu())  # to the host's rows
        ids = torch.cat([unique for unique, _ in pending])
        grads = torch.cat([g.grad.cpu() for _, g in pending])  # to the host's rows
        if self.raw_ids:  # ids are not row numbers: a sparse tensor cannot index them
            unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
            summed = grads.new_zeros((unique.numel(), self.dim)).index_add_(0, inverse, grads)
            return SparseRows(unique, summed.detach())
        sparse = torch.sparse_coo_tensor(
            ids.unsqueeze(0), grads.detach(), (self.num_rows, self.dim), check_invariants=True
        )
        return coalesce_gradient(self.spec().name, sparse)

    def push_gradient(self) -> SparseRows:
        """Send :meth:`take_gradient` to the shards (one part each); returns what was sent."""
        if self._source is None:
            self._refuse_released()
            raise TableNotAttached(self._not_attached())
        rows = self.take_gradient()
        partition = self.partition
        if partition.num_shards == 1:
            parts = [rows]
        else:
            parts = split_rows(rows, partition.shard_of(rows.indices), partition.num_shards)
        push_own_rows = getattr(self._source, "push_own_rows", None)
        if push_own_rows is not None:  # a source in this process: the parts are ours
            push_own_rows(self.spec().name, parts)
        else:
            self._source.push_rows(self.spec().name, parts)
        return rows

    def create_all_rows(self) -> int:
        """Create every row not created yet, from the initializer (the values a lookup would
        create them with), instead of at each row's first lookup, as ``nn.Embedding``
        initializes its weight in its constructor; returns how many rows it created. Then no
        step creates rows, and a table created whole, before any lookup, holds each row at
        its own index (no step looks up where a row is stored). Rows that exist keep their
        values and optimizer slots, so a call is never too late and a second one creates
        nothing.

        In one process (a :class:`LocalRowSource`, e.g. a ``TrainingSession`` without a
        cluster) the rows are created here; in a cluster, on the ps shards, a range of rows
        per request and every shard at once (``table_create_rows``), so that a shard answers
        the other workers between the ranges; any worker may call it, the others' calls then
        create nothing. The memory is the whole table's at once (values and the rule's
        slots), and creating takes about 0.6 CPU seconds per million rows of 8
        (docs/sparse.md). Refused for a table of raw ids (ConfigError: it has no fixed rows)
        and a row source that cannot create rows ahead (UsageError)."""
        if self._source is None:
            self._refuse_released()
            raise TableNotAttached(self._not_attached())
        if self.raw_ids:
            raise ConfigError(
                f"{self._label()} has ids='raw': it has no fixed set of rows to create ahead "
                f"(a row is created per id seen); fix: do not call create_all_rows() on it"
            )
        create = getattr(self._source, "create_all_rows", None)
        if create is None:
            raise UsageError(
                f"{self._label()}: its row source ({type(self._source).__name__}) cannot "
                f"create rows ahead (tfl.LocalRowSource and a cluster's ps shards can); fix: "
                f"drop the call, its rows are created as steps first use them"
            )
        return create(self.spec().name, self.partition, self.dim)

    def extra_repr(self) -> str:
        hashing = f", hash_ids=True (seed {self.hash_seed})" if self.hash_ids else ""
        if self.raw_ids:
            hashing = (
                f", ids='raw', admit_after={self.admit_after}, "
                f"expire_after_steps={self.expire_after_steps}"
            )
            if self.admission_filter is not None:
                hashing += f", admission_filter={self.admission_filter}"
        return f"{self.num_rows}, {self.dim}, name={self.table_name!r}{hashing}"

    def _label(self) -> str:
        """The table in messages: its name, else its size (a session names it later)."""
        if self.table_name:
            return f"EmbeddingTable {self.table_name!r}"
        return f"an unnamed EmbeddingTable({self.num_rows}, {self.dim})"

    def _refuse_released(self) -> None:
        if self._released is not None:
            raise UsageError(
                f"{self._label()}: its rows live on {self._released}, and the session that "
                f"held them has ended (its `with` block is over: the ps tasks end with the "
                f"training). Fix: evaluate inside the `with` block, after the training loop "
                f"(e.g. `if sess.is_chief: evaluate(model)` before the block ends), or read "
                f"the rows from the final checkpoint with tfl.load_table_rows(checkpoint_dir, "
                f"{self.table_name!r})"
            )

    def _not_attached(self) -> str:
        return (
            f"{self._label()} is not attached to its rows yet: it was used outside a "
            f"TrainingSession (a session refuses tables in mode 'allreduce' and with the "
            f"device engines at its start). A TrainingSession attaches every table (named after its place "
            f"in the model, e.g. 'embedding') when it starts, in modes 'async' and 'sync' and "
            f"in one process (server=None); fix: run the model inside such a session (after "
            f"it started), or attach the table yourself with "
            f"tfl.LocalRowSource([table], rule=...)"
        )
