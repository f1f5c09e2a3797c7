"""TrainingSession: which mode/argument combinations are refused (before anything connects,
with or without a server), the warning that --encrypt does not cover mode 'allreduce', a
local session's moving average, its methods outside the ``with`` block, and the LoggingHook
printing only for the worker that made the step. A Server for a 'worker' task starts
nothing, so no test here opens a socket."""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet.errors import ClusterConfigError, ConfigError, UsageError
from tensorfleet.ps.update_rules import SGD
from tensorfleet.session import update_modes
from tensorfleet.session.hooks import LoggingHook, StepResult
from tensorfleet.session.server import Server, ServerConfig
from tensorfleet.session.training_session import TrainingSession

SECRET = "s" * 32


def _server(ps: int = 1, workers: int = 2, index: int = 0, encrypt: bool = False) -> Server:
    cluster = {"worker": [f"127.0.0.1:{2000 + i}" for i in range(workers)]}
    if ps:
        cluster["ps"] = [f"127.0.0.1:{3000 + i}" for i in range(ps)]
    return Server(cluster, "worker", index, secret=SECRET, config=ServerConfig(encrypt=encrypt))


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
        (
            {"mode": "sync", "replicas_to_aggregate": 0},
            "replicas_to_aggregate must be >= 1 (the gradients a sync step averages, one per "
            "worker; default: every worker's), got 0: give an int >= 1, or leave "
            "replicas_to_aggregate out",
        ),
        ({"mode": "sync", "replicas_to_aggregate": -1}, "must be >= 1 (the gradients a sync"),
        (
            {"max_staleness": -1},
            "max_staleness must be >= 0 (the steps the fastest worker may run ahead of the "
            "slowest; 0 is lockstep), got -1: give an int >= 0, or leave max_staleness out",
        ),
        (
            {"mode": "sync", "lost_worker": "wait"},
            "lost_worker must be one of ('shrink', 'fail'), got 'wait': 'shrink' (the default)",
        ),
        (
            {"mode": "async", "lost_worker": "fail"},
            "lost_worker=fail only applies to mode 'sync', not 'async': leave lost_worker out, "
            "or train with mode='sync'",
        ),
        (
            {"mode": "allreduce", "lost_worker": "shrink"},
            "lost_worker=shrink only applies to mode 'sync', not 'allreduce'",
        ),
        ({"ema_decay": 1.0}, "ema_decay must be in (0, 1), got 1.0: the weight of the old"),
    ],
)
@pytest.mark.parametrize("with_server", [True, False])
def test_invalid_arguments_are_refused_by_name(
    kwargs: dict, message: str, with_server: bool
) -> None:
    server = _server() if with_server else None
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainingSession(server, _model(), SGD(lr=0.1), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"mode": "sync", "replicas_to_aggregate": 2.5},
            "replicas_to_aggregate must be a whole number (the gradients a sync step averages, "
            "one per worker; default: every worker's), got 2.5 (float): give an int >= 1, or "
            "leave replicas_to_aggregate out",
        ),
        ({"mode": "sync", "replicas_to_aggregate": True}, "got True (bool): give an int >= 1"),
        (
            {"max_staleness": 1.5},
            "max_staleness must be a whole number (the steps the fastest worker may run ahead "
            "of the slowest; 0 is lockstep), got 1.5 (float): give an int >= 0",
        ),
        ({"max_staleness": True}, "max_staleness must be a whole number"),
        (
            {"clip_grad_norm": True},
            "clip_grad_norm must be a number, got True (bool): give e.g. clip_grad_norm=1.0, "
            "or leave clip_grad_norm out",
        ),
        ({"ema_decay": "0.9"}, "ema_decay must be a number, got '0.9' (str)"),
    ],
)
@pytest.mark.parametrize("with_server", [True, False])
def test_options_of_the_wrong_type_are_refused_by_name(
    kwargs: dict, message: str, with_server: bool
) -> None:
    """The same script fails alike in one process and on a cluster, before anything is sent
    (a float max_staleness used to reach the ps as a wire-protocol error)."""
    server = _server() if with_server else None
    with pytest.raises(TypeError, match=re.escape(message)):
        TrainingSession(server, _model(), SGD(lr=0.1), **kwargs)


@pytest.mark.parametrize("index", [0, 1])
def test_sync_with_more_replicas_than_workers_is_refused_on_every_worker(index: int) -> None:
    """Every worker alike, the chief included, refuses before sending anything (the ps used
    to refuse only the chief's create and leave the others waiting)."""
    with pytest.raises(ConfigError) as excinfo:
        TrainingSession(
            _server(workers=2, index=index),
            _model(),
            SGD(lr=0.1),
            mode="sync",
            replicas_to_aggregate=5,
        )
    assert str(excinfo.value) == (
        "replicas_to_aggregate=5 is more than the 2 worker tasks of the cluster (worker:0, "
        "worker:1) that train it: a sync step averages one gradient per worker. Use "
        "replicas_to_aggregate <= 2, or launch more workers"
    )


def test_sync_replicas_are_counted_among_the_models_workers() -> None:
    """With several models on a cluster, a model's replicas are its model_workers only."""
    with pytest.raises(ConfigError) as excinfo:
        TrainingSession(
            _server(workers=3, index=1),
            _model(),
            SGD(lr=0.1),
            mode="sync",
            replicas_to_aggregate=3,
            model_name="small",
            model_workers=[1, 2],
        )
    assert str(excinfo.value) == (
        "replicas_to_aggregate=3 is more than the 2 model_workers of model 'small' (worker:1, "
        "worker:2) that train it: a sync step averages one gradient per worker. Use "
        "replicas_to_aggregate <= 2, or name more workers in model_workers"
    )
    session = TrainingSession(
        _server(workers=3, index=1),
        _model(),
        SGD(lr=0.1),
        mode="sync",
        replicas_to_aggregate=2,
        model_name="small",
        model_workers=[1, 2],
    )
    try:
        assert session.discipline.replicas_to_aggregate == 2
    finally:
        session._updater.close()  # never started: release the client without telling the ps


@pytest.mark.parametrize("uses_ps", [True, False])
def test_a_users_mode_through_the_ps_has_the_models_chief_only_with_uses_ps(
    uses_ps: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mode of the user's built on ``ps_updater``: with ``uses_ps`` the chief is the
    model's (the first of model_workers) and sparse_optimizer applies, as in the built-in
    ps modes; without it the chief is the cluster's and sparse_optimizer is refused."""
    monkeypatch.setattr(update_modes, "_MODES", dict(update_modes._MODES))  # this test's own

    def build(server, named_params, settings):
        return update_modes.ps_updater(server, named_params, settings, discipline="async")

    update_modes.register_update_mode(update_modes.UpdateMode("mine", build, uses_ps=uses_ps))
    session = TrainingSession(
        _server(workers=3, index=1),
        _model(),
        SGD(lr=0.1),
        mode="mine",
        model_name="small",
        model_workers=[1, 2],
    )
    try:
        assert session.is_chief is uses_ps  # worker:1 is the first of model 'small'
        assert session.discipline.mode == "async"
    finally:
        session._updater.close()  # never started: release the client without telling the ps
    arguments = {"mode": "mine", "sparse_optimizer": tfl.optim.SparseAdam(lr=0.1)}
    if uses_ps:
        TrainingSession(_server(), _model(), SGD(lr=0.1), **arguments)._updater.close()
    else:
        with pytest.raises(ConfigError, match="sparse_optimizer='sparse_adam'"):
            TrainingSession(_server(), _model(), SGD(lr=0.1), **arguments)


def test_allreduce_on_an_encrypting_server_warns_once_that_it_is_not_covered(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(update_modes, "_warned_allreduce_in_clear", False)
    caplog.set_level(logging.WARNING, logger="tensorfleet.session")
    TrainingSession(_server(ps=0), _model(), SGD(lr=0.1), mode="allreduce")
    assert not caplog.records  # no --encrypt: nothing to say
    for index in (0, 1):
        TrainingSession(
            _server(ps=0, index=index, encrypt=True), _model(), SGD(lr=0.1), mode="allreduce"
        )
    assert [r.getMessage() for r in caplog.records] == [
        "mode 'allreduce' traffic (torch.distributed, gloo/NCCL) is neither authenticated nor "
        "encrypted; --encrypt covers the ps traffic only (docs/security.md)"
    ]


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
            _server(ps=2, index=1),
            _model(),
            SGD(lr=0.1),
            max_staleness=3,
            clip_grad_norm=2.0,
            max_gradient_age=200,
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
            "lost_worker": "shrink",  # the default, in the one mode that takes it
            "max_gradient_age": "auto",  # the default; a sync shard does not use it
        }
        assert async_ == {
            "mode": "async",
            "replicas_to_aggregate": None,
            "max_staleness": 3,
            "clip_norm": None,  # clipped on each worker
            "ema_decay": None,
            "lost_worker": "shrink",
            "max_gradient_age": 200,
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
    with pytest.raises(ValueError, match=re.escape(f"ema_decay must be in (0, 1), got {decay}")):
        TrainingSession(None, _model(), SGD(lr=0.1), ema_decay=decay)


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


_CALLS = {
    "step()": lambda sess: sess.step(lambda: sess.model(torch.ones(1, 3)).sum()),
    "pull()": lambda sess: sess.pull(),
    "cluster_stats()": lambda sess: sess.cluster_stats(),
    "moving_average()": lambda sess: sess.moving_average(),
    "save_checkpoint()": lambda sess: sess.save_checkpoint(),
}


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_session_methods_outside_the_with_block_say_where_they_belong(
    call: str, tmp_path: Path
) -> None:
    """Alone as on a cluster (tests/unit/test_open_session.py): before start() and after the
    block, the methods that use the session's connections raise the same UsageError."""
    sess = TrainingSession(None, _model(), SGD(lr=0.1), ema_decay=0.5, checkpoint_dir=tmp_path)
    with pytest.raises(
        UsageError,
        match=re.escape(f"{call} needs a started, open session, and this one has not started"),
    ):
        _CALLS[call](sess)
    with sess:
        _CALLS[call](sess)  # inside the block it works
    with pytest.raises(UsageError) as excinfo:
        _CALLS[call](sess)
    assert str(excinfo.value) == (
        f"{call} needs a started, open session, and this one is closed (its `with` block "
        "ended, or it failed): its connections are released. Call it inside the `with` "
        "block, e.g. after the training loop and before the block ends"
    )


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


def test_every_parameter_has_no_gradient_when_a_step_begins() -> None:
    """The step clears the gradients of the step before (frozen parameters' included, as
    ``Module.zero_grad`` does), so that the backward never adds to old ones."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    seen: list[bool] = []

    def loss() -> torch.Tensor:
        seen.append(all(p.grad is None for p in model.parameters()))
        return model(torch.ones(1, 3)).sum()

    with TrainingSession(None, model, optimizer=SGD(lr=0.1), progress_secs=None) as sess:
        model[0].bias.grad = torch.ones(4)  # set by hand: cleared too
        for _ in range(3):
            sess.step(loss)
    assert seen == [True, True, True]
