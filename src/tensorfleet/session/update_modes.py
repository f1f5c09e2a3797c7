"""The update modes a :class:`~tensorfleet.session.training_session.TrainingSession` can
train in, and the one place that turns ``mode=`` into an
:class:`~tensorfleet.worker.updater.Updater`.

Each mode is an :class:`UpdateMode` registered under its name: which session options it
accepts, whether each worker clips its own gradient, and a ``build`` function that checks
the cluster fits the mode and returns the updater. The session looks the mode up here and
never branches on it. A new mode (in-graph replicas, pipelines, sparse tables, ...) is a new
``Updater`` implementation plus one :func:`register_update_mode` call at the end of this
module (docs/architecture.md, "Adding an update mode"). Without a server every mode trains
in this one process (:class:`~tensorfleet.worker.local_updater.LocalUpdater`), so the same
script runs alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tensorfleet.errors import ClusterConfigError, ConfigError
from tensorfleet.ps.model_namespace import ModelClaim, fingerprint, model_workers
from tensorfleet.ps.placement import PlacementPlan, VariableSpec, plan_placement
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.session.device_engines import device_option, with_device_engine
from tensorfleet.session.server import Server
from tensorfleet.wire.gradient_encoding import check_wire_dtype
from tensorfleet.wire.tensors import dtype_name
from tensorfleet.wire.value_encoding import check_values_wire_dtype
from tensorfleet.worker.allreduce_updater import AllReduceUpdater
from tensorfleet.worker.local_updater import LocalUpdater
from tensorfleet.worker.ps_updater import PsUpdater
from tensorfleet.worker.push_overlap import Overlap
from tensorfleet.worker.timeouts import ClientTimeouts
from tensorfleet.worker.updater import NamedParams, Updater


@dataclass(frozen=True)
class UpdateSettings:
    """The session's arguments that shape how updates are made (see ``TrainingSession``)."""

    mode: str = "async"
    replicas_to_aggregate: int | None = None
    max_staleness: int | None = None
    clip_grad_norm: float | None = None
    ema_decay: float | None = None
    placement: str = "greedy"
    partition_threshold_bytes: int | None = None
    log_placement: bool = False
    timeouts: ClientTimeouts | None = None
    lost_worker: str = "shrink"
    replica_devices: tuple[str, ...] | None = None
    stage_devices: tuple[str, ...] | None = None
    microbatches: int = 4
    soft_placement: bool = False
    model_name: str = ""
    model_workers: tuple[str | int, ...] | None = None
    sparse_optimizer: SparseRowRule | None = None
    wire_dtype: str | None = None
    values_wire_dtype: str | None = None
    overlap: Overlap | None = None

    def __post_init__(self) -> None:
        # any sequence of device strings becomes a tuple; replica_devices=n: /cpu:0../cpu:n-1
        for option, count_ok in (("replica_devices", True), ("stage_devices", False)):
            devices = device_option(option, getattr(self, option), count_ok=count_ok)
            object.__setattr__(self, option, devices)
        check_wire_dtype(self.wire_dtype)
        check_values_wire_dtype(self.values_wire_dtype)


UpdaterFactory = Callable[[Server, NamedParams, UpdateSettings], Updater]
"""Builds a mode's updater for ``server``'s task (checking the cluster fits the mode)."""


@dataclass(frozen=True)
class UpdateMode:
    """One way to update: its name, the mode-specific options it accepts, where gradients
    are clipped, and how its updater is built."""

    name: str
    build: UpdaterFactory
    options: frozenset[str] = frozenset()
    """Which of the mode-specific session options (:data:`MODE_OPTIONS`) it accepts."""
    clips_on_worker: bool = True
    """Each worker clips its own gradient (False: the mode clips the aggregate itself)."""


#: Session options that only some modes accept; a mode lists those it takes in ``options``.
MODE_OPTIONS = ("replicas_to_aggregate", "max_staleness", "wire_dtype", "values_wire_dtype")

_MODES: dict[str, UpdateMode] = {}


def register_update_mode(mode: UpdateMode) -> None:
    """Make ``mode`` available as ``TrainingSession(mode=mode.name)``."""
    if mode.name in _MODES:
        raise ConfigError(f"update mode {mode.name!r} is registered already")
    unknown = set(mode.options) - set(MODE_OPTIONS)
    if unknown:
        raise ConfigError(f"update mode {mode.name!r} names unknown options {sorted(unknown)}")
    _MODES[mode.name] = mode


def mode_names() -> tuple[str, ...]:
    """The registered modes, in registration order."""
    return tuple(_MODES)


def update_mode(settings: UpdateSettings) -> UpdateMode:
    """The registered mode ``settings.mode``, after checking the options fit it (ConfigError
    naming the option, the modes that take it, and the mode given)."""
    mode = _MODES.get(settings.mode)
    if mode is None:
        raise ConfigError(f"mode must be one of {mode_names()}, got {settings.mode!r}")
    for option in MODE_OPTIONS:
        value = getattr(settings, option)
        if value is not None and option not in mode.options:
            takers = " or ".join(repr(m.name) for m in _MODES.values() if option in m.options)
            raise ConfigError(
                f"{option}={value} only applies to mode {takers}, not {settings.mode!r}"
            )
    return mode


def model_claim(
    server: Server, settings: UpdateSettings, named_params: NamedParams = ()
) -> ModelClaim:
    """The namespace ``server``'s task trains in: ``settings.model_name`` and its workers
    (``model_workers``, default every worker; ConfigError when this task is not one), with
    the fingerprint of ``named_params``. Its ``chief`` is the model's chief."""
    workers = model_workers(
        settings.model_workers, [str(t) for t in server.worker_tasks], str(server.task)
    )
    digest, summary = fingerprint(
        [(name, tuple(p.shape), dtype_name(p.dtype)) for name, p in named_params]
    )
    return ModelClaim(settings.model_name, workers, digest if named_params else None, summary)


def is_chief(server: Server | None, settings: UpdateSettings) -> bool:
    """Whether ``server``'s task is the chief of the model it trains (this process without a
    server): the cluster's chief for the default model on every worker, else the first of
    ``model_workers`` in cluster order."""
    if server is None:
        return True
    if settings.mode not in _PS_MODES:
        return server.is_chief
    return model_claim(server, settings).chief == str(server.task)


def build_updater(
    server: Server | None, named_params: NamedParams, settings: UpdateSettings
) -> Updater:
    """The updater for ``settings.mode`` on ``server``'s task (this process without one)."""
    mode = update_mode(settings)
    if settings.sparse_optimizer is not None and server is not None and mode.name not in _PS_MODES:
        raise ConfigError(
            f"sparse_optimizer={settings.sparse_optimizer.name!r} is the row-sparse rule the ps "
            f"shards apply to the sparse=True embedding weights and embedding tables they hold "
            f"as rows (modes 'async', 'sync'); in mode {mode.name!r} the model's optimizer "
            f"(torch's) updates sparse=True weights itself (torch.optim.SGD and Adagrad take "
            f"sparse gradients, Adam does not); fix: leave sparse_optimizer out here, or train "
            f"through ps tasks"
        )
    if server is None:  # one process: the rule of the model's tables (LocalUpdater checks)
        updater: Updater = LocalUpdater(settings.ema_decay, sparse_rule=settings.sparse_optimizer)
    else:
        updater = mode.build(server, named_params, settings)
    return with_device_engine(updater, server, settings)


# -- the built-in modes ---------------------------------------------------------------------------


def _ps_updater(server: Server, named_params: NamedParams, settings: UpdateSettings) -> Updater:
    """``async`` and ``sync``: the variables live on the ps shards, which apply the updates."""
    mode, shards = settings.mode, len(server.ps_addresses)
    if not shards:
        raise ClusterConfigError(
            f"mode {mode!r} trains through parameter servers, but the cluster has no 'ps' job: "
            "add ps tasks (tensorfleet launch --ps 1), or use mode='allreduce'"
        )
    if mode == "sync" and settings.clip_grad_norm is not None and shards > 1:
        raise ConfigError(
            "clip_grad_norm in mode 'sync' clips the aggregated gradient on the ps, which needs "
            f"its norm across all shards; that works with one ps task, and this cluster has "
            f"{shards}. Use one ps task, or mode 'async' (each worker clips "
            "its own gradient), or 'allreduce'"
        )
    discipline = UpdateDiscipline(
        mode=mode,
        replicas_to_aggregate=settings.replicas_to_aggregate,
        max_staleness=settings.max_staleness,
        clip_norm=settings.clip_grad_norm if mode == "sync" else None,
        ema_decay=settings.ema_decay,
        lost_worker=settings.lost_worker,
    )
    specs = [
        VariableSpec(name, tuple(p.shape), dtype_name(p.dtype), p.element_size())
        for name, p in named_params
    ]
    plan = plan_placement(specs, shards, settings.placement, settings.partition_threshold_bytes)

    def replan(leave_out: set[str]) -> PlacementPlan:
        """The plan without the sparse embedding weights (the ps holds them as rows)."""
        kept = [spec for spec in specs if spec.name not in leave_out]
        return plan_placement(kept, shards, settings.placement, settings.partition_threshold_bytes)

    # log_placement: the session prints the whole table once the model is wrapped
    model = model_claim(server, settings, named_params)
    chief = model.chief == str(server.task)
    return PsUpdater(
        server.ps_addresses,
        server.secret,
        str(server.task),
        is_chief=chief,
        model=model,
        plan=plan,
        discipline=discipline,
        timeouts=settings.timeouts,
        encrypt=server.encrypt,
        log_placement=settings.log_placement and chief,
        sparse_rule=settings.sparse_optimizer,
        replan=replan,
        variables=named_params,
        gradient_dtype=settings.wire_dtype,
        values_dtype=settings.values_wire_dtype,
        # sync and the staleness gate take one whole push per step (see push_overlap.py)
        overlap=settings.overlap if mode == "async" and settings.max_staleness is None else None,
    )


def _allreduce_updater(
    server: Server, named_params: NamedParams, settings: UpdateSettings
) -> Updater:
    """``allreduce``: no ps; the workers average gradients with torch.distributed."""
    if settings.model_name or settings.model_workers is not None:
        raise ConfigError(
            "model_name and model_workers name a model's namespace on the ps tasks; mode "
            "'allreduce' has none (every worker trains the one model). Use mode 'async' or "
            "'sync' to share ps tasks between models, or give each model its own cluster"
        )
    if server.ps_addresses:
        raise ClusterConfigError(
            f"mode 'allreduce' needs no ps tasks, but the cluster has {len(server.ps_addresses)}: "
            "they would wait for workers that never come. Launch with --ps 0"
        )
    workers = server.worker_tasks
    chief = server.cluster.chief_task()
    return AllReduceUpdater(
        server.cluster.task_address(chief.job, chief.index),
        workers.index(server.task),
        len(workers),
        settings.timeouts,
        settings.ema_decay,
        task_names=[str(t) for t in workers],
    )


_PS_MODES = ("async", "sync")

register_update_mode(
    UpdateMode(
        "async",
        _ps_updater,
        options=frozenset({"max_staleness", "wire_dtype", "values_wire_dtype"}),
        clips_on_worker=True,
    )
)
register_update_mode(
    UpdateMode(
        "sync",
        _ps_updater,
        options=frozenset({"replicas_to_aggregate", "wire_dtype", "values_wire_dtype"}),
        clips_on_worker=False,
    )
)
register_update_mode(UpdateMode("allreduce", _allreduce_updater, clips_on_worker=True))
