"""A pipeline inside one task: a model split into stages with micro-batches gives the outputs,
gradients and updated parameters of the unsplit model; bad input and failing stages are named."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorfleet.parallel.errors import ParallelConfigError, PipelineFailed
from tensorfleet.parallel.local_pipeline import LocalPipeline
from tensorfleet.parallel.schedule import bubble_fraction, stage_order
from tensorfleet.parallel.stages import split_microbatches, split_stages, stage_boundaries
from tests.backward_threads import record_backward_threads


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 10),
    )


def train_reference(model: nn.Sequential, batches, lr: float):
    """Unsplit, whole batch: per step the outputs and gradients, and the final parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    outs, grads = [], []
    for x, y in batches:
        opt.zero_grad()
        out = model(x)
        F.cross_entropy(out, y).backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return outs, grads


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("boundaries", [[4], [2, 5]], ids=["2-stages", "3-stages"])
def test_pipeline_matches_the_unsplit_model_for_5_steps(schedule, boundaries):
    torch.manual_seed(1)
    batches = [(torch.randn(32, 32), torch.randint(0, 10, (32,))) for _ in range(5)]
    model, reference = mlp(), mlp()
    ref_outs, ref_grads = train_reference(reference, batches, lr=0.1)
    stages = split_stages(model, boundaries=boundaries)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalPipeline(
        stages, n_microbatches=4, loss_fn=F.cross_entropy, schedule=schedule
    ) as pipe:
        for step, (x, y) in enumerate(batches):
            result = pipe.step(x, y)
            assert (result.outputs - ref_outs[step]).abs().max() < 1e-5
            assert abs(result.loss.item() - F.cross_entropy(ref_outs[step], y).item()) < 1e-5
            for name, p in model.named_parameters():
                assert (p.grad - ref_grads[step][name]).abs().max() < 1e-5, (step, name)
            opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p - q).abs().max() < 1e-5, name


def test_stage_that_raises_stops_the_others_and_is_named():
    class Explode(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("boom in micro-batch 2")
            return x

    stages = [nn.Sequential(nn.Linear(8, 8)), nn.Sequential(Explode(), nn.Linear(8, 2))]
    with LocalPipeline(stages, n_microbatches=4, loss_fn=F.cross_entropy, timeout_s=30) as pipe:
        with pytest.raises(PipelineFailed, match=r"stage 1 of 2 .*forward of micro-batch 2.*boom"):
            pipe.step(torch.randn(8, 8), torch.zeros(8, dtype=torch.long))
    for thread in threading.enumerate():  # the stage threads end by themselves
        if thread.name.startswith("stage"):
            thread.join(timeout=10)
            assert not thread.is_alive(), thread.name


def test_a_stuck_stage_fails_at_the_deadline_naming_what_was_awaited():
    release = threading.Event()

    class Stuck(nn.Module):
        def forward(self, x):
            release.wait(10)
            return x

    stages = [nn.Sequential(nn.Linear(4, 4), Stuck()), nn.Sequential(nn.Linear(4, 2))]
    try:
        with LocalPipeline(
            stages, n_microbatches=2, loss_fn=F.cross_entropy, timeout_s=0.5
        ) as pipe:
            with pytest.raises(
                PipelineFailed,
                match=r"stage 1 waited 0.5 s for the activations of micro-batch 0 from stage 0",
            ):
                pipe.step(torch.randn(4, 4), torch.zeros(4, dtype=torch.long))
            release.set()
    finally:
        release.set()


def test_bad_input_is_refused_with_the_fix():
    model = mlp()
    with pytest.raises(ParallelConfigError, match=r"model of 7 layer\(s\) into 8 stages"):
        split_stages(model, 8)
    with pytest.raises(ParallelConfigError, match=r"from an nn.Sequential, got Linear"):
        split_stages(nn.Linear(2, 2), 2)  # type: ignore[arg-type]
    with pytest.raises(ParallelConfigError, match=r"strictly increasing layer indices in 1..6"):
        split_stages(model, boundaries=[5, 3])
    with pytest.raises(ParallelConfigError, match="exactly one"):
        split_stages(model, 2, boundaries=[3])
    with pytest.raises(ParallelConfigError, match=r"a batch of 10 does not split into 4 .*8 or 12"):
        split_microbatches(torch.zeros(10), 4)
    stages = split_stages(model, 2)
    with pytest.raises(ParallelConfigError, match="2 stages but 1 devices"):
        LocalPipeline(stages, ["/cpu:0"], n_microbatches=2, loss_fn=F.cross_entropy)
    with pytest.raises(ParallelConfigError, match="schedule must be one of"):
        LocalPipeline(stages, n_microbatches=2, loss_fn=F.cross_entropy, schedule="zb")
    with pytest.raises(ParallelConfigError, match=r"n_microbatches must be an integer >= 1, got 0"):
        LocalPipeline(stages, n_microbatches=0, loss_fn=F.cross_entropy)
    with LocalPipeline(stages, n_microbatches=4, loss_fn=F.cross_entropy) as pipe:
        with pytest.raises(ParallelConfigError, match="a batch of 6 does not split into 4"):
            pipe.step(torch.randn(6, 32), torch.zeros(6, dtype=torch.long))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="asks for a GPU"):
            LocalPipeline(
                copy.deepcopy(stages),
                ["/gpu:0", "/gpu:1"],
                n_microbatches=2,
                loss_fn=F.cross_entropy,
            )


def test_the_stages_cut_makes_the_largest_stage_smallest():
    """The cut minimises the largest stage (each layer counts 1 + its parameters); the
    earlier greedy rule cut this model 1600/132 parameters where 544/1188 was possible."""
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    stages = split_stages(model, 2)
    assert [sum(p.numel() for p in s.parameters()) for s in stages] == [544, 1188]
    assert stage_boundaries(model, 2) == [3]
    # where the earlier cut was already optimal it stays (the examples' MLP, mlp() in 2)
    example = nn.Sequential(
        nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10),
    )  # fmt: skip
    assert stage_boundaries(example, 2) == [2]
    assert stage_boundaries(mlp(), 2) == [3]
    assert stage_boundaries(mlp(), 3) == [1, 4]  # largest 4813, where the earlier [3, 5] had 6275


def test_balanced_boundaries_and_schedules():
    assert stage_boundaries(mlp(), 7) == [1, 2, 3, 4, 5, 6]
    assert len(split_stages(mlp(), 3)) == 3
    assert stage_order("1f1b", 0, 2, 4) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("F", 2),
        ("B", 1),
        ("F", 3),
        ("B", 2),
        ("B", 3),
    ]
    assert stage_order("1f1b", 1, 2, 4) == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
        ("F", 3),
        ("B", 3),
    ]
    assert stage_order("gpipe", 0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert bubble_fraction(2, 4) == pytest.approx(0.2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_pipeline_on_two_gpus_matches():  # pragma: no cover - GPU machines only
    torch.manual_seed(2)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    model, reference = mlp(), mlp()
    ref_outs, ref_grads = train_reference(reference, [(x, y)], lr=0.1)
    with LocalPipeline(
        split_stages(model, 2), ["/gpu:0", "/gpu:1"], n_microbatches=4, loss_fn=F.cross_entropy
    ) as pipe:
        result = pipe.step(x.cuda(0), y.cuda(0))
    assert (result.outputs.cpu() - ref_outs[0]).abs().max() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_stages_on_one_gpu_match_and_report_the_gpus_time():  # pragma: no cover - GPU only
    """The stages' computing time on a GPU comes from CUDA events read at the step's end."""
    torch.manual_seed(2)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    model, reference = mlp(), mlp()
    ref_outs, _ = train_reference(reference, [(x, y)], lr=0.1)
    with LocalPipeline(
        split_stages(model, 2), ["/gpu:0", "/gpu:0"], n_microbatches=4, loss_fn=F.cross_entropy
    ) as pipe:
        result = pipe.step(x.cuda(0), y.cuda(0))
    assert (result.outputs.cpu() - ref_outs[0]).abs().max() < 1e-5
    assert result.bubble is not None and all(busy > 0 for busy in result.bubble.busy_s)
    assert all(0.0 <= share <= 1.0 for share in result.bubble.idle_shares)


def train_through(wrapper: nn.Module, model: nn.Module, batches, ref_outs, ref_grads) -> None:
    """SGD steps of ``model`` through ``wrapper`` (a closure's loss on its output), each step's
    output and gradients checked against the unsplit model's (``train_reference``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        out = wrapper(x)
        F.cross_entropy(out, y).backward()
        assert (out.detach() - ref_outs[step]).abs().max() < 1e-5
        for name, p in model.named_parameters():
            assert (p.grad - ref_grads[step][name]).abs().max() < 1e-5, (step, name)
        opt.step()


@pytest.mark.parametrize("boundaries", [[4], [2, 5]], ids=["2-stages", "3-stages"])
def test_pipelined_module_in_a_step_closure_matches_the_unsplit_model(boundaries):
    from tensorfleet.parallel.local_pipeline import PipelinedModule

    torch.manual_seed(3)
    batches = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(5)]
    model, reference = mlp(), mlp()
    ref_outs, ref_grads = train_reference(reference, batches, lr=0.1)
    pipe = LocalPipeline(split_stages(model, boundaries=boundaries), n_microbatches=4, loss_fn=None)
    wrapper = PipelinedModule(model, pipe)
    with pipe:
        train_through(wrapper, model, batches, ref_outs, ref_grads)
        with torch.no_grad():
            assert torch.allclose(wrapper(batches[0][0]), reference(batches[0][0]), atol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p - q).abs().max() < 1e-5
    with pytest.raises(ParallelConfigError, match="needs loss_fn"):
        pipe.step(torch.randn(4, 32), torch.zeros(4, dtype=torch.long))


class _Slow(nn.Module):
    """A stage that takes at least ``seconds`` per forward (a sleep: a lower bound on its
    computing time that holds on any machine)."""

    def __init__(self, width: int, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_each_step_reports_each_stages_idle_share_beside_the_schedules_bubble(schedule):
    from tensorfleet.worker.timeline import Timeline

    stages = [nn.Linear(8, 8), _Slow(8, 0.02)]
    timeline = Timeline("worker:0")
    with LocalPipeline(stages, n_microbatches=4, loss_fn=F.mse_loss, schedule=schedule) as pipe:
        pipe.timeline = timeline
        assert pipe.last_bubble is None
        for _ in range(2):
            result = pipe.step(torch.randn(8, 8), torch.randn(8, 8))
        report = result.bubble
        assert report is pipe.last_bubble
        assert report.schedule_bubble == bubble_fraction(2, 4)
        assert len(report.busy_s) == len(report.idle_shares) == 2
        assert report.busy_s[1] >= 4 * 0.02  # four forwards of at least 20 ms each
        assert report.step_s >= report.busy_s[1]  # computing happens inside the step
        assert all(0.0 <= share <= 1.0 for share in report.idle_shares)
        assert report.describe().startswith("pipeline bubble: stage idle ")
        assert "(schedule's own 20%)" in report.describe()
    names = [event["name"] for event in timeline.events]
    for stage in (0, 1):
        for kind in ("forward", "backward"):
            assert names.count(f"stage {stage} {kind}") == 2 * 4  # 2 steps x 4 micro-batches
    steps = [event for event in timeline.events if event["name"] == "pipeline step"]
    assert len(steps) == 2
    assert steps[-1]["args"]["schedule_bubble"] == 0.2
    assert len(steps[-1]["args"]["idle_shares"]) == 2


def test_a_pipelined_module_reports_the_bubble_of_its_forward_and_backward():
    from tensorfleet.parallel.local_pipeline import PipelinedModule

    model = mlp()
    pipe = LocalPipeline(split_stages(model, boundaries=[4]), n_microbatches=4, loss_fn=None)
    wrapper = PipelinedModule(model, pipe)
    with pipe:
        F.cross_entropy(wrapper(torch.randn(16, 32)), torch.randint(0, 10, (16,))).backward()
        report = pipe.last_bubble
    assert report is not None and len(report.busy_s) == 2
    assert report.step_s >= max(report.busy_s) > 0


@pytest.mark.parametrize("boundaries", [[4], [2, 5]], ids=["2-stages", "3-stages"])
def test_stages_on_the_device_of_the_loss_run_their_backward_in_autograds_own_thread(
    monkeypatch, boundaries
):
    """On a GPU autograd runs the pipeline's backward on that device's one thread, so the
    stages on the same device must run their backward there, downstream first: queued from a
    stage thread they would wait for that thread forever (two stages on one H200 hung). The
    CPU stands in for the GPU: the wrapper is told its backward runs on the CPU's device
    thread. (Upstream first would fail at the deadline: stage 0 would wait for gradients no
    one computes.)"""
    from tensorfleet.parallel import local_pipeline
    from tensorfleet.parallel.local_pipeline import PipelinedModule

    torch.manual_seed(4)
    batches = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(2)]
    model, reference = mlp(), mlp()
    ref_outs, ref_grads = train_reference(reference, batches, lr=0.1)
    pipe = LocalPipeline(
        split_stages(model, boundaries=boundaries), n_microbatches=4, loss_fn=None, timeout_s=30
    )
    wrapper = PipelinedModule(model, pipe)
    threads = record_backward_threads(pipe.stages)
    monkeypatch.setattr(local_pipeline, "backward_thread_device", lambda grad: grad.device)
    with pipe:
        train_through(wrapper, model, batches, ref_outs, ref_grads)
    assert threads and set(threads) == {threading.current_thread().name}
    assert pipe.last_bubble is not None and all(busy > 0 for busy in pipe.last_bubble.busy_s)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_stages_on_one_gpu_in_a_step_closure_match():  # pragma: no cover - GPU only
    """The closure API with both stages on the GPU of the loss (it hung before)."""
    from tensorfleet.parallel.local_pipeline import PipelinedModule

    torch.manual_seed(5)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    model, reference = mlp(), mlp()
    _, ref_grads = train_reference(reference, [(x, y)], lr=0.1)
    pipe = LocalPipeline(
        split_stages(model, 2), ["/gpu:0", "/gpu:0"], n_microbatches=4, loss_fn=None, timeout_s=60
    )
    with pipe:
        F.cross_entropy(PipelinedModule(model, pipe)(x.cuda()), y.cuda()).backward()
    for name, p in model.named_parameters():
        assert (p.grad.cpu() - ref_grads[0][name]).abs().max() < 1e-5, name
