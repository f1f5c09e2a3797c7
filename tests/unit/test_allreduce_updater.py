"""AllReduceUpdater in one process: a torch.distributed world of size 1 over gloo (the
rendezvous on a free loopback port). Every test destroys what it created in ``finally``, and
the autouse fixture checks that no process group outlives a test."""

from __future__ import annotations

import copy
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tensorfleet import task_markers
from tensorfleet.errors import TensorfleetError
from tensorfleet.launch.ports import free_port
from tensorfleet.ps.update_rules import SGD, Momentum
from tensorfleet.session.server import Server
from tensorfleet.session.training_session import TrainingSession
from tensorfleet.worker.allreduce_updater import AllReduceUpdater
from tensorfleet.worker.client import ClientTimeouts

pytestmark = pytest.mark.timeout(60)

TIMEOUTS = ClientTimeouts(connect_s=10.0)


@pytest.fixture(autouse=True)
def no_process_group_left() -> Iterator[None]:
    assert not dist.is_initialized(), "a process group was left by an earlier test"
    try:
        yield
    finally:
        leaked = dist.is_initialized()
        if leaked:
            dist.destroy_process_group()
        assert not leaked, "the test left a process group initialized"


def _updater(ema_decay: float | None = None) -> AllReduceUpdater:
    return AllReduceUpdater(f"127.0.0.1:{free_port()}", 0, 1, TIMEOUTS, ema_decay)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 3, generator=generator), torch.randn(8, 1, generator=generator)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return nn.functional.mse_loss(model(x), y)


def test_connect_wrap_register_push_pull_update_the_model_like_torch_optim() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    updater = _updater()
    try:
        updater.connect()
        assert dist.is_initialized() and dist.get_world_size() == 1
        wrapped = updater.wrap(model)
        updater.register(list(model.named_parameters()), Momentum(0.1, 0.9))
        assert updater.pull().global_step == 0
        for step in range(3):
            wrapped.zero_grad(set_to_none=True)
            _loss(wrapped, step).backward()
            progress = updater.push_pull()
            assert (progress.global_step, progress.made_step, progress.stop) == (
                step + 1,
                True,
                False,
            )

            optimizer.zero_grad(set_to_none=True)
            _loss(reference, step).backward()
            optimizer.step()
        for (name, ours), theirs in zip(
            model.named_parameters(), reference.parameters(), strict=True
        ):
            assert torch.equal(ours, theirs), name
        assert not torch.equal(model[0].weight, _model()[0].weight)  # it did train
        updater.finish(None)  # a barrier of one
    finally:
        updater.close()
    assert not dist.is_initialized()


def test_finish_tells_a_launcher_the_worker_passed_the_end_and_a_failed_one_does_not(
    tmp_path, monkeypatch
) -> None:
    """Past the final barrier the worker leaves the marker by which a launcher retires it if
    it dies at exit (tensorfleet.task_markers); after a failure it leaves none."""
    monkeypatch.setenv(task_markers.MARKERS_VAR, str(tmp_path))
    markers = task_markers.TaskMarkers()
    markers.directory = tmp_path
    updater = _updater()
    try:
        updater.connect()
        updater.finish(None, failed=True)
        assert not markers.has("worker:0", task_markers.COLLECTIVE_END)
        updater.finish(None)
        assert markers.has("worker:0", task_markers.COLLECTIVE_END)
        assert not markers.has("worker:1", task_markers.COLLECTIVE_END)
    finally:
        updater.close()


def test_register_before_wrap_is_refused() -> None:
    updater = _updater()
    try:
        updater.connect()
        with pytest.raises(RuntimeError, match=r"wrap\(\) the model before register\(\)"):
            updater.register(list(_model().named_parameters()), SGD(0.1))
    finally:
        updater.close()


def test_push_pull_after_a_forward_that_bypassed_the_wrapper_says_to_use_sess_model() -> None:
    model = _model()
    updater = _updater()
    try:
        updater.connect()
        wrapped = updater.wrap(model)
        updater.register(list(model.named_parameters()), SGD(0.1))
        before = [p.detach().clone() for p in model.parameters()]
        _loss(model, 0).backward()  # the inner model, not the DDP wrapper
        with pytest.raises(TensorfleetError) as excinfo:
            updater.push_pull()
        assert "did not go through the DDP wrapper" in str(excinfo.value)
        assert "`sess.model(x)`" in str(excinfo.value)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        # Through the wrapper the next step works, and only one forward counts per step.
        wrapped.zero_grad(set_to_none=True)
        _loss(wrapped, 1).backward()
        assert updater.push_pull().global_step == 1
        with pytest.raises(TensorfleetError, match="sess.model"):
            updater.push_pull()
    finally:
        updater.close()
    assert not dist.is_initialized()  # also after a failure


@pytest.mark.parametrize("wish", [False, True])
def test_agreement_in_a_world_of_one_is_the_local_wish(wish: bool) -> None:
    updater = _updater()
    try:
        updater.connect()
        assert updater.agree(wish) == (wish, False, False)
        assert updater.agree(wish, checkpoint=True) == (wish, True, False)
        assert updater.agree(wish, preempted=True) == (wish, False, True)
    finally:
        updater.close()


def test_the_moving_average_matches_a_hand_computed_one() -> None:
    decay = 0.75
    model = _model()
    updater = _updater(ema_decay=decay)
    try:
        updater.connect()
        wrapped = updater.wrap(model)
        updater.register(list(model.named_parameters()), SGD(0.5))
        average = {name: p.detach().clone() for name, p in model.named_parameters()}
        for step in range(3):
            wrapped.zero_grad(set_to_none=True)
            _loss(wrapped, step).backward()
            updater.push_pull()
            for name, p in model.named_parameters():
                average[name] = decay * average[name] + (1 - decay) * p.detach()
        got = updater.moving_average()
        assert got.keys() == average.keys()
        for name in average:
            torch.testing.assert_close(got[name], average[name], rtol=1e-6, atol=1e-7)
            assert not torch.equal(got[name], dict(model.named_parameters())[name])
        got["0.weight"].add_(1.0)  # a copy: changing it changes nothing inside
        torch.testing.assert_close(updater.moving_average()["0.weight"], average["0.weight"])
    finally:
        updater.close()


def test_moving_average_without_ema_decay_is_refused() -> None:
    with pytest.raises(ValueError, match="no moving average is kept: pass ema_decay"):
        AllReduceUpdater("127.0.0.1:1", 0, 1).moving_average()


@pytest.mark.parametrize(("rank", "world"), [(1, 1), (-1, 2), (0, 0)])
def test_a_rank_outside_the_world_is_refused(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match=f"rank {rank} is outside a group of {world} workers"):
        AllReduceUpdater("127.0.0.1:1", rank, world)


def test_close_destroys_only_the_group_it_created() -> None:
    first, second = _updater(), _updater()
    try:
        first.connect()
        with pytest.raises(TensorfleetError, match="a torch.distributed process group already"):
            second.connect()
        second.close()
        assert dist.is_initialized()  # not second's to destroy
        first.close()
        assert not dist.is_initialized()
        first.close()  # twice is harmless
    finally:
        first.close()
        second.close()


def test_a_failed_connect_leaves_no_group_and_says_where() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        updater = AllReduceUpdater(address, 0, 1, ClientTimeouts(connect_s=5.0))
        try:
            with pytest.raises(TensorfleetError) as excinfo:
                updater.connect()
        finally:
            updater.close()
    assert f"worker 0 could not join the all-reduce group of 1 at {address}" in str(excinfo.value)
    assert not dist.is_initialized()


# -- through a TrainingSession -----------------------------------------------------------------


def _allreduce_session(model: nn.Module, **kwargs: object) -> TrainingSession:
    cluster = {"worker": [f"127.0.0.1:{free_port()}"]}
    server = Server(cluster, "worker", 0, secret="s" * 32)
    return TrainingSession(server, model, SGD(lr=0.1), mode="allreduce", **kwargs)


def test_an_allreduce_session_trains_through_sess_model_and_closes_the_group() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    with _allreduce_session(model, ema_decay=0.5) as sess:
        assert isinstance(sess.model, nn.parallel.DistributedDataParallel)
        for step in range(2):
            assert not sess.should_stop()
            result = sess.step(lambda step=step: _loss(sess.model, step))
            assert (result.global_step, result.made_step) == (step + 1, True)
            optimizer.zero_grad(set_to_none=True)
            _loss(reference, step).backward()
            optimizer.step()
        sess.request_stop()
        assert sess.should_stop()
        assert sess.moving_average().keys() == dict(model.named_parameters()).keys()
    assert not dist.is_initialized()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_an_allreduce_step_that_bypasses_sess_model_fails_and_the_group_is_closed() -> None:
    model = _model()
    with pytest.raises(TensorfleetError, match=r"Compute the loss with `sess.model\(x\)`"):
        with _allreduce_session(model) as sess:
            sess.step(lambda: _loss(model, 0))
    assert not dist.is_initialized()


def test_a_checkpoint_of_the_replica_restores_parameters_optimizer_state_and_data() -> None:
    """Save after 3 momentum steps, train on, restore: the parameters, the momentum and the
    data position are those of the checkpoint (the next step matches an uninterrupted run),
    in a world of one (the collectives are the same calls as in a real group)."""
    model = _model()
    updater = _updater()
    try:
        updater.connect()
        wrapped = updater.wrap(model)
        updater.register(list(model.named_parameters()), Momentum(0.1, 0.9))

        def step(number: int) -> None:
            wrapped.zero_grad(set_to_none=True)
            _loss(wrapped, number).backward()
            updater.push_pull()

        for number in range(3):
            step(number)
        positions = updater.gather_data({"epoch": 1, "offset": 24}, ["worker:0"])
        assert positions == {"worker:0": {"epoch": 1, "offset": 24}}
        global_step, (document,) = updater.save_replica(positions)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        step(3)
        after_uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}
        step(4)  # the replica moves on; the restore must bring it back
        assert global_step == 3
        data = updater.restore_collectively(bytes(document), global_step, "worker:0")
        assert data == {"epoch": 1, "offset": 24}
        assert updater.pull().global_step == 3
        for name, value in saved.items():
            assert torch.equal(model.state_dict()[name], value), name
        step(3)  # with the restored momentum, step 3 again gives what it gave before
        for name, value in after_uninterrupted.items():
            assert torch.equal(model.state_dict()[name], value), name
        assert updater.restore_collectively(None, 0, "worker:0") is None  # no checkpoint
        with pytest.raises(TensorfleetError, match="cannot be restored: the checkpoint cannot"):
            updater.restore_collectively(b"not a checkpoint", 3, "worker:0")
    finally:
        updater.close()


def test_a_model_with_an_embedding_table_is_refused_naming_the_table() -> None:
    """Its rows live on ps shards; all-reduce has none (the first lookup failed with
    TableNotAttached before)."""
    import tensorfleet as tfl
    from tensorfleet.errors import ConfigError

    model = nn.Sequential()
    model.add_module("user", tfl.EmbeddingTable(100, 4))
    with pytest.raises(ConfigError, match=r"EmbeddingTable modules \('user'\).*'allreduce'"):
        AllReduceUpdater("127.0.0.1:1", 0, 1).wrap(model)


def test_a_loop_that_does_not_ask_should_stop_after_a_sigterm_is_told_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In allreduce a preemption's checkpoint is agreed at should_stop(): a loop that does not
    ask it trains on after the SIGTERM, and is told so (once); asking then leaves."""
    import os
    import signal

    from tensorfleet.errors import Preempted

    fallback = signal.signal(signal.SIGTERM, lambda *_: None)  # should the session not take it
    try:
        with pytest.raises(Preempted):
            with _allreduce_session(_model()) as sess:
                os.kill(os.getpid(), signal.SIGTERM)
                for step in range(4):
                    sess.step(lambda step=step: _loss(sess.model, step))
                told = [
                    r for r in caplog.records if "has not asked sess.should_stop()" in r.message
                ]
                assert len(told) == 1, caplog.text
                sess.should_stop()  # the agreement, then the preempted worker leaves
    finally:
        signal.signal(signal.SIGTERM, fallback)
    assert not dist.is_initialized()
