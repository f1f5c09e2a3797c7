"""``tensorfleet k8s render``: Kubernetes manifests that run a cluster shape.

What is written, for ``--ps P --workers W`` under ``--name NAME``:

- one ``Secret`` (``NAME-secret``) holding the cluster secret, mounted read-only as a file
  in every pod and read through ``TENSORFLEET_SECRET_FILE`` (never an environment value).
  The file is owned by root; the pod's ``securityContext.fsGroup`` (``--fs-group``, default
  :data:`DEFAULT_FS_GROUP`) makes the kubelet give it that group and mode 0440, and adds
  the group to every container's processes, so an image that runs as a non-root user can
  read it too (``--no-fs-group`` leaves the group to the cluster, e.g. OpenShift's SCC);
- per task, a headless ``Service`` (``NAME-ps-0``, ``NAME-worker-1``, ...) selecting that
  task's pod: a stable DNS name, ``NAME-worker-1.NAMESPACE.svc``, that follows the pod when
  it is replaced. Those names, with ``--port``, are the cluster spec;
- per task, a ``Job`` whose pod gets its identity in ``TF_CONFIG`` (TensorFlow's schema, as
  Kubeflow's TFJob sets it; :func:`tensorfleet.resolve_task` reads it), torch threads as many
  as the whole CPUs it requests (:mod:`tensorfleet.launch.renderers.pod_resources`), and, for
  a ps, its payload streams' port (``--stream-port``, declared in its Service too).

Why a Job per task, not StatefulSets: a StatefulSet restarts its pods forever, even after
they finish, while tensorfleet tasks run to completion (the ps tasks exit 0 by themselves
when training is over); and a StatefulSet's pods share one template, so their ``TF_CONFIG``
would have to be computed at run time from the ordinal, where a Job per task renders each
task's identity in the manifest, where it can be read and checked. Why not a Kubeflow
``TFJob``: it needs the Training Operator installed (and Kubeflow Trainer v2 replaces it
with TrainJob); plain Jobs run on any cluster.

The restart policy is the launcher's: a task killed by a signal (exit code 128 + n:
SIGKILL, the OOM killer, SIGTERM) is replaced by a new pod with the same identity, up to
``--max-restarts`` times (the Job's ``backoffLimit``, with Kubernetes' back-off); a pod
disrupted by the cluster (preemption, eviction, a node drained: the ``DisruptionTarget``
condition) is replaced without counting; a task that exits with an error (1..127: a Python
exception, a bad flag) fails its Job at once (``podFailurePolicy``). ``podReplacementPolicy:
Failed`` starts the new pod only once the old one is gone, so that two pods never hold one
identity. Each pod first waits (an init container, with a deadline) until every task's
name resolves: a headless Service has a DNS record only once its pod has an address, and a
ps binds to its own name.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tensorfleet import environment
from tensorfleet.cluster.spec import ClusterSpec, TaskId, show
from tensorfleet.errors import ClusterConfigError
from tensorfleet.launch.renderers.pod_resources import Resources
from tensorfleet.launch.renderers.secret_file import ensure_secret_file
from tensorfleet.launch.renderers.shape import ClusterShape
from tensorfleet.launch.renderers.yaml_text import dump_documents
from tensorfleet.wire.secret import generate_secret

#: Where the Secret is mounted in every pod, and the file the tasks read.
SECRET_DIR = "/etc/tensorfleet"
SECRET_KEY = "secret"
#: The container running the task (the pod failure policy names it).
CONTAINER = "tensorfleet"
#: Labels of every object; the Service of a task selects its pod by all four.
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
JOB_LABEL = "tensorfleet/job"
INDEX_LABEL = "tensorfleet/task-index"
#: The ps tasks' default program: the built-in parameter server (as the launcher runs it).
DEFAULT_PS_COMMAND = ("python", "-m", "tensorfleet", "server")
#: The pods' ``fsGroup``: the group the secret file gets (mode 0440) and every container's
#: processes get as a supplementary group, whatever user the image runs as. Any group
#: works; this one is the usual first non-root group.
DEFAULT_FS_GROUP = 1000
#: Longest Kubernetes name of a Service or namespace (a DNS label).
MAX_NAME_LENGTH = 63

_LABEL_CHARS_RE = re.compile(r"[-a-z0-9]")

#: The init container's program: wait until every host of TF_CONFIG's cluster resolves.
AWAIT_DNS = """\
import json, os, socket, sys, time
timeout = float(sys.argv[1])
hosts = sorted({a.rpartition(":")[0] for tasks in json.loads(os.environ["TF_CONFIG"])["cluster"].values() for a in tasks})
deadline = time.monotonic() + timeout
for host in hosts:
    while True:
        try:
            socket.getaddrinfo(host, None)
            break
        except socket.gaierror as error:
            if time.monotonic() > deadline:
                sys.exit(f"tensorfleet: {host} does not resolve after {timeout:g} s ({error}); is its Service applied and its pod scheduled?")
            time.sleep(1)
print(f"tensorfleet: all {len(hosts)} task names resolve", flush=True)
"""


@dataclass(frozen=True)
class KubernetesOptions:
    """What to render: the shape, the container image and the program of the workers.

    ``ps_command`` is the ps tasks' program (default: the built-in parameter server,
    ``python -m tensorfleet server``); ``max_restarts`` is how many times a task killed by a
    signal is replaced (each Job's ``backoffLimit``); ``dns_timeout_s`` bounds the wait for
    the other tasks' names. ``fs_group`` is every pod's ``securityContext.fsGroup``, so that
    a non-root image can read the secret file (``None``: no ``securityContext``; the secret
    file is then root's, mode 0400, readable only by an image that runs as root, unless the
    cluster sets an ``fsGroup`` itself). ``stream_port`` is the ps tasks' second port, where
    their payload streams listen (:mod:`tensorfleet.wire.service_streams`), declared beside
    ``port`` in the ps Services and containers; None (the default) takes the port after
    ``port`` (2223 beside the default 2222; the one before when ``port`` is 65535), so that
    ``--port`` alone never clashes with it. ``thread_budget`` gives each task as many
    torch threads as whole CPUs it requests
    (:meth:`~tensorfleet.launch.renderers.pod_resources.Resources.thread_env`); ``False``
    leaves torch's defaults.
    """

    shape: ClusterShape
    image: str
    command: Sequence[str]
    secret: bytes = field(repr=False)
    name: str = "tensorfleet"
    namespace: str = "default"
    port: int = 2222
    stream_port: int | None = None
    ps_command: Sequence[str] = DEFAULT_PS_COMMAND
    ps_resources: Resources = Resources(cpu="1", memory="2Gi")
    worker_resources: Resources = Resources(cpu="2", memory="4Gi")
    max_restarts: int = 3
    dns_timeout_s: int = 600
    fs_group: int | None = DEFAULT_FS_GROUP
    thread_budget: bool = True

    def __post_init__(self) -> None:
        if not self.command:
            raise ClusterConfigError(
                "no command to run: give the worker program after the options, e.g. "
                "`tensorfleet k8s render --image IMAGE -- python train.py`"
            )
        if not self.ps_command:
            raise ClusterConfigError("the ps command is empty; give the ps program")
        if not self.image or any(c.isspace() for c in self.image):
            raise ClusterConfigError(
                f"--image {show(self.image)} is not an image reference (e.g. "
                "registry.example.com/train:1.0)"
            )
        longest = f"{self.name}-worker-{max(self.shape.workers, self.shape.ps) - 1}"
        problem = dns_label_problem(self.name, letter_first=True, longest=longest)
        if problem is not None:
            raise ClusterConfigError(
                f"--name {show(self.name)} cannot name Kubernetes objects (Services need DNS "
                f"labels): {problem}"
            )
        problem = dns_label_problem(self.namespace, letter_first=False)
        if problem is not None:
            raise ClusterConfigError(
                f"--namespace {show(self.namespace)} is not a Kubernetes namespace name (a DNS "
                f"label): {problem}"
            )
        if self.fs_group is not None and (
            isinstance(self.fs_group, bool)
            or not isinstance(self.fs_group, int)
            or not 0 <= self.fs_group <= 2**31 - 1
        ):
            raise ClusterConfigError(
                f"--fs-group must be a group id in 0..{2**31 - 1}, got {show(self.fs_group)}; "
                "or --no-fs-group to render none"
            )
        if not 1 <= self.port <= 65535:
            raise ClusterConfigError(f"--port must be in 1..65535, got {self.port}")
        if self.stream_port is None:
            object.__setattr__(self, "stream_port", self.port + 1 if self.port < 65535 else 65534)
        if not 1 <= self.stream_port <= 65535:
            raise ClusterConfigError(
                f"--stream-port must be in 1..65535, got {self.stream_port}: it is the ps "
                "tasks' second port, for large payloads"
            )
        if self.stream_port == self.port and self.shape.ps > 0:
            raise ClusterConfigError(
                f"--stream-port {self.stream_port} is --port too: the ps tasks listen on both, "
                f"so they must differ; leave --stream-port out (it then follows --port: "
                f"{self.port + 1 if self.port < 65535 else 65534}) or give another port"
            )
        if self.max_restarts < 0:
            raise ClusterConfigError(
                f"--max-restarts must be 0 or more, got {self.max_restarts}: it is how many "
                "times a task killed by a signal is replaced"
            )
        if self.dns_timeout_s < 1:
            raise ClusterConfigError(f"the DNS timeout must be positive, got {self.dns_timeout_s}")

    def object_name(self, task: TaskId) -> str:
        """The name of a task's Service and Job, e.g. ``tensorfleet-worker-1``."""
        return f"{self.name}-{task.job}-{task.index}"

    def cluster(self) -> ClusterSpec:
        """The cluster spec every pod gets: each task at its Service's DNS name."""
        jobs: dict[str, list[str]] = {}
        for task in self.shape.tasks:
            address = f"{self.object_name(task)}.{self.namespace}.svc:{self.port}"
            jobs.setdefault(task.job, []).append(address)
        return ClusterSpec(jobs)


def render_manifests(options: KubernetesOptions) -> list[dict[str, Any]]:
    """The manifests, in the order to apply them: the Secret, then each task's Service and
    Job (ps tasks first)."""
    secret_name = f"{options.name}-secret"
    documents: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _metadata(options, secret_name, None),
            "type": "Opaque",
            "data": {SECRET_KEY: base64.b64encode(options.secret).decode("ascii")},
        }
    ]
    cluster = options.cluster().as_dict()
    for task in options.shape.tasks:
        name = options.object_name(task)
        documents.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _metadata(options, name, task),
                "spec": {
                    "clusterIP": "None",
                    "publishNotReadyAddresses": True,
                    "selector": _labels(options, task),
                    "ports": _ports(options, task, "port"),
                },
            }
        )
        documents.append(_job(options, task, name, secret_name, cluster))
    return documents


def render_yaml(options: KubernetesOptions) -> str:
    """:func:`render_manifests` as one YAML stream, for ``kubectl apply -f``."""
    return dump_documents(render_manifests(options))


def _labels(options: KubernetesOptions, task: TaskId | None) -> dict[str, str]:
    labels = {NAME_LABEL: "tensorfleet", INSTANCE_LABEL: options.name}
    if task is not None:
        labels[JOB_LABEL] = task.job
        labels[INDEX_LABEL] = str(task.index)
    return labels


def _metadata(options: KubernetesOptions, name: str, task: TaskId | None) -> dict[str, Any]:
    return {"name": name, "namespace": options.namespace, "labels": _labels(options, task)}


def _ports(options: KubernetesOptions, task: TaskId, key: str) -> list[dict[str, Any]]:
    """A task's ports, under ``key`` (a Service's ``port``, a container's ``containerPort``):
    the task's own, and for a ps the payload streams' (which it listens on because its pod's
    ``TENSORFLEET_PAYLOAD_STREAM_PORT`` says so), so that a network policy can name both."""
    ports = [{"name": "tensorfleet", key: options.port, "protocol": "TCP"}]
    if task.job == "ps":
        ports.append({"name": "payload-stream", key: options.stream_port, "protocol": "TCP"})
    return ports


def _job(
    options: KubernetesOptions,
    task: TaskId,
    name: str,
    secret_name: str,
    cluster: dict[str, Any],
) -> dict[str, Any]:
    tf_config = json.dumps({"cluster": cluster, "task": {"type": task.job, "index": task.index}})
    env = [
        {"name": environment.TF_CONFIG_VAR, "value": tf_config},
        {"name": environment.SECRET_FILE_VAR, "value": f"{SECRET_DIR}/{SECRET_KEY}"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    is_ps = task.job == "ps"
    resources = options.ps_resources if is_ps else options.worker_resources
    if options.thread_budget:
        env += [{"name": k, "value": v} for k, v in sorted(resources.thread_env().items())]
    if is_ps:
        stream_port = str(options.stream_port)
        env.append({"name": environment.PAYLOAD_STREAM_PORT_VAR, "value": stream_port})
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": options.image,
        "command": list(options.ps_command if is_ps else options.command),
        "env": env,
        "ports": _ports(options, task, "containerPort"),
        "volumeMounts": [{"name": "secret", "mountPath": SECRET_DIR, "readOnly": True}],
    }
    manifest_resources = resources.as_manifest()
    if manifest_resources:
        container["resources"] = manifest_resources
    await_dns = {
        "name": "await-dns",
        "image": options.image,
        "command": ["python", "-c", AWAIT_DNS, str(options.dns_timeout_s)],
        "env": env[:1],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(options, name, task),
        "spec": {
            "backoffLimit": options.max_restarts,
            "podReplacementPolicy": "Failed",
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "Ignore",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                    },
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": CONTAINER,
                            "operator": "In",
                            "values": list(range(1, 128)),
                        },
                    },
                ]
            },
            "template": {
                "metadata": {"labels": _labels(options, task)},
                "spec": {
                    "restartPolicy": "Never",
                    **_security_context(options),
                    "initContainers": [await_dns],
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "secret",
                            "secret": {"secretName": secret_name, "defaultMode": 0o400},
                        }
                    ],
                },
            },
        },
    }


def _security_context(options: KubernetesOptions) -> dict[str, Any]:
    """The pod's ``securityContext``: its ``fsGroup`` (none when ``fs_group`` is None).

    With it the kubelet gives the secret volume's file that group and mode 0440 (the volume's
    0400 plus group read), and every container's processes have the group, whatever user the
    image runs as. ``OnRootMismatch`` spares volumes already owned by the group the recursive
    ownership change (for volumes the user adds to the pod).
    """
    if options.fs_group is None:
        return {}
    return {
        "securityContext": {
            "fsGroup": options.fs_group,
            "fsGroupChangePolicy": "OnRootMismatch",
        }
    }


def dns_label_problem(value: str, *, letter_first: bool, longest: str | None = None) -> str | None:
    """What makes ``value`` not a Kubernetes DNS label, naming the rule that fails and the
    fix, or None when it is one.

    The rules (RFC 1123 labels, as namespaces; ``letter_first`` adds RFC 1035's first letter,
    as Service names): only lower-case letters, digits and '-', starting with a letter (or a
    digit, without ``letter_first``) and ending with a letter or digit, at most 63
    characters. ``longest`` is the longest name built from ``value`` (``NAME-worker-11``),
    which must fit in 63 characters too.
    """
    if not value:
        return "it is empty; give a name such as 'mnist'"
    upper = any(c.isupper() for c in value)
    others = sorted({c for c in value if not c.isupper() and not _LABEL_CHARS_RE.fullmatch(c)})
    if upper or others:
        found = ["upper-case letters"] if upper else []
        if others:
            found.append(", ".join(map(repr, others)))
        problem = f"it has {' and '.join(found)}, and Kubernetes names allow only lower-case letters, digits and '-'"
        suggestion = re.sub(r"[^-a-z0-9]+", "-", value.lower()).strip("-")
        built = None if longest is None else suggestion + longest[len(value) :]
        if (
            suggestion
            and dns_label_problem(suggestion, letter_first=letter_first, longest=built) is None
        ):
            problem += f"; use e.g. {suggestion!r}"
        return problem
    if letter_first and not value[0].isalpha():
        return f"it starts with {value[0]!r}, and a Service name must start with a letter"
    if value.startswith("-"):
        return "it starts with '-', and Kubernetes names must start with a letter or digit"
    if value.endswith("-"):
        return "it ends with '-', and Kubernetes names must end with a letter or digit"
    longest = longest or value
    if len(longest) > MAX_NAME_LENGTH:
        fit = MAX_NAME_LENGTH - (len(longest) - len(value))
        named = "it has" if longest == value else f"the longest object name, {longest!r}, has"
        return (
            f"{named} {len(longest)} characters, more than Kubernetes' {MAX_NAME_LENGTH}; "
            f"use at most {fit} characters"
        )
    return None


def add_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``tensorfleet k8s render`` to the ``tensorfleet`` command's subparsers."""
    k8s = commands.add_parser(
        "k8s",
        help="Kubernetes: render manifests for a cluster shape",
        description="Kubernetes support. `tensorfleet k8s render` writes the manifests.",
    )
    actions = k8s.add_subparsers(dest="k8s_action", metavar="ACTION", required=True)
    render = actions.add_parser(
        "render",
        help="write the manifests of a cluster shape",
        description="Write a Secret, a headless Service per task and a Job per task (its "
        "identity in TF_CONFIG) for PS ps tasks and WORKERS worker tasks, as YAML for "
        "`kubectl apply -f`. The output holds the cluster secret: it is written with mode 600.",
        epilog="example: tensorfleet k8s render --ps 1 --workers 3 --image "
        "registry.example.com/train:1.0 -o cluster.yaml -- python train.py --steps 3000",
    )
    render.add_argument("--ps", type=int, default=1, metavar="N", help="ps tasks (default: 1)")
    render.add_argument(
        "--workers", type=int, default=2, metavar="N", help="worker tasks (default: 2)"
    )
    render.add_argument("--image", required=True, help="the container image of every task")
    render.add_argument(
        "--name", default="tensorfleet", help="prefix of every object (default: tensorfleet)"
    )
    render.add_argument("--namespace", default="default", help="(default: default)")
    render.add_argument("--port", type=int, default=2222, help="port of every task (default: 2222)")
    render.add_argument(
        "--stream-port",
        type=int,
        default=None,
        metavar="PORT",
        help="the ps tasks' second port, for large payloads over a plain TCP stream (rendered "
        "as TENSORFLEET_PAYLOAD_STREAM_PORT and declared in the Service; default: the port "
        "after --port, 2223; 65534 with --port 65535)",
    )
    render.add_argument("--worker-cpu", default="2", metavar="Q", help="(default: 2)")
    render.add_argument("--worker-memory", default="4Gi", metavar="Q", help="(default: 4Gi)")
    render.add_argument(
        "--worker-gpus", type=int, default=0, metavar="N", help="nvidia.com/gpu (default: 0)"
    )
    render.add_argument("--ps-cpu", default="1", metavar="Q", help="(default: 1)")
    render.add_argument("--ps-memory", default="2Gi", metavar="Q", help="(default: 2Gi)")
    render.add_argument(
        "--no-thread-budget",
        dest="thread_budget",
        action="store_false",
        help="leave torch's thread defaults alone in every pod (by default each task gets as "
        "many torch threads as whole CPUs it requests: TENSORFLEET_INTRA_OP_THREADS, "
        "OMP_NUM_THREADS)",
    )
    ps_mode = render.add_mutually_exclusive_group()
    ps_mode.add_argument(
        "--ps-command",
        metavar="CMD",
        help="the ps tasks' program, split like a shell would (default: "
        f"{shlex.join(DEFAULT_PS_COMMAND)})",
    )
    ps_mode.add_argument(
        "--ps-runs-script", action="store_true", help="run COMMAND for the ps tasks too"
    )
    fs_group = render.add_mutually_exclusive_group()
    fs_group.add_argument(
        "--fs-group",
        type=int,
        default=DEFAULT_FS_GROUP,
        metavar="GID",
        help="every pod's securityContext.fsGroup: the secret file gets this group (mode "
        "0440) and every container's processes have it, so a non-root image can read it "
        f"(default: {DEFAULT_FS_GROUP})",
    )
    fs_group.add_argument(
        "--no-fs-group",
        dest="fs_group",
        action="store_const",
        const=None,
        help="render no securityContext (the secret file stays root's, mode 0400: the image "
        "must run as root, or the cluster set an fsGroup, as OpenShift does)",
    )
    render.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="replace a task killed by a signal up to N times (default: 3)",
    )
    render.add_argument(
        "--secret-file",
        metavar="PATH",
        help="put this file's secret in the Secret (created, mode 600, its missing directories "
        "mode 700, if missing; default: a fresh secret)",
    )
    render.add_argument(
        "-o", "--output", metavar="FILE", help="write here, mode 600 (default: stdout)"
    )
    render.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="COMMAND ...",
        help="the worker program (put -- before it)",
    )
    render.set_defaults(handler=_render)


def _render(args: argparse.Namespace) -> int:
    """``tensorfleet k8s render``: write the manifests; print the path when written to a file."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    ps_command: Sequence[str] = DEFAULT_PS_COMMAND
    if args.ps_runs_script:
        ps_command = command
    elif args.ps_command is not None:
        try:
            ps_command = shlex.split(args.ps_command)
        except ValueError as exc:
            raise ClusterConfigError(
                f"cannot split --ps-command {args.ps_command!r}: {exc}"
            ) from None
    shape = ClusterShape(args.ps, args.workers)
    ps_resources = Resources(args.ps_cpu, args.ps_memory, job="ps")
    worker_resources = Resources(args.worker_cpu, args.worker_memory, args.worker_gpus, "worker")
    # A placeholder secret first: every option is checked before a secret file is created.
    options = KubernetesOptions(
        shape=shape,
        image=args.image,
        command=command,
        secret=b"",
        name=args.name,
        namespace=args.namespace,
        port=args.port,
        stream_port=args.stream_port,
        ps_command=ps_command,
        ps_resources=ps_resources,
        worker_resources=worker_resources,
        max_restarts=args.max_restarts,
        fs_group=args.fs_group,
        thread_budget=args.thread_budget,
    )
    if args.stream_port is not None and shape.ps == 0:
        print(
            f"tensorfleet k8s render: note: --stream-port {args.stream_port} has no effect with "
            "--ps 0 (only ps tasks listen for payload streams); leave it out",
            file=sys.stderr,
        )
    if args.secret_file:
        secret = ensure_secret_file(args.secret_file)[1]
    else:
        secret = generate_secret().encode("ascii")
    text = render_yaml(replace(options, secret=secret))
    if args.output is None:
        sys.stdout.write(text)
        return 0
    fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    Path(args.output).chmod(0o600)  # an existing file keeps its mode through O_TRUNC
    print(args.output)
    return 0
