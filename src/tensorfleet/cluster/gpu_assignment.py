"""Which GPUs a host has, and which of them each worker the launcher starts gets.

Several workers started on one GPU is the first thing a user with one GPU tries; with every
worker seeing every GPU, each one computes on ``/gpu:0`` (the same card) and NCCL refuses the
group ("Duplicate GPU detected"). So by default ``tensorfleet launch`` gives each worker its
own GPU: worker ``i`` sees the host's GPU ``gpus[i % n]`` as its only one (its
``CUDA_VISIBLE_DEVICES``), so ``/gpu:0`` in every worker is a different card while there are
enough; with more workers than GPUs they share, round-robin, and the launcher says so once.
ps tasks see no GPU (their variables live in host memory). ``--gpus-per-worker N`` gives each
worker N GPUs of its own instead (refused when the host has fewer than N x workers), and
``--gpus-per-worker 0`` hides every GPU from every task (``CUDA_VISIBLE_DEVICES=""``: all
compute on the CPU).

The host's GPUs are found without torch and without initialising CUDA in the launcher
(:func:`host_gpus`): its own ``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi -L``, else
the NVIDIA driver's ``/proc/driver/nvidia/gpus`` entries. :func:`assign_gpus` is a pure
function of the counts, tested for 1-16 workers on 1, 2 and 8 GPUs.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tensorfleet import environment
from tensorfleet.errors import ClusterConfigError

#: Where the NVIDIA driver lists one directory per GPU (Linux).
NVIDIA_PROC_DIR = Path("/proc/driver/nvidia/gpus")
#: The longest the launcher waits for ``nvidia-smi -L``.
NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class HostGpus:
    """The GPU ids the launcher may hand out and where they were found (for its message)."""

    ids: tuple[int, ...]
    source: str


@dataclass(frozen=True)
class GpuAssignment:
    """Each worker's GPUs (physical ids, by worker index) and how they were chosen.

    ``per_worker[i]`` becomes worker ``i``'s ``CUDA_VISIBLE_DEVICES``; ps tasks get none.
    """

    per_worker: tuple[tuple[int, ...], ...]
    host: HostGpus
    default: bool

    @property
    def shared(self) -> bool:
        """Whether some GPU is given to more than one worker."""
        given = [gpu for gpus in self.per_worker for gpu in gpus]
        return len(set(given)) != len(given)

    def workers_by_gpu(self) -> dict[int, list[int]]:
        """The worker indices each handed-out GPU serves, by GPU id (in the host's order)."""
        by_gpu: dict[int, list[int]] = {}
        for gpu in self.host.ids:
            users = [i for i, gpus in enumerate(self.per_worker) if gpu in gpus]
            if users:
                by_gpu[gpu] = users
        return by_gpu

    def describe(self) -> str:
        """The launcher's first line: who has which GPU; a second line when workers share one."""
        how = (
            "one per worker, round-robin (the default)"
            if self.default
            else f"{len(self.per_worker[0])} per worker (--gpus-per-worker)"
        )
        groups = "; ".join(
            f"GPU {gpu}: worker {','.join(map(str, users))}"
            for gpu, users in self.workers_by_gpu().items()
        )
        line = (
            f"GPUs: {how}, of the {len(self.host.ids)} this host has ({self.host.source}): "
            f"{groups}. Each worker sees its GPU(s) from /gpu:0 on; ps tasks see none"
        )
        unused = len(self.host.ids) - len(self.workers_by_gpu())
        if unused and self.default:
            line += (
                f"; {unused} GPU(s) left unused (--gpus-per-worker N gives each worker N, e.g. "
                "for replica_devices or stage_devices on several GPUs)"
            )
        if self.shared:
            line += (
                f".\n{len(self.per_worker)} workers share {len(self.workers_by_gpu())} GPU(s): "
                "workers on one GPU split its compute and memory (mode 'allreduce' averages "
                "their gradients through shared memory, since NCCL refuses two on one GPU). "
                "--gpus-per-worker 0 keeps every task on the CPU"
            )
        return line


def assign_gpus(
    num_workers: int, host: HostGpus, gpus_per_worker: int | None
) -> GpuAssignment | None:
    """Each worker's GPUs. ``gpus_per_worker``: None is the default (one each, round-robin
    over ``host.ids``; None when the host has no GPU), 0 is none (None: the caller hides
    every GPU), N > 0 gives disjoint blocks of N (a :class:`ClusterConfigError` naming both
    counts when the host has fewer than N x workers)."""
    if num_workers < 1:
        raise ClusterConfigError(f"need >= 1 worker to give GPUs to, got {num_workers}")
    if gpus_per_worker is not None and (
        isinstance(gpus_per_worker, bool)
        or not isinstance(gpus_per_worker, int)
        or gpus_per_worker < 0
    ):
        raise ClusterConfigError(
            f"gpus_per_worker must be an integer >= 0, got {gpus_per_worker!r}"
        )
    gpus = host.ids
    if gpus_per_worker == 0 or (gpus_per_worker is None and not gpus):
        return None
    if gpus_per_worker is None:
        per_worker = tuple((gpus[i % len(gpus)],) for i in range(num_workers))
        return GpuAssignment(per_worker, host, default=True)
    needed = gpus_per_worker * num_workers
    if needed > len(gpus):
        inherited = host.source.startswith(f"{environment.CUDA_VISIBLE_DEVICES_VAR}=")
        if gpus:
            described = "GPU ids " + ",".join(map(str, gpus))
            described += f", from {host.source}" if inherited else ""
        elif inherited:
            described = f"none: {environment.CUDA_VISIBLE_DEVICES_VAR}='' hides every GPU"
        else:
            described = "no GPU torch can use"
        also = (
            f", unset {environment.CUDA_VISIBLE_DEVICES_VAR} or list more GPUs in it"
            if inherited
            else ""
        )
        raise ClusterConfigError(
            f"{gpus_per_worker} GPU(s) per worker x {num_workers} worker(s) = {needed} GPU(s), but "
            f"this host has {len(gpus)} ({described}). Lower --gpus-per-worker or "
            f"--workers{also}, or run on a host with more GPUs; nothing was started"
        )
    per_worker = tuple(
        tuple(gpus[i * gpus_per_worker : (i + 1) * gpus_per_worker]) for i in range(num_workers)
    )
    return GpuAssignment(per_worker, host, default=False)


#: The launcher's first line with ``--gpus-per-worker 0``.
NO_GPU_LINE = (
    "GPUs: none (--gpus-per-worker 0): every task's CUDA_VISIBLE_DEVICES is empty, so every "
    "task computes on the CPU"
)


def host_gpus(
    environ: Mapping[str, str] | None = None,
    *,
    nvidia_smi: Callable[[], list[str] | None] | None = None,
    proc_dir: Path = NVIDIA_PROC_DIR,
) -> HostGpus:
    """The GPUs this host offers the launcher, found without initialising CUDA.

    ``CUDA_VISIBLE_DEVICES`` when set (``""``: none; GPU UUIDs are refused by
    :func:`~tensorfleet.cluster.resources.parse_visible_devices` with the fix); else the
    ``GPU i:`` lines of ``nvidia-smi -L``; else one per entry of the NVIDIA driver's
    ``/proc/driver/nvidia/gpus``; else none. ``nvidia_smi`` (tests) returns the lines of
    ``nvidia-smi -L`` or None when it is not there.
    """
    from tensorfleet.cluster.resources import parse_visible_devices  # resources imports us

    env = environment.environ() if environ is None else environ
    inherited = env.get(environment.CUDA_VISIBLE_DEVICES_VAR)
    if inherited is not None:
        return HostGpus(
            parse_visible_devices(inherited), f"{environment.CUDA_VISIBLE_DEVICES_VAR}={inherited}"
        )
    lines = (nvidia_smi or _nvidia_smi_lines)()
    if lines is not None:
        count = sum(1 for line in lines if line.startswith("GPU "))
        return HostGpus(tuple(range(count)), "nvidia-smi -L")
    try:
        entries = [p for p in proc_dir.iterdir() if p.is_dir()]
    except OSError:
        entries = []
    if entries:
        return HostGpus(tuple(range(len(entries))), str(proc_dir))
    return HostGpus((), "no NVIDIA driver found")


def _nvidia_smi_lines() -> list[str] | None:
    """``nvidia-smi -L``'s lines, or None when the tool is absent or fails (then the driver's
    /proc entries are looked at instead)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        done = subprocess.run(
            [tool, "-L"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.splitlines()
