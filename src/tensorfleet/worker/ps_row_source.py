"""``PsRowSource``: the :class:`~tensorfleet.worker.embedding_table.RowSource` of a cluster,
whose rows live on the ps shards (:mod:`tensorfleet.ps.table_requests` is the shards' side).

Every request goes through the client's one fan-out path (:class:`ShardFanout`, through the
client's recovering wrapper): ``create`` tells every shard its part of a table, ``pull_rows``
asks one shard for the rows of the ids it holds (``pull_rows_of``: several shards in one round
trip; ``send_rows_of`` / ``receive_rows_of``: the same sent ahead, with the step before's
exchange, :mod:`tensorfleet.worker.lookup_ahead`), ``push_rows`` sends each shard its part
of a gradient (an empty part too: a shard counts every step of its tables) in one round trip
to all shards at once, or, between
:meth:`PsRowSource.defer_pushes` and :meth:`PsRowSource.settle_pushes`, without waiting for
the replies (:mod:`tensorfleet.worker.rows_in_flight`: the dense exchange goes meanwhile).
Only the rows a batch touches cross the wire.

For the ``sparse=True`` ``nn.Embedding`` weights held as tables of given rows
(:mod:`tensorfleet.worker.mirrored_embeddings`): ``create_given`` (the replies say whether
each shard's part is complete), ``fill_rows`` (one chunk of rows to each of some shards) and
``pull_changed`` (the rows changed since the version a worker last saw, one chunk per shard).
Each takes ``direct=True`` to skip the client's recovering wrapper: the chief re-creates such
a table on a restarted shard from inside a recovery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tensorfleet.errors import ProtocolError
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.sparse_rows import SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.table_requests import partition_to_wire
from tensorfleet.wire.channel import Reply
from tensorfleet.wire.tensors import DTYPES, as_buffer, from_buffer
from tensorfleet.worker.client import RECOVERABLE
from tensorfleet.worker.lookup_ahead import SentLookup
from tensorfleet.worker.rows_in_flight import RowsInFlight
from tensorfleet.worker.shard_fanout import ShardFanout

log = logging.getLogger("tensorfleet.worker")

#: About how many values (rows x dim) one ``table_create_rows`` request creates: 2M take a
#: shard 0.1-0.2 CPU seconds (0.6 s per million rows of 8, docs/sparse.md).
CREATE_ELEMENTS_PER_REQUEST = 1 << 21

#: How many times :meth:`PsRowSource.whole_again_after_a_restart` runs its work at most (a
#: ps that restarts during each of them is failing, not restarting).
WHOLE_WORK_ATTEMPTS = 5


@dataclass(frozen=True)
class ChangedRows:
    """One shard's answer to ``pull_changed``: the rows (``ids``, ``values``), the store's
    ``incarnation`` and ``version`` when it answered, and ``next`` (where to go on from;
    None: the scan is over)."""

    ids: torch.Tensor
    values: torch.Tensor
    incarnation: int
    version: int
    next: int | None


class PsRowSource:
    """Rows of embedding tables on the ps shards of ``fanout()``; ``call(attempt)`` runs a
    fan-out (the client's recovering wrapper); ``task_name`` names this worker."""

    def __init__(
        self,
        fanout: Callable[[], ShardFanout],
        call: Callable[[Callable[[], list[Reply]]], list[Reply]],
        task_name: str,
        timeout_s: float,
        recover: Callable[[Exception], None] | None = None,
    ) -> None:
        self._fanout = fanout
        self._call = call
        self._recover = recover
        """The client's recovery: with it, a push that fails because a ps restarted, fell
        silent or timed out is not sent again (its rows may have been applied on the other
        shards): the client recovers and the rows are dropped, like a dense push's step."""
        self.dropped_pushes = 0
        """Row pushes dropped that way."""
        self.task_name = task_name
        self.timeout_s = timeout_s
        self._dtypes: dict[str, torch.dtype] = {}
        self.sync_step: int | None = None
        """In sync training, the step the next pushed rows belong to (the shards hold them
        for that step's mean); None: async."""
        self.bytes_sent = 0
        """Bytes of ids and rows this source sent (pushes) and received (pulls): the
        benchmarks' measure of the wire."""
        self.in_flight: RowsInFlight | None = None
        """While pushes are deferred (:meth:`defer_pushes`): the row pushes sent and not
        yet awaited; None: each push waits for its replies."""

    def defer_pushes(self) -> None:
        """From now on, :meth:`push_rows` sends without waiting for the replies, until
        :meth:`settle_pushes` (a step's rows, sent just before its dense exchange)."""
        if self.in_flight is None:
            self.in_flight = RowsInFlight()

    def settle_pushes(self, failed: bool = False) -> None:
        """Wait for the replies of the pushes sent since :meth:`defer_pushes` and push
        with waiting again; ``failed``: the step failed past recovery, forget them."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return
        if failed:
            in_flight.abandon()
            return
        self.dropped_pushes += in_flight.settle(self._fanout, self._recover)

    def create(self, table: TableSpec, partition: RowPartition, rule: SparseRowRule) -> bool:
        """Every shard holds its part of ``table`` (idempotent); True when some shard created it."""
        body = {
            "task": self.task_name,
            "table": table.to_wire(),
            "partition": partition_to_wire(partition),
            "rule": rule.to_wire(),
        }
        replies = self._call(lambda: self._fanout().call("table_create", body, self.timeout_s))
        self._dtypes[table.name] = DTYPES[table.dtype]
        return any(r.body.get("created") is True for r in replies)

    def create_all_rows(self, table: str, partition: RowPartition, dim: int) -> int:
        """Create every row of ``table`` not created yet on every shard, a range of local
        rows per request (about :data:`CREATE_ELEMENTS_PER_REQUEST` values: a few tenths of
        a second of a shard's CPU, so that it answers the other workers in between), every
        shard at once; returns how many rows were created. Idempotent: rows that exist keep
        their values (another worker may have looked them up, or created them first)."""
        per_request = max(1, CREATE_ELEMENTS_PER_REQUEST // max(1, dim))
        ends = [partition.rows_on(k) for k in range(partition.num_shards)]
        created, start = 0, 0
        while start < max(ends):
            shards = [k for k in range(partition.num_shards) if start < ends[k]]
            bodies = [
                {"task": self.task_name, "table": table, "start": start,
                 "stop": min(start + per_request, ends[k])}
                for k in shards
            ]  # fmt: skip
            replies = self._call(
                lambda shards=shards, bodies=bodies: self._fanout().call(
                    "table_create_rows", bodies, self.timeout_s, shards=shards
                )
            )
            created += sum(int(r.body.get("created", 0)) for r in replies)
            start += per_request
        return created

    def create_given(
        self,
        table: TableSpec,
        partition: RowPartition,
        rule: SparseRowRule,
        shards: Sequence[int] | None = None,
        direct: bool = False,
    ) -> list[dict[str, Any]]:
        """Every shard (or ``shards``) holds its part of ``table``, a table of given rows
        (idempotent): each reply body (``created``, ``complete``), in shard order."""
        body = {
            "task": self.task_name,
            "table": table.to_wire(),
            "partition": partition_to_wire(partition),
            "rule": rule.to_wire(),
        }
        replies = self._run(
            lambda: self._fanout().call("table_create", body, self.timeout_s, shards=shards),
            direct,
        )
        self._dtypes[table.name] = DTYPES[table.dtype]
        return [r.body for r in replies]

    def fill_rows(
        self, table: str, parts: dict[int, SparseRows], direct: bool = False
    ) -> dict[int, tuple[int, int]]:
        """Send shard ``k`` the rows ``parts[k]`` (ids and values) of table ``table``: one
        round trip to all of them. Returns each shard's ``(incarnation, version)`` after it."""
        shards = sorted(parts)
        wired = [parts[k].to_wire() for k in shards]
        bodies = [{"task": self.task_name, "table": table, "rows": h} for h, _ in wired]
        replies = self._run(
            lambda: self._fanout().call(
                "fill_rows", bodies, self.timeout_s, buffers=[b for _, b in wired], shards=shards
            ),
            direct,
        )
        self.bytes_sent += sum(parts[k].nbytes for k in shards)
        return {k: _version(k, r.body) for k, r in zip(shards, replies, strict=True)}

    def pull_changed(
        self,
        table: str,
        requests: dict[int, tuple[list[int] | None, int]],
        max_rows: int,
        dim: int,
        direct: bool = False,
    ) -> dict[int, ChangedRows]:
        """Ask shard ``k`` for the rows of ``table`` changed since ``requests[k][0]``
        (``[incarnation, version]``, or None: every row), from position ``requests[k][1]``,
        at most ``max_rows``: one round trip to all of them. Every reply is checked (counts,
        sizes) before it is used."""
        shards = sorted(requests)
        bodies = [
            {
                "task": self.task_name,
                "table": table,
                "since": requests[k][0],
                "start": requests[k][1],
                "max_rows": max_rows,
            }
            for k in shards
        ]
        replies = self._run(
            lambda: self._fanout().call("pull_changed", bodies, self.timeout_s, shards=shards),
            direct,
        )
        dtype = self._dtypes.get(table, torch.float32)
        changed = {}
        for shard, reply in zip(shards, replies, strict=True):
            rows, following = reply.body.get("rows"), reply.body.get("next")
            if not isinstance(rows, int) or isinstance(rows, bool) or not 0 <= rows <= max_rows:
                raise ProtocolError(f"ps:{shard} answered pull_changed with {rows!r} rows")
            if following is not None and (not isinstance(following, int) or following < 0):
                raise ProtocolError(f"ps:{shard} answered pull_changed with next={following!r}")
            if len(reply.buffers) != 2:
                raise ProtocolError(
                    f"ps:{shard} answered pull_changed with {len(reply.buffers)} buffers, not 2"
                )
            ids = from_buffer(reply.buffers[0], torch.int64, (rows,)).clone()
            values = from_buffer(reply.buffers[1], dtype, (rows, dim)).clone()
            incarnation, version = _version(shard, reply.body)
            changed[shard] = ChangedRows(ids, values, incarnation, version, following)
            self.bytes_sent += ids.numel() * 8 + values.numel() * values.element_size()
        return changed

    def _run(self, attempt: Callable[[], list[Reply]], direct: bool) -> list[Reply]:
        return attempt() if direct else self._call(attempt)

    def whole_again_after_a_restart(self, work: Callable[[], None], what: str) -> None:
        """Run ``work`` (requests sent ``direct``), and when a ps restarts, falls silent or
        times out during it, recover and run all of ``work`` again, up to
        :data:`WHOLE_WORK_ATTEMPTS` times: for work that a restarted shard needs whole
        (the chief's first fill of a table: a shard that restarted midway has lost the
        table and the rows sent so far). ``work`` must be idempotent."""
        for attempt in range(1, WHOLE_WORK_ATTEMPTS + 1):
            try:
                work()
                return
            except RECOVERABLE as exc:
                if self._recover is None or attempt == WHOLE_WORK_ATTEMPTS:
                    raise
                self._recover(exc)
                log.warning("%s: %s again from the start", self.task_name, what)

    def pull_rows(
        self, table: str, shard: int, ids: torch.Tensor, read_only: bool = False
    ) -> torch.Tensor:
        ids = ids.to(torch.int64).contiguous()
        body = _pull_body(self.task_name, table, read_only)
        (reply,) = self._call(
            lambda: self._fanout().call(
                "pull_rows", body, self.timeout_s, buffers=[[as_buffer(ids)]], shards=[shard]
            )
        )
        return self._rows_of_reply(
            shard, reply, self._dtypes.get(table, torch.float32), ids.numel()
        )

    def pull_rows_of(
        self, table: str, parts: dict[int, torch.Tensor], read_only: bool = False
    ) -> dict[int, torch.Tensor]:
        """The rows of ids ``parts[k]`` from shard ``k``, for every ``k`` at once: one round
        trip to all of them (:meth:`pull_rows` asks one). Every reply is checked (one buffer
        of exactly the ids' rows) before it is used. ``read_only``: an evaluation's lookup,
        which changes nothing on the shards."""
        shards = sorted(parts)
        wanted = {k: parts[k].to(torch.int64).contiguous() for k in shards}
        body = _pull_body(self.task_name, table, read_only)
        replies = self._call(
            lambda: self._fanout().call(
                "pull_rows",
                body,
                self.timeout_s,
                buffers=[[as_buffer(wanted[k])] for k in shards],
                shards=shards,
            )
        )
        dtype = self._dtypes.get(table, torch.float32)
        out = {}
        for shard, reply in zip(shards, replies, strict=True):
            out[shard] = self._rows_of_reply(shard, reply, dtype, wanted[shard].numel())
        return out

    def send_rows_of(self, table: str, parts: dict[int, torch.Tensor]) -> SentLookup | None:
        """Ask shard ``k`` for the rows of ids ``parts[k]``, for every ``k``, without waiting:
        a lookup sent ahead (:mod:`tensorfleet.worker.lookup_ahead`), whose answers
        :meth:`receive_rows_of` takes. None when the sending failed and the client recovered
        (the lookup then asks when it comes)."""
        wanted = {k: parts[k].to(torch.int64).contiguous() for k in sorted(parts)}
        body = {"task": self.task_name, "table": table}
        fanout, requests = self._fanout(), {}
        try:
            with fanout.timeline.span("pull_rows_ahead"):
                for shard, ids in wanted.items():
                    requests[shard] = fanout.send(
                        shard, "pull_rows", body, self.timeout_s, [as_buffer(ids)]
                    )
        except RECOVERABLE as exc:
            if self._recover is None:
                raise
            self._recover(exc)
            return None
        return SentLookup(table, fanout, wanted, requests)

    def receive_rows_of(self, sent: SentLookup) -> dict[int, torch.Tensor] | None:
        """The rows :meth:`send_rows_of` asked for, by shard, each reply checked as a
        lookup's. None when a recovery lost the requests since (the client's fan-out is
        another, or forgot them) or when waiting for them failed and the client recovered:
        the caller asks again."""
        if self._fanout() is not sent.fanout:
            return None
        known = {k: r for k, r in sent.requests.items() if sent.fanout.channels[k].knows(r)}
        dtype = self._dtypes.get(sent.table, torch.float32)
        out = {}
        try:
            for shard, request_id in known.items():
                with sent.fanout.timeline.span("wait"):
                    reply = sent.fanout.wait(shard, request_id, self.timeout_s)
                out[shard] = self._rows_of_reply(shard, reply, dtype, sent.ids[shard].numel())
        except RECOVERABLE as exc:
            if self._recover is None:
                raise
            self._recover(exc)
            return None
        return out if len(known) == len(sent.requests) else None

    def _rows_of_reply(self, shard: int, reply: Reply, dtype: torch.dtype, n: int) -> torch.Tensor:
        """The ``n`` rows of a ``pull_rows`` reply, checked: one buffer, a whole number of
        rows of ``dtype``."""
        if len(reply.buffers) != 1:
            raise ProtocolError(f"ps:{shard} answered pull_rows with {len(reply.buffers)} buffers")
        size = memoryview(reply.buffers[0]).nbytes
        item = torch.empty((), dtype=dtype).element_size()
        if n == 0 or size == 0 or size % (n * item):
            raise ProtocolError(
                f"ps:{shard} answered pull_rows for {n} ids with {size} bytes, not a whole "
                f"number of {dtype} rows"
            )
        rows = from_buffer(reply.buffers[0], dtype).view(n, -1).clone()
        self.bytes_sent += n * 8 + rows.numel() * rows.element_size()
        return rows

    def push_rows(self, table: str, parts: Sequence[SparseRows]) -> None:
        wired = [part.to_wire() for part in parts]
        step = {} if self.sync_step is None else {"step": self.sync_step}
        bodies = [{"task": self.task_name, "table": table, "gradient": h, **step} for h, _ in wired]

        def attempt() -> list[Reply]:
            return self._fanout().call(
                "push_rows", bodies, self.timeout_s, buffers=[b for _, b in wired]
            )

        self.bytes_sent += sum(part.nbytes for part in parts)
        if self.in_flight is not None:  # the replies are awaited after the dense exchange
            fanout = self._fanout()
            try:
                with fanout.timeline.span("push_rows"):
                    for shard, (body, (_, buffers)) in enumerate(zip(bodies, wired, strict=True)):
                        request_id = fanout.send(shard, "push_rows", body, self.timeout_s, buffers)
                        self.in_flight.add(fanout, shard, request_id, self.timeout_s)
            except RECOVERABLE as exc:  # never sent twice: the rows are dropped
                if self._recover is None:
                    raise
                self._recover(exc)
                self.dropped_pushes += 1
            return
        if self._recover is None:
            self._call(attempt)
            return
        try:
            attempt()
        except RECOVERABLE as exc:  # never sent twice: the rows are dropped
            self._recover(exc)
            self.dropped_pushes += 1


def _version(shard: int, body: dict[str, Any]) -> tuple[int, int]:
    """The ``(incarnation, version)`` of a shard's reply, checked."""
    incarnation, version = body.get("incarnation"), body.get("version")
    for value in (incarnation, version):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ProtocolError(
                f"ps:{shard} answered with incarnation {incarnation!r}, version {version!r}"
            )
    return incarnation, version


def _pull_body(task: str, table: str, read_only: bool) -> dict[str, object]:
    """A ``pull_rows`` request's body (``read_only`` only when set: as before otherwise)."""
    body: dict[str, object] = {"task": task, "table": table}
    if read_only:
        body["read_only"] = True
    return body
