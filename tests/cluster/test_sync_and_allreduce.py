"""Exactness of synchronous and all-reduce training: n workers with batch b must produce the
parameters of one process with batch n*b (within 1e-5 after 20 steps), for SGD and Adam."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from .conftest import PROGRAMS, run_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
STEPS = 20
#: Workers of each run of the resume test.
WORKERS_RESUMED = 2


def _program():
    spec = importlib.util.spec_from_file_location("exact_worker", PROGRAMS / "exact_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_process_reference(
    program,
    rule_name: str,
    num_workers: int,
    clip: float | None = None,
    ema: float | None = None,
    step_lr: int | None = None,
):
    """One process, batch n*b: the concatenation of the workers' batches of each step (with
    ``step_lr``, its learning rate halved every that many steps by torch's StepLR)."""
    model = program.make_model()
    x, y = program.make_data(STEPS, num_workers)
    rule = program.rule(rule_name)
    optimizer = rule.build(list(model.parameters()))
    schedule = None if step_lr is None else torch.optim.lr_scheduler.StepLR(optimizer, step_lr, 0.5)
    averages = {k: v.detach().clone() for k, v in model.named_parameters()}
    for step in range(STEPS):
        start = step * num_workers * program.BATCH
        xb, yb = (
            x[start : start + num_workers * program.BATCH],
            y[start : start + num_workers * program.BATCH],
        )
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        if ema is not None:
            for k, v in model.named_parameters():
                averages[k].lerp_(v.detach(), 1 - ema)
    return {k: v.detach() for k, v in model.state_dict().items()}, averages


def _max_difference(result: dict, reference: dict) -> float:
    return max((torch.tensor(result[k]) - reference[k]).abs().max().item() for k in reference)


@pytest.mark.parametrize(
    ("mode", "num_ps", "rule", "shared_memory"),
    [
        ("sync", 2, "sgd", "1"),
        ("sync", 2, "adam", "1"),
        ("allreduce", 0, "sgd", "0"),  # the gradients over gloo's ring
        ("allreduce", 0, "adam", "1"),  # through shared memory (worker/host_allreduce.py)
    ],
)
def test_n_workers_of_batch_b_equal_one_process_of_batch_nb(
    tmp_path, mode, num_ps, rule, shared_memory
):
    program = _program()
    out = tmp_path / "result.json"
    command = [sys.executable, str(PROGRAMS / "exact_worker.py"), str(out), mode, rule, str(STEPS)]
    run = run_local_cluster(
        num_ps, 3, command, timeout_s=200, env={"TENSORFLEET_SHARED_MEMORY": shared_memory}
    )
    assert run.returncode == 0, str(run)
    if mode == "allreduce":
        how = "through shared memory" if shared_memory == "1" else "over the group's backend"
        assert any(f"gradients averaged {how}" in line for line in run.output.of("worker:0"))
    result = json.loads(out.read_text())
    assert result["global_step"] == STEPS, str(run)
    reference, _ = _one_process_reference(program, rule, 3)
    difference = _max_difference(result["params"], reference)
    assert difference < 1e-5, f"max |distributed - one process| = {difference:.2e}\n{run}"


@pytest.mark.parametrize(("mode", "num_ps", "rule"), [("sync", 2, "sgd"), ("allreduce", 0, "adam")])
def test_a_learning_rate_schedule_on_every_worker_trains_as_in_one_process(
    tmp_path, mode, num_ps, rule
):
    """Every worker halves ``sess.optimizer``'s learning rate every 3 steps (torch's StepLR):
    the shards (sent with each push) or each replica's optimizer apply it as one process's
    optimizer does."""
    program = _program()
    out = tmp_path / "result.json"
    command = [sys.executable, str(PROGRAMS / "exact_worker.py"), str(out), mode, rule,
               str(STEPS), "--step-lr", "3"]  # fmt: skip
    run = run_local_cluster(num_ps, 2, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    result = json.loads(out.read_text())
    reference, _ = _one_process_reference(program, rule, 2, step_lr=3)
    difference = _max_difference(result["params"], reference)
    assert difference < 1e-5, f"max |distributed - one process| = {difference:.2e}\n{run}"
    unscheduled, _ = _one_process_reference(program, rule, 2)
    assert _max_difference(result["params"], unscheduled) > 1e-3, "the schedule changed nothing"


def test_sync_clips_the_aggregated_gradient_and_keeps_a_moving_average(tmp_path):
    program = _program()
    out = tmp_path / "result.json"
    command = [
        sys.executable,
        str(PROGRAMS / "exact_worker.py"),
        str(out),
        "sync",
        "sgd",
        str(STEPS),
        "--clip",
        "0.05",
        "--ema",
        "0.9",
    ]
    run = run_local_cluster(1, 2, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    result = json.loads(out.read_text())
    reference, averages = _one_process_reference(program, "sgd", 2, clip=0.05, ema=0.9)
    assert _max_difference(result["params"], reference) < 1e-5, str(run)
    unclipped, _ = _one_process_reference(program, "sgd", 2)
    assert _max_difference(result["params"], unclipped) > 1e-3, (
        "the clip must have changed the result"
    )
    assert _max_difference(result["ema"], averages) < 1e-5, str(run)


@pytest.mark.parametrize(("mode", "num_ps"), [("sync", 2), ("allreduce", 0)])
def test_a_run_resumed_from_a_checkpoint_ends_bit_for_bit_where_the_uninterrupted_run_ends(
    tmp_path, mode, num_ps
):
    """Checkpoint -> restore -> the same tensors: 20 steps in one run, and 10 + 10 steps in
    two runs that share a checkpoint directory (Adam state and the moving average included),
    end with the same parameters: bit for bit in sync mode (the ps shards write and restore
    the checkpoint), to the last bit of DDP's rounding in all-reduce mode (the chief's
    replica is broadcast to every worker). Two workers: a chief and one other suffice, and
    each of the three runs starts one process fewer than with three."""

    def run(steps: int, out, checkpoint_dir=None):
        command = [
            sys.executable, str(PROGRAMS / "exact_worker.py"), str(out), mode, "adam", str(STEPS),
            "--ema", "0.5", "--stop-at", str(steps),
            *(["--checkpoint-dir", str(checkpoint_dir), "--checkpoint-steps", "5"]
              if checkpoint_dir else []),
        ]  # fmt: skip
        result = run_local_cluster(num_ps, WORKERS_RESUMED, command, timeout_s=200)
        assert result.returncode == 0, str(result)
        return result, json.loads(out.read_text())

    _, straight = run(STEPS, tmp_path / "straight.json")
    checkpoints = tmp_path / "checkpoints"
    run(STEPS // 2, tmp_path / "first.json", checkpoints)
    second_run, resumed = run(STEPS, tmp_path / "resumed.json", checkpoints)
    chief = second_run.output.of("worker:0")
    assert any(f"(global step {STEPS // 2})" in line for line in chief), str(second_run)
    made = [
        json.loads(line)["made_steps"]
        for task in (f"worker:{i}" for i in range(WORKERS_RESUMED))
        for line in second_run.output.of(task)
        if line.startswith('{"task"')
    ]
    assert sum(made) == STEPS // 2, str(second_run)  # the resumed run made 10 steps, not 20
    assert resumed["global_step"] == straight["global_step"] == STEPS
    if mode == "sync":
        assert resumed["params"] == straight["params"]
        assert resumed["ema"] == straight["ema"]
    else:
        # DDP re-forms its gradient buckets after the first step of every run, and gloo sums
        # differently sized buckets in a different order: the resumed run's gradients can
        # differ from the straight run's in the last bit (measured: 1 ulp). The restore itself
        # is exact; the training after it is exact up to that rounding.
        reference = {k: torch.tensor(v) for k, v in straight["params"].items()}
        assert _max_difference(resumed["params"], reference) < 1e-6
        reference = {k: torch.tensor(v) for k, v in straight["ema"].items()}
        assert _max_difference(resumed["ema"], reference) < 1e-6


def test_the_same_host_path_and_tcp_train_to_bit_identical_parameters(tmp_path):
    """The same sync training (Adam, 2 workers, a model whose pushes are 200 KB, so that they
    go through shared memory) over the same-host path and over TCP
    (``TENSORFLEET_SHARED_MEMORY=0``) ends with the same parameters, bit for bit: payloads
    handed out where the ps wrote them, without a copy or a MAC, are the same bytes."""

    def run(shared_memory: str) -> dict:
        out = tmp_path / f"shm-{shared_memory}.json"
        command = [
            sys.executable, str(PROGRAMS / "exact_worker.py"), str(out), "sync", "adam",
            str(STEPS), "--hidden", "5000",
        ]  # fmt: skip
        result = run_local_cluster(
            1, 2, command, timeout_s=200, env={"TENSORFLEET_SHARED_MEMORY": shared_memory}
        )
        assert result.returncode == 0, str(result)
        return json.loads(out.read_text())

    same_host, over_tcp = run("1"), run("0")
    assert same_host["stats"][0]["shared_memory"].get("requests", 0) >= STEPS, same_host["stats"]
    assert same_host["stats"][0]["shared_memory"].get("replies", 0) >= STEPS
    assert over_tcp["stats"][0]["shared_memory"] == {"requests": 0, "replies": 0}, over_tcp
    assert same_host["global_step"] == over_tcp["global_step"] == STEPS
    assert same_host["params"] == over_tcp["params"]


def test_the_payload_stream_and_zeromq_train_to_bit_identical_parameters(tmp_path):
    """The same sync training over TCP with the payload stream on
    (``TENSORFLEET_PAYLOAD_STREAM=1``: the payloads of 2 MiB and more, the ps's replies and
    the workers' pushes, travel on each worker's stream, received in place) and off ends with
    the same parameters, bit for bit; the ps counts the replies and requests it streamed (at
    least one of each per worker step)."""

    def run(stream: str) -> dict:
        out = tmp_path / f"stream-{stream}.json"
        command = [
            sys.executable, str(PROGRAMS / "exact_worker.py"), str(out), "sync", "adam",
            str(STEPS), "--hidden", "60000",
        ]  # fmt: skip
        env = {"TENSORFLEET_SHARED_MEMORY": "0", "TENSORFLEET_PAYLOAD_STREAM": stream}
        result = run_local_cluster(1, 2, command, timeout_s=200, env=env)
        assert result.returncode == 0, str(result)
        return json.loads(out.read_text())

    streamed, plain = run("1"), run("0")
    assert streamed["stats"][0]["streamed_replies"] >= 2 * STEPS, streamed["stats"]
    assert streamed["stats"][0]["streamed_requests"] >= 2 * STEPS, streamed["stats"]
    assert plain["stats"][0]["streamed_replies"] == 0, plain["stats"]
    assert plain["stats"][0]["streamed_requests"] == 0, plain["stats"]
    assert streamed["global_step"] == plain["global_step"] == STEPS
    assert streamed["params"] == plain["params"]
