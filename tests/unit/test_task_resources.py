"""Per-task resources: the thread budget, disjoint GPU sets, the memory cap, the env round trip,
and applying them to torch."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from tensorfleet.cluster.resources import (
    OPENMP_SPIN_COUNT,
    TaskResources,
    parse_visible_devices,
    plan_resources,
)
from tensorfleet.cluster.spec import ClusterSpec, TaskId
from tensorfleet.cluster.thread_budget import (
    co_located_threads,
    host_key,
    planned_threads,
    takes_turns,
    thread_budget,
)
from tensorfleet.errors import ClusterConfigError
from tensorfleet.launch.resource_flags import add_resource_flags, task_environments
from tensorfleet.worker.task_resources import apply_task_resources


@pytest.mark.parametrize(
    ("cores", "tasks", "budget"),
    [(2, 4, [1, 1, 1, 1]), (16, 3, [6, 5, 5]), (8, 4, [2, 2, 2, 2]), (1, 1, [1]), (3, 2, [2, 1])],
)
def test_thread_budget_divides_the_cores_at_least_one_each(cores, tasks, budget):
    assert thread_budget(cores, tasks) == budget


def test_plan_gives_workers_the_remainder_first():
    plan = plan_resources(1, 3, host_cores=9)
    assert {n: r.intra_op_threads for n, r in plan.items()} == {
        "worker:0": 3,
        "worker:1": 2,
        "worker:2": 2,
        "ps:0": 2,
    }
    assert all(r.inter_op_threads == r.intra_op_threads for r in plan.values())
    assert all(r.visible_gpus is None for r in plan.values())


@pytest.mark.parametrize(
    ("ps", "workers", "cores", "threads"),
    [
        # One worker and its ps take turns: the worker gets every core, the ps divide them.
        (1, 1, 2, {"worker:0": 2, "ps:0": 2}),
        (2, 1, 2, {"worker:0": 2, "ps:0": 1, "ps:1": 1}),
        (3, 1, 16, {"worker:0": 16, "ps:0": 6, "ps:1": 5, "ps:2": 5}),
        # Two or more workers compute at the same time: every task shares.
        (1, 2, 2, {"worker:0": 1, "worker:1": 1, "ps:0": 1}),
        (1, 3, 9, {"worker:0": 3, "worker:1": 2, "worker:2": 2, "ps:0": 2}),
        # No ps (all-reduce): the workers share.
        (0, 2, 4, {"worker:0": 2, "worker:1": 2}),
        (0, 1, 4, {"worker:0": 4}),
    ],
)
def test_tasks_that_take_turns_each_get_every_core_and_others_share(ps, workers, cores, threads):
    assert takes_turns(ps, workers) == (workers == 1 and ps >= 1)
    assert planned_threads(ps, workers, cores) == threads
    plan = plan_resources(ps, workers, host_cores=cores)
    assert {n: r.intra_op_threads for n, r in plan.items()} == threads


@pytest.mark.parametrize(
    ("cluster", "task", "cores", "expected"),
    [
        # a ps on a machine of its own takes every core
        ({"ps": ["pshost:2222"], "worker": ["w0:2222", "w1:2222"]}, "ps:0", 16, (16, 1)),
        # beside three workers named on its host (any loopback spelling) it takes its share
        (
            {"ps": ["localhost:1"], "worker": ["127.0.0.1:2", "localhost:3", "[::1]:4"]},
            "ps:0",
            2,
            (1, 4),
        ),
        # one worker and its ps take turns: each gets every core
        ({"ps": ["LOCALHOST:1"], "worker": ["localhost:2"]}, "ps:0", 8, (8, 2)),
        # two ps of one machine apply their shards of a push at once: they divide it
        ({"ps": ["a:1", "a:2"], "worker": ["b:1"]}, "ps:1", 8, (4, 2)),
        # a chief counts as a worker
        ({"chief": ["a:1"], "ps": ["a:2"], "worker": ["a:3"]}, "ps:0", 6, (2, 3)),
    ],
)
def test_a_ps_started_by_itself_plans_its_threads_over_the_tasks_of_its_host(
    cluster, task, cores, expected
):
    assert co_located_threads(ClusterSpec(cluster), TaskId.parse(task), cores) == expected


def test_host_key_joins_spellings_of_one_host_only():
    assert host_key("localhost:1") == host_key("127.0.0.1:2") == host_key("[::1]:3")
    assert host_key("Node1.example.org:1") == host_key("node1.example.org:2")
    assert host_key("10.0.0.1:1") != host_key("10.0.0.2:1")
    assert host_key("[FE80:0::1]:1") == host_key("[fe80::1]:2")


def test_plan_gives_disjoint_gpu_sets_and_none_to_ps():
    plan = plan_resources(
        1, 2, host_cores=2, host_gpus=(4, 5, 6, 7), gpus_per_worker=2, gpu_memory_fraction=0.5
    )
    assert plan["worker:0"].visible_gpus == (4, 5)
    assert plan["worker:1"].visible_gpus == (6, 7)
    assert plan["ps:0"].visible_gpus == ()
    assert plan["worker:0"].gpu_memory_fraction == 0.5
    assert plan["ps:0"].gpu_memory_fraction is None
    assert plan["worker:1"].to_env()["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert plan["ps:0"].to_env()["CUDA_VISIBLE_DEVICES"] == ""


def test_more_gpus_than_the_host_has_are_refused():
    with pytest.raises(
        ClusterConfigError,
        match=re.escape("1 GPU(s) per worker x 3 worker(s) = 3 GPU(s), but this host has 2"),
    ):
        plan_resources(1, 3, host_gpus=(0, 1), gpus_per_worker=1)
    with pytest.raises(ClusterConfigError, match="this host has 0 .no GPU torch can use"):
        plan_resources(0, 1, host_gpus=(), gpus_per_worker=1)


def test_explicit_threads_and_no_budget():
    plan = plan_resources(1, 1, host_cores=8, intra_op_threads=3, inter_op_threads=2)
    assert {(r.intra_op_threads, r.inter_op_threads) for r in plan.values()} == {(3, 2)}
    plan = plan_resources(1, 1, host_cores=8, thread_budget_enabled=False)
    assert all(r.to_env() == {} for r in plan.values())


def test_env_round_trip():
    res = TaskResources(
        intra_op_threads=2, inter_op_threads=1, visible_gpus=(1, 3), gpu_memory_fraction=0.25
    )
    env = res.to_env()
    assert env["OMP_NUM_THREADS"] == "2"
    assert TaskResources.from_env(env) == res
    assert TaskResources.from_env({}) == TaskResources()


def test_a_thread_budget_shortens_openmps_idle_spinning_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert TaskResources(intra_op_threads=2).to_env()["GOMP_SPINCOUNT"] == str(OPENMP_SPIN_COUNT)
    assert "GOMP_SPINCOUNT" not in TaskResources(visible_gpus=(0,)).to_env()  # no budget
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")  # the user's own choice is kept
    assert "GOMP_SPINCOUNT" not in TaskResources(intra_op_threads=2).to_env()


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        (
            {"TENSORFLEET_INTRA_OP_THREADS": "0"},
            "TENSORFLEET_INTRA_OP_THREADS='0' is not an integer >= 1",
        ),
        ({"TENSORFLEET_INTER_OP_THREADS": "two"}, "TENSORFLEET_INTER_OP_THREADS='two'"),
        ({"TENSORFLEET_GPU_MEMORY_FRACTION": "1.5"}, "must be a number in (0, 1], got '1.5'"),
        ({"TENSORFLEET_GPU_MEMORY_FRACTION": "half"}, "got 'half'"),
        ({"CUDA_VISIBLE_DEVICES": "0,two"}, "'two' is not a GPU index"),
    ],
)
def test_malformed_env_is_named(env, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)):
        TaskResources.from_env(env)


@pytest.mark.parametrize(
    "value", ["GPU-8f2e1c4a-1b2c-3d4e-5f60-718293a4b5c6", "GPU-a,GPU-b", "MIG-1c3b9d2e-aaaa"]
)
def test_gpus_named_by_uuid_are_left_to_cuda(value):
    # The launcher leaves an inherited CUDA_VISIBLE_DEVICES of UUIDs to the tasks as it is
    # (docs/gpu.md), and MIG instances are only named that way: tfl.Server, which reads the
    # task's resources on creation, must not refuse it.
    assert TaskResources.from_env({"CUDA_VISIBLE_DEVICES": value}).visible_gpus is None


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"intra_op_threads": 0}, "intra_op_threads must be an integer >= 1, got 0"),
        ({"visible_gpus": (0, 0)}, "lists a GPU twice"),
        ({"gpu_memory_fraction": 0.0}, "in (0, 1], got 0.0"),
        ({"gpu_memory_fraction": float("nan")}, "in (0, 1], got nan"),
    ],
)
def test_bad_resources_are_refused(kwargs, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)):
        TaskResources(**kwargs)


def test_parse_visible_devices():
    assert parse_visible_devices("0, 2") == (0, 2)
    assert parse_visible_devices("") == ()


def test_launcher_flags_build_each_tasks_environment():
    parser = argparse.ArgumentParser()
    add_resource_flags(parser)
    envs = task_environments(parser.parse_args(["--intra-op-threads", "2"]), 1, 2)
    assert sorted(envs) == ["ps:0", "worker:0", "worker:1"]
    assert {e["TENSORFLEET_INTRA_OP_THREADS"] for e in envs.values()} == {"2"}
    if not torch.cuda.is_available():
        with pytest.raises(ClusterConfigError, match="nothing was started"):
            task_environments(parser.parse_args(["--gpus-per-worker", "1"]), 1, 2)


def test_apply_sets_torch_threads():
    before = torch.get_num_threads()
    try:
        applied = apply_task_resources(TaskResources(intra_op_threads=1))
        assert applied.intra_op_threads == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without GPU")
def test_apply_refuses_a_memory_fraction_without_gpu():
    with pytest.raises(ClusterConfigError, match="sees no GPU"):
        apply_task_resources(TaskResources(gpu_memory_fraction=0.5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_apply_caps_gpu_memory():  # pragma: no cover - runs on a GPU machine only
    applied = apply_task_resources(TaskResources(gpu_memory_fraction=0.5))
    assert applied.gpu_memory_fraction == 0.5 and applied.cuda_devices >= 1


def test_the_ps_threads_line_says_who_set_the_variable_and_what_it_overrode():
    """A new user's ps, started by hand with ``TENSORFLEET_INTRA_OP_THREADS`` and
    ``--threads``, logged "the launcher's plan" and did not say its ``--threads`` lost."""
    from tensorfleet.launch.cli import threads_reason_with_environment

    planned = "planned: 2 core(s), 3 task(s) of the cluster on this host; --threads N to choose"
    assert threads_reason_with_environment(planned, None, {}) == planned
    assert threads_reason_with_environment("--threads", 4, {}) == "--threads"
    by_hand = {"TENSORFLEET_INTRA_OP_THREADS": "3"}
    assert (
        threads_reason_with_environment("--threads", 4, by_hand)
        == "TENSORFLEET_INTRA_OP_THREADS=3, in the environment; it wins over --threads 4"
    )
    launched = {**by_hand, "TENSORFLEET_LAUNCHER": "1"}
    assert (
        threads_reason_with_environment(planned, None, launched)
        == "TENSORFLEET_INTRA_OP_THREADS=3, the launcher's plan"
    )
