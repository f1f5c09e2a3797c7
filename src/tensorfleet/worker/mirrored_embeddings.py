"""The ``sparse=True`` embedding weights of a model trained through the ps shards: held by the
shards as tables of rows, pushed as rows, and mirrored whole, exactly, on every worker.

Why. ``nn.Embedding(N, d, sparse=True)`` (and ``nn.EmbeddingBag``) gives its weight a sparse
gradient: the rows the batch looked up. Pushed as the dense gradient of a dense variable it
moves the whole table every step, and the shard's dense rule (torch's dense kernel) applies
it. Pushed as rows it needs a shard that holds the weight as rows with a row-sparse rule
bit-exact with torch's (:mod:`tensorfleet.ps.sparse_update_rules`): what
:class:`~tensorfleet.EmbeddingTable` already has. But the module's forward reads its whole
local weight, so every worker keeps a full copy, and must keep it exact without pulling the
whole table each step: each shard remembers, per row, the version at which it last changed
(:mod:`tensorfleet.ps.row_store`), and a worker asks for the rows changed since the version
it last saw; a worker that saw another incarnation of the shard (restarted, restored from a
checkpoint, or a worker that just started) gets every row.

The alternative, keeping such a weight dense on the ps and pulling only the rows a batch
needs, would change the module's forward (it reads every row), which tensorfleet does not
rewrite; ``tfl.EmbeddingTable`` is that design, as a module of its own.

The life of one weight (its table takes the parameter's name, e.g. ``emb.weight``):

* placement: left out of the dense placement plan; its rows split over the shards by
  ``r mod n`` like an EmbeddingTable's (``log_placement`` shows the split);
* creation: the chief creates the table on every shard from its own initial values, in
  chunks that fit the message limits (:class:`~tensorfleet.wire.message.Limits`), before it
  creates the dense variables, so a worker that waited for those finds the table complete;
  creating is idempotent (a complete table is left as it is: a restarted chief, or shards
  restored from a checkpoint); every other worker then asks for the same table (a
  different shape, dtype or rule is refused, naming it) and pulls every row;
* each step: the weight's sparse COO gradient, coalesced (duplicate ids summed once), is
  pushed as ids and rows through ``push_rows``: applied at once (async), held for the step's
  mean over the union of the workers' rows (sync), held until the staleness gate releases
  this worker's dense push (``max_staleness``): :mod:`tensorfleet.ps.held_row_gradients`.
  After the dense exchange the worker pulls the rows changed since its last pull and writes
  them into its weight (``index_copy_``);
* checkpoints: each shard's rows are in its document like any table's, and the manifest's
  ``table/<name>`` entry names the parameter (``param``), so ``tfl.load_checkpoint`` returns
  the weight whole under its parameter name;
* a ps that restarts without a checkpoint to restore gets the table again from the chief's
  copy (:meth:`MirroredEmbeddings.recreate`, called by the client before it re-creates the
  shard's dense variables); one that restarts during the chief's first fill makes the chief
  recover and create and fill the table again from the start
  (:meth:`~tensorfleet.worker.ps_row_source.PsRowSource.whole_again_after_a_restart`).

The row-sparse rule is ``sparse_optimizer`` when the session has one, else the session's
optimizer by name (:func:`row_rule`): ``sgd`` and ``adagrad`` as torch applies them to a
sparse gradient; ``adam`` is refused (torch's ``Adam`` refuses sparse gradients), naming the
parameter and the fixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tensorfleet.errors import ConfigError, ProtocolError, UsageError
from tensorfleet.ps.row_initializer import RowInitializer
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.sparse_rows import MAX_ROWS, SparseGradientError, SparseRows
from tensorfleet.ps.sparse_update_rules import SparseRowRule, SparseRuleError
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.worker.ps_row_source import ChangedRows, PsRowSource
from tensorfleet.worker.sparse_gradient import coalesce_gradient, split_rows

#: The modules whose ``sparse=True`` weight the ps holds as rows.
SPARSE_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
_TABLE_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
#: Largest chunk of rows one fill request or pull reply carries (also below the limits).
MAX_CHUNK_BYTES = 64 << 20


@dataclass
class MirroredWeight:
    """One ``sparse=True`` embedding weight: its parameter, its table on the shards, the
    rule the shards apply, and per shard the ``[incarnation, version]`` this worker's copy
    holds (None: nothing known; the next pull takes every row of that shard)."""

    name: str
    param: torch.Tensor
    spec: TableSpec
    partition: RowPartition
    rule: SparseRowRule | None = None
    seen: list[list[int] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seen = [None] * self.partition.num_shards


def find_sparse_embeddings(
    model: nn.Module, names: dict[int, str] | None = None
) -> list[tuple[str, nn.Module]]:
    """``(parameter name, module)`` of every ``nn.Embedding`` / ``nn.EmbeddingBag`` of
    ``model`` built with ``sparse=True`` whose weight trains, each weight once. ``names``:
    the parameters' names by ``id`` (the session's; default: ``model``'s own)."""
    if names is None:
        names = {id(p): n for n, p in model.named_parameters()}
    found: dict[str, nn.Module] = {}
    for _, module in model.named_modules():
        if isinstance(module, SPARSE_EMBEDDINGS) and module.sparse:
            weight = module.weight
            if weight.requires_grad and id(weight) in names:
                found.setdefault(names[id(weight)], module)
    return list(found.items())


def mirror_weight(name: str, module: nn.Module, num_shards: int) -> MirroredWeight:
    """The table of ``module``'s weight over ``num_shards`` shards, or ConfigError naming the
    parameter, what does not fit and the fix."""
    kind = type(module).__name__
    if module.max_norm is not None:
        raise ConfigError(
            f"parameter {name!r}: {kind}(..., sparse=True, max_norm={module.max_norm}) rewrites "
            f"the rows it looks up in its forward pass, in each worker's copy of the weight, "
            f"where the ps (which holds this weight as rows and applies its sparse gradients) "
            f"never sees it; fix: leave max_norm out and normalize the looked-up vectors "
            f"instead (F.normalize on the output), or use sparse=False (a dense variable)"
        )
    weight = module.weight
    if weight.dtype not in _TABLE_DTYPES:
        raise ConfigError(
            f"parameter {name!r}: a sparse=True embedding weight is held by the ps as rows of "
            f"float32 or float64, this one is {weight.dtype}; fix: keep the embedding in "
            f"float32, or use sparse=False (a dense variable)"
        )
    rows, dim = weight.shape
    spec = TableSpec(
        name, int(rows), int(dim), _TABLE_DTYPES[weight.dtype], RowInitializer("given")
    )
    return MirroredWeight(name, weight, spec, RowPartition(int(rows), num_shards, "mod"))


def row_rule(name: str, rule: UpdateRule, sparse_rule: SparseRowRule | None) -> SparseRowRule:
    """The row-sparse rule the shards apply to weight ``name``: ``sparse_rule`` when given,
    else ``rule``'s row-sparse twin (SparseRuleError naming the parameter and the fix)."""
    if sparse_rule is not None:
        return sparse_rule
    fixes = (
        "fix: pass TrainingSession(..., sparse_optimizer=tfl.optim.SparseAdam(lr=...)) (lazy "
        "Adam, torch.optim.SparseAdam, for the sparse weights; the optimizer for the rest), or "
        "train with tfl.optim.Adagrad or tfl.optim.SGD (both take sparse gradients), or build "
        "the embedding with sparse=False"
    )
    if rule.name == "adam":
        raise SparseRuleError(
            f"parameter {name!r} is the weight of a sparse=True embedding, which the ps holds "
            f"as rows and updates with a row-sparse rule; optimizer {rule.name!r} has none "
            f"(torch.optim.Adam refuses sparse gradients: dense Adam moves every row's "
            f"moments every step); {fixes}"
        )
    try:
        return SparseRowRule.from_dense(rule.name, rule.hyperparameters)
    except SparseRuleError as exc:
        raise SparseRuleError(
            f"parameter {name!r} is the weight of a sparse=True embedding, which the ps holds "
            f"as rows: {exc}; {fixes}"
        ) from None


class MirroredEmbeddings:
    """The mirrored weights of one model on the shards of ``source``; a fill request or a
    pull reply carries at most ``max_chunk_bytes`` of rows."""

    def __init__(
        self, weights: Sequence[MirroredWeight], source: PsRowSource, max_chunk_bytes: int
    ) -> None:
        self.weights = list(weights)
        self.source = source
        self.max_chunk_bytes = max(1, min(max_chunk_bytes, MAX_CHUNK_BYTES))

    @property
    def names(self) -> set[str]:
        return {w.name for w in self.weights}

    def bind_rules(self, rule: UpdateRule, sparse_rule: SparseRowRule | None) -> None:
        """Decide every weight's row-sparse rule (refusals before anything reaches a shard)."""
        for weight in self.weights:
            weight.rule = row_rule(weight.name, rule, sparse_rule)

    # -- creation ---------------------------------------------------------------------------

    def create(self, is_chief: bool) -> None:
        """Every shard holds its part of every weight's table. The chief fills the parts
        that are not complete with its weights' values (and then knows what the shards hold);
        the others only ask for the same tables (refused when they differ)."""
        for weight in self.weights:
            if is_chief:  # a shard that restarts midway lost the table: create and fill again
                self.source.whole_again_after_a_restart(
                    lambda weight=weight: self._create_filled(weight),
                    f"creating the rows of {weight.name!r}",
                )
            else:
                self.source.create_given(weight.spec, weight.partition, self._rule(weight))

    def _create_filled(self, weight: MirroredWeight) -> None:
        """Every shard holds its part of ``weight``'s table, filled with this copy's rows
        where it was not complete (requests sent directly: the caller recovers)."""
        replies = self.source.create_given(
            weight.spec, weight.partition, self._rule(weight), direct=True
        )
        incomplete = [k for k, body in enumerate(replies) if body.get("complete") is not True]
        if incomplete:
            self._fill(weight, incomplete, direct=True)

    def recreate(self, shards: Sequence[int]) -> None:
        """The chief, recovering: ``shards`` restarted without a checkpoint; give them their
        part of every table again from this worker's copy (directly: inside a recovery)."""
        for weight in self.weights:
            replies = self.source.create_given(
                weight.spec, weight.partition, self._rule(weight), shards=shards, direct=True
            )
            incomplete = [
                k for k, body in zip(shards, replies, strict=True) if not body.get("complete")
            ]
            if incomplete:
                self._fill(weight, incomplete, direct=True)

    def _fill(self, weight: MirroredWeight, shards: Sequence[int], direct: bool) -> None:
        """Send ``shards`` every row of theirs, a chunk per shard per round trip."""
        per_chunk = self._rows_per_chunk(weight)
        ids_of = {
            k: weight.partition.global_of(k, torch.arange(weight.partition.rows_on(k)))
            for k in shards
        }
        values = weight.param.detach()
        offset, seen = 0, {}
        while True:
            parts = {}
            for shard, ids in ids_of.items():
                chunk = ids[offset : offset + per_chunk]
                if chunk.numel():
                    rows = values.index_select(0, chunk.to(values.device)).cpu().contiguous()
                    parts[shard] = SparseRows(chunk.contiguous(), rows)
            if not parts:
                break
            seen.update(self.source.fill_rows(weight.name, parts, direct=direct))
            offset += per_chunk
        for shard, (incarnation, version) in seen.items():
            weight.seen[shard] = [incarnation, version]  # this copy is what was sent

    # -- each step --------------------------------------------------------------------------

    def push(self, sync_step: int | None = None) -> None:
        """Push every weight's coalesced sparse gradient as rows, one part per shard
        (``sync_step``: the sync step they belong to; None in async training). A weight
        without a gradient this step pushes nothing."""
        self.source.sync_step = sync_step
        for weight in self.weights:
            grad = weight.param.grad
            if grad is None:
                continue
            if not grad.is_sparse:
                raise SparseGradientError(
                    f"parameter {weight.name!r}, the weight of a sparse=True embedding held by "
                    f"the ps as rows, has a dense gradient this step: the weight is used "
                    f"outside its embedding too (tied to another layer?), or the gradient was "
                    f"made dense; fix: build the embedding with sparse=False, or use the "
                    f"weight only through the embedding"
                )
            rows = coalesce_gradient(weight.name, grad)
            rows = SparseRows(rows.indices.cpu().contiguous(), rows.values.cpu().contiguous())
            parts = split_rows(
                rows, weight.partition.shard_of(rows.indices), weight.partition.num_shards
            )
            self.source.push_rows(weight.name, parts)

    def pull(self) -> None:
        """Bring every weight's copy up to the shards: the rows changed since the version
        this worker last saw of each shard (every row of a shard it saw another incarnation
        of), written into the weight."""
        for weight in self.weights:
            self._pull(weight)

    def _pull(self, weight: MirroredWeight) -> None:
        per_chunk = self._rows_per_chunk(weight)
        pending: dict[int, tuple[list[int] | None, int]] = {
            k: (weight.seen[k], 0) for k in range(weight.partition.num_shards)
        }
        started: dict[int, tuple[int, int]] = {}  # shard -> its first answer of this scan
        while pending:
            answers = self.source.pull_changed(weight.name, pending, per_chunk, weight.spec.dim)
            following: dict[int, tuple[list[int] | None, int]] = {}
            for shard, answer in answers.items():
                since, start = pending[shard]
                first = started.setdefault(shard, (answer.incarnation, answer.version))
                if answer.incarnation != first[0]:  # restarted during the scan: start over
                    del started[shard]
                    following[shard] = (None, 0)
                    continue
                self._write(weight, shard, answer)
                if answer.next is None:
                    # Rows changed after the scan's first answer come again next time.
                    weight.seen[shard] = list(first)
                elif answer.next <= start:
                    raise ProtocolError(
                        f"ps:{shard} answered pull_changed for {weight.name!r} from {start} "
                        f"with next={answer.next}: the scan would not advance"
                    )
                else:
                    following[shard] = (since, answer.next)
            pending = following

    @staticmethod
    def _write(weight: MirroredWeight, shard: int, answer: ChangedRows) -> None:
        ids = answer.ids
        if ids.numel():
            if int(ids.min()) < 0 or int(ids.max()) >= weight.spec.num_rows:
                raise ProtocolError(
                    f"ps:{shard} sent rows of {weight.name!r} outside [0, {weight.spec.num_rows})"
                )
            if bool((weight.partition.shard_of(ids) != shard).any()):
                raise ProtocolError(f"ps:{shard} sent rows of {weight.name!r} it does not hold")
            param = weight.param
            with torch.no_grad():
                param.index_copy_(0, ids.to(param.device), answer.values.to(param.device))

    # -- reports ----------------------------------------------------------------------------

    def placement(self) -> dict[str, dict[str, object]]:
        """Each weight's entry for the checkpoint manifest (``table/<name>``: the parameter,
        rows, dim, dtype, partition; each shard's document holds its rows)."""
        return {
            f"table/{w.name}": {
                "table": w.name,
                "param": w.name,
                "num_rows": w.spec.num_rows,
                "dim": w.spec.dim,
                "dtype": w.spec.dtype,
                "partition": w.partition.scheme,
                "shards": w.partition.num_shards,
            }
            for w in self.weights
        }

    def stored_on(self) -> dict[str, str]:
        """Where each weight is stored, for the placement report."""
        return {
            w.name: ",".join(f"ps:{k}" for k in range(w.partition.num_shards))
            + f" (rows mod {w.partition.num_shards})"
            for w in self.weights
        }

    def report(self) -> str:
        """``log_placement``'s lines: each weight's rows per shard."""
        return "\n".join(
            w.partition.report(w.spec, len(w.rule.slot_names) if w.rule else 0)
            + "\n  (a sparse=True embedding weight: rows on the ps, a whole copy on each worker)"
            for w in self.weights
        )

    # -- internals --------------------------------------------------------------------------

    def _rows_per_chunk(self, weight: MirroredWeight) -> int:
        return max(1, min(MAX_ROWS, self.max_chunk_bytes // (weight.spec.row_bytes + 8)))

    @staticmethod
    def _rule(weight: MirroredWeight) -> SparseRowRule:
        if weight.rule is None:
            raise UsageError(f"{weight.name!r}: bind_rules() before creating its table")
        return weight.rule
