"""The launcher's per-task resource flags and the environment they give each task.

``tensorfleet launch`` divides the host among the tasks it starts (see
:mod:`tensorfleet.cluster.resources`): ``--intra-op-threads`` / ``--inter-op-threads``
override the thread budget, ``--no-thread-budget`` leaves torch's defaults (every task uses
every core); on a host with GPUs each worker gets one of them by default (round-robin, see
:mod:`tensorfleet.cluster.gpu_assignment`), ``--gpus-per-worker N`` gives each worker N GPUs
of its own and ``--gpus-per-worker 0`` none (every task on the CPU),
``--gpu-memory-fraction F`` caps each task's share of its GPUs' memory. A request the host
cannot meet is refused before any task starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from tensorfleet import environment
from tensorfleet.cluster.gpu_assignment import NO_GPU_LINE, HostGpus, assign_gpus, host_gpus
from tensorfleet.cluster.resources import plan_resources
from tensorfleet.errors import ClusterConfigError


def add_resource_flags(parser: argparse.ArgumentParser) -> None:
    """Add the resource flags to the ``launch`` sub-command."""
    group = parser.add_argument_group("per-task resources")
    group.add_argument(
        "--intra-op-threads",
        type=int,
        metavar="N",
        help="torch intra-op threads of every task (default: the host's cores divided among "
        "the tasks, at least 1, so that co-located tasks do not oversubscribe the cores)",
    )
    group.add_argument(
        "--inter-op-threads",
        type=int,
        metavar="N",
        help="torch inter-op threads of every task (default: the same budget as intra-op)",
    )
    group.add_argument(
        "--no-thread-budget",
        action="store_true",
        help="leave torch's thread defaults alone in every task (each uses every core)",
    )
    group.add_argument(
        "--gpus-per-worker",
        type=int,
        default=None,
        metavar="N",
        help="give each worker N GPUs of its own (disjoint CUDA_VISIBLE_DEVICES); ps tasks get "
        "none. Refused before anything starts if the host has fewer than N x workers. 0: no "
        "task sees a GPU (all compute on the CPU). Default: on a host with GPUs, one GPU per "
        "worker, round-robin, shared when there are more workers than GPUs",
    )
    group.add_argument(
        "--gpu-memory-fraction",
        type=float,
        metavar="F",
        help="cap each task's share of each of its GPUs' memory to F in (0, 1] "
        "(torch.cuda.set_per_process_memory_fraction; default: grow on demand)",
    )


def add_pipeline_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--pipeline-stages`` to the ``launch`` sub-command."""
    parser.add_argument(
        "--pipeline-stages",
        type=int,
        default=1,
        metavar="S",
        help="run the workers as pipelines of S stages across tasks: worker i is stage i %% S of "
        "pipeline i // S (--workers must be a multiple of S); stage 0 trains, the others "
        "serve their stage (sets TENSORFLEET_PIPELINE_STAGES; default: 1, no pipelines)",
    )


def pipeline_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variable every task gets for ``--pipeline-stages`` (refused unless the workers
    form whole pipelines)."""
    stages = getattr(args, "pipeline_stages", 1)
    if stages < 1:
        raise ClusterConfigError(f"--pipeline-stages must be >= 1, got {stages}")
    if stages == 1:
        return {}
    if args.workers % stages:
        raise ClusterConfigError(
            f"--workers {args.workers} do not form whole pipelines of --pipeline-stages {stages}: "
            f"use a multiple of {stages} workers ({stages} per pipeline)"
        )
    return {environment.PIPELINE_STAGES_VAR: str(stages)}


@dataclass(frozen=True)
class LaunchResources:
    """Each task's resource variables by task name, and the line the launcher prints first
    about the GPUs (None when it gives out none)."""

    envs: dict[str, dict[str, str]]
    gpu_line: str | None = None


def task_environments(
    args: argparse.Namespace, num_ps: int, num_workers: int, *, local: bool = True
) -> dict[str, dict[str, str]]:
    """Each task's resource variables by task name (:func:`launch_resources`' ``envs``)."""
    return launch_resources(args, num_ps, num_workers, local=local).envs


def launch_resources(
    args: argparse.Namespace,
    num_ps: int,
    num_workers: int,
    *,
    local: bool = True,
    find_host_gpus: Callable[[], HostGpus] | None = None,
) -> LaunchResources:
    """Each task's resource variables by task name, from the parsed flags, and the GPU line
    (:meth:`~tensorfleet.cluster.gpu_assignment.GpuAssignment.describe`). Raises
    :class:`~tensorfleet.errors.ClusterConfigError` for a request the host cannot meet.
    ``local``: every task runs on this host; otherwise (the Ray backend) the tasks' hosts are
    unknown here, so only explicit thread counts and the pipelines apply, and GPUs are the
    backend's to give (``--ray-gpus-per-task``). ``find_host_gpus`` (tests) replaces
    :func:`~tensorfleet.cluster.gpu_assignment.host_gpus`."""
    if num_ps < 0 or num_workers < 1:
        return LaunchResources({})  # the supervisor refuses these counts with its own message
    pipelines = pipeline_environment(args)
    if not local:
        if args.gpus_per_worker or args.gpu_memory_fraction is not None:
            raise ClusterConfigError(
                "--gpus-per-worker and --gpu-memory-fraction plan the GPUs of this host; with "
                "the Ray backend the tasks run elsewhere: use --ray-gpus-per-task"
            )
        threads = {
            name: value
            for name, value in (
                (environment.INTRA_OP_THREADS_VAR, args.intra_op_threads),
                (environment.INTER_OP_THREADS_VAR, args.inter_op_threads),
            )
            if value is not None
        }
        names = [f"ps:{i}" for i in range(num_ps)] + [f"worker:{i}" for i in range(num_workers)]
        return LaunchResources(
            {name: {**{k: str(v) for k, v in threads.items()}, **pipelines} for name in names}
        )
    host = HostGpus((), "not looked up: --gpus-per-worker 0")
    if args.gpus_per_worker != 0 or args.gpu_memory_fraction is not None:
        explicit = bool(args.gpus_per_worker) or args.gpu_memory_fraction is not None
        host = find_host_gpus() if find_host_gpus is not None else _host_gpus(explicit)
    # First: its refusal of too few GPUs names where the count came from.
    assignment = assign_gpus(num_workers, host, args.gpus_per_worker)
    plan = plan_resources(
        num_ps,
        num_workers,
        host_gpus=host.ids,
        gpus_per_worker=args.gpus_per_worker,
        gpu_memory_fraction=args.gpu_memory_fraction,
        intra_op_threads=args.intra_op_threads,
        inter_op_threads=args.inter_op_threads,
        thread_budget_enabled=not args.no_thread_budget,
    )
    return LaunchResources(
        {name: {**resources.to_env(), **pipelines} for name, resources in plan.items()},
        NO_GPU_LINE
        if args.gpus_per_worker == 0
        else (None if assignment is None else assignment.describe()),
    )


def _host_gpus(explicit: bool) -> HostGpus:
    """The GPUs the launcher may hand out (:func:`~tensorfleet.cluster.gpu_assignment.host_gpus`:
    no torch, no CUDA initialised). When that finds none and GPUs were asked for ``explicit``ly,
    torch is asked too (a driver without nvidia-smi or /proc entries, e.g. ROCm). By default
    an inherited CUDA_VISIBLE_DEVICES of GPU UUIDs is left to the tasks as it is."""
    try:
        found = host_gpus()
    except ClusterConfigError:
        if explicit:
            raise
        return HostGpus((), "CUDA_VISIBLE_DEVICES names GPUs by UUID: left as inherited")
    if not explicit or found.ids or found.source.startswith(environment.CUDA_VISIBLE_DEVICES_VAR):
        return found
    from tensorfleet.worker.device import cuda_device_count_here

    count = cuda_device_count_here()
    return HostGpus(tuple(range(count)), "torch.cuda.device_count()") if count else found
