"""Per-task resources: each task's CPU thread budget, its GPUs and its GPU memory cap.

Co-located tasks that each use every core oversubscribe the host: four tasks on two cores,
each with torch's default of one intra-op thread per core, run 8 busy threads on 2 cores and
lose time to context switches and cache thrashing (2.3x slower for a 2-process pipeline
measured here). :func:`plan_resources` divides the host among the tasks the way
TensorFlow's ``ConfigProto`` lets each server be told (``intra_op_parallelism_threads``,
``inter_op_parallelism_threads``, ``gpu_options.visible_device_list``,
``gpu_options.per_process_gpu_memory_fraction``):

- threads: tasks that compute at the same time share the cores, ``cores // tasks`` each, at
  least 1, the remainder to the workers first (worker 0 first); one worker and its ps
  tasks take turns, so the worker gets every core and the ps tasks divide them
  (:mod:`tensorfleet.cluster.thread_budget`: the rule and the measurement);
- GPUs: by default (``gpus_per_worker=None``) worker i gets the host's GPU ``i % n`` (see
  :mod:`tensorfleet.cluster.gpu_assignment`; a host without GPUs: nothing is set);
  ``gpus_per_worker`` N gives worker i the disjoint set ``[i*N, (i+1)*N)`` of the host's
  GPUs (physical ids, through the launcher's own ``CUDA_VISIBLE_DEVICES`` when set); 0
  hides every GPU from every task (all compute on the CPU); ps tasks get none (``CUDA_VISIBLE_DEVICES=""``). Asking for more GPUs than the host has is
  refused here, before anything starts;
- memory: ``gpu_memory_fraction`` F in (0, 1] caps each task's share of each of its GPUs
  (torch's caching allocator otherwise grows on demand, which is TensorFlow's
  ``allow_growth``: the default).
- idle threads: a task with a thread budget also gets ``GOMP_SPINCOUNT=20000``
  (:data:`OPENMP_SPIN_COUNT`; unless the launcher's own environment sets it). After every
  parallel op torch's idle OpenMP threads spin for libgomp's default of 300,000 iterations
  before they sleep, and during an exchange that spinning takes the cores this task's MAC
  and ZeroMQ threads, and the co-located tasks, need: an 8 MB push+pull over TCP from a
  2-thread client cost it 19-20 ms of CPU per round with the default and 12-13 ms with
  20,000 (wall time 20.6-22.1 -> 17.8-19.4 ms; ``docs/devices.md``), while a model's
  forward and backward, whose ops follow each other within microseconds, keep their
  threads spinning from one op to the next and did not slow down. (``OMP_WAIT_POLICY=passive``,
  no spinning at all, did the same for the exchange but slowed a CNN step by 10 % and a
  small MLP step by 60 %.)

The plan travels to each task as environment variables (:meth:`TaskResources.to_env`) and is
read back there (:meth:`TaskResources.from_env`); applying it to torch is
:func:`tensorfleet.worker.task_resources.apply_task_resources`. This module imports no torch,
so the launcher stays light.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tensorfleet import environment
from tensorfleet.cluster.gpu_assignment import HostGpus, assign_gpus
from tensorfleet.cluster.spec import show
from tensorfleet.cluster.thread_budget import planned_threads
from tensorfleet.errors import ClusterConfigError

#: Spin iterations of an idle OpenMP thread before it sleeps, for tasks given a thread
#: budget (libgomp's default: 300,000); why: the module's docstring, "idle threads".
OPENMP_SPIN_COUNT = 20_000


@dataclass(frozen=True)
class TaskResources:
    """What one task may use. ``None`` everywhere means "leave torch's defaults alone".

    Attributes:
        intra_op_threads: threads one op may use (``torch.set_num_threads``), >= 1.
        inter_op_threads: threads running independent ops (``torch.set_num_interop_threads``).
        visible_gpus: the physical GPU ids this task may see (``CUDA_VISIBLE_DEVICES``); an
            empty tuple hides every GPU; ``None`` leaves the variable as inherited.
        gpu_memory_fraction: cap on this process's share of each visible GPU, in (0, 1].
    """

    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    visible_gpus: tuple[int, ...] | None = None
    gpu_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        for name in ("intra_op_threads", "inter_op_threads"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ClusterConfigError(
                    f"{name} must be an integer >= 1, got {show(value)}; use None for torch's default"
                )
        if self.visible_gpus is not None:
            gpus = tuple(self.visible_gpus)
            if any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gpus):
                raise ClusterConfigError(
                    f"visible_gpus must be non-negative GPU ids, got {show(self.visible_gpus)}"
                )
            if len(set(gpus)) != len(gpus):
                raise ClusterConfigError(f"visible_gpus lists a GPU twice: {list(gpus)}")
            object.__setattr__(self, "visible_gpus", gpus)
        fraction = self.gpu_memory_fraction
        if fraction is not None:
            _check_fraction(fraction, "gpu_memory_fraction")
            object.__setattr__(self, "gpu_memory_fraction", float(fraction))

    def to_env(self) -> dict[str, str]:
        """The variables that carry this to a task (only the parts that are set; with the
        threads, OpenMP's spin count, unless this process's environment sets it: the
        module's docstring, "idle threads")."""
        env: dict[str, str] = {}
        if self.intra_op_threads is not None:
            env[environment.INTRA_OP_THREADS_VAR] = str(self.intra_op_threads)
            env[environment.OMP_NUM_THREADS_VAR] = str(self.intra_op_threads)
            env[environment.MKL_NUM_THREADS_VAR] = str(self.intra_op_threads)
            if environment.OPENMP_SPIN_COUNT_VAR not in environment.environ():
                env[environment.OPENMP_SPIN_COUNT_VAR] = str(OPENMP_SPIN_COUNT)
        if self.inter_op_threads is not None:
            env[environment.INTER_OP_THREADS_VAR] = str(self.inter_op_threads)
        if self.visible_gpus is not None:
            env[environment.CUDA_VISIBLE_DEVICES_VAR] = ",".join(map(str, self.visible_gpus))
        if self.gpu_memory_fraction is not None:
            env[environment.GPU_MEMORY_FRACTION_VAR] = repr(self.gpu_memory_fraction)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TaskResources:
        """What the launcher set for this task (nothing set: all ``None``). A malformed value
        is a :class:`ClusterConfigError` naming the variable and the value."""
        env = environment.environ() if environ is None else environ
        visible: tuple[int, ...] | None = None
        raw_visible = env.get(environment.CUDA_VISIBLE_DEVICES_VAR)
        if raw_visible is not None and not names_gpus_by_uuid(raw_visible):
            visible = parse_visible_devices(raw_visible)
        fraction: float | None = None
        raw_fraction = env.get(environment.GPU_MEMORY_FRACTION_VAR, "").strip()
        if raw_fraction:
            try:
                fraction = float(raw_fraction)
            except ValueError:
                fraction = math.nan
            _check_fraction(fraction, environment.GPU_MEMORY_FRACTION_VAR, raw_fraction)
        return cls(
            intra_op_threads=_env_count(env, environment.INTRA_OP_THREADS_VAR),
            inter_op_threads=_env_count(env, environment.INTER_OP_THREADS_VAR),
            visible_gpus=visible,
            gpu_memory_fraction=fraction,
        )


#: How CUDA names a GPU or a MIG instance by UUID in ``CUDA_VISIBLE_DEVICES``.
UUID_PREFIXES = ("GPU-", "MIG-")


def names_gpus_by_uuid(value: str) -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES=value`` names its GPUs by UUID (``GPU-...``, or
    ``MIG-...`` for MIG instances, which have no index). The launcher never writes that form;
    an inherited one is left to CUDA: :meth:`TaskResources.from_env` reads it as "not set by
    the launcher" instead of refusing it, so a task on such a host still starts."""
    return any(part.strip().startswith(UUID_PREFIXES) for part in value.split(","))


def parse_visible_devices(value: str) -> tuple[int, ...]:
    """``"0,2"`` -> ``(0, 2)``; ``""`` -> ``()``. GPU UUIDs (``GPU-...``) are refused with a
    clear error: tensorfleet hands out GPUs by index."""
    text = value.strip()
    if not text:
        return ()
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ClusterConfigError(
                f"{environment.CUDA_VISIBLE_DEVICES_VAR}={value!r}: {part!r} is not a GPU index; "
                "tensorfleet hands out GPUs by index: list them as indices such as '0,1' "
                "(nvidia-smi -L numbers them); GPUs named by UUID are passed to the tasks as "
                "they are only without --gpus-per-worker"
            )
        ids.append(int(part))
    return tuple(ids)


def plan_resources(
    num_ps: int,
    num_workers: int,
    *,
    host_cores: int | None = None,
    host_gpus: Sequence[int] = (),
    gpus_per_worker: int | None = None,
    gpu_memory_fraction: float | None = None,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
    thread_budget_enabled: bool = True,
) -> dict[str, TaskResources]:
    """Each task's resources by task name (``"ps:0"``, ``"worker:1"``), all on one host.

    ``host_cores`` defaults to the cores this process may use; ``host_gpus`` are the GPU ids
    the host offers (physical ids); ``gpus_per_worker`` None gives each worker one of them,
    round-robin (:func:`~tensorfleet.cluster.gpu_assignment.assign_gpus`). Explicit ``intra_op_threads`` / ``inter_op_threads``
    apply to every task; otherwise, with ``thread_budget_enabled``, the host's cores are
    divided as :func:`~tensorfleet.cluster.thread_budget.planned_threads` says (tasks that
    compute at the same time share, one worker and its ps take turns). Raises :class:`ClusterConfigError` when the workers would need
    more GPUs than ``host_gpus`` holds, naming both counts.
    """
    if num_ps < 0 or num_workers < 1:
        raise ClusterConfigError(
            f"need >= 0 ps tasks and >= 1 worker, got {num_ps} and {num_workers}"
        )
    if gpus_per_worker is not None and (
        isinstance(gpus_per_worker, bool)
        or not isinstance(gpus_per_worker, int)
        or gpus_per_worker < 0
    ):
        raise ClusterConfigError(
            f"gpus_per_worker must be an integer >= 0, got {show(gpus_per_worker)}"
        )
    if gpu_memory_fraction is not None:
        _check_fraction(gpu_memory_fraction, "gpu_memory_fraction")
    gpus = tuple(host_gpus)
    assignment = assign_gpus(num_workers, HostGpus(gpus, "given"), gpus_per_worker)
    if gpu_memory_fraction is not None and gpus_per_worker == 0:
        raise ClusterConfigError(
            f"gpu_memory_fraction={gpu_memory_fraction} caps GPU memory, but --gpus-per-worker 0 "
            "gives no task a GPU; drop one of the two"
        )
    if gpu_memory_fraction is not None and not gpus_per_worker and not gpus:
        raise ClusterConfigError(
            f"gpu_memory_fraction={gpu_memory_fraction} caps GPU memory, but this host has no "
            "GPU; drop --gpu-memory-fraction"
        )
    names = [f"worker:{i}" for i in range(num_workers)] + [f"ps:{i}" for i in range(num_ps)]
    if intra_op_threads is not None or not thread_budget_enabled:
        intra = [intra_op_threads] * len(names)
    else:
        threads_of = planned_threads(
            num_ps, num_workers, host_cores or environment.host_cpu_count()
        )
        intra = [threads_of[name] for name in names]
    plan: dict[str, TaskResources] = {}
    for position, name in enumerate(names):
        job, index = name.split(":")
        if assignment is None:
            visible = () if gpus_per_worker == 0 else None  # 0: no GPU for anyone
        elif job == "worker":
            visible = assignment.per_worker[int(index)]
        else:
            visible = ()
        threads = intra[position]
        plan[name] = TaskResources(
            intra_op_threads=threads,
            inter_op_threads=inter_op_threads
            if inter_op_threads is not None
            else (threads if thread_budget_enabled else None),
            visible_gpus=visible,
            gpu_memory_fraction=gpu_memory_fraction if visible != () else None,
        )
    return plan


def _env_count(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ClusterConfigError(f"{name}={raw!r} is not an integer >= 1")
    return int(raw)


def _check_fraction(value: object, where: str, raw: str | None = None) -> None:
    shown = repr(raw) if raw is not None else show(value)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= 1
    ):
        raise ClusterConfigError(
            f"{where} must be a number in (0, 1], got {shown}: the share of each GPU's memory "
            "this process may take (e.g. 0.5)"
        )
