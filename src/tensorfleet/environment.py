"""The one module that reads process environment variables.

Every other module receives an ``environ`` mapping (defaulting to :func:`environ`) so that
tests can pass a plain dict and nothing reads ``os.environ`` behind the caller's back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Cluster secret for message authentication (hex or any string; at least 16 characters).
SECRET_VAR = "TENSORFLEET_SECRET"
#: Path to a file holding the cluster secret (alternative to ``TENSORFLEET_SECRET``).
SECRET_FILE_VAR = "TENSORFLEET_SECRET_FILE"
#: TensorFlow's cluster/task description, as Kubeflow's TFJob and our launcher set it.
TF_CONFIG_VAR = "TF_CONFIG"
#: Set by the launcher: how many ps tasks a Slurm allocation reserves (first ranks).
SLURM_NUM_PS_VAR = "TENSORFLEET_SLURM_NUM_PS"
#: Set by the script ``tensorfleet slurm`` writes: how many worker tasks the cluster shape has,
#: so that a Slurm step with fewer (or more) tasks than ps + workers fails at once.
SLURM_NUM_WORKERS_VAR = "TENSORFLEET_SLURM_NUM_WORKERS"
#: Port of the first task on each node of a Slurm job; the task of local rank r listens on
#: this port + r (default 2222).
SLURM_BASE_PORT_VAR = "TENSORFLEET_SLURM_BASE_PORT"
#: Set by the launcher so children know they run under it (for the progress view).
LAUNCHER_VAR = "TENSORFLEET_LAUNCHER"
#: Root of the dataset cache (``<root>/<dataset>``); default ``~/.cache/tensorfleet/datasets``.
DATA_DIR_VAR = "TENSORFLEET_DATA_DIR"
#: Set by the launcher: a directory where its tasks leave facts it reads when they end
#: (tensorfleet.task_markers).
TASK_MARKERS_VAR = "TENSORFLEET_TASK_MARKERS"
#: The user's home directory, under which the default dataset cache lives.
HOME_VAR = "HOME"
#: Set by the launcher in a warm spare worker's environment: the named pipe from which
#: ``resolve_task()`` reads the identity the spare takes over (tensorfleet.cluster.warm_spare).
SPARE_PIPE_VAR = "TENSORFLEET_SPARE_PIPE"
#: Seconds a warm spare waits for an identity before it exits (set by the launcher).
SPARE_WAIT_VAR = "TENSORFLEET_SPARE_WAIT_S"
#: The launcher's process id, in a warm spare's environment: the spare exits once it is gone.
SPARE_LAUNCHER_VAR = "TENSORFLEET_SPARE_LAUNCHER_PID"


#: "0" to send every payload through ZeroMQ, also between tasks on one host (the default
#: uses shared memory there: tensorfleet.wire.shared_memory), and to keep all-reduce workers
#: on one host on gloo (tensorfleet.worker.host_allreduce).
SHARED_MEMORY_VAR = "TENSORFLEET_SHARED_MEMORY"

#: "0" keeps every payload on the ZeroMQ socket; unset or "1" (the default): payloads of 2 MiB
#: and more between tasks that do not share memory travel over a plain TCP stream beside it
#: (tensorfleet.wire.payload_stream), both ways. Either end with "0" keeps every payload on
#: ZeroMQ.
PAYLOAD_STREAM_VAR = "TENSORFLEET_PAYLOAD_STREAM"

#: The TCP port a service's payload streams listen on (unset or "0": a free port, chosen at
#: each start and named to the clients in the ``hello`` answer). Set it where a firewall or a
#: Kubernetes network policy must name the port (``tensorfleet k8s render`` sets it in the ps
#: pods; tensorfleet.wire.service_streams).
PAYLOAD_STREAM_PORT_VAR = "TENSORFLEET_PAYLOAD_STREAM_PORT"

#: "1" to encrypt all traffic between tasks (AES-256-GCM under per-connection keys; every
#: task must agree).
ENCRYPT_VAR = "TENSORFLEET_ENCRYPT"


def encryption_requested(environ_: Mapping[str, str] | None = None) -> bool:
    """Whether ``TENSORFLEET_ENCRYPT`` asks for encrypted traffic."""
    value = (environ() if environ_ is None else environ_).get(ENCRYPT_VAR, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


#: A directory: the ps tasks log every update they apply there, so that a ps killed with
#: SIGKILL is restored to its last acknowledged push (``tensorfleet server --update-log``).
#: ``tensorfleet launch`` sets it for its tasks (``--ps-update-log``: by default a directory
#: of the launch in ``/dev/shm``); ``off`` (or ``0``, ``no``, ``false``, ``none``): no log; in
#: the launcher's own environment, ``auto`` is its default.
PS_UPDATE_LOG_VAR = "TENSORFLEET_PS_UPDATE_LOG"
#: The values of ``TENSORFLEET_PS_UPDATE_LOG`` (and ``--ps-update-log``) that mean no log.
UPDATE_LOG_OFF_WORDS = ("off", "0", "no", "false", "none")


def ps_update_log_choice(environ_: Mapping[str, str] | None = None) -> str | None:
    """``TENSORFLEET_PS_UPDATE_LOG`` as set (stripped; None: unset or empty): a directory,
    ``auto`` or an off word (the launcher's choices)."""
    value = (environ() if environ_ is None else environ_).get(PS_UPDATE_LOG_VAR, "").strip()
    return value or None


def update_log_off(value: str) -> bool:
    """Whether a ``--ps-update-log`` / ``--update-log`` / ``TENSORFLEET_PS_UPDATE_LOG`` value
    is one of :data:`UPDATE_LOG_OFF_WORDS` (no log)."""
    return value.strip().lower() in UPDATE_LOG_OFF_WORDS


#: A size (``512MiB``, ``2G``, bytes; ``0``: never): the ps update log writes a snapshot of the
#: shard's state after that many bytes of records (unset: four times the state, at least
#: 64 MiB; ``tensorfleet server --update-log-snapshot``; ``tensorfleet launch
#: --ps-update-log-snapshot`` sets it).
PS_UPDATE_LOG_SNAPSHOT_VAR = "TENSORFLEET_PS_UPDATE_LOG_SNAPSHOT"


def ps_update_log_snapshot(environ_: Mapping[str, str] | None = None) -> str | None:
    """The size ``TENSORFLEET_PS_UPDATE_LOG_SNAPSHOT`` gives (None: unset or empty)."""
    value = (environ() if environ_ is None else environ_).get(PS_UPDATE_LOG_SNAPSHOT_VAR, "")
    return value.strip() or None


#: A size (``8GB``, ``512MiB``, bytes): the most memory a ps's embedding tables may take
#: (``tensorfleet server --max-memory`` takes its default from it; ``tensorfleet launch
#: --ps-max-memory`` sets it).
PS_MAX_MEMORY_VAR = "TENSORFLEET_PS_MAX_MEMORY"


def ps_max_memory(environ_: Mapping[str, str] | None = None) -> str | None:
    """The size ``TENSORFLEET_PS_MAX_MEMORY`` gives (None: unset or empty)."""
    value = (environ() if environ_ is None else environ_).get(PS_MAX_MEMORY_VAR, "")
    return value.strip() or None


#: ``tuned`` (or unset): a ps process keeps its update's temporaries on the heap
#: (``tensorfleet.ps.heap_settings``); ``default``: glibc's own malloc settings.
PS_HEAP_VAR = "TENSORFLEET_PS_HEAP"


#: Set to "1" by a launcher in the environment of a task it restarts after the task's
#: previous process died (it saw it exit): the task's hello then asks the ps to let it take
#: over its identity at once (``"takeover": true``) instead of after the liveness timeout.
PREDECESSOR_DEAD_VAR = "TENSORFLEET_PREDECESSOR_DEAD"


def predecessor_dead(environ_: Mapping[str, str] | None = None) -> bool:
    """Whether ``TENSORFLEET_PREDECESSOR_DEAD`` says this task's previous process is dead."""
    value = (environ() if environ_ is None else environ_).get(PREDECESSOR_DEAD_VAR, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def environ() -> Mapping[str, str]:
    """The current process environment, read-only by convention."""
    return os.environ


def adopt(variables: Mapping[str, str], drop: tuple[str, ...] = ()) -> None:
    """Set ``variables`` in this process's environment and remove ``drop``: the one place a
    process changes its own environment (a warm spare taking over a task's identity takes the
    variables that task was started with, so that everything read later sees them)."""
    for name in drop:
        os.environ.pop(name, None)
    os.environ.update(variables)


#: Per-task resources the launcher sets (read back by ``TaskResources.from_env``).
#: Intra-op threads of torch in this task (``torch.set_num_threads``).
INTRA_OP_THREADS_VAR = "TENSORFLEET_INTRA_OP_THREADS"
#: Inter-op threads of torch in this task (``torch.set_num_interop_threads``).
INTER_OP_THREADS_VAR = "TENSORFLEET_INTER_OP_THREADS"
#: Cap on this task's share of each visible GPU's memory, in (0, 1].
GPU_MEMORY_FRACTION_VAR = "TENSORFLEET_GPU_MEMORY_FRACTION"
#: The GPUs this process may see (CUDA's own variable; the launcher gives disjoint sets).
CUDA_VISIBLE_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"
#: OpenMP's and MKL's thread counts: set with the intra-op budget so that native libraries
#: started before tensorfleet applies its budget do not spawn one thread per core either.
OMP_NUM_THREADS_VAR = "OMP_NUM_THREADS"
MKL_NUM_THREADS_VAR = "MKL_NUM_THREADS"
#: How long an idle OpenMP thread of torch (GNU libgomp, which torch's Linux wheels use)
#: spins before it sleeps, in spin iterations.
OPENMP_SPIN_COUNT_VAR = "GOMP_SPINCOUNT"


def host_cpu_count() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


#: Stages per pipeline when the workers run pipelines across tasks (the launcher's
#: ``--pipeline-stages``): worker i is stage i % S of pipeline i // S. Unset: no pipelines.
PIPELINE_STAGES_VAR = "TENSORFLEET_PIPELINE_STAGES"


def pipeline_stages_requested(environ_: Mapping[str, str] | None = None) -> str | None:
    """The raw ``TENSORFLEET_PIPELINE_STAGES`` (None when unset or empty)."""
    value = (environ() if environ_ is None else environ_).get(PIPELINE_STAGES_VAR, "").strip()
    return value or None
