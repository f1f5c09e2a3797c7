"""A whole tensorfleet cluster as processes on this machine, started and supervised together.

:class:`LocalCluster` is a :class:`~tensorfleet.launch.supervisor.ClusterSupervisor` with the
local backend (:mod:`tensorfleet.launch.backends.local`): every task a child process of this
one, listening on a free loopback port. It is what ``tensorfleet launch`` runs by default,
and what tests and benchmarks use from Python::

    with LocalCluster(1, 3, ["python", "train.py"]) as cluster:
        status = cluster.wait()

The supervision rules (restarts, failure reports, grace periods, no process left behind)
are those of :mod:`tensorfleet.launch.supervisor`; the restart policy is
:mod:`tensorfleet.launch.restart_policy`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from tensorfleet.launch.backends.local import LocalBackend
from tensorfleet.launch.output import Output
from tensorfleet.launch.ports import LOOPBACK
from tensorfleet.launch.restart_policy import RestartPolicy, describe_returncode, exit_status
from tensorfleet.launch.stopped_ps import AUTO
from tensorfleet.launch.supervisor import (
    DEFAULT_GRACE_PERIOD,
    DEFAULT_HISTORY,
    DEFAULT_KILL_TIMEOUT,
    ClusterSupervisor,
    default_ps_command,
)
from tensorfleet.launch.task import Task
from tensorfleet.launch.warm_spares import DEFAULT_SPARE_WAIT_S

__all__ = [
    "DEFAULT_GRACE_PERIOD",
    "DEFAULT_HISTORY",
    "DEFAULT_KILL_TIMEOUT",
    "LocalCluster",
    "Task",
    "default_ps_command",
    "describe_returncode",
    "exit_status",
]


class LocalCluster(ClusterSupervisor):
    """Start ``num_ps`` ps tasks and ``num_workers`` worker tasks on this machine, supervise them.

    The arguments are those of :class:`~tensorfleet.launch.supervisor.ClusterSupervisor`
    (without ``backend``), plus ``host``: the address every task listens on (loopback), and
    ``fork_tasks``: whether tasks are forked from the run's task fork server (None, the default:
    unless ``TENSORFLEET_TASK_FORKS=0``; :mod:`tensorfleet.launch.backends.task_forks`).
    """

    def __init__(
        self,
        num_ps: int,
        num_workers: int,
        worker_command: Sequence[str],
        *,
        ps_command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        task_env: Mapping[str, Mapping[str, str]] | None = None,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        kill_timeout: float = DEFAULT_KILL_TIMEOUT,
        output: Output | None = None,
        host: str = LOOPBACK,
        cwd: str | os.PathLike[str] | None = None,
        secret: str | None = None,
        history: int = DEFAULT_HISTORY,
        restart_policy: RestartPolicy | None = None,
        max_restarts: int | None = None,
        spares: int = 0,
        spare_wait_s: float = DEFAULT_SPARE_WAIT_S,
        ps_spares: int = 0,
        replace_stopped_ps: float | str | None = AUTO,
        fork_tasks: bool | None = None,
    ):
        super().__init__(
            num_ps,
            num_workers,
            worker_command,
            backend=LocalBackend(host, fork_tasks=fork_tasks),
            ps_command=ps_command,
            env=env,
            task_env=task_env,
            grace_period=grace_period,
            kill_timeout=kill_timeout,
            output=output,
            cwd=cwd,
            secret=secret,
            history=history,
            restart_policy=restart_policy,
            max_restarts=max_restarts,
            spares=spares,
            spare_wait_s=spare_wait_s,
            ps_spares=ps_spares,
            replace_stopped_ps=replace_stopped_ps,
        )

    def __enter__(self) -> LocalCluster:
        super().__enter__()
        return self
