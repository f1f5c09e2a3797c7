"""The checks of :class:`~tensorfleet.launch.supervisor.ClusterSupervisor`'s timing options
and the choice of its restart policy, out of the supervisor's constructor (which had grown
past 600 lines with them): each error names the option, the value seen and what it means."""

from __future__ import annotations

from tensorfleet.errors import LaunchError
from tensorfleet.launch.restart_policy import DEFAULT_POLICY, RestartPolicy

#: Seconds between SIGTERM and SIGKILL (the supervisor's default, named in the error).
DEFAULT_KILL_TIMEOUT = 15.0


def check_timings(grace_period: float, kill_timeout: float, history: int) -> None:
    """A :class:`LaunchError` for a negative grace period, a kill timeout that is not
    positive, or a history of no lines."""
    if grace_period < 0:
        raise LaunchError(
            f"--grace-period (grace_period) must be >= 0 seconds, got {grace_period:g}: "
            "the time the other tasks get after a failure (and the ps tasks after the "
            "workers finished); 0 does not wait"
        )
    if kill_timeout <= 0:
        raise LaunchError(
            f"--kill-timeout (kill_timeout) must be > 0 seconds, got {kill_timeout:g}: the "
            f"time between SIGTERM and SIGKILL (default {DEFAULT_KILL_TIMEOUT:g})"
        )
    if history < 1:
        raise LaunchError(f"history must keep at least 1 line, got {history}")


def chosen_policy(restart_policy: RestartPolicy | None, max_restarts: int | None) -> RestartPolicy:
    """The run's restart policy: ``restart_policy``, or ``RestartPolicy.uniform(N)`` for
    ``max_restarts=N`` (not both), else :data:`DEFAULT_POLICY`."""
    if max_restarts is not None and restart_policy is not None:
        raise LaunchError(
            "give restart_policy or max_restarts, not both: max_restarts=N is "
            "RestartPolicy.uniform(N)"
        )
    if max_restarts is not None:
        return RestartPolicy.uniform(max_restarts)
    return DEFAULT_POLICY if restart_policy is None else restart_policy
