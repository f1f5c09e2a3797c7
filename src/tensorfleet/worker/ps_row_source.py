"""``PsRowSource``: the :class:`~tensorfleet.worker.embedding_table.RowSource` of a cluster,
whose rows live on the ps shards (:mod:`tensorfleet.ps.table_requests` is the shards' side).

Every request goes through the client's one fan-out path (:class:`ShardFanout`, through the
client's recovering wrapper): ``create`` tells every shard its part of a table, ``pull_rows``
asks one shard for the rows of the ids it holds, ``push_rows`` sends each shard its part of a
gradient (an empty part too: a shard counts every step of its tables) in one round trip to
all shards at once. Only the rows a batch touches cross the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tensorfleet.errors import ProtocolError
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.sparse_rows import SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.table_requests import partition_to_wire
from tensorfleet.wire.channel import Reply
from tensorfleet.wire.tensors import DTYPES, as_buffer, from_buffer
from tensorfleet.worker.shard_fanout import ShardFanout


class PsRowSource:
    """Rows of embedding tables on the ps shards of ``fanout()``; ``call(attempt)`` runs a
    fan-out (the client's recovering wrapper); ``task_name`` names this worker."""

    def __init__(
        self,
        fanout: Callable[[], ShardFanout],
        call: Callable[[Callable[[], list[Reply]]], list[Reply]],
        task_name: str,
        timeout_s: float,
    ) -> None:
        self._fanout = fanout
        self._call = call
        self.task_name = task_name
        self.timeout_s = timeout_s
        self._dtypes: dict[str, torch.dtype] = {}
        self.sync_step: int | None = None
        """In sync training, the step the next pushed rows belong to (the shards hold them
        for that step's mean); None: async."""
        self.bytes_sent = 0
        """Bytes of ids and rows this source sent (pushes) and received (pulls): the
        benchmarks' measure of the wire."""

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

    def pull_rows(self, table: str, shard: int, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.int64).contiguous()
        body = {"task": self.task_name, "table": table}
        (reply,) = self._call(
            lambda: self._fanout().call(
                "pull_rows", body, self.timeout_s, buffers=[[as_buffer(ids)]], shards=[shard]
            )
        )
        if len(reply.buffers) != 1:
            raise ProtocolError(f"ps:{shard} answered pull_rows with {len(reply.buffers)} buffers")
        dtype = self._dtypes.get(table, torch.float32)
        rows = from_buffer(reply.buffers[0], dtype).view(ids.numel(), -1).clone()
        self.bytes_sent += ids.numel() * 8 + rows.numel() * rows.element_size()
        return rows

    def push_rows(self, table: str, parts: Sequence[SparseRows]) -> None:
        wired = [part.to_wire() for part in parts]
        step = {} if self.sync_step is None else {"step": self.sync_step}
        bodies = [{"task": self.task_name, "table": table, "gradient": h, **step} for h, _ in wired]
        self._call(
            lambda: self._fanout().call(
                "push_rows", bodies, self.timeout_s, buffers=[b for _, b in wired]
            )
        )
        self.bytes_sent += sum(part.nbytes for part in parts)
