"""The ``tensorfleet`` command line: ``launch`` a cluster (its options live in
:mod:`tensorfleet.launch.launch_command`), run a ps ``server`` task, ``plot`` the metrics a
``SummaryHook`` wrote, ``export`` a checkpoint's model, or describe a cluster for a cluster
manager (``slurm``: an sbatch script; ``k8s render``: manifests), or run a hyperparameter
``sweep`` (registered by :mod:`tensorfleet.patterns.sweep_cli`) or population-based training
(``pbt``, registered by :mod:`tensorfleet.patterns.pbt_cli`).

::

    tensorfleet launch --ps 1 --workers 3 -- python train.py --lr 1e-3
    tensorfleet server --cluster cluster.json --job ps --task 0 --secret-file secret
    tensorfleet plot runs/cnn -o curves.png
    tensorfleet export runs/cnn/checkpoints model.safetensors
    tensorfleet sweep sweep.yaml --dir runs/sweep
    tensorfleet pbt pbt.yaml --dir runs/pbt

Errors tensorfleet raises on purpose are printed as one line, ``tensorfleet: error: ...``,
with exit status 2 and no traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tensorfleet import environment
from tensorfleet.cluster.resolved_task import ResolvedTask
from tensorfleet.errors import ConfigError, Preempted, TensorfleetError
from tensorfleet.launch.launch_command import add_launch_command
from tensorfleet.launch.renderers import kubernetes, slurm
from tensorfleet.launch.task_flags import (
    add_security_flags,
    add_server_task_flags,
    resolve_server_task,
    task_security,
)
from tensorfleet.patterns.pbt_cli import add_pbt_command
from tensorfleet.patterns.sweep_cli import add_sweep_command
from tensorfleet.ps.service_settings import ServiceSettings
from tensorfleet.version import __version__

#: Exit status for usage errors and tensorfleet errors (argparse's convention).
USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tensorfleet`` command."""
    parser = argparse.ArgumentParser(
        prog="tensorfleet",
        description="Distributed training of PyTorch models in the style of Distributed "
        "TensorFlow: parameter servers, workers, a chief, all-reduce.",
    )
    parser.add_argument("--version", action="version", version=f"tensorfleet {__version__}")
    commands = parser.add_subparsers(dest="command_name", metavar="COMMAND")

    add_launch_command(commands)

    server = commands.add_parser(
        "server",
        help="run one ps task: the built-in parameter server",
        description="Run a parameter-server task: --job ps --task N with --cluster (or "
        "--ps_hosts/--worker_hosts), all together. Without them, the task and the cluster come "
        "from TF_CONFIG (as `tensorfleet launch` sets it). Worker tasks run the training "
        "script instead. Returns when training is over.",
    )
    add_server_task_flags(server)
    add_security_flags(server)
    server.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="torch threads for applying updates (default: planned as the launcher plans a "
        "host's tasks, over the tasks the cluster spec names on this host: alone on its "
        "host, every core it may use; TENSORFLEET_INTRA_OP_THREADS, which the launcher sets, "
        "wins over both)",
    )
    server.add_argument(
        "--liveness-timeout",
        type=float,
        default=ServiceSettings.liveness_timeout_s,
        metavar="S",
        help="a worker not heard from for S seconds is lost: it stops holding back sync "
        "steps and the staleness bound, and a restarted copy may take its place "
        "(default: %(default)g)",
    )
    server.add_argument(
        "--end-grace",
        type=float,
        default=ServiceSettings.end_grace_s,
        metavar="S",
        help="after the chief ends training, wait up to S seconds for the other workers "
        "(default: %(default)g)",
    )
    server.add_argument(
        "--idle-timeout",
        type=float,
        default=ServiceSettings.idle_timeout_s,
        metavar="S",
        help="end after S seconds without a valid request from anyone (no worker ever came, "
        "or all went away without a word) (default: %(default)g)",
    )
    server.add_argument(
        "--max-memory",
        default=None,
        metavar="SIZE",
        help="most memory this ps's embedding tables may take, counted at their full size "
        "(e.g. 8GB, 512MiB, or bytes); a table that would not fit is refused when created "
        "(default: $TENSORFLEET_PS_MAX_MEMORY, which tensorfleet launch --ps-max-memory sets, "
        "else no limit)",
    )
    server.add_argument(
        "--preempt-grace",
        type=float,
        default=ServiceSettings.preempt_grace_s,
        metavar="S",
        help="after a SIGTERM (a preemption), keep serving up to S seconds until the chief "
        "has written a checkpoint, then exit with status 143 (a preemption, to a launcher "
        "that restarts tasks) "
        "(default: %(default)g)",
    )
    server.add_argument(
        "--timeline",
        default=None,
        metavar="FILE",
        help="write a Chrome trace of where this ps's time goes (receive, apply, reply) to "
        "FILE with the task's name before the suffix (trace.json -> trace.ps-0.json) when "
        "it ends; Perfetto opens it (default: none)",
    )
    server.add_argument(
        "--update-log",
        default=None,
        metavar="DIR",
        help="log every update this ps applies since its newest checkpoint in DIR, so that "
        "the process that takes over after it is killed (SIGKILL) comes back at its last "
        "acknowledged push instead of at that checkpoint; snapshots of the shard's state keep "
        "DIR to about a snapshot and the updates after it, and the log starts only where "
        "that fits in half the free space (docs/reliability.md); off: no log (default: "
        "$TENSORFLEET_PS_UPDATE_LOG, which tensorfleet launch sets, else no log)",
    )
    server.add_argument(
        "--update-log-snapshot",
        default=None,
        metavar="SIZE",
        help="with --update-log: write a snapshot of the shard's state to the log after SIZE "
        "of logged updates (e.g. 512MiB, 2G; 0: never, the log then grows until the next "
        "checkpoint); smaller keeps the log smaller and a restore shorter, for more snapshot "
        "writes (default: $TENSORFLEET_PS_UPDATE_LOG_SNAPSHOT, else four times the shard's "
        "state, at least 64 MiB)",
    )
    server.set_defaults(handler=_server)

    plot = commands.add_parser(
        "plot",
        help="draw the metrics of a run as a PNG",
        description="Draw LOGDIR/metrics.jsonl (written by the chief when training runs with a "
        "SummaryHook) as one panel per metric against the global step, and print the path of "
        "the PNG written. Needs matplotlib: pip install 'tensorfleet[plot]'.",
        epilog="example: tensorfleet plot runs/cnn -o curves.png",
    )
    plot.add_argument("logdir", metavar="LOGDIR", help="the SummaryHook's log directory")
    plot.add_argument(
        "-o",
        "--output",
        metavar="PNG",
        help="where to write the picture (default: LOGDIR/metrics.png)",
    )
    plot.set_defaults(handler=_plot)

    export = commands.add_parser(
        "export",
        help="write a checkpoint's model as one safetensors file",
        description="Write the parameters of a checkpoint (a step-N directory, or a run's "
        "checkpoint_dir: its newest valid checkpoint) to one safetensors file named like the "
        "model's state_dict, for serving or sharing without tensorfleet; print its path.",
        epilog="example: tensorfleet export runs/demo/checkpoints model.safetensors",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint or checkpoint_dir")
    export.add_argument("output", metavar="OUTPUT", help="the safetensors file to write")
    export.add_argument(
        "--moving-average",
        action="store_true",
        help="export the exponential moving average (runs with ema_decay) instead",
    )
    export.set_defaults(handler=_export)
    slurm.add_command(commands)
    kubernetes.add_command(commands)
    add_sweep_command(commands)
    add_pbt_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tensorfleet`` command with ``argv`` (default: ``sys.argv[1:]``); return the
    exit status."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # a command may explain where its stray options belong (launch: after --)
            on_unrecognized = getattr(args, "on_unrecognized", None)
            if on_unrecognized is not None:
                on_unrecognized(unknown)
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # --help, --version, usage errors: argparse already printed
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return USAGE_ERROR
    try:
        return handler(args)
    except TensorfleetError as exc:
        print(f"tensorfleet: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, or an error naming the value."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return int(text)


def _plan_server_threads(threads: int | None, task: ResolvedTask) -> str:
    """Set torch's threads for a ps task: ``threads`` (``--threads``) when given, else the
    share :func:`~tensorfleet.cluster.thread_budget.co_located_threads` plans over the tasks
    ``task.cluster`` names on this host; the reason, for the log line."""
    import torch

    from tensorfleet.cluster.spec import TaskId
    from tensorfleet.cluster.thread_budget import co_located_threads

    if threads is not None:
        torch.set_num_threads(threads)
        return "--threads"
    cores = environment.host_cpu_count()
    planned, tasks = co_located_threads(task.cluster, TaskId(task.job, task.index), cores)
    torch.set_num_threads(planned)
    return (
        f"planned: {cores} core(s), {tasks} task(s) of the cluster on this host; "
        "--threads N to choose"
    )


def threads_reason_with_environment(
    reason: str, threads_flag: int | None, environ: Mapping[str, str]
) -> str:
    """The reason of the ps's threads line once the server has applied
    ``TENSORFLEET_INTRA_OP_THREADS`` (which wins over ``--threads`` and the plan): who set it
    (the launcher, or the environment the ps was started in), and the ``--threads`` it
    overrode; ``reason`` when the variable is not set."""
    value = environ.get(environment.INTRA_OP_THREADS_VAR, "").strip()
    if not value:
        return reason
    who = "the launcher's plan" if environ.get(environment.LAUNCHER_VAR) else "in the environment"
    overrode = "" if threads_flag is None else f"; it wins over --threads {threads_flag}"
    return f"{environment.INTRA_OP_THREADS_VAR}={value}, {who}{overrode}"


def server_update_log_dir(flag: str | None) -> str | None:
    """The directory of a ``tensorfleet server``'s update log: ``--update-log`` (``flag``),
    else ``TENSORFLEET_PS_UPDATE_LOG`` (the launcher sets it); None for unset or an off word.
    ``auto`` is the launcher's choice, not a directory: refused, naming the fix."""
    value, source = flag, "--update-log"
    if value is None:
        value, source = environment.ps_update_log_choice(), environment.PS_UPDATE_LOG_VAR
    if value is None or environment.update_log_off(value):
        return None
    if value.strip().lower() == "auto":
        raise ConfigError(
            f"{source} auto: auto is tensorfleet launch's choice (a directory of the launch in "
            "/dev/shm), which a ps started by hand does not have: give a directory, or off"
        )
    return value


def server_config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ServerConfig`` fields ``tensorfleet server``'s options (and, where an option is
    not given, the environment the launcher sets) give; the others keep their defaults."""
    update_log_dir = server_update_log_dir(args.update_log)
    if args.update_log_snapshot is not None and update_log_dir is None:
        raise ConfigError(
            f"--update-log-snapshot {args.update_log_snapshot} has no effect without an update "
            f"log: give --update-log DIR (or {environment.PS_UPDATE_LOG_VAR}), or leave it out"
        )
    snapshot, snapshot_source = args.update_log_snapshot, "--update-log-snapshot"
    if snapshot is None and update_log_dir is not None:
        snapshot = environment.ps_update_log_snapshot()
        snapshot_source = environment.PS_UPDATE_LOG_SNAPSHOT_VAR
    fields = (
        ("liveness_timeout_s", args.liveness_timeout),
        ("end_grace_s", args.end_grace),
        ("idle_timeout_s", args.idle_timeout),
        ("preempt_grace_s", args.preempt_grace),
        ("max_memory", _max_memory(args.max_memory)),
        ("timeline", args.timeline),
        ("update_log_dir", update_log_dir),
        ("update_log_snapshot_bytes", _memory_size(snapshot, snapshot_source)),
    )
    return {field: value for field, value in fields if value is not None}


def _server(args: argparse.Namespace) -> int:
    """``tensorfleet server``: run one ps task until training is over."""
    # Imported here so that the CLI (and `launch`) work without the server's dependencies.
    import torch

    from tensorfleet.ps.update_rules import warm_up_optimizers
    from tensorfleet.session.server import Server, ServerConfig

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads or 1)
    # torch's lazy optimizer imports (1-8 s) before a warm spare waits for its identity in
    # resolve_server_task, not after it took over a dead ps (the service would do it then).
    warm_up_optimizers()
    task = resolve_server_task(args)  # a ps task, or an error in this command's terms
    threads_reason = _plan_server_threads(args.threads, task)
    security = task_security(args)  # the same options and meaning as in the examples
    try:
        server = Server(
            task.cluster,
            task.job,
            task.index,
            secret=security.secret,
            config=ServerConfig(  # options not given keep the config's own defaults
                encrypt=security.encrypt,
                **server_config_fields(args),
            ),
        )
    except (
        OSError,
        ValueError,
    ) as exc:  # cannot listen on the task's address; the message says why
        print(f"tensorfleet: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    threads_reason = threads_reason_with_environment(
        threads_reason, args.threads, environment.environ()
    )
    logging.getLogger(__name__).info(
        "%s:%d: %d torch thread(s) for applying updates (%s)",
        task.job,
        task.index,
        torch.get_num_threads(),
        threads_reason,
    )
    logging.getLogger(__name__).info(
        "%s:%d: messages authenticated with the cluster secret from %s; %s",
        task.job,
        task.index,
        getattr(server.secret, "source", "the secret argument"),
        "every message sealed with AES-256-GCM (--encrypt)"
        if server.encrypt
        else "not encrypted (--encrypt on every task seals every message)",
    )
    try:
        outcome = server.join()  # a SIGTERM meanwhile is a preemption (session/preemption.py)
    except Preempted as preempted:
        print(f"tensorfleet: {preempted}", file=sys.stderr)
        return preempted.code
    if outcome is not None and not outcome.clean:
        print(
            f"tensorfleet: {task.task_id} ended without a clean finish ({outcome.reason})",
            file=sys.stderr,
        )
        return 1
    return 0


def _plot(args: argparse.Namespace) -> int:
    """``tensorfleet plot``: draw the metrics of a run; print the path of the PNG."""
    # Imported here so that the other commands do not load the summaries package.
    from tensorfleet.summaries.plot import plot_metrics

    try:
        path = plot_metrics(args.logdir, args.output)
    except (OSError, ValueError, ImportError) as exc:  # the message names the file and the fix
        message = " ".join(str(exc).split())
        print(f"tensorfleet: error: {message}", file=sys.stderr)
        return USAGE_ERROR
    print(path)
    return 0


def _export(args: argparse.Namespace) -> int:
    """``tensorfleet export``: one safetensors file from a checkpoint; print its path."""
    from tensorfleet.errors import CheckpointError
    from tensorfleet.session.checkpoints import export_checkpoint

    try:
        path = export_checkpoint(args.checkpoint, args.output, moving_average=args.moving_average)
    except (CheckpointError, OSError) as exc:  # the message names the checkpoint and the fix
        print(f"tensorfleet: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return USAGE_ERROR
    print(path)
    return 0


def _max_memory(flag: str | None) -> int | None:
    """``--max-memory``, else the launcher's ``TENSORFLEET_PS_MAX_MEMORY``."""
    if flag is not None:
        return _memory_size(flag)
    return _memory_size(environment.ps_max_memory(), environment.PS_MAX_MEMORY_VAR)


def _memory_size(text: str | None, flag: str = "--max-memory") -> int | None:
    """The value of a size option (``flag``) in bytes (None when not given)."""
    from tensorfleet.ps.memory_budget import parse_memory_size

    return None if text is None else parse_memory_size(text, flag)
