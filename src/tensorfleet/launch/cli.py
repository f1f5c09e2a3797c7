"""The ``tensorfleet`` command line: ``launch`` a local cluster, run a ps ``server`` task,
``plot`` the metrics a ``SummaryHook`` wrote, or ``export`` a checkpoint's model.

::

    tensorfleet launch --ps 1 --workers 3 -- python train.py --lr 1e-3
    tensorfleet server --cluster cluster.json --job ps --task 0 --secret-file secret
    tensorfleet plot runs/cnn -o curves.png
    tensorfleet export runs/cnn/checkpoints model.safetensors

Errors tensorfleet raises on purpose are printed as one line, ``tensorfleet: error: ...``,
with exit status 2 and no traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

from tensorfleet import environment
from tensorfleet.errors import LaunchError, TensorfleetError
from tensorfleet.launch.local_cluster import (
    DEFAULT_GRACE_PERIOD,
    DEFAULT_KILL_TIMEOUT,
    LocalCluster,
)
from tensorfleet.launch.output import LiveOutput, Output, PlainOutput
from tensorfleet.ps.service_settings import ServiceSettings
from tensorfleet.version import __version__

#: Exit status for usage errors and tensorfleet errors (argparse's convention).
USAGE_ERROR = 2
#: Signals to the launcher that are forwarded to the tasks as SIGTERM. SIGHUP too: with the
#: tasks in their own sessions, a closed terminal would otherwise orphan them.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tensorfleet`` command."""
    parser = argparse.ArgumentParser(
        prog="tensorfleet",
        description="Distributed training of PyTorch models in the style of Distributed "
        "TensorFlow: parameter servers, workers, a chief, all-reduce.",
    )
    parser.add_argument("--version", action="version", version=f"tensorfleet {__version__}")
    commands = parser.add_subparsers(dest="command_name", metavar="COMMAND")

    launch = commands.add_parser(
        "launch",
        help="run a whole cluster on this machine",
        description="Start --ps parameter-server tasks and --workers worker tasks on this "
        "machine, each in its own process with TF_CONFIG and a fresh cluster secret, and "
        "supervise them: prefixed output, a live view on a terminal, failures reported, "
        "nothing left running. Worker tasks run COMMAND; ps tasks run the built-in parameter "
        "server unless told otherwise.",
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
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart a failed task in place with the same identity (same TF_CONFIG, address "
        "and secret) up to N times, after a back-off of 1 s doubling up to 10 s (default: 0: "
        "a failure stops the cluster with a report)",
    )
    launch.add_argument(
        "--encrypt",
        action="store_true",
        help="encrypt all traffic between tasks with ZeroMQ CURVE (sets TENSORFLEET_ENCRYPT=1 "
        "for every task; keys are derived from the cluster secret)",
    )
    launch.add_argument(
        "--no-live",
        action="store_true",
        help="plain prefixed lines only, even on a terminal (no live task view)",
    )
    launch.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="COMMAND ...",
        help="the worker program and its arguments (put -- before it if it starts with -)",
    )
    launch.set_defaults(handler=_launch)

    server = commands.add_parser(
        "server",
        help="run one ps task: the built-in parameter server",
        description="Run a parameter-server task. Without options, the task and the cluster "
        "come from TF_CONFIG (as `tensorfleet launch` sets it). Returns when training is over.",
    )
    server.add_argument(
        "--cluster",
        metavar="JSON_OR_FILE",
        help='the cluster spec as JSON (\'{"ps": ["h:p"], "worker": [...]}\') or a JSON file',
    )
    server.add_argument(
        "--job", metavar="NAME", help="this task's job name (default: from TF_CONFIG)"
    )
    server.add_argument(
        "--task",
        type=int,
        metavar="INDEX",
        help="this task's index in its job (default: from TF_CONFIG)",
    )
    server.add_argument(
        "--secret-file",
        metavar="PATH",
        help="file holding the cluster secret (default: $TENSORFLEET_SECRET or "
        "$TENSORFLEET_SECRET_FILE)",
    )
    server.add_argument(
        "--encrypt",
        action="store_true",
        help="encrypt traffic with ZeroMQ CURVE (default: $TENSORFLEET_ENCRYPT); every task must agree",
    )
    server.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch threads for applying updates (default: 1; the workers need the cores)",
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tensorfleet`` command with ``argv`` (default: ``sys.argv[1:]``); return the
    exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
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


def _launch(args: argparse.Namespace) -> int:
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

    output: Output
    if not args.no_live and sys.stdout.isatty():
        live = LiveOutput()
        output = PlainOutput() if live.console.is_dumb_terminal else live
    else:
        output = PlainOutput()
    cluster = LocalCluster(
        args.ps,
        args.workers,
        command,
        ps_command=ps_command,
        env={environment.ENCRYPT_VAR: "1"} if args.encrypt else None,
        grace_period=args.grace_period,
        kill_timeout=args.kill_timeout,
        output=output,
        max_restarts=args.max_restarts,
    )
    with _forward_signals(cluster.interrupt), output:
        try:
            cluster.start()
            return cluster.wait()
        finally:
            # Never leave a child behind, whatever happened above (even a bug of ours).
            cluster.stop()


def _server(args: argparse.Namespace) -> int:
    """``tensorfleet server``: run one ps task until training is over."""
    # Imported here so that the CLI (and `launch`) work without the server's dependencies.
    import torch

    from tensorfleet.cluster.resolver import resolve_task
    from tensorfleet.session.server import Server, ServerConfig
    from tensorfleet.wire.secret import load_secret

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    task = resolve_task(cluster=args.cluster, job_name=args.job, task_index=args.task, argv=[])
    try:
        server = Server(
            task.cluster,
            task.job,
            task.index,
            secret=load_secret(secret_file=args.secret_file),
            config=ServerConfig(
                encrypt=True if args.encrypt else None,
                liveness_timeout_s=args.liveness_timeout,
                end_grace_s=args.end_grace,
            ),
        )
    except (
        OSError,
        ValueError,
    ) as exc:  # cannot listen on the task's address; the message says why
        print(f"tensorfleet: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: server.stop())
    outcome = server.join()
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
