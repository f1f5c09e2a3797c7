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
the newest checkpoint. N must leave the job time to run (:func:`requeue_signal_seconds`):
an explicit ``--signal-seconds`` that does not is refused, and the default (120 s) shrinks to
fit a short ``--time``, saying so. Slurm ends the requeued (or preempted) job's tasks with SIGTERM, then
SIGKILL after its ``KillWait``; tensorfleet's tasks take that SIGTERM as a preemption
(:mod:`tensorfleet.session.preemption`): the ps tasks wait for the chief's checkpoint and the
chief writes it, so the next run resumes at the step of the requeue. There is no restart
inside a job: ``srun --kill-on-bad-exit=1`` ends
the step as soon as one task fails, and the job's exit status is the step's.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
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
#: How much earlier than asked Slurm may send the signal (sbatch(1), ``--signal``: "up to
#: 60 seconds earlier than specified", the resolution of its event handling).
SIGNAL_EARLY_S = 60
#: The largest ``sig_time`` Slurm accepts in ``--signal``.
MAX_SIGNAL_SECONDS = 65535
#: The shortest ``--time`` (minutes) with room for a requeue signal (see
#: :func:`max_signal_seconds`): half of it less :data:`SIGNAL_EARLY_S` is at least 1 s.
SHORTEST_TIME_WITH_SIGNAL_MIN = math.ceil(2 * (SIGNAL_EARLY_S + 1) / 60)

log = logging.getLogger(__name__)


def time_limit_seconds(limit: str) -> int | None:
    """The seconds of a Slurm ``--time`` value, ``None`` for no limit (``UNLIMITED`` or 0).

    Slurm's formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS. Slurm counts whole
    minutes and rounds seconds up to the next minute (sbatch(1)), and so does this.
    """
    if limit == "UNLIMITED":
        return None
    days, _, clock = limit.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:  # HH:MM:SS
        hours, minutes, seconds = parts
    else:  # minutes, MM:SS
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    total = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    return math.ceil(total / 60) * 60 or None


def max_signal_seconds(limit_s: int) -> int:
    """The longest requeue signal that still lets a job with a ``limit_s`` time limit run:
    Slurm may signal up to :data:`SIGNAL_EARLY_S` seconds early, and the job must get at
    least half of its time limit before the signal (else every run is requeued having done
    little, and the job loops). 0 or less: no signal fits."""
    return limit_s // 2 - SIGNAL_EARLY_S


def check_signal_seconds(asked: int | None) -> None:
    """Refuse a ``--signal-seconds`` outside 0..:data:`MAX_SIGNAL_SECONDS` (``None``, the
    default, passes)."""
    if asked is not None and (
        isinstance(asked, bool)
        or not isinstance(asked, int)
        or not 0 <= asked <= MAX_SIGNAL_SECONDS
    ):
        raise ClusterConfigError(
            "--signal-seconds must be 0 (no signal) or a number of seconds up to "
            f"{MAX_SIGNAL_SECONDS} (Slurm's largest), got {show(asked)}"
        )


def requeue_signal_seconds(time: str | None, asked: int | None) -> tuple[int, str | None]:
    """The ``--signal`` seconds to write for ``--time time`` and ``--signal-seconds asked``
    (``None``: not given), and a note saying how the default was changed (else ``None``).

    An explicit value is checked against the time limit and refused with
    :class:`~tensorfleet.errors.ClusterConfigError` if it does not leave the job half of its
    limit (:func:`max_signal_seconds`). The default, :data:`DEFAULT_SIGNAL_SECONDS`, shrinks
    to the largest value that fits, or to none (0) when the limit is too short for any; the
    note says so. Without ``--time`` (the partition's default limit, unknown here) or with no
    limit, nothing is checked.
    """
    check_signal_seconds(asked)
    limit_s = None if time is None else time_limit_seconds(time)
    seconds = DEFAULT_SIGNAL_SECONDS if asked is None else asked
    if limit_s is None or seconds == 0:
        return seconds, None
    fits = max_signal_seconds(limit_s)
    if seconds <= fits:
        return seconds, None
    rule = (
        f"Slurm may send it up to {SIGNAL_EARLY_S} s early, and the job must get at least half "
        f"of its {limit_s} s before it"
    )
    if asked is not None:
        fix = (
            f"Give --signal-seconds {fits} or less, a longer --time"
            if fits > 0
            else f"Give a --time of at least {math.ceil(2 * (asked + SIGNAL_EARLY_S) / 60)} minutes"
        )
        raise ClusterConfigError(
            f"--signal-seconds {asked} does not leave the job time to run with --time {time}: "
            f"{rule}, else every run is requeued soon after it starts, forever. {fix}, or "
            "--signal-seconds 0 (no requeue near the time limit)"
        )
    if fits > 0:
        return fits, (
            f"the requeue signal comes {fits} s before the time limit, not the default "
            f"{DEFAULT_SIGNAL_SECONDS} s: with --time {time} ({rule}). Give --signal-seconds "
            "to choose another value that fits, or a longer --time"
        )
    return 0, (
        f"no requeue signal: --time {time} is too short for one ({rule}), so the job is not "
        "requeued near its time limit (a preemption still requeues it). Give a --time of at "
        f"least {SHORTEST_TIME_WITH_SIGNAL_MIN} minutes to have one"
    )


@dataclass(frozen=True)
class SbatchOptions:
    """What the sbatch script asks Slurm for, and what it runs.

    ``command`` runs in every task (ps tasks included, as ``srun`` starts one program; the
    ps tasks of a tensorfleet script call ``Server(...).join()``). ``secret_file`` must be
    readable at the same path on every node. ``nodes``, ``tasks_per_node``, ``gpus_per_task``,
    ``cpus_per_task``, ``time`` and ``partition`` are left to Slurm's defaults when ``None``.
    ``cpus_per_task`` goes on the ``srun`` line too: since Slurm 22.05 ``srun`` no longer
    takes it from the job (``SLURM_CPUS_PER_TASK``), and each task would get 1 CPU.
    ``gpus_per_task`` is every task's, ps tasks included (one ``srun`` step gives all its
    tasks the same resources); a note says how many GPUs the ps tasks take.
    ``overcommit`` lets Slurm run more tasks than CPUs (ps tasks need little CPU).
    ``signal_seconds`` (with ``requeue``) is how long before the time limit the script
    requeues the job; 0 writes no signal; ``None`` is the default, 120 s, shrunk to fit a
    short ``time`` (:func:`requeue_signal_seconds`). :attr:`signal_at` is the value written,
    :attr:`notes` what was changed or is worth knowing (also logged as warnings).
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
    signal_seconds: int | None = None
    signal_at: int = field(init=False, default=0)
    notes: tuple[str, ...] = field(init=False, default=())

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
        check_signal_seconds(self.signal_seconds)
        notes: list[str] = []
        signal_at = 0
        if self.requeue:
            signal_at, note = requeue_signal_seconds(self.time, self.signal_seconds)
            if note:
                notes.append(note)
        elif self.signal_seconds:
            notes.append(
                f"--signal-seconds {self.signal_seconds} is not used: with --no-requeue the "
                "script has no requeue signal (drop one of the two)"
            )
        if self.gpus_per_task and self.shape.ps:
            notes.append(
                f"--gpus-per-task {self.gpus_per_task} gives each of the {self.shape.ps} ps "
                f"task(s) GPUs too: {self.gpus_per_task * tasks} GPUs in all, "
                f"{self.gpus_per_task * self.shape.ps} of them for the ps, which do not use "
                "them (one srun step gives every task the same resources)"
            )
        object.__setattr__(self, "signal_at", signal_at)
        object.__setattr__(self, "notes", tuple(notes))
        for note in notes:
            log.warning("tensorfleet slurm: %s", note)


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
        f"--signal=B:USR1@{options.signal_at}" if options.signal_at else None,
    ]
    # srun takes --cpus-per-task from its own flag only (Slurm >= 22.05), not from the job.
    cpus = [f"--cpus-per-task={options.cpus_per_task}"] if options.cpus_per_task else []
    srun = shlex.join(["srun", "--kill-on-bad-exit=1", "--label", *cpus, *options.command])
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
    if options.signal_at:
        lines += [
            f"# {options.signal_at} s before the time limit Slurm sends USR1 to this "
            "script, which requeues",
            "# the job: the next run resumes from the newest checkpoint (keep the "
            "checkpoint_dir on shared storage).",
            "# USR1 interrupts the wait for the step (status 128+10): the loop waits again,",
            "# which also collects the status of a step that ended during the requeue.",
            "interrupted=0",
            "requeue() {",
            "    interrupted=1",
            '    echo "tensorfleet: job $SLURM_JOB_ID is near its time limit: requeueing it" >&2',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "}",
            "trap requeue USR1",
            f"{srun} &",
            "step=$!",
            "while :; do",
            '    wait "$step"',
            "    status=$?",
            '    [ "$interrupted" = 1 ] && [ "$status" -gt 128 ] || break',
            "    interrupted=0",
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
        default=None,
        metavar="S",
        help="requeue the job S seconds before its time limit; 0: never. It must leave the "
        f"job half its --time even if Slurm signals {SIGNAL_EARLY_S} s early (default: "
        f"{DEFAULT_SIGNAL_SECONDS}, shrunk to fit a short --time, saying so)",
    )
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        help="the cluster secret's file, on storage every node sees; created (mode 600, its "
        f"missing directories mode 700) if missing (default: ${environment.SECRET_FILE_VAR})",
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
