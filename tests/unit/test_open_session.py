"""A TrainingSession on a real parameter service (in a thread, ``service_harness``): after its
``with`` block, the methods that use its connections raise a UsageError saying where they
belong, not the transport's error on a closed socket (ZeroMQ's "Socket operation on
non-socket"). The one-process twin is in ``test_training_session_modes.py``."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tensorfleet.errors import UsageError
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.update_rules import SGD
from tensorfleet.session.hooks import StopAtStep
from tensorfleet.session.server import Server
from tensorfleet.session.training_session import TrainingSession
from tensorfleet.wire.secret import load_secret

from .service_harness import serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(60)

SECRET = "open-session-unit-test-secret-0000000001"

_CALLS: dict[str, Callable[[TrainingSession], object]] = {
    "pull()": lambda sess: sess.pull(),
    "cluster_stats()": lambda sess: sess.cluster_stats(),
    "moving_average()": lambda sess: sess.moving_average(),
    "step()": lambda sess: sess.step(lambda: sess.model(torch.ones(2, 3)).sum()),
}


def _worker_server(ps_address: str) -> Server:
    """worker:0 (the chief) of a cluster whose one ps is the service in a thread."""
    return Server({"ps": [ps_address], "worker": ["127.0.0.1:1"]}, "worker", 0, secret=SECRET)


def test_after_the_with_block_the_session_methods_raise_a_usage_error() -> None:
    service = serve_in_thread(
        ServiceConfig(shard_index=0, worker_tasks=("worker:0",)), load_secret(SECRET)
    )
    try:
        server = _worker_server(service.address)
        torch.manual_seed(0)
        with TrainingSession(
            server, nn.Linear(3, 2), SGD(lr=0.1), ema_decay=0.5, progress_secs=None
        ) as sess:
            for call in _CALLS.values():
                call(sess)  # each works inside the block
            assert sess.cluster_stats()[0]["pushes"] == 1
        for name, call in _CALLS.items():
            with pytest.raises(
                UsageError,
                match=re.escape(f"{name} needs a started, open session, and this one is closed"),
            ):
                call(sess)
    finally:
        stop_services([service])


def test_a_session_preempted_while_its_ps_is_gone_ends_without_waiting_for_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A SIGTERM while the step's exchange recovers from a ps that is gone (the whole job is
    stopped, and the ps ended first) raises Preempted out of the step; the session then
    says nothing more to the unreachable ps: no 'done' waited for until its silence is
    noticed, no second recovery (a worker took 10 s more to stop)."""
    import os
    import signal
    import threading

    from tensorfleet.errors import Preempted
    from tensorfleet.worker.timeouts import ClientTimeouts

    service = serve_in_thread(
        ServiceConfig(shard_index=0, worker_tasks=("worker:0",)), load_secret(SECRET)
    )
    server = Server(
        {"ps": [service.address], "worker": ["127.0.0.1:1"]}, "worker", 0, secret=SECRET
    )
    patient = ClientTimeouts(
        connect_s=10.0, initialize_s=10.0, step_s=10.0, recover_s=60.0, ps_silence_s=30.0
    )
    fallback = signal.signal(signal.SIGTERM, lambda *_: None)  # should the session not take it
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        torch.manual_seed(0)
        with pytest.raises(Preempted, match="unreachable"):
            with TrainingSession(
                server, nn.Linear(3, 2), SGD(lr=0.1), progress_secs=None, timeouts=patient
            ) as sess:
                sess.step(lambda: sess.model(torch.ones(2, 3)).sum())
                stop_services([service])  # the ps is gone
                timer.start()
                while True:  # each step recovers until the SIGTERM ends the recovery
                    sess.step(lambda: sess.model(torch.ones(2, 3)).sum())
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, fallback)
    said = caplog.text
    assert "'done'" not in said and said.count("recovering") == 1, said


def test_a_final_checkpoint_of_the_step_saved_last_is_not_written_again(tmp_path, caplog) -> None:
    """The last periodic checkpoint is of the step training ends at (no push since): the
    chief's final save is skipped, where it wrote the same checkpoint a second time (a new
    user saw its line twice; a big model's checkpoint written twice)."""
    service = serve_in_thread(
        ServiceConfig(shard_index=0, worker_tasks=("worker:0",)), load_secret(SECRET)
    )
    try:
        server = _worker_server(service.address)
        torch.manual_seed(0)
        with caplog.at_level(logging.INFO, logger="tensorfleet.session"):
            with TrainingSession(
                server, nn.Linear(3, 2), SGD(lr=0.1), hooks=[StopAtStep(last_step=4)],
                checkpoint_dir=tmp_path, save_checkpoint_steps=2, progress_secs=None,
            ) as sess:  # fmt: skip
                while not sess.should_stop():
                    sess.step(lambda: sess.model(torch.ones(2, 3)).sum())
    finally:
        stop_services([service])
    saved = [
        r.getMessage() for r in caplog.records if "checkpoint of global step 4" in r.getMessage()
    ]
    assert len(saved) == 1, saved
    assert any(
        "the final checkpoint is the one of global step 4, saved already" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
