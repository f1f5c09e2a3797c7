"""TrainingSession: which mode/argument combinations are refused (before anything connects),
a local session's moving average, and the LoggingHook printing only for the worker that made
the step. A Server for a 'worker' task starts nothing, so no test here opens a socket."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tensorfleet.errors import ClusterConfigError
from tensorfleet.ps.update_rules import SGD
from tensorfleet.session.hooks import LoggingHook, StepResult
from tensorfleet.session.server import Server
from tensorfleet.session.training_session import TrainingSession

SECRET = "s" * 32


def _server(ps: int = 1, workers: int = 2, index: int = 0) -> Server:
    cluster = {"worker": [f"127.0.0.1:{2000 + i}" for i in range(workers)]}
    if ps:
        cluster["ps"] = [f"127.0.0.1:{3000 + i}" for i in range(ps)]
    return Server(cluster, "worker", index, secret=SECRET)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "ssp"}, "mode must be one of ('async', 'sync', 'allreduce'), got 'ssp'"),
        (
            {"mode": "async", "replicas_to_aggregate": 1},
            "replicas_to_aggregate=1 only applies to mode 'sync', not 'async'",
        ),
        (
            {"mode": "allreduce", "replicas_to_aggregate": 2},
            "replicas_to_aggregate=2 only applies to mode 'sync', not 'allreduce'",
        ),
        ({"mode": "sync", "max_staleness": 0}, "max_staleness=0 only applies to mode 'async'"),
        (
            {"mode": "allreduce", "max_staleness": 2},
            "max_staleness=2 only applies to mode 'async', not 'allreduce'",
        ),
        (
            {"mode": "allreduce", "wire_dtype": "bf16"},
            "wire_dtype=bf16 only applies to mode 'async' or 'sync', not 'allreduce'",
        ),
        ({"wire_dtype": "fp8"}, "wire_dtype must be None (gradients in their own dtype) or one"),
        (
            {"mode": "allreduce", "values_wire_dtype": "bf16"},
            "values_wire_dtype=bf16 only applies to mode 'async' or 'sync', not 'allreduce'",
        ),
        ({"values_wire_dtype": "fp8"}, "values_wire_dtype must be None (values in their own"),
        ({"clip_grad_norm": 0.0}, "clip_grad_norm must be > 0, got 0.0"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm must be > 0, got -1.0"),
        ({"mode": "sync", "clip_grad_norm": float("nan")}, "clip_grad_norm must be > 0, got nan"),
    ],
)
@pytest.mark.parametrize("with_server", [True, False])
def test_invalid_arguments_are_refused_by_name(
    kwargs: dict, message: str, with_server: bool
) -> None:
    server = _server() if with_server else None
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainingSession(server, _model(), SGD(lr=0.1), **kwargs)


def test_an_optimizer_that_is_not_an_update_rule_is_refused() -> None:
    model = _model()
    with pytest.raises(TypeError, match="optimizer must be a tensorfleet update rule"):
        TrainingSession(None, model, torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[arg-type]


def test_sync_clipping_with_two_ps_shards_is_refused_naming_the_count() -> None:
    with pytest.raises(ValueError) as excinfo:
        TrainingSession(_server(ps=2), _model(), SGD(lr=0.1), mode="sync", clip_grad_norm=1.0)
    text = str(excinfo.value)
    assert "works with one ps task, and this cluster has 2." in text
    assert "mode 'async' (each worker clips its own gradient), or 'allreduce'" in text


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_ps_modes_without_a_ps_job_are_a_cluster_config_error(mode: str) -> None:
    with pytest.raises(ClusterConfigError) as excinfo:
        TrainingSession(_server(ps=0), _model(), SGD(lr=0.1), mode=mode)
    text = str(excinfo.value)
    assert (
        f"mode {mode!r} trains through parameter servers, but the cluster has no 'ps' job" in text
    )
    assert "tensorfleet launch --ps 1" in text and "mode='allreduce'" in text


def test_allreduce_with_ps_tasks_is_a_cluster_config_error_saying_ps_0() -> None:
    with pytest.raises(ClusterConfigError) as excinfo:
        TrainingSession(_server(ps=2), _model(), SGD(lr=0.1), mode="allreduce")
    text = str(excinfo.value)
    assert "mode 'allreduce' needs no ps tasks, but the cluster has 2" in text
    assert text.endswith("Launch with --ps 0")


def test_sync_and_async_sessions_describe_their_discipline_without_connecting() -> None:
    """Constructing a session sends nothing; the discipline says where clipping happens."""
    sessions = [
        TrainingSession(
            _server(ps=1),
            _model(),
            SGD(lr=0.1),
            mode="sync",
            replicas_to_aggregate=1,
            clip_grad_norm=2.0,
            ema_decay=0.9,
        ),
        TrainingSession(
            _server(ps=2, index=1), _model(), SGD(lr=0.1), max_staleness=3, clip_grad_norm=2.0
        ),
    ]
    try:
        sync, async_ = (s.discipline.to_wire() for s in sessions)
        assert sync == {
            "mode": "sync",
            "replicas_to_aggregate": 1,
            "max_staleness": None,
            "clip_norm": 2.0,  # clipped on the ps
            "ema_decay": 0.9,
            "lost_worker": "shrink",
        }
        assert async_ == {
            "mode": "async",
            "replicas_to_aggregate": None,
            "max_staleness": 3,
            "clip_norm": None,  # clipped on each worker
            "ema_decay": None,
            "lost_worker": "shrink",
        }
        assert (sessions[0].is_chief, sessions[1].is_chief) == (True, False)
        assert sessions[1].task_name == "worker:1"
    finally:
        for session in sessions:  # never started: release the client without telling the ps
            session._updater.close()


# -- a local session ------------------------------------------------------------------------------


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)


def test_a_local_session_trains_like_torch_optim_and_keeps_the_hand_computed_average() -> None:
    decay = 0.5
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    average = {name: p.detach().clone() for name, p in reference.named_parameters()}
    with TrainingSession(None, model, SGD(lr=0.1), ema_decay=decay) as sess:
        assert sess.model is model and sess.task_name == "local"
        for step in range(4):
            x, y = _batch(step)
            result = sess.step(lambda x=x, y=y: nn.functional.mse_loss(sess.model(x), y))
            assert (result.global_step, result.made_step, result.dropped) == (step + 1, True, False)

            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(reference(x), y).backward()
            optimizer.step()
            for name, p in reference.named_parameters():
                average[name] = decay * average[name] + (1 - decay) * p.detach()
        got = sess.moving_average()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    assert got.keys() == average.keys() == {"weight", "bias"}
    for name in average:
        torch.testing.assert_close(got[name], average[name], rtol=1e-6, atol=1e-7)
        assert not torch.allclose(got[name], dict(reference.named_parameters())[name])


def test_a_local_session_without_ema_decay_has_no_moving_average() -> None:
    with TrainingSession(None, _model(), SGD(lr=0.1)) as sess:
        with pytest.raises(ValueError, match="no moving average is kept: pass ema_decay"):
            sess.moving_average()


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_a_local_session_refuses_an_ema_decay_outside_0_1(decay: float) -> None:
    sess = TrainingSession(None, _model(), SGD(lr=0.1), ema_decay=decay)
    with pytest.raises(ValueError, match=re.escape(f"ema_decay must be in (0, 1), got {decay}")):
        sess.start()


def test_a_local_session_clips_each_gradient_like_clip_grad_norm() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = _batch(0)
    y = y * 100  # a large gradient, so that clipping matters
    with TrainingSession(None, model, SGD(lr=0.1), clip_grad_norm=0.5) as sess:
        sess.step(lambda: nn.functional.mse_loss(sess.model(x), y))
    nn.functional.mse_loss(reference(x), y).backward()
    assert torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5) > 0.5
    optimizer.step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


# -- LoggingHook ---------------------------------------------------------------------------------


def _result(step: int, made_step: bool) -> StepResult:
    return StepResult(loss=0.125, global_step=step, made_step=made_step)


def test_logging_hook_prints_only_for_results_that_made_the_step() -> None:
    lines: list[str] = []
    hook = LoggingHook(every_n_steps=2, print_fn=lines.append)
    session = SimpleNamespace(task_name="worker:1")
    for step, made in [(1, True), (2, False), (2, True), (3, True), (4, False), (6, True)]:
        hook.after_step(session, _result(step, made))  # type: ignore[arg-type]
    assert lines == [
        "worker:1: global step 2, loss 0.1250",
        "worker:1: global step 6, loss 0.1250",
    ]


def test_logging_hook_formatter_may_print_nothing() -> None:
    lines: list[str] = []
    seen: list[int] = []

    def formatter(session: object, result: StepResult) -> str | None:
        seen.append(result.global_step)
        return None if result.global_step == 1 else f"step {result.global_step}"

    hook = LoggingHook(every_n_steps=1, formatter=formatter, print_fn=lines.append)
    for step, made in [(1, True), (2, False), (3, True)]:
        hook.after_step(SimpleNamespace(task_name="t"), _result(step, made))  # type: ignore[arg-type]
    assert (seen, lines) == ([1, 3], ["step 3"])


@pytest.mark.parametrize("every", [0, -1])
def test_logging_hook_needs_a_positive_interval(every: int) -> None:
    with pytest.raises(ValueError, match=f"every_n_steps must be positive, got {every}"):
        LoggingHook(every_n_steps=every)


def test_logging_hook_in_a_local_session_prints_every_n_steps() -> None:
    lines: list[str] = []
    model = _model()
    hook = LoggingHook(every_n_steps=2, print_fn=lines.append)
    with TrainingSession(None, model, SGD(lr=0.1), hooks=[hook]) as sess:
        losses = []
        for step in range(5):
            x, y = _batch(step)
            losses.append(sess.step(lambda x=x, y=y: nn.functional.mse_loss(sess.model(x), y)).loss)
    assert lines == [
        f"local: global step 2, loss {losses[1]:.4f}",
        f"local: global step 4, loss {losses[3]:.4f}",
    ]
