"""The placement report: one table saying where every variable is stored and where every
module computes.

``log_placement=True`` prints it on the chief. Rows:

- ``variable``: each trainable parameter, its shape, the ps shard(s) storing it (``ps:1``;
  several for a partitioned one; ``ps:0,ps:1 (rows mod 2)`` for a ``sparse=True`` embedding
  weight held as rows; ``local`` when no ps holds it: one process, all-reduce, or a
  pipeline's stage-local state), and the device its working copy is on here;
- ``table``: each :class:`~tensorfleet.EmbeddingTable` (it has no parameters), its
  ``[num_rows, dim]``, where its rows are (``ps:0,ps:1 (rows mod 2)``; ``local (rows)`` in
  one process) and the device its looked-up rows are on (the CPU); with a ps plan, a section
  after the table gives each shard's rows and their bytes at most, as for a ``sparse=True``
  embedding weight;
- ``module``: each module that holds parameters directly (the leaves that compute), the task
  it computes on and its device: the device of its parameters (what torch will really use),
  and, when a ``tfl.device`` scope or ``tfl.place`` asked for something else (soft
  placement; or ``/device:CPU:1``, which runs on the process's one CPU device, with a note
  under the table saying so), the asked spec too.

For a pipeline, ``stage_tasks`` maps each module name prefix (``"0"``, ``"stage1.3"``) to the
task running it, so the report of one pipeline lists every stage's task.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from tensorfleet.cluster.device import DeviceSpec
from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.worker.device_scope import requested_device
from tensorfleet.worker.embedding_table import EmbeddingTable


@dataclass(frozen=True)
class PlacementRow:
    """One line of the report."""

    kind: str  # "variable" or "module"
    name: str
    detail: str  # the shape of a variable, the class of a module
    stored_on: str  # ps shard(s) of a variable, "-" for a module
    task: str
    device: str
    asked: str = ""


def placement_rows(
    model: nn.Module,
    *,
    plan: PlacementPlan | None = None,
    task: str = "local",
    stage_tasks: Mapping[str, str] | None = None,
    replica_devices: Sequence[str] | None = None,
    stage_devices: Mapping[str, str] | None = None,
    stored_on: Mapping[str, str] | None = None,
) -> list[PlacementRow]:
    """The report's rows: every trainable variable, then every module holding parameters.
    ``replica_devices``: the model computes on each of these (in-graph replicas);
    ``stage_devices``: the logical device of each module-name prefix (a pipeline's stages:
    ``/cpu:1`` is its own thread although torch has one CPU device); ``stored_on``: where
    the variables outside the plan are stored (the sparse embedding weights' rows)."""
    shards: dict[str, list[str]] = {}
    if plan is not None:
        for shard in plan.shards:
            for piece in shard:
                shards.setdefault(piece.variable.name, []).append(f"ps:{piece.shard}")
    outside = dict(stored_on or {})
    rows: list[PlacementRow] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        rows.append(
            PlacementRow(
                "variable",
                name,
                str(list(param.shape)),
                outside.get(name) or ",".join(sorted(set(shards.get(name, [])))) or "local",
                _task_of(name, task, stage_tasks),
                _task_of(name, _spec_of(param.device), stage_devices),
            )
        )
    for place, table in _tables(model):
        name = table.table_name or place
        rows.append(
            PlacementRow(
                "table",
                name,
                f"[{table.num_rows}, {table.dim}]",
                outside.get(name) or _table_shards(table),
                _task_of(place, task, stage_tasks),
                "/device:CPU:0",  # the looked-up rows: pulled into CPU tensors
            )
        )
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        actual = _spec_of(own[0].device)
        if replica_devices:
            actual = ",".join(replica_devices)
        elif stage_devices:
            actual = _task_of(name, actual, stage_devices)
        asked = requested_device(module)
        rows.append(
            PlacementRow(
                "module",
                name or "(root)",
                type(module).__name__,
                "-",
                _task_of(name, task, stage_tasks),
                actual,
                asked.to_string() if asked is not None and _differs(asked, actual) else "",
            )
        )
    return rows


def placement_report(
    model: nn.Module,
    *,
    plan: PlacementPlan | None = None,
    task: str = "local",
    stage_tasks: Mapping[str, str] | None = None,
    replica_devices: Sequence[str] | None = None,
    stage_devices: Mapping[str, str] | None = None,
    stored_on: Mapping[str, str] | None = None,
) -> str:
    """The table as text, one row per variable and per module (see the module docstring)."""
    rows = placement_rows(
        model,
        plan=plan,
        task=task,
        stage_tasks=stage_tasks,
        replica_devices=replica_devices,
        stage_devices=stage_devices,
        stored_on=stored_on,
    )
    header = PlacementRow("kind", "name", "shape/type", "stored on", "task", "device", "asked")
    widths = [
        max(len(getattr(r, f)) for r in [header, *rows])
        for f in ("kind", "name", "detail", "stored_on", "task", "device")
    ]
    title = (
        f"placement ({plan.strategy}, {plan.num_shards} ps shard(s)):"
        if plan is not None
        else "placement (no ps: variables are local):"
    )
    lines = [title]
    if not any(r.asked for r in rows):
        header = PlacementRow(
            *[getattr(header, f) for f in ("kind", "name", "detail", "stored_on", "task", "device")]
        )
    for row in [header, *rows]:
        cells = [row.kind, row.name, row.detail, row.stored_on, row.task, row.device]
        text = "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
        lines.append(("  " + text + ("  " + row.asked if row.asked else "")).rstrip())
    if any(_asks_other_cpu(r.asked) for r in rows):
        lines.append(CPU_INDEX_NOTE)
    if plan is not None:
        lines.extend(table_sections(model))
    return "\n".join(lines)


def _asks_other_cpu(asked: str) -> bool:
    if not asked:
        return False
    spec = DeviceSpec.parse(asked)
    return spec.device_type == "CPU" and spec.device_index not in (None, 0)


def table_sections(model: nn.Module) -> list[str]:
    """Each attached :class:`~tensorfleet.EmbeddingTable`'s rows per ps shard and their bytes
    at most (``RowPartition.report``). The bytes count the optimizer slots of the table's
    rule when it is known yet (its own ``rule``, or the rule it was created with); before the
    session decides it, the values only, and a line says so."""
    lines: list[str] = []
    for _, table in _tables(model):
        if not table.attached or not table.table_name:
            continue
        rule = table.bound_rule or table.rule
        lines.append(table.partition.report(table.spec(), len(rule.slot_names) if rule else 0))
        if rule is None:
            lines.append(
                "  (bytes of the values only: each slot of the table's row-sparse rule adds as "
                "much, 1 for adagrad, 2 for sparse_adam)"
            )
        lines.append("  (an EmbeddingTable: rows on the ps, only each batch's rows on a worker)")
    return lines


def _tables(model: nn.Module) -> list[tuple[str, EmbeddingTable]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, EmbeddingTable)]


def _table_shards(table: EmbeddingTable) -> str:
    """Where an attached table's rows are: its shards and partition scheme."""
    if not table.attached:
        return "not attached"
    partition = table.partition
    shards = ",".join(f"ps:{k}" for k in range(partition.num_shards))
    return f"{shards} (rows {partition.scheme} {partition.num_shards})"


def _task_of(name: str, task: str, stage_tasks: Mapping[str, str] | None) -> str:
    if not stage_tasks:
        return task
    best = ""
    for prefix in stage_tasks:
        if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return stage_tasks[best] if best else task


def _spec_of(device: object) -> str:
    dev = str(device)
    if dev.startswith("cuda"):
        index = dev.partition(":")[2] or "0"
        return f"/device:GPU:{index}"
    return "/device:CPU:0"


def _differs(asked: DeviceSpec, actual: str) -> bool:
    """Whether the module computes elsewhere than asked: soft placement (a GPU asked for,
    the CPU used), or a CPU index other than 0 (torch has one CPU device per process)."""
    if asked.device_type is None:
        return False
    parts = actual.split(",")[0].split(":")
    if len(parts) != 3:
        return False
    _, kind, index = parts
    if asked.device_type != kind:
        return True
    return asked.device_index is not None and str(asked.device_index) != index


#: Under the table when a module asked for ``/device:CPU:N`` with N > 0.
CPU_INDEX_NOTE = (
    "  (asked /device:CPU:N with N > 0: it runs on /device:CPU:0, the process's one CPU "
    "device in torch; the index only names it)"
)
