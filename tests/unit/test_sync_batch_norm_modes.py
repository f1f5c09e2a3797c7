"""Synchronized batch norm where nothing synchronizes it: in the ps modes the workers form
no process group, so ``tfl.convert_sync_batchnorm`` layers compute what a plain BatchNorm
computes; the session warns once (tensorfleet.worker.sync_batch_norm.warn_unsynchronized)
instead of accepting them silently. One process (no server) is their documented use: no
warning there."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.wire.secret import load_secret
from tensorfleet.worker import sync_batch_norm
from tensorfleet.worker.sync_batch_norm import (
    UnsynchronizedBatchNormWarning,
    warn_unsynchronized,
)

from .service_harness import serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(120)

SECRET = "sync-batch-norm-modes-unit-secret-00001"


@pytest.fixture(autouse=True)
def _fresh_process_state() -> Iterator[None]:
    """Each test starts as a new process would: no mode warned about yet."""
    sync_batch_norm._warned_modes.clear()
    yield
    sync_batch_norm._warned_modes.clear()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return tfl.convert_sync_batchnorm(
        nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    )


def test_it_warns_once_per_mode_naming_the_layers_and_the_fix() -> None:
    model = _model()
    with pytest.warns(UnsynchronizedBatchNormWarning) as caught:
        assert warn_unsynchronized(model, "async") == ["1"]
    (warning,) = caught
    text = str(warning.message)
    assert "synchronized batch norm layers ('1'" in text and "mode 'async'" in text
    assert "use mode 'allreduce'" in text and "plain BatchNorm" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_unsynchronized(model, "async") == ["1"]  # said once already
        plain = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8))
        assert warn_unsynchronized(plain, "sync") == []  # nothing synchronized: nothing said
    with pytest.warns(UnsynchronizedBatchNormWarning, match="mode 'sync'"):
        warn_unsynchronized(model, "sync")


def _train(server: tfl.Server | None) -> None:
    model = _model()
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with tfl.TrainingSession(
        server, model, optimizer=tfl.optim.SGD(lr=0.1), progress_secs=None
    ) as sess:
        for _ in range(2):
            sess.step(lambda: F.cross_entropy(sess.model(x), y))


def test_a_session_in_a_ps_mode_warns() -> None:
    running = serve_in_thread(
        ServiceConfig(shard_index=0, worker_tasks=("worker:0",)), load_secret(SECRET)
    )
    try:
        server = tfl.Server(
            {"ps": [running.address], "worker": ["127.0.0.1:1"]}, "worker", 0, secret=SECRET
        )
        with pytest.warns(UnsynchronizedBatchNormWarning, match="mode 'async'"):
            _train(server)
    finally:
        stop_services([running])


def test_one_process_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsynchronizedBatchNormWarning)
        _train(None)
