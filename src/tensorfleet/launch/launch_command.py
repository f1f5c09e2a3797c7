"""``tensorfleet launch``: its options, and running a supervised cluster from them.

Kept apart from :mod:`tensorfleet.launch.cli` (which holds the other subcommands) because it
is the one with many options: the cluster shape, the backend (this machine, or a Ray
cluster), the restart policy, the output::

    tensorfleet launch --ps 1 --workers 3 -- python train.py
    tensorfleet launch --backend ray --ray-address 10.0.0.1:6379 --ps 1 --workers 3 -- python train.py
    tensorfleet launch --signal-restarts 3 --error-restarts 1 -- python train.py
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, NoReturn

from tensorfleet import environment
from tensorfleet.errors import LaunchConfigError, LaunchError
from tensorfleet.launch import stopped_ps, update_log_directory
from tensorfleet.launch.backends.base import Backend
from tensorfleet.launch.backends.local import LocalBackend
from tensorfleet.launch.output import LiveOutput, Output, PlainOutput
from tensorfleet.launch.resource_flags import (
    add_pipeline_flags,
    add_resource_flags,
    launch_resources,
)
from tensorfleet.launch.restart_policy import (
    DEFAULT_POLICY,
    RestartPolicy,
)
from tensorfleet.launch.supervisor import (
    DEFAULT_GRACE_PERIOD,
    DEFAULT_KILL_TIMEOUT,
    ClusterSupervisor,
)
from tensorfleet.launch.update_log_directory import UpdateLogDirectory
from tensorfleet.launch.warm_spares import DEFAULT_PS_SPARES, DEFAULT_SPARES
from tensorfleet.ps.memory_budget import parse_memory_size

#: Signals to the launcher that are forwarded to the tasks as SIGTERM. SIGHUP too: with the
#: tasks in their own sessions, a closed terminal would otherwise orphan them.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def add_launch_command(commands: Any) -> argparse.ArgumentParser:
    """Add the ``launch`` subcommand to ``commands`` (an argparse subparsers object)."""
    launch: argparse.ArgumentParser = commands.add_parser(
        "launch",
        help="run a whole cluster on this machine or on a Ray cluster",
        description="Start --ps parameter-server tasks and --workers worker tasks, each in its "
        "own process with TF_CONFIG and a fresh cluster secret, on this machine (or through "
        "Ray actors on a Ray cluster: --backend ray), and supervise them: prefixed output, a "
        "live view on a terminal with the chief's progress, tasks killed by a signal "
        "restarted, failures reported, nothing left running. Worker tasks run COMMAND; ps "
        "tasks run the built-in parameter server unless told otherwise.",
        epilog="example: tensorfleet launch --ps 1 --workers 3 -- python train.py --lr 1e-3",
    )
    launch.add_argument(
        "--ps",
        type=int,
        default=1,
        metavar="N",
        help="number of parameter-server tasks; 0 for all-reduce training (default: 1)",
    )
    launch.add_argument(
        "--workers",
        type=int,
        default=2,
        metavar="N",
        help="number of worker tasks; worker 0 is the chief (default: 2)",
    )
    ps_mode = launch.add_mutually_exclusive_group()
    ps_mode.add_argument(
        "--ps-command",
        metavar="CMD",
        help="command line of each ps task, split like a shell would "
        "(default: the built-in parameter server, `python -m tensorfleet server`)",
    )
    ps_mode.add_argument(
        "--ps-runs-script",
        action="store_true",
        help="run COMMAND for the ps tasks too (TensorFlow style: the script calls "
        "server.join() when its task is a ps)",
    )
    launch.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD,
        metavar="SECONDS",
        help="how long the ps tasks get to exit after every worker finished, and the other "
        f"tasks after one failed, before SIGTERM (default: {DEFAULT_GRACE_PERIOD:g})",
    )
    launch.add_argument(
        "--kill-timeout",
        type=float,
        default=DEFAULT_KILL_TIMEOUT,
        metavar="SECONDS",
        help=f"time between SIGTERM and SIGKILL (default: {DEFAULT_KILL_TIMEOUT:g})",
    )
    restarts = launch.add_argument_group(
        "restarts",
        "A task that ends on its own with a failure is restarted in place with the same "
        "identity (TF_CONFIG, address, secret) and TENSORFLEET_PREDECESSOR_DEAD=1, after a "
        f"back-off of {DEFAULT_POLICY.backoff_s:g} s doubling up to "
        f"{DEFAULT_POLICY.max_backoff_s:g} s. By default a task killed by a signal (SIGKILL, "
        "a preemption's SIGTERM, the OOM killer; exit status >= 128) is restarted up to "
        f"{DEFAULT_POLICY.signal_restarts} times per hour, and a task that exits with an "
        "error (1 to 127: an exception, a bad flag) stops the cluster with its last lines.",
    )
    restarts.add_argument(
        "--signal-restarts",
        type=int,
        default=None,
        metavar="N",
        help="restarts per task after it was killed by a signal, within the window "
        f"(default: {DEFAULT_POLICY.signal_restarts}; 0: a kill stops the cluster)",
    )
    restarts.add_argument(
        "--error-restarts",
        type=int,
        default=None,
        metavar="N",
        help="restarts per task after it exited with an error, within the window "
        f"(default: {DEFAULT_POLICY.error_restarts}: an error stops the cluster)",
    )
    restarts.add_argument(
        "--restart-on-error",
        action="store_true",
        help="restart error exits too, as many times as signals (--error-restarts N sets "
        "its own limit)",
    )
    restarts.add_argument(
        "--restart-window",
        type=float,
        default=None,
        metavar="SECONDS",
        help="restarts are counted within this sliding window (default: "
        f"{DEFAULT_POLICY.window_s:g}; 0: over the whole run)",
    )
    restarts.add_argument(
        "--crash-loop-seconds",
        type=float,
        default=None,
        metavar="S",
        help="a task that ran at least S seconds before it died is restarted at once; one "
        "that died sooner waits a back-off doubling with each quick death in a row (default: "
        f"{DEFAULT_POLICY.crash_loop_s:g}; 0: never back off)",
    )
    restarts.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help="restart every failure, signal or error, up to N times per task over the whole "
        "run (the options above, given as well, override it for their kind)",
    )
    restarts.add_argument(
        "--spares",
        type=int,
        default=None,
        metavar="N",
        help="warm spare workers: the worker command started ahead of time (once the run "
        "is at work: its first task's SERVING marker, at the latest 30 s in), waiting in "
        "tensorfleet.resolve_task() to take over a worker that dies (default: "
        f"{DEFAULT_SPARES} with the local backend, 0 with Ray; 0: none)",
    )
    restarts.add_argument(
        "--ps-spares",
        type=int,
        default=None,
        metavar="N",
        help="warm spare ps processes: the ps command started ahead of time, past its "
        "imports, waiting to take over a ps task that dies (default: "
        f"{DEFAULT_PS_SPARES} with the local backend and the built-in ps or --ps-runs-script, "
        "else 0; 0: none)",
    )
    restarts.add_argument(
        "--replace-stopped-ps",
        default=stopped_ps.AUTO,
        metavar="S",
        help="a ps task whose process stays stopped (SIGSTOP) for S seconds is killed and "
        "restarted, so that a new process (a warm spare) serves its shard (default: auto: "
        f"{stopped_ps.AFTER_WITH_LOG_S:g} s with the update log (the default), which loses "
        f"nothing, {stopped_ps.AFTER_WITHOUT_LOG_S:g} s with --ps-update-log off, which "
        "trains the steps since the newest checkpoint again; off or 0: never; local backend "
        "only)",
    )
    backends = launch.add_argument_group("backend")
    backends.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="where the tasks run: processes on this machine (default), or processes "
        "started by one Ray actor per task on an existing Ray cluster",
    )
    backends.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        default=None,
        help="the Ray cluster's address as `ray start --head` prints it (default: "
        "$RAY_ADDRESS, else a cluster started on this machine)",
    )
    backends.add_argument(
        "--ray-cpus-per-task",
        type=float,
        default=1.0,
        metavar="N",
        help="CPUs Ray reserves for each task (default: 1)",
    )
    backends.add_argument(
        "--ray-gpus-per-task",
        type=float,
        default=0.0,
        metavar="N",
        help="GPUs Ray reserves for each worker task; ps tasks get none (default: 0)",
    )
    launch.add_argument(
        "--encrypt",
        action="store_true",
        help="encrypt the traffic of tensorfleet's wire (parameter servers, weight broadcast, "
        "sample queues) with AES-256-GCM under keys agreed per connection and authenticated "
        "by the cluster secret (sets TENSORFLEET_ENCRYPT=1 for every task); all-reduce and "
        "pipeline groups are not covered (docs/security.md)",
    )
    launch.add_argument(
        "--ps-update-log",
        default=None,
        metavar="DIR|auto|off",
        help="every ps task logs each update it applies since its newest checkpoint, so that "
        "a ps killed with SIGKILL comes back at its last acknowledged push, not at that "
        "checkpoint (sets TENSORFLEET_PS_UPDATE_LOG for the tasks); auto: in a directory of "
        "this launch in /dev/shm, removed at the end (local backend only); DIR: in DIR, kept "
        "after the run; off: no log. Snapshots of each shard's state keep the log to about a "
        "snapshot and the updates after it per ps, and a ps whose log would not fit in half "
        "the free space there logs nothing and says so (docs/reliability.md) (default: "
        "$TENSORFLEET_PS_UPDATE_LOG, else auto)",
    )
    launch.add_argument(
        "--ps-update-log-snapshot",
        default=None,
        metavar="SIZE",
        help="with --ps-update-log: each ps writes a snapshot of its state to the log after "
        "SIZE of logged updates (e.g. 512MiB, 2G; 0: never) (sets "
        "TENSORFLEET_PS_UPDATE_LOG_SNAPSHOT) (default: four times the shard's state, at "
        "least 64 MiB)",
    )
    launch.add_argument(
        "--ps-max-memory",
        default=None,
        metavar="SIZE",
        help="most memory each ps's embedding tables may take (e.g. 8GB, 512MiB); a table "
        "that would not fit is refused when created, naming the fixes (sets "
        "TENSORFLEET_PS_MAX_MEMORY, tensorfleet server --max-memory's default) (default: no "
        "limit)",
    )
    launch.add_argument(
        "--no-live",
        action="store_true",
        help="plain prefixed lines only, even on a terminal (no live task view)",
    )
    add_resource_flags(launch)
    add_pipeline_flags(launch)
    launch.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="COMMAND ...",
        help="the worker program and its arguments (put -- before it if it starts with -)",
    )
    launch.set_defaults(
        handler=run_launch, on_unrecognized=functools.partial(_refuse_stray_options, launch)
    )
    return launch


def _refuse_stray_options(launch: argparse.ArgumentParser, unknown: list[str]) -> NoReturn:
    """Refuse options ``tensorfleet launch`` does not have (``tensorfleet``'s ``main`` calls this
    with them), saying that the worker program's options go after ``--``: the usual cause is
    ``tensorfleet launch --steps 100 -- python train.py``, where argparse alone would print the
    top-level usage (and has already taken ``100`` as the program)."""
    stray = " ".join(unknown)
    launch.error(
        f"unrecognized arguments: {stray}. The options before `--` are the launcher's; the "
        "worker program's options go after `--`, behind the program: "
        f"`tensorfleet launch --ps 1 --workers 2 -- python train.py {stray} ...`"
    )


def restart_policy_from(args: argparse.Namespace) -> RestartPolicy:
    """The restart policy the options ask for; :class:`LaunchConfigError` for a negative
    limit or window, before anything starts."""
    policy = (
        DEFAULT_POLICY if args.max_restarts is None else RestartPolicy.uniform(args.max_restarts)
    )
    changes: dict[str, Any] = {}
    if args.signal_restarts is not None:
        changes["signal_restarts"] = args.signal_restarts
    if args.error_restarts is not None:
        changes["error_restarts"] = args.error_restarts
    elif args.restart_on_error:
        changes["error_restarts"] = changes.get("signal_restarts", policy.signal_restarts)
    if args.restart_window is not None:
        if args.restart_window < 0:
            raise LaunchConfigError(
                f"--restart-window must be >= 0 seconds, got {args.restart_window:g} "
                "(0: count restarts over the whole run)"
            )
        changes["window_s"] = args.restart_window or None
    if args.crash_loop_seconds is not None:
        changes["crash_loop_s"] = args.crash_loop_seconds
    return dataclasses.replace(policy, **changes) if changes else policy


def launch_env(
    args: argparse.Namespace, update_log: UpdateLogDirectory | None = None
) -> dict[str, str] | None:
    """The environment every task gets from the launcher's own options (None: nothing);
    ``update_log``: the launch's update log, as :func:`update_log_directory.choose` chose it
    (None: none chosen, e.g. a caller that only checks the options)."""
    env = {}
    if args.encrypt:
        env[environment.ENCRYPT_VAR] = "1"
    if update_log is not None:
        # an empty value when off: the tasks do not inherit a directory (or `auto`) from here
        env[environment.PS_UPDATE_LOG_VAR] = "" if update_log.path is None else str(update_log.path)
    if args.ps_update_log_snapshot is not None:
        if update_log is not None and update_log.path is None:
            raise LaunchConfigError(
                f"--ps-update-log-snapshot {args.ps_update_log_snapshot} has no effect without "
                "an update log (it is off here): leave it out, or give --ps-update-log DIR"
            )
        parse_memory_size(args.ps_update_log_snapshot, "--ps-update-log-snapshot")  # checked now
        env[environment.PS_UPDATE_LOG_SNAPSHOT_VAR] = args.ps_update_log_snapshot
    elif (inherited := environment.ps_update_log_snapshot()) is not None:
        # the tasks inherit it: a bad one is refused now, not by every ps after the start
        if update_log is not None and update_log.path is None:
            raise LaunchConfigError(
                f"{environment.PS_UPDATE_LOG_SNAPSHOT_VAR}={inherited} has no effect without an "
                "update log (it is off here): unset it, or give --ps-update-log DIR"
            )
        parse_memory_size(inherited, environment.PS_UPDATE_LOG_SNAPSHOT_VAR)
    if args.ps_max_memory is not None:
        parse_memory_size(args.ps_max_memory, "--ps-max-memory")  # checked now
        env[environment.PS_MAX_MEMORY_VAR] = args.ps_max_memory
    return env or None


def backend_from(args: argparse.Namespace) -> Backend:
    """The backend the options ask for (connects to Ray for ``--backend ray``)."""
    if args.backend == "ray":
        from tensorfleet.launch.backends.ray import RayBackend

        return RayBackend(
            args.ray_address,
            cpus_per_task=args.ray_cpus_per_task,
            gpus_per_task=args.ray_gpus_per_task,
        )
    if args.ray_address is not None:
        raise LaunchConfigError(
            f"--ray-address {args.ray_address} is given but the backend is local; add "
            "--backend ray to run the tasks on that Ray cluster"
        )
    return LocalBackend()


def run_launch(args: argparse.Namespace) -> int:
    """``tensorfleet launch``: run the cluster until the workers are done; its exit status."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LaunchError(
            "no command to run: give the worker program after the options, e.g. "
            "`tensorfleet launch --ps 1 --workers 2 -- python train.py`"
        )
    ps_command: list[str] | None = None
    if args.ps_runs_script:
        ps_command = command
    elif args.ps_command is not None:
        try:
            ps_command = shlex.split(args.ps_command)
        except ValueError as exc:
            raise LaunchError(f"cannot split --ps-command {args.ps_command!r}: {exc}") from exc
        if not ps_command:
            raise LaunchError("--ps-command is empty; give the ps program and its arguments")
    policy = restart_policy_from(args)  # bad limits are refused before anything starts
    for flag, count in (("--spares", args.spares), ("--ps-spares", args.ps_spares)):
        if count and args.backend != "local":
            raise LaunchConfigError(
                f"{flag} {count}: warm spares need the local backend, not --backend "
                f"{args.backend}; pass {flag} 0"
            )
    replace_stopped_ps = stopped_ps.parse_after(args.replace_stopped_ps)
    if args.backend != "local" and replace_stopped_ps not in (None, stopped_ps.AUTO):
        raise LaunchConfigError(
            f"--replace-stopped-ps {args.replace_stopped_ps}: the launcher sees a stopped ps "
            f"only on the local backend, not --backend {args.backend}; leave the option out"
        )
    # A ps spare by default only where the ps command is known to wait in resolve_task: the
    # built-in server, or the user's script (which calls it, as the worker spares need).
    ps_spares = args.ps_spares
    if ps_spares is None:
        waits = args.ps_command is None or args.ps_runs_script
        ps_spares = DEFAULT_PS_SPARES if args.backend == "local" and waits else 0
    # resources the host cannot give, or workers that do not form whole pipelines: refused
    # before anything starts
    resources = launch_resources(args, args.ps, args.workers, local=args.backend == "local")
    task_env = resources.envs

    output: Output
    if not args.no_live and sys.stdout.isatty():
        live = LiveOutput()
        output = PlainOutput() if live.console.is_dumb_terminal else live
    else:
        output = PlainOutput()
    # no ps tasks (all-reduce): no log to keep, nothing made
    update_log = update_log_directory.choose(args.ps_update_log, args.backend) if args.ps else None
    try:
        env = launch_env(args, update_log)  # a bad snapshot size: refused before the start
        backend = backend_from(args)
        try:
            cluster = ClusterSupervisor(
                args.ps,
                args.workers,
                command,
                backend=backend,
                ps_command=ps_command,
                env=env,
                task_env=task_env,
                grace_period=args.grace_period,
                kill_timeout=args.kill_timeout,
                output=output,
                restart_policy=policy,
                spares=(DEFAULT_SPARES if args.backend == "local" else 0)
                if args.spares is None
                else args.spares,
                ps_spares=ps_spares,
                replace_stopped_ps=replace_stopped_ps,
            )
        except BaseException:
            backend.close()
            raise
        with _forward_signals(cluster.interrupt), output:
            try:
                if resources.gpu_line is not None:
                    output.message(resources.gpu_line)  # the first line: which worker has which GPU
                if update_log is not None:
                    if update_log.cleanup is not None:
                        output.message(update_log.cleanup)
                    output.message(update_log.line)
                cluster.start()
                return cluster.wait()
            finally:
                # Never leave a child behind, whatever happened above (even a bug of ours).
                cluster.stop()
    finally:
        if update_log is not None:  # after the tasks are gone: none of them writes there now
            update_log.remove()


@contextmanager
def _forward_signals(interrupt: Callable[[int], None]) -> Iterator[None]:
    """While inside, SIGINT/SIGTERM/SIGHUP to this process call ``interrupt(signum)`` instead
    of killing it, so that the cluster stops its tasks first. Only the main thread can set
    handlers; elsewhere (e.g. ``main()`` called from a test thread) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        interrupt(signum)

    previous: dict[int, Any] = {}
    try:
        for sig in FORWARDED_SIGNALS:
            previous[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
