"""``tensorfleet slurm``: an sbatch script that runs a cluster shape as one Slurm job.

The script asks Slurm for one task per tensorfleet task and starts them all with one
``srun``. It does not name any task: each task finds its own identity from Slurm's variables
with :func:`tensorfleet.resolve_task` (:class:`~tensorfleet.cluster.resolver.SlurmDetector`:
the first ``TENSORFLEET_SLURM_NUM_PS`` ranks are the ps tasks, the others the workers, in
Slurm's block order). The script exports the shape (``TENSORFLEET_SLURM_NUM_PS`` and
``TENSORFLEET_SLURM_NUM_WORKERS``, so that a step with too few tasks fails at once, naming
both numbers), the base port, and the *path* of the secret file: the secret itself is never
on a command line or in the script.

Preemption and time limits: with ``--requeue`` (the default) Slurm may requeue the job when
it is preempted or its node fails, and ``--signal=B:USR1@N`` makes Slurm signal the script N
seconds before the time limit; the script then requeues the job itself (as Lightning's
``SLURMEnvironment(auto_requeue=True)`` and submitit do), so that the next run resumes from
the newest checkpoint. Slurm ends the requeued (or preempted) job's tasks with SIGTERM, then
SIGKILL after its ``KillWait``; tensorfleet's tasks take that SIGTERM as a preemption
(:mod:`tensorfleet.session.preemption`): the ps tasks wait for the chief's checkpoint and the
chief writes it, so the next run resumes at the step of the requeue. There is no restart
inside a job: ``srun --kill-on-bad-exit=1`` ends
the step as soon as one task fails, and the job's exit status is the step's.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tensorfleet import environment
from tensorfleet.cluster.resolver import SlurmDetector
from tensorfleet.cluster.spec import show
from tensorfleet.errors import ClusterConfigError
from tensorfleet.launch.renderers.secret_file import ensure_secret_file
from tensorfleet.launch.renderers.shape import ClusterShape

#: Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
_TIME_RE = re.compile(r"[0-9]+(:[0-9]{1,2}){0,2}|[0-9]+-[0-9]{1,2}(:[0-9]{1,2}){0,2}|UNLIMITED")
#: Names that go into ``#SBATCH`` lines as they are (no spaces, quotes or newlines).
_NAME_RE = re.compile(r"[A-Za-z0-9_.,%-]+")
_PATH_RE = re.compile(r"[A-Za-z0-9_.,%/-]+")

#: Seconds before the time limit at which Slurm signals the script to requeue the job.
DEFAULT_SIGNAL_SECONDS = 120


@dataclass(frozen=True)
class SbatchOptions:
    """What the sbatch script asks Slurm for, and what it runs.

    ``command`` runs in every task (ps tasks included, as ``srun`` starts one program; the
    ps tasks of a tensorfleet script call ``Server(...).join()``). ``secret_file`` must be
    readable at the same path on every node. ``nodes``, ``tasks_per_node``, ``gpus_per_task``,
    ``cpus_per_task``, ``time`` and ``partition`` are left to Slurm's defaults when ``None``.
    ``overcommit`` lets Slurm run more tasks than CPUs (ps tasks need little CPU).
    ``signal_seconds`` (with ``requeue``) is how long before the time limit the script
    requeues the job; 0 writes no signal.
    """

    shape: ClusterShape
    command: Sequence[str]
    secret_file: Path
    nodes: int | None = None
    tasks_per_node: int | None = None
    gpus_per_task: int | None = None
    cpus_per_task: int | None = None
    time: str | None = None
    partition: str | None = None
    job_name: str = "tensorfleet"
    output: str = "tensorfleet-%j.out"
    base_port: int = SlurmDetector.DEFAULT_BASE_PORT
    overcommit: bool = False
    requeue: bool = True
    signal_seconds: int = DEFAULT_SIGNAL_SECONDS

    def __post_init__(self) -> None:
        if not self.command:
            raise ClusterConfigError(
                "no command to run: give the training program after the options, e.g. "
                "`tensorfleet slurm --ps 1 --workers 3 -- python train.py`"
            )
        for name in ("nodes", "tasks_per_node", "gpus_per_task", "cpus_per_task"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                flag = "--" + name.replace("_", "-")
                raise ClusterConfigError(f"{flag} must be a positive integer, got {show(value)}")
        tasks = self.shape.num_tasks
        if self.nodes is not None and self.nodes > tasks:
            raise ClusterConfigError(
                f"--nodes {self.nodes} is more than the {tasks} tasks of {self.shape}: some "
                f"nodes would have no task. Ask for at most {tasks} nodes"
            )
        if self.nodes is not None and self.tasks_per_node is not None:
            room = self.nodes * self.tasks_per_node
            if room < tasks:
                raise ClusterConfigError(
                    f"the allocation is smaller than the cluster shape: --nodes {self.nodes} x "
                    f"--tasks-per-node {self.tasks_per_node} = {room} tasks, but {self.shape} "
                    f"= {tasks} tasks. Ask for more nodes or more tasks per node"
                )
        if self.time is not None and not _TIME_RE.fullmatch(self.time):
            raise ClusterConfigError(
                f"--time {show(self.time)} is not a Slurm time limit: write minutes, MM:SS, "
                "HH:MM:SS or D-HH:MM:SS (e.g. 2:00:00), or UNLIMITED"
            )
        for flag, value, pattern, allowed in (
            ("--partition", self.partition, _NAME_RE, "'_.,%-'"),
            ("--job-name", self.job_name, _NAME_RE, "'_.,%-'"),
            ("--log", self.output, _PATH_RE, "'_.,%-/'"),
        ):
            if value is not None and not pattern.fullmatch(value):
                raise ClusterConfigError(
                    f"{flag} {show(value)} may hold only letters, digits and {allowed} "
                    "(it goes into the script as it is)"
                )
        if not 1 <= self.base_port <= 65536 - tasks:
            raise ClusterConfigError(
                f"--base-port {self.base_port} with up to {tasks} tasks per node gives ports "
                "outside 1..65535; pick one in 1024..60000"
            )
        if self.signal_seconds < 0:
            raise ClusterConfigError(
                f"--signal-seconds must be 0 (no signal) or positive, got {self.signal_seconds}"
            )


def render_sbatch(options: SbatchOptions) -> str:
    """The text of the sbatch script for ``options``; submit it with ``sbatch FILE``."""
    shape = options.shape
    directives = [
        f"--job-name={options.job_name}",
        f"--ntasks={shape.num_tasks}",
        f"--nodes={options.nodes}" if options.nodes else None,
        f"--ntasks-per-node={options.tasks_per_node}" if options.tasks_per_node else None,
        f"--gpus-per-task={options.gpus_per_task}" if options.gpus_per_task else None,
        f"--cpus-per-task={options.cpus_per_task}" if options.cpus_per_task else None,
        f"--time={options.time}" if options.time else None,
        f"--partition={options.partition}" if options.partition else None,
        f"--output={options.output}",
        "--distribution=block",
        "--overcommit" if options.overcommit else None,
        "--requeue" if options.requeue else "--no-requeue",
        f"--signal=B:USR1@{options.signal_seconds}"
        if options.requeue and options.signal_seconds
        else None,
    ]
    srun = shlex.join(["srun", "--kill-on-bad-exit=1", "--label", *options.command])
    lines = [
        "#!/bin/bash",
        f"# tensorfleet: {shape}, one Slurm task each; written by `tensorfleet slurm`.",
        "# Submit with `sbatch THIS_FILE`.",
        *(f"#SBATCH {d}" for d in directives if d),
        "",
        "# Every task finds its identity from Slurm's variables (tensorfleet.resolve_task()):",
        _rank_rule(shape),
        "# The secret stays in its file (mode 600, readable at this path on every node).",
        f"export {environment.SLURM_NUM_PS_VAR}={shape.ps}",
        f"export {environment.SLURM_NUM_WORKERS_VAR}={shape.workers}",
        f"export {environment.SLURM_BASE_PORT_VAR}={options.base_port}",
        f"export {environment.SECRET_FILE_VAR}={shlex.quote(str(options.secret_file))}",
        f"unset {environment.SECRET_VAR} {environment.TF_CONFIG_VAR}",
        "",
    ]
    if options.requeue and options.signal_seconds:
        lines += [
            f"# {options.signal_seconds} s before the time limit Slurm sends USR1 to this "
            "script, which requeues",
            "# the job: the next run resumes from the newest checkpoint (keep the "
            "checkpoint_dir on shared storage).",
            "requeue() {",
            '    echo "tensorfleet: job $SLURM_JOB_ID is near its time limit: requeueing it" >&2',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "}",
            "trap requeue USR1",
            f"{srun} &",
            "step=$!",
            "while :; do",
            '    wait "$step"',
            "    status=$?",
            '    kill -0 "$step" 2>/dev/null || break  # else USR1 interrupted the wait',
            "done",
            'exit "$status"',
        ]
    else:
        lines.append(srun)
    return "\n".join(lines) + "\n"


def _rank_rule(shape: ClusterShape) -> str:
    """The comment saying which ranks are which tasks."""
    if shape.ps == 0:
        return "# every rank is a worker (all-reduce, no ps)."
    ps = "rank 0 is the ps task" if shape.ps == 1 else f"ranks 0..{shape.ps - 1} are the ps tasks"
    return f"# {ps}, the next ranks the workers, in block order."


def add_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``tensorfleet slurm`` to the ``tensorfleet`` command's subparsers."""
    parser = commands.add_parser(
        "slurm",
        help="write an sbatch script for a cluster shape",
        description="Write an sbatch script that runs PS parameter-server tasks and WORKERS "
        "worker tasks as one Slurm job, each task finding its identity from Slurm's variables. "
        "The secret is passed as a file (mode 600, created with a fresh secret if missing), "
        "never on a command line.",
        epilog="example: tensorfleet slurm --ps 1 --workers 3 --time 2:00:00 --secret-file "
        "~/.tensorfleet-secret -o job.sbatch -- python train.py && sbatch job.sbatch",
    )
    parser.add_argument("--ps", type=int, default=1, metavar="N", help="ps tasks (default: 1)")
    parser.add_argument(
        "--workers", type=int, default=2, metavar="N", help="worker tasks (default: 2)"
    )
    parser.add_argument("--nodes", type=int, metavar="N", help="nodes to spread the tasks on")
    parser.add_argument("--tasks-per-node", type=int, metavar="N", help="tasks on each node")
    parser.add_argument("--gpus-per-task", type=int, metavar="N", help="GPUs of each task")
    parser.add_argument("--cpus-per-task", type=int, metavar="N", help="CPUs of each task")
    parser.add_argument("--time", metavar="LIMIT", help="time limit, e.g. 2:00:00")
    parser.add_argument("--partition", metavar="NAME", help="Slurm partition")
    parser.add_argument(
        "--job-name", default="tensorfleet", metavar="NAME", help="(default: tensorfleet)"
    )
    parser.add_argument(
        "--log",
        default="tensorfleet-%j.out",
        metavar="PATTERN",
        help="the job's output file, Slurm's patterns (default: tensorfleet-%%j.out)",
    )
    parser.add_argument(
        "--base-port",
        type=int,
        default=SlurmDetector.DEFAULT_BASE_PORT,
        metavar="PORT",
        help="port of the first task on each node; the next tasks take the next ports "
        f"(default: {SlurmDetector.DEFAULT_BASE_PORT})",
    )
    parser.add_argument(
        "--overcommit",
        action="store_true",
        help="let Slurm run more tasks than CPUs on a node (ps tasks need little CPU)",
    )
    parser.add_argument(
        "--no-requeue",
        dest="requeue",
        action="store_false",
        help="do not let Slurm requeue the job after a preemption or near its time limit",
    )
    parser.add_argument(
        "--signal-seconds",
        type=int,
        default=DEFAULT_SIGNAL_SECONDS,
        metavar="S",
        help="requeue the job S seconds before its time limit; 0: never "
        f"(default: {DEFAULT_SIGNAL_SECONDS})",
    )
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        help="the cluster secret's file, on storage every node sees; created (mode 600) if "
        f"missing (default: ${environment.SECRET_FILE_VAR})",
    )
    parser.add_argument(
        "-o", "--output", metavar="SCRIPT", help="write the script here (default: stdout)"
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="COMMAND ...",
        help="the program every task runs (put -- before it)",
    )
    parser.set_defaults(handler=_slurm)


def _slurm(args: argparse.Namespace) -> int:
    """``tensorfleet slurm``: write the sbatch script; print its path when written to a file."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    shape = ClusterShape(args.ps, args.workers)
    secret_file = args.secret_file or environment.environ().get(environment.SECRET_FILE_VAR)
    if not secret_file:
        raise ClusterConfigError(
            "no secret file: give --secret-file PATH (created with a fresh secret, mode 600, "
            f"if missing) or set ${environment.SECRET_FILE_VAR}; it must be readable at that "
            "path on every node"
        )
    # Check everything before the secret file is created.
    options = SbatchOptions(
        shape=shape,
        command=command,
        secret_file=Path(secret_file).expanduser().absolute(),
        nodes=args.nodes,
        tasks_per_node=args.tasks_per_node,
        gpus_per_task=args.gpus_per_task,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        partition=args.partition,
        job_name=args.job_name,
        output=args.log,
        base_port=args.base_port,
        overcommit=args.overcommit,
        requeue=args.requeue,
        signal_seconds=args.signal_seconds,
    )
    ensure_secret_file(options.secret_file)
    script = render_sbatch(options)
    if args.output is None:
        sys.stdout.write(script)
        return 0
    Path(args.output).write_text(script)
    print(args.output)
    return 0
