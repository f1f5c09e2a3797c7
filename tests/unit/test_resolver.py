"""resolve_task: arguments, flags, TF_CONFIG and Slurm, their order, and their errors."""

from __future__ import annotations

import json
import re

import pytest

from tensorfleet.cluster import (
    DETECTORS,
    ClusterSpec,
    ResolvedTask,
    ResolveRequest,
    TaskDetector,
    TaskId,
    resolve_task,
)
from tensorfleet.errors import ClusterConfigError

CLUSTER = {"ps": ["ps0:2222"], "worker": ["w0:2222", "w1:2222", "w2:2222"]}
CLUSTER_JSON = json.dumps(CLUSTER)


def tf_config(task_type: str = "worker", index: object = 1, cluster: object = None) -> str:
    return json.dumps(
        {
            "cluster": CLUSTER if cluster is None else cluster,
            "task": {"type": task_type, "index": index},
        }
    )


def resolve(*args, argv=(), environ=None, **kwargs):
    """resolve_task with no command line and an empty environment unless given."""
    return resolve_task(*args, argv=list(argv), environ=environ or {}, **kwargs)


def raises(fragment: str):
    return pytest.raises(ClusterConfigError, match=re.escape(fragment))


# --- ResolvedTask --------------------------------------------------------------------------


def test_resolved_task_properties():
    task = ResolvedTask(ClusterSpec(CLUSTER), "worker", 2, "arguments")
    assert task.task_id == TaskId("worker", 2)
    assert task.address == "w2:2222"
    assert task.num_workers == 3
    assert not task.is_chief
    assert ResolvedTask(ClusterSpec(CLUSTER), "worker", 0, "x").is_chief
    assert not ResolvedTask(ClusterSpec(CLUSTER), "ps", 0, "x").is_chief
    assert len({task, ResolvedTask(ClusterSpec(CLUSTER), "worker", 2, "arguments")}) == 1


def test_chief_job_makes_chief_0_the_chief():
    cluster = ClusterSpec({"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"]})
    assert ResolvedTask(cluster, "chief", 0, "x").is_chief
    assert not ResolvedTask(cluster, "worker", 0, "x").is_chief
    assert ResolvedTask(cluster, "worker", 0, "x").num_workers == 3


def test_rank_is_unique_among_the_training_tasks_and_none_for_a_ps():
    """``index`` repeats when a chief job sits beside the workers (chief:0 and worker:0);
    ``rank`` (what data sharding needs with ``num_workers``) does not."""
    cluster = ClusterSpec({"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["p:1"]})
    ranks = [
        ResolvedTask(cluster, job, i, "x").rank
        for job, i in (("chief", 0), ("worker", 0), ("worker", 1))
    ]
    assert ranks == [0, 1, 2]
    assert ResolvedTask(cluster, "ps", 0, "x").rank is None
    assert ResolvedTask(ClusterSpec(CLUSTER), "worker", 2, "x").rank == 2


def test_num_workers_without_worker_job():
    assert ResolvedTask(ClusterSpec({"ps": ["p:1"]}), "ps", 0, "x").num_workers == 0


@pytest.mark.parametrize(
    ("job", "index", "fragment"),
    [
        ("chief", 0, "src: this task is chief:0 but the cluster has no job 'chief'"),
        (
            "worker",
            3,
            "src: this task is worker:3 but job 'worker' has only the task indices [0, 1, 2]",
        ),
        ("worker", -1, "worker:-1"),
    ],
)
def test_resolved_task_is_validated(job, index, fragment):
    with raises(fragment):
        ResolvedTask(ClusterSpec(CLUSTER), job, index, "src")


def test_resolved_task_needs_a_cluster_spec():
    with raises("must be a ClusterSpec, got dict"):
        ResolvedTask(CLUSTER, "worker", 0, "x")  # type: ignore[arg-type]


# --- explicit arguments --------------------------------------------------------------------


@pytest.mark.parametrize(
    "cluster", [CLUSTER, ClusterSpec(CLUSTER), CLUSTER_JSON, " " + CLUSTER_JSON]
)
def test_arguments(cluster):
    task = resolve(cluster, "worker", 1)
    assert task == ResolvedTask(ClusterSpec(CLUSTER), "worker", 1, "arguments")


def test_arguments_cluster_from_file(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(CLUSTER_JSON)
    assert resolve(str(path), "ps", 0).cluster == ClusterSpec(CLUSTER)
    assert resolve(path, "ps", 0).source == "arguments"


def test_arguments_win_over_everything():
    task = resolve(
        CLUSTER,
        "worker",
        2,
        argv=["--job_name=ps", "--task_index=0", f"--cluster={CLUSTER_JSON}"],
        environ={"TF_CONFIG": tf_config("worker", 0), "SLURM_PROCID": "0"},
    )
    assert (task.job, task.index, task.source) == ("worker", 2, "arguments")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ((None, "worker", None), "resolve_task() got job_name but not cluster, task_index"),
        ((None, "worker", 0), "resolve_task() got job_name, task_index but not cluster"),
        ((CLUSTER, None, None), "resolve_task() got cluster but not job_name, task_index"),
        ((CLUSTER, "worker", None), "got cluster, job_name but not task_index"),
        ((None, None, 0), "got task_index but not cluster, job_name"),
    ],
)
def test_partial_arguments(args, fragment):
    with raises(fragment):
        resolve(*args, environ={"TF_CONFIG": tf_config()})


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            (CLUSTER, "chief", 0),
            "arguments: this task is chief:0 but the cluster has no job 'chief'",
        ),
        ((CLUSTER, "worker", 3), "job 'worker' has only the task indices [0, 1, 2]"),
        ((CLUSTER, 1, 0), "the job_name argument must be a string"),
        ((CLUSTER, "worker", -1), "the task_index argument must be a non-negative integer"),
        ((CLUSTER, "worker", 1.5), "the task_index argument must be a non-negative integer"),
        (
            ({"worker": ["x"]}, "worker", 0),
            "the cluster argument: cluster spec: address of task worker:0 'x' has no port",
        ),
        (
            ("no-such-file.json", "worker", 0),
            "the cluster argument: 'no-such-file.json' is neither JSON text",
        ),
        (("{bad json", "worker", 0), "the cluster argument: cluster spec JSON is not valid JSON"),
        ((["a:1"], "worker", 0), "the cluster argument: expected a ClusterSpec, a dict"),
    ],
)
def test_bad_arguments(args, fragment):
    with raises(fragment):
        resolve(*args)


# --- flags ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--job_name", "worker", "--task_index", "1", "--cluster", CLUSTER_JSON],
        ["--job_name=worker", "--task_index=1", f"--cluster={CLUSTER_JSON}"],
        ["--cluster", CLUSTER_JSON, "--task_index=1", "--job_name", "worker"],
        ["--job-name=worker", "--task-index", "1", f"--cluster={CLUSTER_JSON}"],
        # unrelated arguments around them are ignored
        [
            "train.txt",
            "--lr",
            "0.1",
            "-v",
            "--job_name=worker",
            "--epochs=3",
            "--task_index=1",
            "--cluster",
            CLUSTER_JSON,
            "--batch-size",
            "64",
        ],
        # the last of a repeated flag wins, as with argparse
        ["--job_name=ps", "--job_name=worker", "--task_index=1", f"--cluster={CLUSTER_JSON}"],
        # TensorFlow 1.x scripts' per-job host lists
        [
            "--ps_hosts=ps0:2222",
            "--worker_hosts=w0:2222,w1:2222,w2:2222",
            "--job_name=worker",
            "--task_index=1",
        ],
        [
            "--ps_hosts",
            "ps0:2222",
            "--worker-hosts",
            "w0:2222, w1:2222, w2:2222",
            "--job_name",
            "worker",
            "--task_index",
            "1",
        ],
    ],
)
def test_flags(argv):
    task = resolve(argv=argv)
    assert task == ResolvedTask(ClusterSpec(CLUSTER), "worker", 1, "flags")


def test_flags_that_agree_with_tf_config_are_fine():
    argv = ["--job_name=worker", "--task_index=1", f"--cluster={CLUSTER_JSON}"]
    task = resolve(argv=argv, environ={"TF_CONFIG": tf_config("worker", 1)})
    assert task == ResolvedTask(ClusterSpec(CLUSTER), "worker", 1, "flags")


@pytest.mark.parametrize(
    ("environ_task", "environ_cluster", "fragment"),
    [
        (("ps", 0), None, "the flags say this task is worker:1 of"),
        (("ps", 0), None, "but TF_CONFIG says ps:0 of"),
        (("worker", 1), {"worker": ["a:1", "b:1"]}, 'TF_CONFIG says worker:1 of {"worker": ["a:1"'),
        (
            ("worker", 2),
            None,
            "drop the --job_name/--task_index/--cluster flags, or unset TF_CONFIG",
        ),
    ],
)
def test_flags_that_disagree_with_tf_config_are_refused(environ_task, environ_cluster, fragment):
    argv = ["--job_name=worker", "--task_index=1", f"--cluster={CLUSTER_JSON}"]
    environ = {"TF_CONFIG": tf_config(*environ_task, cluster=environ_cluster)}
    with raises(fragment):
        resolve(argv=argv, environ=environ)


def test_flags_cluster_from_file(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(CLUSTER_JSON)
    task = resolve(argv=["--job_name=ps", "--task_index=0", f"--cluster={path}"])
    assert (task.cluster, task.task_id, task.source) == (
        ClusterSpec(CLUSTER),
        TaskId("ps", 0),
        "flags",
    )


def test_flags_chief_hosts_and_empty_ps_hosts():
    argv = [
        "--chief_hosts=c:1",
        "--worker_hosts=w:1",
        "--ps_hosts=",
        "--job_name=chief",
        "--task_index=0",
    ]
    task = resolve(argv=argv)
    assert task.cluster.as_dict() == {"chief": ["c:1"], "ps": {}, "worker": ["w:1"]}
    assert task.is_chief


def test_flags_after_double_dash_are_ignored():
    argv = ["--", "--job_name=worker", "--task_index=1", f"--cluster={CLUSTER_JSON}"]
    assert resolve(argv=argv, allow_none=True) is None


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--job_name"], "flag --job_name needs a value"),
        (["--task_index", "--job_name", "worker"], "flag --task_index needs a value"),
        (
            ["--job_name=worker"],
            "flags: found --job_name but not --task_index, --cluster (or --ps_hosts/--worker_hosts)",
        ),
        (["--job_name=worker", "--task_index=0"], "but not --cluster"),
        (
            [f"--cluster={CLUSTER_JSON}", "--task_index=0"],
            "found --task_index, --cluster but not --job_name",
        ),
        (["--worker_hosts=w:1", "--job_name=worker"], "but not --task_index"),
        (
            ["--job_name=worker", "--task_index=x", f"--cluster={CLUSTER_JSON}"],
            "flag --task_index must be a non-negative integer, got 'x'",
        ),
        (["--job_name=worker", "--task_index=-1", f"--cluster={CLUSTER_JSON}"], "got '-1'"),
        (
            ["--job_name=wor:ker", "--task_index=0", f"--cluster={CLUSTER_JSON}"],
            "flag --job_name 'wor:ker' is not valid",
        ),
        (
            ["--job_name=worker", "--task_index=0", f"--cluster={CLUSTER_JSON}", "--ps_hosts=p:1"],
            "both --cluster and --ps_hosts were given",
        ),
        (
            ["--job_name=worker", "--task_index=0", "--cluster=ps0:2222"],
            "flag --cluster: 'ps0:2222' is neither JSON text",
        ),
        (
            ["--job_name=worker", "--task_index=0", '--cluster={"worker": "w:1"}'],
            "flag --cluster: cluster spec: job 'worker' must map to a list",
        ),
        (
            ["--job_name=worker", "--task_index=0", "--worker_hosts=w:1,,w:2"],
            "flags --*_hosts: cluster spec: address of task worker:1 '' has no port",
        ),
        (
            ["--job_name=worker", "--task_index=5", f"--cluster={CLUSTER_JSON}"],
            "flags: this task is worker:5 but job 'worker' has only the task indices [0, 1, 2]",
        ),
        (
            ["--job_name=evaluator", "--task_index=0", f"--cluster={CLUSTER_JSON}"],
            "flags: this task is evaluator:0 but the cluster has no job 'evaluator'",
        ),
    ],
)
def test_bad_flags(argv, fragment):
    with raises(fragment):
        resolve(argv=argv, environ={"TF_CONFIG": tf_config()})


def test_argv_must_be_a_list():
    with raises("argv must be a list of arguments"):
        resolve_task(argv="--job_name=worker", environ={})  # type: ignore[arg-type]


def test_default_argv_and_environ(monkeypatch):
    monkeypatch.setattr(
        "sys.argv", ["train.py", "--job_name=worker", "--task_index=2", f"--cluster={CLUSTER_JSON}"]
    )
    assert resolve_task().task_id == TaskId("worker", 2)
    monkeypatch.setattr("sys.argv", ["train.py"])
    monkeypatch.setenv("TF_CONFIG", tf_config("ps", 0))
    assert resolve_task().source == "TF_CONFIG"


# --- TF_CONFIG -----------------------------------------------------------------------------


def test_tf_config():
    task = resolve(environ={"TF_CONFIG": tf_config("worker", 2)})
    assert task == ResolvedTask(ClusterSpec(CLUSTER), "worker", 2, "TF_CONFIG")


def test_tf_config_kubeflow_with_chief():
    # As Kubeflow's TFJob writes it: lowercase replica types, a chief job, extra keys.
    config = {
        "cluster": {
            "chief": ["trainer-chief-0.ns.svc:2222"],
            "worker": ["trainer-worker-0.ns.svc:2222", "trainer-worker-1.ns.svc:2222"],
            "ps": ["trainer-ps-0.ns.svc:2222"],
        },
        "task": {"type": "chief", "index": 0},
        "environment": "cloud",
    }
    chief = resolve(environ={"TF_CONFIG": json.dumps(config)})
    assert (chief.job, chief.index, chief.is_chief, chief.num_workers) == ("chief", 0, True, 3)
    assert chief.address == "trainer-chief-0.ns.svc:2222"
    config["task"] = {"type": "worker", "index": 0}
    worker = resolve(environ={"TF_CONFIG": json.dumps(config)})
    assert (worker.job, worker.index, worker.is_chief) == ("worker", 0, False)


def test_tf_config_sparse_cluster_and_string_index():
    config = {
        "cluster": {"worker": {"1": "w1:1"}, "ps": ["p:1"]},
        "task": {"type": "worker", "index": "1"},
    }
    task = resolve(environ={"TF_CONFIG": json.dumps(config)})
    assert task.task_id == TaskId("worker", 1)
    assert task.cluster.job_tasks("worker") == [None, "w1:1"]


def test_tf_config_wins_over_slurm():
    environ = {"TF_CONFIG": tf_config("ps", 0), **slurm_env(procid=3)}
    assert resolve(environ=environ).source == "TF_CONFIG"


@pytest.mark.parametrize(
    "value", ["", "  ", "{}", '{"cluster": {}}', '{"cluster": {}, "task": {}}']
)
def test_empty_tf_config_says_nothing(value):
    assert resolve(environ={"TF_CONFIG": value}, allow_none=True) is None


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("{not json", "TF_CONFIG is not valid JSON"),
        ('["worker"]', "TF_CONFIG must be a JSON object with 'cluster' and 'task'"),
        ('"worker"', "TF_CONFIG must be a JSON object"),
        (json.dumps({"cluster": CLUSTER}), "TF_CONFIG has a 'cluster' but its 'task' is None"),
        (json.dumps({"cluster": CLUSTER, "task": "worker:0"}), "its 'task' is 'worker:0'"),
        (
            json.dumps({"task": {"type": "worker", "index": 0}}),
            "TF_CONFIG has a 'task' but no 'cluster'",
        ),
        (
            json.dumps({"cluster": ["w:1"], "task": {"type": "worker", "index": 0}}),
            "TF_CONFIG: 'cluster' must be an object",
        ),
        (json.dumps({"cluster": CLUSTER, "task": {"index": 0}}), "TF_CONFIG: 'task' has no 'type'"),
        (
            json.dumps({"cluster": CLUSTER, "task": {"type": "worker"}}),
            "TF_CONFIG: 'task' has no 'index'",
        ),
        (tf_config("worker", -1), "TF_CONFIG: task index must be a non-negative integer, got -1"),
        (
            tf_config("worker", "one"),
            "TF_CONFIG: task index must be a non-negative integer, got 'one'",
        ),
        (tf_config("worker", True), "got True of type bool"),
        (tf_config("", 0), "TF_CONFIG: task type is empty"),
        (tf_config(None, 0), "TF_CONFIG: task type must be a string"),
        (
            tf_config("worker", 9),
            "TF_CONFIG: this task is worker:9 but job 'worker' has only the task indices [0, 1, 2]",
        ),
        (
            tf_config("evaluator", 0),
            "TF_CONFIG: this task is evaluator:0 but the cluster has no job 'evaluator'",
        ),
        (
            tf_config(cluster={"worker": ["w:99999"]}),
            "TF_CONFIG 'cluster': cluster spec: address of task worker:0 'w:99999': port 99999 is out of range",
        ),
        ('{"cluster": {}, "cluster": {}}', "TF_CONFIG: key 'cluster' appears twice"),
    ],
)
def test_bad_tf_config(value, fragment):
    with raises(fragment):
        resolve(environ={"TF_CONFIG": value})


# --- Slurm ---------------------------------------------------------------------------------


def slurm_env(procid: int, **extra: str) -> dict[str, str]:
    """7 tasks on 4 nodes, as `srun -N4 -n7` places them (block distribution)."""
    env = {
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": "7",
        "SLURM_JOB_NODELIST": "node[01-03],gpu7",
        "SLURM_TASKS_PER_NODE": "2(x3),1",
    }
    env.update(extra)
    return env


SLURM_CLUSTER = {
    "ps": ["node01:2222"],
    "worker": [
        "node01:2223",
        "node02:2222",
        "node02:2223",
        "node03:2222",
        "node03:2223",
        "gpu7:2222",
    ],
}


@pytest.mark.parametrize(
    ("procid", "local", "node", "job", "index"),
    [
        (0, 0, "node01", "ps", 0),
        (1, 1, "node01", "worker", 0),
        (2, 0, "node02", "worker", 1),
        (5, 1, "node03", "worker", 4),
        (6, 0, "gpu7", "worker", 5),
    ],
)
def test_slurm(procid, local, node, job, index):
    env = slurm_env(procid, SLURM_LOCALID=str(local), SLURMD_NODENAME=node)
    task = resolve(environ=env)
    assert task == ResolvedTask(ClusterSpec(SLURM_CLUSTER), job, index, "slurm")
    assert task.is_chief == (job == "worker" and index == 0)


def test_slurm_num_ps_and_base_port():
    env = slurm_env(2, TENSORFLEET_SLURM_NUM_PS="3", TENSORFLEET_SLURM_BASE_PORT="40000")
    task = resolve(environ=env)
    assert task.cluster.as_dict() == {
        "ps": ["node01:40000", "node01:40001", "node02:40000"],
        "worker": ["node02:40001", "node03:40000", "node03:40001", "gpu7:40000"],
    }
    assert task.task_id == TaskId("ps", 2)
    env = slurm_env(2, TENSORFLEET_SLURM_NUM_PS="0")
    assert resolve(environ=env).task_id == TaskId("worker", 2)
    assert resolve(environ=env).cluster.jobs == ["worker"]


def test_slurm_single_task_is_a_lone_worker():
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_NODELIST": "n1",
        "SLURM_TASKS_PER_NODE": "1",
    }
    task = resolve(environ=env)
    assert task.cluster.as_dict() == {"worker": ["n1:2222"]}
    assert task.is_chief


def test_slurm_step_variables_win_over_job_variables():
    # srun on 2 of the job's 3 nodes: the step's variables describe where the tasks are.
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "6",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_STEP_NODELIST": "n[2-3]",
        "SLURM_TASKS_PER_NODE": "2(x3)",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }
    task = resolve(environ=env)
    assert task.cluster.as_dict() == {"ps": ["n2:2222"], "worker": ["n3:2222"]}
    assert task.task_id == TaskId("worker", 0)


def test_slurm_nodelist_wins_over_job_nodelist():
    env = slurm_env(0, SLURM_NODELIST="a[1-4]")
    assert resolve(environ=env).address == "a1:2222"


def test_slurm_block_distribution_is_accepted():
    assert resolve(environ=slurm_env(0, SLURM_DISTRIBUTION="block:cyclic")).source == "slurm"


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        (
            {"SLURM_NTASKS": None},
            "slurm: SLURM_PROCID is set but SLURM_STEP_NUM_TASKS / SLURM_NTASKS is not",
        ),
        (
            {"SLURM_JOB_NODELIST": None},
            "SLURM_STEP_NODELIST / SLURM_NODELIST / SLURM_JOB_NODELIST is not",
        ),
        ({"SLURM_TASKS_PER_NODE": None}, "SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE is not"),
        ({"SLURM_PROCID": "x"}, "slurm: SLURM_PROCID must be a non-negative integer, got 'x'"),
        ({"SLURM_PROCID": "7"}, "slurm: SLURM_PROCID=7 is not in 0..6"),
        ({"SLURM_NTASKS": "-7"}, "SLURM_NTASKS must be a non-negative integer, got '-7'"),
        ({"SLURM_NTASKS": "8"}, "SLURM_TASKS_PER_NODE='2(x3),1' places 7 tasks but there are 8"),
        ({"SLURM_JOB_NODELIST": "n[1-3]"}, "node list names 3 nodes"),
        (
            {"SLURM_JOB_NODELIST": "n[1-3"},
            "slurm: SLURM_JOB_NODELIST: Slurm host list 'n[1-3' has a '[' without ']'",
        ),
        ({"SLURM_TASKS_PER_NODE": "2(x3"}, "slurm: SLURM_TASKS_PER_NODE: Slurm tasks-per-node"),
        (
            {"TENSORFLEET_SLURM_NUM_PS": "7"},
            "TENSORFLEET_SLURM_NUM_PS=7 leaves no worker among 7 tasks",
        ),
        (
            {"TENSORFLEET_SLURM_NUM_PS": "one"},
            "TENSORFLEET_SLURM_NUM_PS must be a non-negative integer",
        ),
        (
            {"TENSORFLEET_SLURM_BASE_PORT": "65535"},
            "TENSORFLEET_SLURM_BASE_PORT=65535 with up to 2 tasks per node",
        ),
        ({"TENSORFLEET_SLURM_BASE_PORT": "0"}, "TENSORFLEET_SLURM_BASE_PORT=0"),
        ({"SLURM_DISTRIBUTION": "cyclic"}, "SLURM_DISTRIBUTION='cyclic', but tensorfleet lays out"),
        ({"SLURM_DISTRIBUTION": "plane=2"}, "SLURM_DISTRIBUTION='plane=2'"),
        ({"SLURM_LOCALID": "0"}, "rank 3 should run with SLURM_LOCALID='1'"),
        ({"SLURMD_NODENAME": "node01"}, "rank 3 should run with SLURMD_NODENAME='node02'"),
        (
            {"SLURM_JOB_NODELIST": "n1,n1,n2,n3"},
            "tasks ps:0 and worker:1 both have address 'n1:2222'",
        ),
    ],
)
def test_bad_slurm(changes, fragment):
    env = slurm_env(3)
    for name, value in changes.items():
        if value is None:
            del env[name]
        else:
            env[name] = value
    with raises(fragment):
        resolve(environ=env)


def test_single_slurm_task_may_not_have_a_ps():
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_NODELIST": "n1",
        "SLURM_TASKS_PER_NODE": "1",
        "TENSORFLEET_SLURM_NUM_PS": "1",
    }
    with raises("TENSORFLEET_SLURM_NUM_PS=1 leaves no worker among 1 tasks"):
        resolve(environ=env)


# --- nothing found, and custom detectors ---------------------------------------------------


def test_nothing_found_lists_every_source():
    with pytest.raises(ClusterConfigError) as info:
        resolve(argv=["--lr=0.1"], environ={"SLURM_JOB_ID": "5"})
    message = str(info.value)
    for detector in DETECTORS:
        assert f"  - {detector.name}: {detector.how}" in message
    assert [d.name for d in DETECTORS] == ["arguments", "flags", "TF_CONFIG", "slurm"]
    assert "--job_name" in message and "TF_CONFIG=" in message and "srun" in message
    assert "allow_none=True" in message


def test_allow_none():
    assert resolve(allow_none=True) is None
    assert resolve(CLUSTER, "ps", 0, allow_none=True).task_id == TaskId("ps", 0)


def test_custom_detectors():
    class Fixed(TaskDetector):
        name = "fixed"
        how = "always"

        def detect(self, request: ResolveRequest) -> ResolvedTask | None:
            assert request.environ == {"X": "1"}
            return ResolvedTask(ClusterSpec(CLUSTER), "worker", 0, self.name)

    class Never(TaskDetector):
        name = "never"
        how = "cannot be satisfied"

        def detect(self, request: ResolveRequest) -> ResolvedTask | None:
            return None

    task = resolve(environ={"X": "1"}, detectors=[*DETECTORS, Fixed()])
    assert task.source == "fixed"
    with raises("Tried, in order:\n  - never: cannot be satisfied\nProvide one"):
        resolve(detectors=[Never()])


def test_slurm_allocation_smaller_than_the_shape_names_both_numbers():
    environ = slurm_env(0, TENSORFLEET_SLURM_NUM_PS="1", TENSORFLEET_SLURM_NUM_WORKERS="7")
    with raises("allocation is smaller than the cluster shape: SLURM_NTASKS=7 but the shape is "
                "1 ps + 7 workers = 8 tasks"):  # fmt: skip
        resolve(environ=environ)


def test_slurm_step_larger_than_the_shape_is_refused():
    environ = slurm_env(0, TENSORFLEET_SLURM_NUM_WORKERS="3", SLURM_STEP_NUM_TASKS="7")
    with raises("SLURM_STEP_NUM_TASKS=7 but the shape is 1 ps + 3 workers = 4 tasks"):
        resolve(environ=environ)


def test_slurm_allocation_that_fits_the_shape():
    environ = slurm_env(2, TENSORFLEET_SLURM_NUM_PS="1", TENSORFLEET_SLURM_NUM_WORKERS="6")
    task = resolve(environ=environ)
    assert (task.job, task.index, task.cluster) == ("worker", 1, ClusterSpec(SLURM_CLUSTER))


def test_tf_configs_evaluator_task_is_told_to_run_on_the_checkpoints() -> None:
    """Estimator and Kubeflow give an evaluator a TF_CONFIG task outside the cluster: the
    refusal says what tensorfleet offers instead."""
    tf_config = {"cluster": {"worker": ["h1:2222"]}, "task": {"type": "evaluator", "index": 0}}
    with pytest.raises(ClusterConfigError, match=r"tfl\.checkpoints_iterator\(checkpoint_dir\)"):
        resolve_task(argv=[], environ={"TF_CONFIG": json.dumps(tf_config)})
