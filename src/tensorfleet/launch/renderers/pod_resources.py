"""What one task's pod asks Kubernetes for, and the torch threads that follow from it.

``Resources`` renders a container's ``resources`` field (CPU requested, memory requested and
limited, GPUs) and, from the CPU it requests, the threads its task gives torch
(:meth:`Resources.thread_env`). Why the threads: a container sees every core of its node
(a CPU request is a share of time, not a set of cores), and torch sizes its thread pool by
the cores it sees; a task on a 64-core node with 2 CPUs requested would run 64 OpenMP threads
in its 2 CPUs' time, and the built-in ps, started as ``tensorfleet server``, uses 1 thread
whatever it requested (its ``--threads`` default is made for a host shared with workers).
The launcher divides a host's cores among its tasks the same way
(:mod:`tensorfleet.cluster.resources`); on Kubernetes the scheduler already divided them, and
the request is the task's share. The alternative, a CPU *limit* with threads from the cgroup
quota, throttles the training loop when it bursts (CFS quota) and is not rendered.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from tensorfleet import environment
from tensorfleet.cluster.resources import OPENMP_SPIN_COUNT, TaskResources
from tensorfleet.cluster.spec import show
from tensorfleet.errors import ClusterConfigError

_QUANTITY_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_SCALE = {
    None: 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50, "Ei": 2.0**60,
}  # fmt: skip


@dataclass(frozen=True)
class Resources:
    """What one task's container asks for: ``cpu`` (``"2"``, ``"500m"``) and ``memory``
    (``"4Gi"``) as Kubernetes quantities, ``None`` to leave out; ``gpus`` (``nvidia.com/gpu``).

    CPU is a request only (a CPU limit throttles the training loop); memory is requested and
    limited to the same amount, so the scheduler's promise is the kernel's limit.

    ``job`` (``"ps"``, ``"worker"``; not part of the value) names the command-line options
    in the errors: ``--ps-cpu 'two' is not a Kubernetes quantity``.
    """

    cpu: str | None = None
    memory: str | None = None
    gpus: int = 0
    job: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("cpu", "memory"):
            value = getattr(self, name)
            if value is not None and not _QUANTITY_RE.fullmatch(value):
                examples = "'2' or '500m'" if name == "cpu" else "'4Gi' or '512Mi'"
                raise ClusterConfigError(
                    f"{self._named(name)} {show(value)} is not a Kubernetes quantity: write "
                    f"e.g. {examples}"
                )
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
            raise ClusterConfigError(
                f"{self._named('gpus')} must be a non-negative integer, got {show(self.gpus)}"
            )

    def _named(self, name: str) -> str:
        """``--ps-cpu`` for ``cpu`` of a ps's resources; the bare name without a job."""
        return name if self.job is None else f"--{self.job}-{name}"

    def as_manifest(self) -> dict[str, dict[str, Any]]:
        """The container's ``resources`` field."""
        requests: dict[str, Any] = {}
        limits: dict[str, Any] = {}
        if self.cpu is not None:
            requests["cpu"] = self.cpu
        if self.memory is not None:
            requests["memory"] = limits["memory"] = self.memory
        if self.gpus:
            limits["nvidia.com/gpu"] = self.gpus
        return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}

    def threads(self) -> int | None:
        """The torch threads of a task with this CPU request: the whole CPUs requested, at
        least 1 (``"500m"`` -> 1, ``"2500m"`` -> 2, ``"4"`` -> 4); ``None`` without a request."""
        if self.cpu is None:
            return None
        match = _QUANTITY_RE.fullmatch(self.cpu)
        assert match is not None  # checked in __post_init__
        return max(1, math.floor(float(match.group(1)) * _SCALE[match.group(2)] + 1e-9))

    def thread_env(self) -> dict[str, str]:
        """The environment that gives the task :meth:`threads` torch threads, as the launcher
        gives its tasks theirs (``TENSORFLEET_INTRA_OP_THREADS``, which the built-in ps and
        ``tensorfleet.apply_task_resources`` apply, with ``OMP_NUM_THREADS``,
        ``MKL_NUM_THREADS`` and OpenMP's spin count); empty without a CPU request."""
        threads = self.threads()
        if threads is None:
            return {}
        env = TaskResources(intra_op_threads=threads).to_env()
        env[environment.OPENMP_SPIN_COUNT_VAR] = str(OPENMP_SPIN_COUNT)  # not the renderer's
        return env
