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

import logging
from collections.abc import Callable
from dataclasses import dataclass

from tensorfleet.errors import ClusterConfigError, ConfigError, ConfigTypeError
from tensorfleet.ps.gradient_age import check_setting as check_gradient_age
from tensorfleet.ps.model_namespace import ModelClaim, fingerprint, label, model_workers
from tensorfleet.ps.placement import PlacementPlan, VariableSpec, plan_placement
from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.update_discipline import LOST_WORKER_POLICIES, UpdateDiscipline
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

log = logging.getLogger("tensorfleet.session")


@dataclass(frozen=True)
class UpdateSettings:
    """The session's arguments that shape how updates are made (see ``TrainingSession``).

    Built, it has checked each option's type and range (:func:`check_option_values`), with
    or without a server, so that a script refused on a cluster is refused in one process
    too; which mode takes which option is checked by :func:`update_mode`, and what needs
    the cluster (e.g. ``replicas_to_aggregate`` against its workers) by the mode's build."""

    mode: str = "async"
    replicas_to_aggregate: int | None = None
    max_staleness: int | None = None
    max_gradient_age: int | str | None = None
    """Mode ``async`` only; None: ``"auto"`` there (:mod:`tensorfleet.ps.gradient_age`)."""
    clip_grad_norm: float | None = None
    ema_decay: float | None = None
    placement: str = "greedy"
    partition_threshold_bytes: int | None = None
    log_placement: bool = False
    timeouts: ClientTimeouts | None = None
    lost_worker: str | None = None
    """Mode ``sync`` only; None: ``"shrink"`` there."""
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
        check_option_values(self)


def _check_whole_number(option: str, value: object, minimum: int, meaning: str) -> None:
    """ConfigTypeError unless ``value`` is None or an int (not a bool, not a float);
    ConfigError when it is below ``minimum``. Both name ``option``, the value and the fix."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(
            f"{option} must be a whole number ({meaning}), got {value!r} "
            f"({type(value).__name__}): give an int >= {minimum}, or leave {option} out"
        )
    if value < minimum:
        raise ConfigError(
            f"{option} must be >= {minimum} ({meaning}), got {value}: give an int >= "
            f"{minimum}, or leave {option} out"
        )


def _check_real_number(option: str, value: object, example: str) -> None:
    """ConfigTypeError unless ``value`` is None or an int or float (not a bool)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigTypeError(
            f"{option} must be a number, got {value!r} ({type(value).__name__}): give e.g. "
            f"{option}={example}, or leave {option} out"
        )


def check_option_values(settings: UpdateSettings) -> None:
    """Each update option's type and range, whatever the mode and with or without a server
    (ConfigError / ConfigTypeError naming the option, the value seen and the fix)."""
    _check_whole_number(
        "replicas_to_aggregate",
        settings.replicas_to_aggregate,
        1,
        "the gradients a sync step averages, one per worker; default: every worker's",
    )
    _check_whole_number(
        "max_staleness",
        settings.max_staleness,
        0,
        "the steps the fastest worker may run ahead of the slowest; 0 is lockstep",
    )
    if settings.max_gradient_age is not None:
        check_gradient_age(settings.max_gradient_age)
    _check_real_number("clip_grad_norm", settings.clip_grad_norm, "1.0")
    if settings.clip_grad_norm is not None and not settings.clip_grad_norm > 0:
        raise ConfigError(
            f"clip_grad_norm must be > 0, got {settings.clip_grad_norm}: it is the global norm "
            "the gradient is clipped to; give e.g. clip_grad_norm=1.0, or leave it out"
        )
    _check_real_number("ema_decay", settings.ema_decay, "0.99")
    if settings.ema_decay is not None and not 0.0 < settings.ema_decay < 1.0:
        raise ConfigError(
            f"ema_decay must be in (0, 1), got {settings.ema_decay}: the weight of the old "
            "average at each step; give e.g. ema_decay=0.99, or leave it out"
        )
    if settings.lost_worker is not None and settings.lost_worker not in LOST_WORKER_POLICIES:
        raise ConfigError(
            f"lost_worker must be one of {LOST_WORKER_POLICIES}, got {settings.lost_worker!r}: "
            "'shrink' (the default) goes on with the live workers when one stops sending "
            "heartbeats, 'fail' stops the training with an error naming it"
        )


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
    uses_ps: bool = False
    """The mode trains through the ps shards (its ``build`` returns a :func:`ps_updater`, or
    wraps one): the chief is the model's (the first of ``model_workers``), not the cluster's,
    and ``sparse_optimizer`` applies."""


#: Session options that only some modes accept; a mode lists those it takes in ``options``.
#: Each defaults to None, which every mode accepts.
MODE_OPTIONS = (
    "replicas_to_aggregate",
    "max_staleness",
    "max_gradient_age",
    "wire_dtype",
    "values_wire_dtype",
    "lost_worker",
)

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
    naming the option, the modes that take it, the mode given and the fix)."""
    mode = _MODES.get(settings.mode)
    if mode is None:
        hint = (
            ": bounded staleness is mode='async' with max_staleness=N"
            if settings.mode == "max_staleness"
            else ""
        )
        raise ConfigError(f"mode must be one of {mode_names()}, got {settings.mode!r}{hint}")
    for option in MODE_OPTIONS:
        value = getattr(settings, option)
        if value is not None and option not in mode.options:
            names = [m.name for m in _MODES.values() if option in m.options]
            takers = " or ".join(repr(name) for name in names)
            raise ConfigError(
                f"{option}={value} only applies to mode {takers}, not {settings.mode!r}: "
                f"leave {option} out, or train with mode={names[0]!r}"
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
    if not update_mode(settings).uses_ps:
        return server.is_chief
    return model_claim(server, settings).chief == str(server.task)


def build_updater(
    server: Server | None, named_params: NamedParams, settings: UpdateSettings
) -> Updater:
    """The updater for ``settings.mode`` on ``server``'s task (this process without one)."""
    mode = update_mode(settings)
    if settings.sparse_optimizer is not None and server is not None and not mode.uses_ps:
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


def ps_updater(
    server: Server,
    named_params: NamedParams,
    settings: UpdateSettings,
    discipline: str | None = None,
) -> Updater:
    """The updater of a mode whose variables live on the ps shards, which apply the updates:
    ``async`` and ``sync``, and a mode of the user's registered with ``uses_ps=True`` whose
    ``build`` calls this (and may wrap what it returns). ``discipline``: how the ps applies
    the pushes, ``"async"`` or ``"sync"`` (default: ``settings.mode``, a built-in mode's)."""
    mode, shards = discipline or settings.mode, len(server.ps_addresses)
    if not shards:
        raise ClusterConfigError(
            f"mode {settings.mode!r} trains through parameter servers, but the cluster has no "
            "'ps' job: "
            "add ps tasks (tensorfleet launch --ps 1), or use mode='allreduce'"
        )
    if mode == "sync" and settings.clip_grad_norm is not None and shards > 1:
        raise ConfigError(
            "clip_grad_norm in mode 'sync' clips the aggregated gradient on the ps, which needs "
            f"its norm across all shards; that works with one ps task, and this cluster has "
            f"{shards}. Use one ps task, or mode 'async' (each worker clips "
            "its own gradient), or 'allreduce'"
        )
    model = model_claim(server, settings, named_params)
    _check_replicas_fit(settings, model)
    discipline = UpdateDiscipline(
        mode=mode,
        replicas_to_aggregate=settings.replicas_to_aggregate,
        max_staleness=settings.max_staleness,
        max_gradient_age=(
            settings.max_gradient_age
            if mode == "async" and settings.max_gradient_age is not None
            else "auto"
        ),
        clip_norm=settings.clip_grad_norm if mode == "sync" else None,
        ema_decay=settings.ema_decay,
        lost_worker="shrink" if settings.lost_worker is None else settings.lost_worker,
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


def _check_replicas_fit(settings: UpdateSettings, model: ModelClaim) -> None:
    """A sync step averages ``replicas_to_aggregate`` gradients, one per worker of the model:
    more than it has workers is refused here, on every worker alike, before anything is
    sent (the ps would refuse the chief's ``create`` and leave the others waiting)."""
    wanted, workers = settings.replicas_to_aggregate, model.workers or ()
    if wanted is None or wanted <= len(workers):
        return
    named = settings.model_workers is not None
    whose = f"model_workers of {label(model.name)}" if named else "worker tasks of the cluster"
    raise ConfigError(
        f"replicas_to_aggregate={wanted} is more than the {len(workers)} {whose} "
        f"({', '.join(workers)}) that train it: a sync step averages one gradient per worker. "
        f"Use replicas_to_aggregate <= {len(workers)}, or "
        + ("name more workers in model_workers" if named else "launch more workers")
    )


_warned_allreduce_in_clear = False
"""Whether this process has said that --encrypt does not cover mode 'allreduce'."""


def _warn_allreduce_in_clear(server: Server) -> None:
    """Once per process, on a server that encrypts: the all-reduce traffic is not covered."""
    global _warned_allreduce_in_clear
    if server.encrypt and not _warned_allreduce_in_clear:
        _warned_allreduce_in_clear = True
        log.warning(
            "mode 'allreduce' traffic (torch.distributed, gloo/NCCL) is neither authenticated "
            "nor encrypted; --encrypt covers the ps traffic only (docs/security.md)"
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
    _warn_allreduce_in_clear(server)
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


register_update_mode(
    UpdateMode(
        "async",
        ps_updater,
        options=frozenset({"max_staleness", "max_gradient_age", "wire_dtype", "values_wire_dtype"}),
        clips_on_worker=True,
        uses_ps=True,
    )
)
register_update_mode(
    UpdateMode(
        "sync",
        ps_updater,
        options=frozenset(
            {"replicas_to_aggregate", "lost_worker", "wire_dtype", "values_wire_dtype"}
        ),
        clips_on_worker=False,
        uses_ps=True,
    )
)
register_update_mode(UpdateMode("allreduce", _allreduce_updater, clips_on_worker=True))
