"""``Server``: the service of one task, as in TensorFlow's ``tf.distribute.Server``.

For a ps task it starts the parameter service at once (listening on the task's address from
the cluster spec; one service per model namespace, :mod:`tensorfleet.ps.model_router`) and :meth:`Server.join` returns when training is over. For a worker task it
holds the task's identity and the cluster secret for the :class:`TrainingSession`; its
``join()`` returns at once (a worker's work is its training loop).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from tensorfleet import environment
from tensorfleet.cluster.resources import TaskResources
from tensorfleet.cluster.spec import ClusterSpec, TaskId
from tensorfleet.errors import ClusterConfigError, DeadlineExceeded, Preempted, TensorfleetError
from tensorfleet.ps.heap_settings import apply_ps_heap_settings
from tensorfleet.ps.model_router import ModelRouter
from tensorfleet.ps.service import ServiceConfig, ServiceOutcome
from tensorfleet.ps.service_settings import ServiceSettings
from tensorfleet.session.preemption import PreemptionNotice
from tensorfleet.task_memory import record_at_exit
from tensorfleet.wire.secret import load_secret
from tensorfleet.wire.service_socket import ServiceSocket
from tensorfleet.worker.task_resources import AppliedResources, apply_task_resources
from tensorfleet.worker.timeline import task_timeline

log = logging.getLogger("tensorfleet.server")

PS_JOB = "ps"
WORKER_JOB = "worker"


@dataclass(frozen=True)
class ServerConfig(ServiceSettings):
    """Settings of a task's server: a ps shard's :class:`ServiceSettings` (timeouts and
    limits, with their defaults and checks: ``idle_timeout_s``, ``end_grace_s``,
    ``liveness_timeout_s``, ``limits``) and whether to encrypt its traffic."""

    encrypt: bool | None = None
    """Encrypt traffic (AES-256-GCM under keys agreed per connection, authenticated by the
    secret: ``tensorfleet.wire.encryption``); None: from
    ``TENSORFLEET_ENCRYPT``. Every task of a cluster must agree."""
    resources: TaskResources | None = None
    """This task's thread budget and GPU memory cap, applied to torch when the server is
    created; None: what the launcher set in the environment (nothing set: torch's defaults)."""
    pipeline_stages: int | None = None
    """Stages per pipeline when the workers run pipelines across tasks (worker i is stage
    i % S of pipeline i // S; only each pipeline's stage 0 trains through the ps). None:
    ``TENSORFLEET_PIPELINE_STAGES`` (unset: 1, no pipelines). Every task must agree."""
    timeline: str | os.PathLike[str] | None = None
    """A ps task: record where its time goes (receiving each request, applying each update,
    sending each reply) and write it when the service ends, as a Chrome trace named for the
    task (``trace.json`` -> ``trace.ps-0.json``; see docs/timeline.md). None: nothing."""


class Server:
    """The server of task ``(job_name, task_index)`` of ``cluster``.

    ``secret`` defaults to ``TENSORFLEET_SECRET`` / ``TENSORFLEET_SECRET_FILE`` (the launcher
    sets one). Raises :class:`ClusterConfigError` for a task not in the cluster and
    ``OSError`` when a ps cannot listen on its address (the message says why).
    """

    def __init__(
        self,
        cluster: ClusterSpec | Mapping,
        job_name: str,
        task_index: int,
        *,
        secret: str | bytes | None = None,
        config: ServerConfig | None = None,
    ) -> None:
        self.cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
        self.task = TaskId(job_name, task_index)
        self.address = self.cluster.task_address(job_name, task_index)  # validates job and index
        self.secret = load_secret(secret)
        self.config = config or ServerConfig()
        self.encrypt = (
            self.config.encrypt
            if self.config.encrypt is not None
            else environment.encryption_requested()
        )
        self.resources: AppliedResources = apply_task_resources(self.config.resources)
        """The threads and GPUs torch uses in this task, after applying the resources."""
        self.pipeline_stages = _pipeline_stages(self.config.pipeline_stages, self.cluster)
        """Stages per pipeline across the worker tasks (1: no pipelines)."""
        self.outcome: ServiceOutcome | None = None
        record_at_exit(str(self.task))  # the launcher's end-of-run summary lists it
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._preempt = threading.Event()
        self._failure: BaseException | None = None
        if job_name == PS_JOB:
            self._start_parameter_service()
        elif job_name not in (WORKER_JOB, "chief"):
            raise ClusterConfigError(
                f"job {job_name!r} has no server role; tensorfleet runs 'ps' and 'worker' tasks"
            )

    @property
    def is_chief(self) -> bool:
        """Whether this task is the chief (worker 0, or chief 0 when the cluster has that job)."""
        return self.task == self.cluster.chief_task()

    @property
    def ps_addresses(self) -> list[str]:
        """Addresses of the ps tasks, by index."""
        if PS_JOB not in self.cluster.jobs:
            return []
        return [self.cluster.task_address(PS_JOB, i) for i in self.cluster.task_indices(PS_JOB)]

    @property
    def worker_tasks(self) -> list[TaskId]:
        """Every task that trains through the ps or the all-reduce: the chief job's (if any)
        and the workers; with pipelines across tasks, each pipeline's stage 0 only."""
        tasks = self.cluster.training_tasks()
        if self.pipeline_stages > 1:
            return [t for t in tasks if t.index % self.pipeline_stages == 0]
        return tasks

    def _start_parameter_service(self) -> None:
        started = threading.Event()
        heap = apply_ps_heap_settings()  # before the first update's temporaries
        if heap:
            log.debug("%s: malloc settings for the ps: %s", self.task, heap)
        config = ServiceConfig.for_shard(
            self.task.index, [str(t) for t in self.worker_tasks], self.config
        )

        timeline, timeline_path = task_timeline(self.config.timeline, str(self.task))

        def run() -> None:
            try:
                socket = ServiceSocket(
                    self.address, self.secret, self.config.limits, encrypt=self.encrypt
                )
            except BaseException as exc:  # reported to the constructor below
                self._failure = exc
                started.set()
                return
            started.set()
            try:
                self.outcome = ModelRouter(socket, config, timeline).serve(
                    self._stop, self._preempt
                )
                log.info(
                    "%s: parameter service ended (%s) %s",
                    self.task,
                    self.outcome.reason,
                    self.outcome.where(),
                )
            except BaseException as exc:  # surfaced by join()
                self._failure = exc
            finally:
                socket.close(linger_s=2.0)
                if timeline_path is not None:
                    try:
                        timeline.write(timeline_path)
                    except TensorfleetError as exc:  # the training itself went well
                        log.error("%s: %s", self.task, exc)

        self._thread = threading.Thread(target=run, name=f"tensorfleet-{self.task}", daemon=True)
        self._thread.start()
        if not started.wait(30.0):
            raise DeadlineExceeded(f"{self.task}: the parameter service did not start within 30 s")
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def join(self, timeout_s: float | None = None) -> ServiceOutcome | None:
        """Wait until this task's service has ended: for a ps, until training is over (every
        worker finished, or the chief's end plus a grace period, or the idle timeout). Returns
        at once for a worker. Raises :class:`DeadlineExceeded` after ``timeout_s``.

        A SIGTERM meanwhile (called from the main thread, as a ps script does) is a
        preemption: the ps asks the chief for a checkpoint, waits for it up to
        ``preempt_grace_s``, then this raises :class:`~tensorfleet.errors.Preempted`, which
        ends the process with exit status 143: a launcher or cluster manager that restarts
        tasks restarts it; one stopping the cluster (or a user's ``kill``) does not, and the
        ps cannot tell which sent the signal (:mod:`tensorfleet.ps.preemption_drain`)."""
        if self._thread is None:
            return None
        with PreemptionNotice(self._preempt.set):
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise DeadlineExceeded(f"{self.task}: still serving after {timeout_s} s")
        if self._failure is not None:
            raise TensorfleetError(
                f"{self.task}: the parameter service failed: {self._failure!r}"
            ) from self._failure
        if self.outcome is not None and self.outcome.reason == "preempted":
            raise Preempted(
                f"{self.task}: SIGTERM at global step {self.outcome.global_step}; exiting with "
                "status 143, which a launcher or cluster manager that restarts tasks treats as "
                "a preemption"
            )
        return self.outcome

    def stop(self) -> None:
        """Ask the service to end now (used by tests)."""
        self._stop.set()

    def preempt(self) -> None:
        """A preemption notice (what SIGTERM does during :meth:`join`): ask the chief for a
        checkpoint, then end with the outcome ``preempted``."""
        self._preempt.set()


def _pipeline_stages(configured: int | None, cluster: ClusterSpec) -> int:
    """The stages per pipeline: ``configured``, else the environment's, else 1; the workers
    must form whole pipelines."""
    raw: object = configured
    if raw is None:
        raw = environment.pipeline_stages_requested()
        if raw is None:
            return 1
    where = (
        f"{environment.PIPELINE_STAGES_VAR}={raw!r}"
        if configured is None
        else f"pipeline_stages={raw!r}"
    )
    try:
        stages = int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        stages = 0
    if isinstance(raw, bool) or stages < 1 or (isinstance(raw, float) and raw != stages):
        raise ClusterConfigError(f"{where} is not an integer >= 1 (stages per pipeline)")
    if stages > 1:
        workers = cluster.num_tasks(WORKER_JOB) if WORKER_JOB in cluster.jobs else 0
        if "chief" in cluster.jobs or workers % stages:
            raise ClusterConfigError(
                f"{where}: the {workers} worker task(s) do not form whole pipelines of {stages} "
                "stages (and pipelines need no 'chief' job): use a number of workers that is a "
                f"multiple of {stages}"
            )
    return stages
