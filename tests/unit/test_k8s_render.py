"""tensorfleet k8s render: the manifests validate offline against named Kubernetes versions,
each pod's TF_CONFIG resolves to its own task, the secret is a mounted file, each task gets
the torch threads of the CPUs it requests and each ps its payload streams' port (both read
back as the task reads them), and bad shapes are refused before anything is written."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from tensorfleet.cluster.resolver import resolve_task
from tensorfleet.cluster.resources import OPENMP_SPIN_COUNT, TaskResources
from tensorfleet.errors import ClusterConfigError
from tensorfleet.launch.cli import main
from tensorfleet.launch.renderers.kubernetes import (
    AWAIT_DNS,
    DEFAULT_FS_GROUP,
    KubernetesOptions,
    render_manifests,
    render_yaml,
)
from tensorfleet.launch.renderers.pod_resources import Resources
from tensorfleet.launch.renderers.shape import ClusterShape
from tensorfleet.wire.service_streams import listen_port

#: The oldest version with every field the Jobs use on by default (podFailurePolicy GA in
#: 1.31; podReplacementPolicy beta, on by default, since 1.29), the first with both GA
#: (podReplacementPolicy: 1.34), and the newest the validator knows.
KUBERNETES_VERSIONS = ["1.31.0", "1.34.0", "1.37.0"]
SECRET = b"0123456789abcdef0123456789abcdef"


def options(ps: int = 2, workers: int = 3, **kwargs) -> KubernetesOptions:
    return KubernetesOptions(
        shape=ClusterShape(ps, workers),
        image="registry.example.com/train:1.0",
        command=["python", "train.py", "--steps", "3000"],
        secret=SECRET,
        **kwargs,
    )


def by_kind(documents, kind):
    return [d for d in documents if d["kind"] == kind]


def env_of(container) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container["env"]}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_strictly(version):
    documents = render_manifests(
        options(worker_resources=Resources(cpu="4", memory="8Gi", gpus=1), namespace="ml")
    )
    assert [d["kind"] for d in documents[:3]] == ["Secret", "Service", "Job"]
    for document in documents:
        kubernetes_validate.validate(document, version, strict=True)


def test_a_broken_manifest_fails_validation():
    """The validator is not a no-op: a typo in a field is caught."""
    job = by_kind(render_manifests(options()), "Job")[0]
    job["spec"]["backofLimit"] = job["spec"].pop("backoffLimit")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES_VERSIONS[0], strict=True)


def test_yaml_reads_back_as_the_manifests():
    opts = options(namespace="ml", name="mnist")
    assert list(yaml.safe_load_all(render_yaml(opts))) == render_manifests(opts)


def test_each_pod_tf_config_resolves_to_its_own_task():
    opts = options(ps=2, workers=3, namespace="ml", name="mnist", port=2300)
    documents = render_manifests(opts)
    jobs, services = by_kind(documents, "Job"), by_kind(documents, "Service")
    assert len(jobs) == len(services) == 5
    expected_cluster = {
        "ps": [f"mnist-ps-{i}.ml.svc:2300" for i in range(2)],
        "worker": [f"mnist-worker-{i}.ml.svc:2300" for i in range(3)],
    }
    seen = []
    for job in jobs:
        pod = job["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        task = resolve_task(argv=[], environ={"TF_CONFIG": env_of(container)["TF_CONFIG"]})
        seen.append(str(task.task_id))
        assert task.source == "TF_CONFIG"
        assert task.cluster.as_dict() == expected_cluster
        assert job["metadata"]["name"] == f"mnist-{task.job}-{task.index}"
        labels = pod["metadata"]["labels"]
        assert (labels["tensorfleet/job"], labels["tensorfleet/task-index"]) == (
            task.job,
            str(task.index),
        )
        # The task's address is its own Service, and that Service selects only this pod.
        host = task.address.split(".")[0]
        (service,) = [s for s in services if s["metadata"]["name"] == host]
        selecting = [
            j
            for j in jobs
            if service["spec"]["selector"].items()
            <= j["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert selecting == [job]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["ports"][0]["port"] == 2300
        assert container["ports"][0]["containerPort"] == 2300
    assert seen == ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2"]


def test_ps_run_the_built_in_server_and_workers_the_command():
    jobs = by_kind(render_manifests(options(ps=1, workers=1)), "Job")
    commands = [j["spec"]["template"]["spec"]["containers"][0]["command"] for j in jobs]
    assert commands == [
        ["python", "-m", "tensorfleet", "server"],
        ["python", "train.py", "--steps", "3000"],
    ]


def test_the_secret_is_a_mounted_file_never_an_environment_value():
    documents = render_manifests(options())
    (secret,) = by_kind(documents, "Secret")
    assert base64.b64decode(secret["data"]["secret"]) == SECRET
    for job in by_kind(documents, "Job"):
        spec = job["spec"]["template"]["spec"]
        (volume,) = spec["volumes"]
        assert volume["secret"] == {"secretName": secret["metadata"]["name"], "defaultMode": 0o400}
        (container,) = spec["containers"]
        (mount,) = container["volumeMounts"]
        assert mount["readOnly"] and mount["name"] == volume["name"]
        env = env_of(container)
        assert env["TENSORFLEET_SECRET_FILE"] == f"{mount['mountPath']}/secret"
        assert "TENSORFLEET_SECRET" not in env
        for init in spec["initContainers"]:
            assert SECRET.decode() not in json.dumps(init)
        assert SECRET.decode() not in json.dumps(job)


def test_restart_policy_is_the_launchers():
    job = by_kind(render_manifests(options(max_restarts=5)), "Job")[0]
    spec = job["spec"]
    assert spec["backoffLimit"] == 5
    assert spec["podReplacementPolicy"] == "Failed"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    ignore, fail = spec["podFailurePolicy"]["rules"]
    assert ignore == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["operator"] == "In"
    failing = set(fail["onExitCodes"]["values"])
    assert failing == set(range(1, 128)), "error exits fail fast; signals (128+n) are retried"
    assert {137, 143}.isdisjoint(failing)


def test_resources():
    documents = render_manifests(
        options(
            ps=1,
            workers=1,
            ps_resources=Resources(cpu="500m", memory="1Gi"),
            worker_resources=Resources(cpu="4", memory="16Gi", gpus=2),
        )
    )
    ps, worker = (
        j["spec"]["template"]["spec"]["containers"][0]["resources"]
        for j in by_kind(documents, "Job")
    )
    assert ps == {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}
    assert worker == {
        "requests": {"cpu": "4", "memory": "16Gi"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": 2},
    }


@pytest.mark.parametrize(("cpu", "threads"), [("500m", 1), ("1", 1), ("2500m", 2), ("2.5", 2), ("4", 4), ("1k", 1000), (None, None)])  # fmt: skip
def test_the_threads_are_the_whole_cpus_requested(cpu, threads):
    assert Resources(cpu=cpu).threads() == threads


def test_each_task_gets_the_threads_of_the_cpus_it_requests(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")  # the renderer's own setting is not the pods'
    documents = render_manifests(
        options(
            ps=1,
            workers=2,
            ps_resources=Resources(cpu="3", memory="1Gi"),
            worker_resources=Resources(cpu="1500m", memory="2Gi"),
        )
    )
    containers = [j["spec"]["template"]["spec"]["containers"][0] for j in by_kind(documents, "Job")]
    for container, threads in zip(containers, [3, 1, 1], strict=True):
        env = env_of(container)
        assert TaskResources.from_env(env).intra_op_threads == threads  # as the task reads it
        assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(threads)
        assert env["GOMP_SPINCOUNT"] == str(OPENMP_SPIN_COUNT)
    for kwargs in ({"thread_budget": False}, {"worker_resources": Resources(memory="2Gi")}):
        for job in by_kind(render_manifests(options(**kwargs)), "Job"):
            env = env_of(job["spec"]["template"]["spec"]["containers"][0])
            worker = job["metadata"]["labels"]["tensorfleet/job"] == "worker"
            if worker or "thread_budget" in kwargs:
                assert not {"TENSORFLEET_INTRA_OP_THREADS", "OMP_NUM_THREADS"} & env.keys()


def test_each_ps_listens_for_payload_streams_on_a_declared_port():
    documents = render_manifests(options(ps=2, workers=1, port=2300, stream_port=2400))
    services = {s["metadata"]["name"]: s for s in by_kind(documents, "Service")}
    for job in by_kind(documents, "Job"):
        name, container = job["metadata"]["name"], job["spec"]["template"]["spec"]["containers"][0]
        service_ports = {p["name"]: p["port"] for p in services[name]["spec"]["ports"]}
        container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        env = env_of(container)
        if job["metadata"]["labels"]["tensorfleet/job"] == "ps":
            assert listen_port(env) == 2400  # as the ps's service reads it
            expected = {"tensorfleet": 2300, "payload-stream": 2400}
        else:
            assert "TENSORFLEET_PAYLOAD_STREAM_PORT" not in env
            expected = {"tensorfleet": 2300}
        assert service_ports == container_ports == expected


def test_the_stream_port_follows_the_port_unless_given():
    """A new user's ``--port 2223`` alone was refused for clashing with the stream port's
    fixed default (2223), also with ``--ps 0``, where no task listens on a stream port."""
    assert options().stream_port == 2223
    assert options(port=2223).stream_port == 2224
    assert options(port=65535).stream_port == 65534
    assert options(port=2223, stream_port=9000).stream_port == 9000
    assert options(ps=0, workers=2, stream_port=2222).stream_port == 2222  # no ps: no clash


def test_cli_says_a_stream_port_without_ps_tasks_has_no_effect(capsys):
    argv = ["k8s", "render", "--ps", "0", "--workers", "2", "--image", "img:1"]
    assert main([*argv, "--stream-port", "9000", "--", "python", "train.py"]) == 0
    err = capsys.readouterr().err
    assert "--stream-port 9000 has no effect with --ps 0" in err, err
    assert main([*argv, "--", "python", "train.py"]) == 0
    assert "--stream-port" not in capsys.readouterr().err


def test_cli_stream_port_and_thread_flags(capsys):
    argv = ["k8s", "render", "--ps", "1", "--workers", "1", "--image", "img:1", "--ps-cpu", "2"]
    assert main([*argv, "--stream-port", "9000", "--", "python", "train.py"]) == 0
    ps, worker = (
        d["spec"]["template"]["spec"]["containers"][0]
        for d in yaml.safe_load_all(capsys.readouterr().out)
        if d["kind"] == "Job"
    )
    assert env_of(ps)["TENSORFLEET_PAYLOAD_STREAM_PORT"] == "9000"
    assert main([*argv, "--port", "2223", "--", "python", "train.py"]) == 0
    jobs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d["kind"] == "Job"]
    assert (
        env_of(jobs[0]["spec"]["template"]["spec"]["containers"][0])[
            "TENSORFLEET_PAYLOAD_STREAM_PORT"
        ]
        == "2224"
    )
    assert env_of(ps)["TENSORFLEET_INTRA_OP_THREADS"] == "2"
    assert env_of(worker)["TENSORFLEET_INTRA_OP_THREADS"] == "2"  # --worker-cpu's default
    assert main([*argv, "--no-thread-budget", "--", "python", "train.py"]) == 0
    for document in yaml.safe_load_all(capsys.readouterr().out):
        if document["kind"] == "Job":
            env = env_of(document["spec"]["template"]["spec"]["containers"][0])
            assert "TENSORFLEET_INTRA_OP_THREADS" not in env


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: ClusterShape(0, 0), "the cluster shape has 0 tasks (0 ps, 0 workers)"),
        (lambda: ClusterShape(2, 0), "has 2 ps tasks but 0 workers"),
        (lambda: ClusterShape(-1, 2), "number of ps tasks must be a non-negative integer, got -1"),
        (lambda: options(name="My_Job"), "--name 'My_Job' cannot name Kubernetes objects"),
        (
            lambda: options(name="x" * 60),
            "the longest object name, '" + "x" * 60 + "-worker-2', has 69 characters, more "
            "than Kubernetes' 63; use at most 54 characters",
        ),
        (lambda: options(namespace="Prod"), "--namespace 'Prod' is not a Kubernetes namespace"),
        (lambda: options(fs_group=-1), "--fs-group must be a group id in 0..2147483647, got -1"),
        (lambda: options(port=0), "--port must be in 1..65535, got 0"),
        (
            lambda: options(stream_port=2222),
            "--stream-port 2222 is --port too: the ps tasks listen on both, so they must "
            "differ; leave --stream-port out (it then follows --port: 2223) or give another",
        ),
        (lambda: options(stream_port=70000), "--stream-port must be in 1..65535, got 70000"),
        (lambda: options(max_restarts=-1), "--max-restarts must be 0 or more, got -1"),
        (lambda: Resources(cpu="two"), "cpu 'two' is not a Kubernetes quantity"),
        (lambda: Resources(gpus=-1), "gpus must be a non-negative integer, got -1"),
        (lambda: Resources(cpu="two", job="ps"), "--ps-cpu 'two' is not a Kubernetes quantity"),
        (lambda: Resources(memory="4GB", job="worker"), "--worker-memory '4GB' is not a"),
        (lambda: Resources(cpu="2 cores"), "quantity: write e.g. '2' or '500m'"),
        (lambda: Resources(memory="4GB"), "quantity: write e.g. '4Gi' or '512Mi'"),
        (lambda: Resources(gpus=-2, job="worker"), "--worker-gpus must be a non-negative"),
    ],
)
def test_bad_input_is_refused(build, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)):
        build()


@pytest.mark.parametrize(
    ("build", "rule"),
    [
        (
            lambda: options(name="MNIST"),
            "--name 'MNIST' cannot name Kubernetes objects (Services need DNS labels): it has "
            "upper-case letters, and Kubernetes names allow only lower-case letters, digits "
            "and '-'; use e.g. 'mnist'",
        ),
        (lambda: options(name="My_Job"), "it has upper-case letters and '_'"),
        (lambda: options(name="run.1"), "it has '.', and Kubernetes names allow only"),
        (lambda: options(name="1st"), "it starts with '1', and a Service name must start with"),
        (lambda: options(name="mnist-"), "it ends with '-', and Kubernetes names must end"),
        (lambda: options(namespace="Prod"), "it has upper-case letters,"),
        (lambda: options(namespace="x" * 64), "it has 64 characters, more than Kubernetes' 63"),
    ],
)
def test_a_bad_name_says_which_rule_it_breaks(build, rule):
    """Each refused name gets the one rule it breaks (the tryout's `--name MNIST` was told
    about 63 characters, not about its upper case), and a name that fits, when one is near."""
    with pytest.raises(ClusterConfigError, match=re.escape(rule)) as refused:
        build()
    if "63" not in rule:
        assert "63" not in str(refused.value)


def test_a_suggested_name_fits_the_length_too():
    """A long upper-case name got a lower-case suggestion that the 63-character rule then
    refused: a suggestion is offered only when every object's name built from it fits."""
    with pytest.raises(ClusterConfigError, match="upper-case letters") as refused:
        options(name="MNIST" + "x" * 52)
    assert "use e.g." not in str(refused.value)


def test_a_namespace_may_start_with_a_digit():
    """Namespaces are RFC 1123 labels (a digit first is fine); Service names are not."""
    documents = render_manifests(options(namespace="1ml"))
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSIONS[0], strict=True)


def test_a_non_root_image_can_read_the_secret_through_the_pods_fs_group():
    """The secret volume is mode 0400 and root's; the pod's fsGroup makes the kubelet give the
    file that group (mode 0440) and every container's processes the group, whatever user the
    image runs as. --no-fs-group (fs_group=None) renders no securityContext."""
    for job in by_kind(render_manifests(options()), "Job"):
        pod = job["spec"]["template"]["spec"]
        assert pod["securityContext"] == {
            "fsGroup": DEFAULT_FS_GROUP,
            "fsGroupChangePolicy": "OnRootMismatch",
        }
        assert pod["volumes"][0]["secret"]["defaultMode"] == 0o400
    chosen = by_kind(render_manifests(options(fs_group=5000)), "Job")[0]
    assert chosen["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == 5000
    for document in render_manifests(options(fs_group=None)):
        if document["kind"] == "Job":
            assert "securityContext" not in document["spec"]["template"]["spec"]
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize(("flags", "expected"), [([], 1000), (["--fs-group", "4242"], 4242), (["--no-fs-group"], None)])  # fmt: skip
def test_cli_fs_group_flags(tmp_path, capsys, flags, expected):
    argv = ["k8s", "render", "--ps", "1", "--workers", "1", "--image", "img:1", *flags]
    assert main([*argv, "--", "python", "train.py"]) == 0
    jobs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d["kind"] == "Job"]
    for job in jobs:
        context = job["spec"]["template"]["spec"].get("securityContext", {})
        assert context.get("fsGroup") == expected


def test_cli_creates_the_secret_files_directory(tmp_path, capsys):
    path = tmp_path / "new" / "secret"
    assert main(["k8s", "render", "--image", "i", "--secret-file", str(path), "--", "t"]) == 0
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600


def test_cli_writes_the_manifests_with_mode_600(tmp_path, capsys):
    out = tmp_path / "cluster.yaml"
    argv = ["k8s", "render", "--ps", "1", "--workers", "2", "--image", "img:1", "-o", str(out)]
    assert main([*argv, "--", "python", "train.py"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.stat().st_mode & 0o777 == 0o600
    documents = list(yaml.safe_load_all(out.read_text()))
    assert [d["kind"] for d in documents] == ["Secret"] + ["Service", "Job"] * 3
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSIONS[0], strict=True)


def test_cli_uses_the_secret_file(tmp_path, capsys):
    path = tmp_path / "secret"
    assert main(["k8s", "render", "--image", "i", "--secret-file", str(path), "--", "t"]) == 0
    assert path.stat().st_mode & 0o777 == 0o600  # created with a fresh secret
    (secret,) = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d["kind"] == "Secret"]
    assert base64.b64decode(secret["data"]["secret"]) == path.read_bytes().strip()


def test_cli_refuses_a_cluster_of_0_tasks(tmp_path, capsys):
    out = tmp_path / "cluster.yaml"
    argv = ["k8s", "render", "--ps", "0", "--workers", "0", "--image", "i", "-o", str(out)]
    assert main([*argv, "--", "t"]) == 2
    assert "the cluster shape has 0 tasks" in capsys.readouterr().err
    assert not out.exists()


def test_await_dns_waits_for_every_name_with_a_deadline():
    """The init container's program, run here: names that resolve pass, one that does not
    fails after the deadline, naming it."""

    def run(hosts: list[str]) -> subprocess.CompletedProcess[str]:
        config = {"cluster": {"worker": [f"{h}:2222" for h in hosts]}, "task": {}}
        return subprocess.run(
            [sys.executable, "-c", AWAIT_DNS, "1"],
            env={"TF_CONFIG": json.dumps(config)},
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = run(["localhost", "127.0.0.1"])
    assert ok.returncode == 0 and "all 2 task names resolve" in ok.stdout, ok.stderr
    missing = run(["localhost", "no-such-task.invalid"])
    assert missing.returncode == 1
    assert "no-such-task.invalid does not resolve after 1 s" in missing.stderr
