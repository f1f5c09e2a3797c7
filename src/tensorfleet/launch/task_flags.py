"""The command-line options that say which task a program runs and how it talks to the others:
``tensorfleet server``'s task options, and the security options it shares with scripts.

Security: :func:`add_security_flags` adds ``--secret-file PATH`` and ``--encrypt`` to a parser,
and :func:`task_security` turns them into the secret and the encryption choice for
:class:`~tensorfleet.session.server.Server`. ``tensorfleet server`` and the examples call both,
so the two options behave identically in every program that offers them: the secret comes
from ``--secret-file``, else ``$TENSORFLEET_SECRET``, else ``$TENSORFLEET_SECRET_FILE``;
``--encrypt`` turns encryption on, and without it ``$TENSORFLEET_ENCRYPT`` decides::

    parser = argparse.ArgumentParser()
    add_security_flags(parser)
    args = parser.parse_args()
    security = task_security(args)
    server = tfl.Server(cluster, "worker", 0, secret=security.secret,
                        config=tfl.ServerConfig(encrypt=security.encrypt))

Task: :func:`add_server_task_flags` and :func:`resolve_server_task` are ``tensorfleet
server``'s. The task is given with ``--job ps --task N`` and the cluster with ``--cluster`` or
the per-job host lists of Distributed TensorFlow (``--ps_hosts``, ``--worker_hosts``,
``--chief_hosts``; ``--job_name`` and ``--task_index`` are accepted for ``--job`` and
``--task``), all together; or with none of them, from ``TF_CONFIG`` (or Slurm's variables).
Flags that disagree with a ``TF_CONFIG`` that is set are refused, as
:func:`~tensorfleet.cluster.resolver.resolve_task` refuses them in scripts. Errors name the
command's own options, not :func:`resolve_task`'s arguments.

The server runs ps tasks only: for a worker, :class:`Server.join` would return at once and the
command would exit 0 having done nothing, so a worker's task is refused with the fix (run the
training script there). No program in tensorfleet runs ``tensorfleet server`` for another job:
``tensorfleet launch`` runs it for ps tasks only (``--ps-runs-script`` runs the user's script
instead), and so do the Kubernetes manifests.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorfleet import environment
from tensorfleet.cluster import warm_spare
from tensorfleet.cluster.resolver import (
    FlagsDetector,
    ResolvedTask,
    ResolveRequest,
    SlurmDetector,
    TFConfigDetector,
    check_agrees_with_tf_config,
    resolve_task,
)
from tensorfleet.cluster.spec import check_job_name, check_task_index
from tensorfleet.errors import ClusterConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

#: The per-job host-list options, by job, as Distributed TensorFlow scripts spell them.
HOSTS_FLAGS = {"ps": "--ps_hosts", "worker": "--worker_hosts", "chief": "--chief_hosts"}
#: How the server's task options are named in its errors.
SERVER_TASK_FLAGS = "--job/--task/--cluster (or --ps_hosts/--worker_hosts)"
_HOW = (
    "give --job ps --task N with --cluster JSON_OR_FILE (or --ps_hosts=h:p,... "
    "--worker_hosts=h:p,...), or none of them and set TF_CONFIG (`tensorfleet launch` and "
    "Kubernetes do)"
)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--secret-file PATH`` and ``--encrypt`` to ``parser``; read them with
    :func:`task_security`."""
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        help="file holding the cluster secret (mode 600; default: $TENSORFLEET_SECRET, else "
        "$TENSORFLEET_SECRET_FILE)",
    )
    parser.add_argument(
        "--encrypt",
        action="store_true",
        help="encrypt traffic with AES-256-GCM under keys agreed per connection (default: "
        "$TENSORFLEET_ENCRYPT); every task must agree",
    )


@dataclass(frozen=True)
class TaskSecurity:
    """What :func:`task_security` read: the cluster secret, and whether to encrypt."""

    #: The cluster secret (checked: long enough, its file not readable by others or warned).
    secret: bytes
    #: True for ``--encrypt``; None leaves it to ``$TENSORFLEET_ENCRYPT``
    #: (:attr:`ServerConfig.encrypt`).
    encrypt: bool | None


def task_security(args: argparse.Namespace) -> TaskSecurity:
    """The secret and encryption choice that :func:`add_security_flags`'s options ask for.

    Raises :class:`~tensorfleet.errors.AuthenticationError` when no secret is found or it is
    too short, naming where it looked."""
    from tensorfleet.wire.secret import load_secret

    return TaskSecurity(load_secret(secret_file=args.secret_file), True if args.encrypt else None)


def add_server_task_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``tensorfleet server``'s task options: ``--cluster``, the host lists, ``--job``
    and ``--task``; read them with :func:`resolve_server_task`."""
    parser.add_argument(
        "--cluster",
        metavar="JSON_OR_FILE",
        help='the cluster spec as JSON (\'{"ps": ["h:p"], "worker": [...]}\') or a JSON file',
    )
    for job, flag in HOSTS_FLAGS.items():
        parser.add_argument(
            flag,
            flag.replace("_", "-"),
            dest=f"{job}_hosts",
            metavar="H:P,...",
            help=f"the {job} tasks' addresses, comma-separated, instead of --cluster",
        )
    parser.add_argument(
        "--job",
        "--job_name",
        dest="job",
        metavar="NAME",
        help="this task's job name: ps (default: from TF_CONFIG)",
    )
    parser.add_argument(
        "--task",
        "--task_index",
        dest="task",
        type=int,
        metavar="INDEX",
        help="this task's index in its job (default: from TF_CONFIG)",
    )


def resolve_server_task(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ResolvedTask:
    """The ps task ``tensorfleet server`` runs, from :func:`add_server_task_flags`'s options or,
    when none is given, from ``TF_CONFIG`` or Slurm's variables in ``environ`` (default: this
    process's environment).

    Raises :class:`ClusterConfigError`, in the command's own terms, when the options are
    incomplete or contradict each other or ``TF_CONFIG``, when nothing names a task, and when
    the task is not a ps task."""
    if environ is None and warm_spare.is_spare(environment.environ()):
        # A warm spare ps of the launcher (launch/warm_spares.py): torch and the server are
        # imported; wait here, before listening, for the identity of a ps task that died.
        warm_spare.wait_for_identity()
    env = environment.environ() if environ is None else environ
    hosts = {job: value for job in HOSTS_FLAGS if (value := getattr(args, f"{job}_hosts"))}
    if args.cluster is not None and hosts:
        given = ", ".join(HOSTS_FLAGS[job] for job in hosts)
        raise ClusterConfigError(
            f"tensorfleet server got both --cluster and {given}; describe the cluster one way "
            "only: --cluster JSON_OR_FILE, or the per-job host lists"
        )
    cluster_flag = "--cluster" if not hosts else "/".join(HOSTS_FLAGS[job] for job in hosts)
    given_flags = {
        cluster_flag: args.cluster is not None or bool(hosts),
        "--job": args.job is not None,
        "--task": args.task is not None,
    }
    if not any(given_flags.values()):
        detected = resolve_task(
            argv=[], environ=env, allow_none=True, detectors=(TFConfigDetector(), SlurmDetector())
        )
        if detected is None:
            raise ClusterConfigError(
                "which ps task should tensorfleet server run? None of its task options was "
                f"given and {environment.TF_CONFIG_VAR} is not set: {_HOW}"
            )
        task = detected
    elif not all(given_flags.values()):
        present = [flag for flag, given in given_flags.items() if given]
        missing = [flag for flag, given in given_flags.items() if not given]
        raise ClusterConfigError(
            f"tensorfleet server got {', '.join(present)} but not {', '.join(missing)}: {_HOW}"
        )
    else:
        task = _task_from_flags(args, hosts, env)
    if task.job != "ps":
        raise ClusterConfigError(
            f"tensorfleet server runs ps tasks, but this task is {task.job}:{task.index} "
            f"(from {task.source}); run your training script for worker tasks (e.g. "
            "`python train.py --cluster ... --job_name worker --task_index 0`), and "
            "tensorfleet server with --job ps on the ps machines only"
        )
    return task


def _task_from_flags(
    args: argparse.Namespace, hosts: dict[str, str], environ: Mapping[str, str]
) -> ResolvedTask:
    """The task the complete set of options describes (the resolver's own flag reading, so
    that the cluster is parsed as in scripts), checked against ``TF_CONFIG``."""
    argv = [
        f"--job_name={check_job_name(args.job, '--job')}",
        f"--task_index={check_task_index(args.task, '--task')}",
    ]
    if args.cluster is not None:
        argv.append(f"--cluster={args.cluster}")
    argv += [f"{HOSTS_FLAGS[job]}={value}" for job, value in hosts.items()]
    task = FlagsDetector().detect(ResolveRequest(None, None, None, argv, environ))
    assert task is not None  # every option is there
    check_agrees_with_tf_config(task, environ, SERVER_TASK_FLAGS)
    return task
