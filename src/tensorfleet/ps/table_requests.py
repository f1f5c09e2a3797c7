"""The embedding-table requests a ps shard answers, served from its
:class:`~tensorfleet.ps.shard_tables.ShardTables`.

=====================  =================================================================
``table_create``       a table (spec, partition, row-sparse rule) -> ``created``, ``complete``
                       (idempotent; refused over the shard's ``max_memory``, naming the table
                       and the fix)
``table_create_rows``  table name, ``start``, ``stop`` -> ``created``, ``rows``: the rows of
                       local indices ``[start, stop)`` not created yet, created now as their
                       first lookup would (:meth:`RowStore.create_rows`; a worker's
                       ``EmbeddingTable.create_all_rows()`` sends one range per request)
``pull_rows``          table name + int64 row ids (one buffer) -> the rows (one buffer);
                       ``read_only: true``: an evaluation's lookup, which changes nothing
``push_rows``          table name + a :class:`~tensorfleet.ps.sparse_rows.SparseRows` (two
                       buffers) -> applied at once with the table's row-sparse rule (async);
                       in sync training (with the ``step`` of the rows) and with
                       ``max_staleness``, checked and held (:mod:`tensorfleet.ps.held_row_gradients`)
``fill_rows``          a table of given rows: ids + their values (two buffers, a chunk) -> set;
                       the reply carries the store's ``incarnation``, ``version``, ``complete``
``pull_changed``       a table of given rows, ``since`` (``[incarnation, version]`` a worker last
                       saw, or none), ``start``, ``max_rows`` -> the ids and values of the rows
                       changed since then (all of them for another incarnation), at most
                       ``max_rows``, with the store's ``incarnation``, ``version`` and ``next``
                       (the position to go on from, or none)
=====================  =================================================================

The last two serve the ``sparse=True`` ``nn.Embedding`` weights the workers mirror whole
(:mod:`tensorfleet.worker.mirrored_embeddings`): the chief creates such a table from its
weight's values in chunks that fit the message limits, and each worker refreshes its copy
with the rows changed since its last pull.

The service says which discipline it follows (:meth:`TableRequests.follow`) and tells it when
a sync step is made (:meth:`TableRequests.step_made`) and when the staleness gate releases a
worker's push (:meth:`TableRequests.released`).

Everything is checked before anything changes (a bad id or gradient leaves the table as it
was and the ps up). The tables live in their own module so that the service only dispatches
to it: the service's request loop is unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from tensorfleet.errors import CheckpointError, ConfigError, ProtocolError
from tensorfleet.ps.held_row_gradients import HeldRowGradients
from tensorfleet.ps.raw_id_rows import decode_store
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.row_store import RowStore
from tensorfleet.ps.shard_tables import ShardTables
from tensorfleet.ps.sparse_rows import MAX_ROWS, SparseRows, check_sparse_rows
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.wire.service_socket import Request, ServiceSocket
from tensorfleet.wire.tensors import as_buffer, from_buffer

log = logging.getLogger("tensorfleet.ps")


class TableRequests:
    """The tables of shard ``shard``, limited to ``max_memory`` bytes (None: no limit);
    ``dense_variables()``: the names of the variables the shard holds dense (a sparse
    gradient pushed for one of them is refused, naming it)."""

    def __init__(
        self,
        socket: ServiceSocket,
        shard: int,
        max_memory: int | None,
        dense_variables: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self.socket = socket
        self.shard = shard
        self.max_memory = max_memory
        self._dense_variables = dense_variables or (lambda: ())
        self.tables: ShardTables | None = None
        self.held: HeldRowGradients | None = None
        """Row gradients held for the sync step or the staleness gate (None: async)."""

    def follow(self, *, sync: bool, gated: bool) -> None:
        """Hold row gradients for the sync step (``sync``) or the staleness gate (``gated``);
        neither: apply them as they arrive."""
        self.held = (
            HeldRowGradients(self._tables, sync=sync, gated=gated) if sync or gated else None
        )

    def step_made(self, step: int, tasks: list[str]) -> None:
        """Sync step ``step`` was made with the gradients of ``tasks`` (worker order)."""
        if self.held is not None and self.held.sync:
            self.held.step_made(step, tasks)

    def released(self, task: str) -> None:
        """The staleness gate applied a push of ``task``."""
        if self.held is not None and self.held.gated:
            self.held.released(task)

    def handlers(self) -> dict[str, Callable[[Request], None]]:
        """The requests this module answers, by operation name."""
        return {
            "table_create": self._create,
            "table_create_rows": self._create_rows,
            "pull_rows": self._pull_rows,
            "push_rows": self._push_rows,
            "fill_rows": self._fill_rows,
            "pull_changed": self._pull_changed,
        }

    def summary(self) -> str:
        """The tables this shard holds, for the log line of the dense variables' creation
        (``""``: none yet; each table is logged when it is created)."""
        if self.tables is None or not len(self.tables):
            return ""
        return f"; {self.tables.summary()}"

    def stats(self) -> dict[str, dict[str, object]]:
        """Each table's numbers (:meth:`ShardTables.stats`), by name."""
        return {} if self.tables is None else self.tables.stats()

    def stat_lines(self) -> list[str]:
        """One line per table for the ps log: rows live, bytes, rule, updates; for a table
        of raw ids also admitted, evicted, still counting, forgotten, dropped, deferred."""
        lines = []
        for name, numbers in self.stats().items():
            line = f"table {name!r}: {numbers['rows_live']:,d} rows live"
            if "admitted" in numbers:
                line += (
                    f" ({numbers['admitted']:,d} admitted, {numbers['evicted']:,d} evicted), "
                    f"{numbers['pending']:,d} ids counting toward admission "
                    f"({numbers['forgotten']:,d} forgotten), {numbers['dropped_rows']:,d} "
                    f"gradient rows dropped, {numbers['deferred']:,d} admissions deferred (full)"
                )
            lines.append(
                f"{line}, {numbers['bytes']:,d} B, rule {numbers['rule']}, "
                f"{numbers['step']:,d} updates"
            )
        return lines

    def documents(self, since: object = None) -> dict[str, bytes]:
        """Each table's document for the shard's checkpoint (none: no tables); logs each
        table's numbers (:meth:`stat_lines`). ``since``: the ``tables_since`` of the
        ``save`` request, ``{table: [incarnation, step]}`` of the checkpoint the chief
        wrote last, for a delta of each table since it (:mod:`tensorfleet.ps.table_deltas`;
        None: every table in full)."""
        if since is not None and not isinstance(since, dict):
            raise ProtocolError(f"save: tables_since is a map of table -> tag, got {since!r:.80}")
        if self.tables is None:
            return {}
        for line in self.stat_lines():
            log.info("ps:%d: saving %s", self.shard, line)
        return self.tables.save(since)

    def restore(self, documents: dict[str, bytes]) -> None:
        """Take a checkpoint's tables (ConfigError, nothing changed, when one is bad)."""
        if not documents:
            return
        try:
            if self.tables is None:
                first = decode_store(next(iter(documents.values())))
                tables = ShardTables(self.shard, first.partition.num_shards, self.max_memory)
                tables.restore(documents)
                self.tables = tables
            else:
                self.tables.restore(documents)
        except CheckpointError as exc:  # a refusal the service answers (a ValueError)
            raise ConfigError(f"ps:{self.shard}: the checkpoint's tables: {exc}") from None

    def _create(self, request: Request) -> None:
        spec = TableSpec.from_wire(request.body.get("table"))
        partition = partition_from_wire(request.body.get("partition"))
        rule = SparseRowRule.from_wire(request.body.get("rule"))
        if self.tables is None:
            tables = ShardTables(self.shard, partition.num_shards, self.max_memory)
            created = tables.create(spec, partition, rule)  # refused: nothing kept
            self.tables = tables
        else:
            created = self.tables.create(spec, partition, rule)
        complete = self.tables.store(spec.name).complete
        if created:
            log.info("ps:%d: created %s", self.shard, self.tables.describe(spec.name))
        self.socket.reply(request, {"created": created, "complete": complete})

    def _create_rows(self, request: Request) -> None:
        name = self._name(request)
        start, stop = request.body.get("start"), request.body.get("stop")
        for key, value in (("start", start), ("stop", stop)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ProtocolError(f"table_create_rows: {key} must be an int, got {value!r:.40}")
        store = self._tables().store(name)
        if not isinstance(store, RowStore):
            raise ConfigError(
                f"table {name!r} has ids='raw': it has no fixed set of rows to create ahead (a "
                f"row is created per id seen); fix: do not call create_all_rows() on it"
            )
        created = store.create_rows(start, stop)
        if created and store.size == store.local_rows:
            log.info(
                "ps:%d: table %r: all %s of its rows on this shard created",
                self.shard, name, f"{store.local_rows:,d}",
            )  # fmt: skip
        self.socket.reply(request, {"created": created, "rows": store.size})

    def _pull_rows(self, request: Request) -> None:
        name = self._name(request)
        if len(request.buffers) != 1:
            raise ProtocolError(f"pull_rows carries one buffer of ids, got {len(request.buffers)}")
        ids = from_buffer(request.buffers[0], torch.int64)
        if ids.numel() > MAX_ROWS:
            raise ProtocolError(f"pull_rows: {ids.numel()} ids, at most {MAX_ROWS}")
        read_only = request.body.get("read_only", False)
        if not isinstance(read_only, bool):
            raise ProtocolError(f"pull_rows: read_only must be a bool, got {read_only!r:.40}")
        rows = self._tables().pull(name, ids, read_only)
        self.socket.reply(request, {"rows": int(rows.shape[0])}, [as_buffer(rows.contiguous())])

    def _push_rows(self, request: Request) -> None:
        name = self._name(request)
        gradient = SparseRows.from_wire(request.body.get("gradient"), request.buffers)
        if self.tables is None or name not in self.tables.names():
            dense = set(self._dense_variables())
            if name in dense or any(v.startswith(f"{name}/part_") for v in dense):
                check_sparse_rows(
                    name, gradient, num_rows=0, dim=0, dtype=torch.float32, held_dense=True
                )
        if self.held is None:
            self._tables().apply(name, gradient)
            self.socket.reply(request, {"applied": gradient.num_rows})
            return
        task = request.body.get("task")
        if not isinstance(task, str) or not task:
            raise ProtocolError(f"push_rows needs the pushing worker's task name, got {task!r}")
        self._tables().store(name).check(gradient)
        self.held.hold(task, name, gradient, request.body.get("step"))
        self.socket.reply(request, {"held": gradient.num_rows})

    def _fill_rows(self, request: Request) -> None:
        store = self._tables().store(self._name(request))
        rows = SparseRows.from_wire(request.body.get("rows"), request.buffers)
        store.fill(rows.indices, rows.values)  # copied into the store
        self.socket.reply(request, self._version_of(store))

    def _pull_changed(self, request: Request) -> None:
        store = self._tables().store(self._name(request))
        since, start = request.body.get("since"), request.body.get("start", 0)
        max_rows = request.body.get("max_rows", MAX_ROWS)
        for key, value in (("start", start), ("max_rows", max_rows)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ProtocolError(f"pull_changed: {key} must be an int >= 0, got {value!r}")
        if since is not None and not (
            isinstance(since, list)
            and len(since) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in since)
        ):
            raise ProtocolError(
                f"pull_changed: since is [incarnation, version] or none, got {since!r}"
            )
        version = since[1] if since is not None and since[0] == store.incarnation else None
        ids, values, next_start = store.changed_since(
            version, start, max(1, min(max_rows, MAX_ROWS))
        )
        body = {**self._version_of(store), "rows": int(ids.numel()), "next": next_start}
        self.socket.reply(request, body, [as_buffer(ids), as_buffer(values)])

    @staticmethod
    def _version_of(store: RowStore) -> dict[str, object]:
        return {
            "incarnation": store.incarnation,
            "version": store.version,
            "complete": store.complete,
        }

    def _tables(self) -> ShardTables:
        if self.tables is None:
            self.tables = ShardTables(self.shard, 1, self.max_memory)  # empty: lookups refused
        return self.tables

    @staticmethod
    def _name(request: Request) -> str:
        name = request.body.get("table")
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"a table request needs the table's name, got {name!r}")
        return name


def partition_to_wire(partition: RowPartition) -> dict[str, object]:
    """A row partition as a request carries it."""
    return {
        "num_rows": partition.num_rows,
        "num_shards": partition.num_shards,
        "scheme": partition.scheme,
    }


def partition_from_wire(data: object) -> RowPartition:
    """The row partition of a request (ProtocolError when malformed; the partition's own
    checks raise ConfigError)."""
    if not isinstance(data, dict):
        raise ProtocolError(f"a row partition is a map, got {type(data).__name__}")
    rows, shards, scheme = data.get("num_rows"), data.get("num_shards"), data.get("scheme")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rows, shards)):
        raise ProtocolError(f"a row partition needs integer num_rows and num_shards, got {data}")
    if not isinstance(scheme, str):
        raise ProtocolError(f"a row partition needs its scheme, got {scheme!r}")
    return RowPartition(rows, shards, scheme)
