"""Which task of which cluster this process is: from arguments, flags, TF_CONFIG or Slurm.

:func:`resolve_task` asks a list of detectors in order and takes the first answer, as JAX's
cluster detection does: explicit arguments win over the command line, which wins over the
environment (``TF_CONFIG``, then Slurm). Each detector is a small class with a ``name`` (the
``source`` recorded in the answer) and a ``how`` (the hint shown when nothing is found), so
adding an environment means adding one class to :data:`DETECTORS`.

A detector that finds nothing returns ``None``; one that finds something malformed or
incomplete raises :class:`~tensorfleet.errors.ClusterConfigError` at once rather than letting a
later source answer, because a half-written configuration is a mistake to report, not a reason
to quietly run as some other task.
"""

from __future__ import annotations

import os
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, overload

from tensorfleet import environment
from tensorfleet.cluster import slurm, warm_spare
from tensorfleet.cluster.resolved_task import ResolvedTask
from tensorfleet.cluster.spec import (
    ClusterSpec,
    check_job_name,
    check_task_index,
    loads_json,
    show,
)
from tensorfleet.errors import ClusterConfigError

#: What a ``cluster`` argument or ``--cluster`` flag may be: a spec, its dict form, JSON text,
#: or the path of a file holding that JSON.
ClusterLike = ClusterSpec | Mapping[str, Any] | str | os.PathLike[str]

_DIGITS_RE = re.compile(r"[0-9]+")
_T = TypeVar("_T")


@dataclass(frozen=True)
class ResolveRequest:
    """Everything a detector may look at: :func:`resolve_task`'s arguments, the command line
    and the environment."""

    cluster: ClusterLike | None
    job_name: str | None
    task_index: int | None
    argv: Sequence[str]
    environ: Mapping[str, str]


class TaskDetector(ABC):
    """One place a task's identity can come from.

    ``name`` is recorded as :attr:`ResolvedTask.source`; ``how`` tells the user how to
    provide the identity this way, in the error raised when no detector finds anything.
    """

    name: ClassVar[str]
    how: ClassVar[str]

    @abstractmethod
    def detect(self, request: ResolveRequest) -> ResolvedTask | None:
        """The task, ``None`` if this source says nothing, or :class:`ClusterConfigError` if
        it says something malformed or incomplete."""


def load_cluster(value: ClusterLike, where: str) -> ClusterSpec:
    """A :class:`ClusterSpec` from a spec, a dict, JSON text (starts with ``{``) or the path
    of a JSON file; errors are prefixed with ``where`` (e.g. ``"--cluster"``)."""
    try:
        if isinstance(value, ClusterSpec):
            return value
        if isinstance(value, Mapping):
            return ClusterSpec(value)
        if isinstance(value, str) and value.lstrip().startswith("{"):
            return ClusterSpec.from_json(value)
        if isinstance(value, (str, os.PathLike)):
            try:
                text = Path(value).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ClusterConfigError(
                    f"{show(str(value))} is neither JSON text (it does not start with '{{') "
                    f"nor a readable JSON file ({e})"
                ) from None
            return ClusterSpec.from_json(text)
        raise ClusterConfigError(
            "expected a ClusterSpec, a dict, JSON text or the path of a JSON file, got "
            f"{show(value)} of type {type(value).__name__}"
        )
    except ClusterConfigError as e:
        raise ClusterConfigError(f"{where}: {e}") from None


class ArgumentsDetector(TaskDetector):
    """``resolve_task(cluster, job_name, task_index)``: all three, or none."""

    name = "arguments"
    how = "pass resolve_task(cluster={...}, job_name='worker', task_index=0)"

    def detect(self, request: ResolveRequest) -> ResolvedTask | None:
        cluster, job_name, task_index = request.cluster, request.job_name, request.task_index
        if cluster is None and job_name is None and task_index is None:
            return None
        if cluster is None or job_name is None or task_index is None:
            given = {"cluster": cluster, "job_name": job_name, "task_index": task_index}
            present = [name for name, value in given.items() if value is not None]
            missing = [name for name, value in given.items() if value is None]
            raise ClusterConfigError(
                f"resolve_task() got {', '.join(present)} but not {', '.join(missing)}; pass "
                "all of cluster, job_name and task_index, or none of them to detect the task "
                "from flags, TF_CONFIG or Slurm"
            )
        return ResolvedTask(
            load_cluster(cluster, "the cluster argument"),
            check_job_name(job_name, "the job_name argument"),
            check_task_index(task_index, "the task_index argument"),
            self.name,
        )


#: Command-line flags read by :class:`FlagsDetector`, as Distributed TensorFlow scripts
#: spelled them (with ``-`` accepted for ``_``), and the field each sets.
FLAGS = {
    "--job_name": "job_name",
    "--task_index": "task_index",
    "--cluster": "cluster",
    "--ps_hosts": "ps",
    "--worker_hosts": "worker",
    "--chief_hosts": "chief",
}
_FLAG_FIELDS = {**FLAGS, **{flag.replace("_", "-"): field for flag, field in FLAGS.items()}}
_HOSTS_JOBS = ("chief", "ps", "worker")


def parse_flags(argv: Sequence[str]) -> dict[str, str]:
    """The :data:`FLAGS` found in ``argv`` (``--flag value`` or ``--flag=value``), by field;
    other arguments are ignored, and so is everything after a bare ``--``. A repeated flag
    keeps its last value, as ``argparse`` does."""
    found: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            break
        flag, eq, value = arg.partition("=")
        if flag not in _FLAG_FIELDS:
            continue
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):
                raise ClusterConfigError(
                    f"flag {flag} needs a value: write '{flag} VALUE' or '{flag}=VALUE'"
                )
            value = argv[i]
            i += 1
        found[_FLAG_FIELDS[flag]] = value
    return found


class FlagsDetector(TaskDetector):
    """Distributed TensorFlow's classic command line: ``--job_name``, ``--task_index`` and
    either ``--cluster`` (JSON text or the path of a JSON file) or the per-job host lists
    ``--ps_hosts``, ``--worker_hosts``, ``--chief_hosts`` (comma-separated ``host:port``)."""

    name = "flags"
    how = (
        'give the flags --job_name=worker --task_index=0 and --cluster=\'{"ps": [...], '
        '"worker": [...]}\' (JSON, or the path of a JSON file), or --ps_hosts=h:p,... '
        "--worker_hosts=h:p,... instead of --cluster"
    )

    def detect(self, request: ResolveRequest) -> ResolvedTask | None:
        found = parse_flags(request.argv)
        if not found:
            return None
        host_lists = {job: found[job] for job in _HOSTS_JOBS if job in found}
        if "cluster" in found and host_lists:
            raise ClusterConfigError(
                f"flags: both --cluster and --{'_hosts, --'.join(host_lists)}_hosts were given; "
                "describe the cluster one way only"
            )
        missing = [f"--{name}" for name in ("job_name", "task_index") if name not in found]
        if "cluster" not in found and not host_lists:
            missing.append("--cluster (or --ps_hosts/--worker_hosts)")
        if missing:
            present = [flag for flag, field in FLAGS.items() if field in found]
            raise ClusterConfigError(
                f"flags: found {', '.join(present)} but not {', '.join(missing)}; give all of "
                "--job_name, --task_index and --cluster to say which task this process is"
            )
        if "cluster" in found:
            cluster = load_cluster(found["cluster"], "flag --cluster")
        else:
            cluster = load_cluster(
                {
                    job: [a.strip() for a in hosts.split(",")] if hosts else []
                    for job, hosts in host_lists.items()
                },
                "flags --*_hosts",
            )
        if not _DIGITS_RE.fullmatch(found["task_index"]):
            raise ClusterConfigError(
                f"flag --task_index must be a non-negative integer, got {found['task_index']!r}"
            )
        return ResolvedTask(
            cluster,
            check_job_name(found["job_name"], "flag --job_name"),
            int(found["task_index"]),
            self.name,
        )


class TFConfigDetector(TaskDetector):
    """The ``TF_CONFIG`` environment variable, in TensorFlow's schema as Kubeflow's TFJob sets
    it: ``{"cluster": {job: [...]}, "task": {"type": "worker", "index": 0}}``. Other keys
    (``"environment"``, ``"rpc_layer"``) are ignored. An unset or empty ``TF_CONFIG``, ``{}``,
    or one without cluster and task, says nothing (TensorFlow's local mode)."""

    name = "TF_CONFIG"
    how = (
        f'set {environment.TF_CONFIG_VAR}=\'{{"cluster": {{"worker": ["host:port", ...]}}, '
        '"task": {"type": "worker", "index": 0}}\' (as Kubeflow\'s TFJob and '
        "`tensorfleet launch` do)"
    )

    def detect(self, request: ResolveRequest) -> ResolvedTask | None:
        var = environment.TF_CONFIG_VAR
        raw = request.environ.get(var)
        if raw is None or not raw.strip():
            return None
        config = loads_json(raw, var)
        if not isinstance(config, dict):
            raise ClusterConfigError(
                f"{var} must be a JSON object with 'cluster' and 'task', got {show(raw)}"
            )
        cluster, task = config.get("cluster"), config.get("task")
        if not cluster and not task:
            return None
        if not cluster:
            raise ClusterConfigError(
                f"{var} has a 'task' but no 'cluster' (or an empty one): add "
                '"cluster": {"worker": ["host:port", ...], ...}'
            )
        if not isinstance(cluster, dict):
            raise ClusterConfigError(
                f"{var}: 'cluster' must be an object mapping job names to lists of "
                f"'host:port', got {show(cluster)}"
            )
        if not isinstance(task, dict):
            raise ClusterConfigError(
                f"{var} has a 'cluster' but its 'task' is {show(task)}: add "
                '"task": {"type": "worker", "index": 0} naming this process\'s task'
            )
        for key in ("type", "index"):
            if key not in task:
                raise ClusterConfigError(
                    f"{var}: 'task' has no {key!r} (got {show(task)}); write "
                    '"task": {"type": "worker", "index": 0}'
                )
        return ResolvedTask(
            load_cluster(cluster, f"{var} 'cluster'"),
            check_job_name(task["type"], f"{var}: task type"),
            check_task_index(task["index"], f"{var}: task index"),
            self.name,
        )


class SlurmDetector(TaskDetector):
    """A task started by ``srun``: the cluster is laid out from Slurm's environment.

    The rule, the same in every task so that all agree without talking:

    - ranks are ``SLURM_PROCID`` in ``0..SLURM_NTASKS-1``;
    - the first ``TENSORFLEET_SLURM_NUM_PS`` ranks (default 1 when ``SLURM_NTASKS >= 2``,
      else 0) are ``ps:0 .. ps:k-1``; the others are ``worker:0, worker:1, ...`` in rank order;
    - ranks sit on the nodes of the step's node list (``SLURM_STEP_NODELIST``, else
      ``SLURM_NODELIST``, else ``SLURM_JOB_NODELIST``) in Slurm's default *block* order,
      using the counts of ``SLURM_STEP_TASKS_PER_NODE`` or ``SLURM_TASKS_PER_NODE``
      (``"2(x3),1"``: two ranks on each of the first three nodes, one on the fourth);
    - a task listens on ``TENSORFLEET_SLURM_BASE_PORT`` (default 2222) plus its rank on its
      node, so tasks sharing a node do not collide.
    - when ``TENSORFLEET_SLURM_NUM_WORKERS`` is set (the script ``tensorfleet slurm`` writes
      sets it), the step must have exactly that many workers plus the ps tasks; an
      allocation smaller than that shape is an error naming both numbers.

    Other distributions (``--distribution=cyclic``, ``plane``, ``arbitrary``) place ranks
    differently and are refused; ``SLURM_LOCALID`` and ``SLURMD_NODENAME``, when set, are
    checked against the layout so that a mismatch fails at once.
    """

    name = "slurm"
    how = (
        "start the tasks with srun (default block distribution); Slurm sets SLURM_PROCID, "
        "SLURM_NTASKS, SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE"
    )

    #: Default port of local rank 0 on each node.
    DEFAULT_BASE_PORT = 2222

    def detect(self, request: ResolveRequest) -> ResolvedTask | None:
        env = request.environ
        if "SLURM_PROCID" not in env:
            return None
        rank = _env_int(env, "SLURM_PROCID")
        ntasks_var = _first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        ntasks = _env_int(env, ntasks_var)
        nodes_var = _first_set(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
        counts_var = _first_set(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        nodes = _in_var(slurm.expand_hostlist, env, nodes_var)
        counts = _in_var(slurm.expand_tasks_per_node, env, counts_var)
        if sum(counts) != ntasks:
            raise ClusterConfigError(
                f"slurm: {counts_var}={env[counts_var]!r} places {sum(counts)} tasks but "
                f"there are {ntasks}; run the tasks with srun so that both describe the same step"
            )
        if not 0 <= rank < ntasks:
            raise ClusterConfigError(f"slurm: SLURM_PROCID={rank} is not in 0..{ntasks - 1}")
        distribution = env.get("SLURM_DISTRIBUTION", "").split(":")[0].split(",")[0]
        if distribution.startswith(("cyclic", "plane", "arbitrary")):
            raise ClusterConfigError(
                f"slurm: SLURM_DISTRIBUTION={env['SLURM_DISTRIBUTION']!r}, but tensorfleet lays "
                "out the cluster in Slurm's default block order; use --distribution=block or "
                "describe the cluster with TF_CONFIG or --cluster"
            )
        num_ps = _env_int(env, environment.SLURM_NUM_PS_VAR, default=1 if ntasks >= 2 else 0)
        if environment.SLURM_NUM_WORKERS_VAR in env:
            num_workers = _env_int(env, environment.SLURM_NUM_WORKERS_VAR)
            slurm.check_allocation(ntasks, num_ps, num_workers, ntasks_var)
        if num_ps >= ntasks:
            raise ClusterConfigError(
                f"slurm: {environment.SLURM_NUM_PS_VAR}={num_ps} leaves no worker among "
                f"{ntasks} tasks; make it at most {ntasks - 1} or start more tasks"
            )
        base_port = _env_int(env, environment.SLURM_BASE_PORT_VAR, default=self.DEFAULT_BASE_PORT)
        layout = slurm.block_layout(nodes, counts)
        if not 1 <= base_port <= 65536 - max(counts):
            raise ClusterConfigError(
                f"slurm: {environment.SLURM_BASE_PORT_VAR}={base_port} with up to "
                f"{max(counts)} tasks per node gives ports outside 1..65535"
            )
        node, local_rank = layout[rank]
        _check_matches(env, "SLURM_LOCALID", str(local_rank), rank)
        _check_matches(env, "SLURMD_NODENAME", node, rank)
        addresses = [f"{host}:{base_port + local}" for host, local in layout]
        cluster = {"ps": addresses[:num_ps], "worker": addresses[num_ps:]}
        if not num_ps:
            del cluster["ps"]
        job, index = ("ps", rank) if rank < num_ps else ("worker", rank - num_ps)
        return ResolvedTask(load_cluster(cluster, "slurm"), job, index, self.name)


def _first_set(env: Mapping[str, str], *names: str) -> str:
    """The first of ``names`` that is set in ``env``."""
    for name in names:
        if name in env:
            return name
    raise ClusterConfigError(
        f"slurm: SLURM_PROCID is set but {' / '.join(names)} is not; start the tasks with srun "
        "inside an allocation so that Slurm sets them"
    )


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None and default is not None:
        return default
    if value is None or not _DIGITS_RE.fullmatch(value.strip()):
        raise ClusterConfigError(f"slurm: {name} must be a non-negative integer, got {show(value)}")
    return int(value)


def _in_var(parse: Callable[[str], _T], env: Mapping[str, str], name: str) -> _T:
    """``parse(env[name])`` with errors naming the variable."""
    try:
        return parse(env[name])
    except ClusterConfigError as e:
        raise ClusterConfigError(f"slurm: {name}: {e}") from None


def _check_matches(env: Mapping[str, str], name: str, expected: str, rank: int) -> None:
    if name in env and env[name] != expected:
        raise ClusterConfigError(
            f"slurm: rank {rank} should run with {name}={expected!r} in Slurm's block "
            f"distribution but has {env[name]!r}; the tasks were placed some other way "
            "(--distribution, --nodelist order, heterogeneous job?). Use the default block "
            "distribution, or describe the cluster with TF_CONFIG or --cluster"
        )


#: The detectors :func:`resolve_task` asks, in order; the first answer wins.
DETECTORS: tuple[TaskDetector, ...] = (
    ArgumentsDetector(),
    FlagsDetector(),
    TFConfigDetector(),
    SlurmDetector(),
)


#: The flags :func:`check_agrees_with_tf_config` tells the user to drop by default: those of
#: :class:`FlagsDetector`.
CLASSIC_TASK_FLAGS = "--job_name/--task_index/--cluster"


def check_agrees_with_tf_config(
    task: ResolvedTask, environ: Mapping[str, str], flags: str = CLASSIC_TASK_FLAGS
) -> None:
    """Raise :class:`ClusterConfigError` when ``TF_CONFIG`` in ``environ`` names a task and
    it is not ``task``, which the command-line flags ``flags`` described.

    Flags win over ``TF_CONFIG`` only when they say the same thing: a process started by a
    launcher or by Kubeflow (which set ``TF_CONFIG``) with leftover task flags would
    otherwise quietly run as another task than its neighbours expect. ``flags`` names them
    in the program's own terms (``tensorfleet server`` has ``--job/--task/--cluster``).
    """
    request = ResolveRequest(cluster=None, job_name=None, task_index=None, argv=(), environ=environ)
    other = TFConfigDetector().detect(request)
    if other is None:
        return
    if (other.cluster, other.job, other.index) == (task.cluster, task.job, task.index):
        return
    raise ClusterConfigError(
        f"the flags and {environment.TF_CONFIG_VAR} disagree: the flags say this task "
        f"is {task.job}:{task.index} of {task.cluster.to_json()} but "
        f"{environment.TF_CONFIG_VAR} says {other.job}:{other.index} of "
        f"{other.cluster.to_json()}. Describe the task one way only: drop the "
        f"{flags} flags, or unset {environment.TF_CONFIG_VAR}"
    )


def _check_flags_agree_with_tf_config(
    task: ResolvedTask, request: ResolveRequest, chosen: Sequence[TaskDetector]
) -> None:
    """:func:`check_agrees_with_tf_config` for a task the flags described, when
    ``TF_CONFIG`` is among the ``chosen`` detectors."""
    if task.source != FlagsDetector.name:
        return
    if any(isinstance(detector, TFConfigDetector) for detector in chosen):
        check_agrees_with_tf_config(task, request.environ)


_this_process: ResolvedTask | None = None
"""The task :func:`resolve_task` last found for this process (from its flags, arguments or
environment), for what asks later without them (:func:`tensorfleet.device`'s ``/job:``)."""


def resolved_in_this_process() -> ResolvedTask | None:
    """The task :func:`resolve_task` last found for this process, or None."""
    return _this_process


@overload
def resolve_task(
    cluster: ClusterLike | None = ...,
    job_name: str | None = ...,
    task_index: int | None = ...,
    *,
    argv: Sequence[str] | None = ...,
    environ: Mapping[str, str] | None = ...,
    allow_none: Literal[False] = ...,
    detectors: Sequence[TaskDetector] | None = ...,
) -> ResolvedTask: ...


@overload
def resolve_task(
    cluster: ClusterLike | None = ...,
    job_name: str | None = ...,
    task_index: int | None = ...,
    *,
    argv: Sequence[str] | None = ...,
    environ: Mapping[str, str] | None = ...,
    allow_none: bool,
    detectors: Sequence[TaskDetector] | None = ...,
) -> ResolvedTask | None: ...


def resolve_task(
    cluster: ClusterLike | None = None,
    job_name: str | None = None,
    task_index: int | None = None,
    *,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    allow_none: bool = False,
    detectors: Sequence[TaskDetector] | None = None,
) -> ResolvedTask | None:
    """Find which task of which cluster this process is.

    Asks each of ``detectors`` (default :data:`DETECTORS`) in turn and returns the first
    answer: the explicit arguments (all three, or none), then the flags ``--job_name``,
    ``--task_index``, ``--cluster`` in ``argv`` (default ``sys.argv[1:]``), then ``TF_CONFIG``,
    then Slurm's environment (see :class:`SlurmDetector` for the layout rule). The answer is
    checked: its job must be in the cluster and its index in the job. Flags and ``TF_CONFIG``
    that are both present must name the same cluster and task, or an error names both.

    In a warm spare the launcher started ahead of time (:mod:`tensorfleet.cluster.warm_spare`:
    :data:`~tensorfleet.environment.SPARE_PIPE_VAR` is set and ``environ`` is not given),
    this first blocks until the launcher hands the spare the identity of a worker that died,
    and sets that worker's variables in the environment. Work done before this call (imports,
    loading data, building the model) is then already done when the spare takes over.

    When no source says anything, returns ``None`` if ``allow_none`` (the caller then runs as
    a single process without a cluster), else raises :class:`ClusterConfigError` listing
    every source tried and how to use it. A source that is present but malformed raises at
    once, naming itself and the problem.
    """
    if isinstance(argv, str):
        raise ClusterConfigError(f"argv must be a list of arguments, got the string {argv!r}")
    if environ is None and warm_spare.is_spare(environment.environ()):
        # A warm spare of the launcher: wait here for the identity of a worker that died,
        # then resolve from the variables it was given (TF_CONFIG) as that worker would.
        warm_spare.wait_for_identity()
    request = ResolveRequest(
        cluster=cluster,
        job_name=job_name,
        task_index=task_index,
        argv=tuple(sys.argv[1:] if argv is None else argv),
        environ=environment.environ() if environ is None else environ,
    )
    chosen = DETECTORS if detectors is None else tuple(detectors)
    for detector in chosen:
        task = detector.detect(request)
        if task is not None:
            _check_flags_agree_with_tf_config(task, request, chosen)
            if environ is None:  # this process's own: its device scopes ask for it
                global _this_process
                _this_process = task
            return task
    if allow_none:
        return None
    tried = "\n".join(f"  - {d.name}: {d.how}" for d in chosen)
    raise ClusterConfigError(
        "could not tell which task of which cluster this process is. Tried, in order:\n"
        f"{tried}\n"
        "Provide one of these (`tensorfleet launch` does it for a local cluster), or call "
        "resolve_task(allow_none=True) to run as a single process without a cluster."
    )
