"""Device engines in a TrainingSession (one process): in-graph replicas and a pipeline in the
task train exactly like the plain model; bad combinations are refused; log_placement prints
the table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.errors import ConfigError


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(16, 12), torch.randint(0, 4, (16,))) for _ in range(5)]


def train(**options) -> tuple[list[float], nn.Module]:
    model = mlp()
    losses = []
    with tfl.TrainingSession(None, model, optimizer=tfl.optim.SGD(lr=0.1), **options) as sess:
        for x, y in batches():
            result = sess.step(lambda x=x, y=y: F.cross_entropy(sess.model(x), y))
            losses.append(result.loss)
    return losses, model


@pytest.mark.parametrize(
    "options",
    [
        {"replica_devices": ["/cpu:0", "/cpu:1"]},
        {"stage_devices": ["/cpu:0", "/cpu:1"], "microbatches": 4},
    ],
    ids=["replicas", "local-pipeline"],
)
def test_engines_train_like_the_plain_model(options, capsys):
    ref_losses, reference = train()
    losses, model = train(log_placement=True, **options)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p - q).abs().max() < 1e-5
    table = capsys.readouterr().out
    assert "placement (no ps: variables are local):" in table
    assert "module    0  " in table or "module    0 " in table
    if "replica_devices" in options:
        assert "/device:CPU:0,/device:CPU:1" in table


def test_bad_combinations_are_refused():
    with pytest.raises(ConfigError, match="one of .*replicas.*local_pipeline"):
        train(replica_devices=["/cpu:0"], stage_devices=["/cpu:0", "/cpu:1"])
    with pytest.raises(ConfigError, match=r"a batch of 16 does not split into 3|n_microbatches"):
        train(stage_devices=["/cpu:0", "/cpu:1"], microbatches=3)
    with pytest.raises(ConfigError, match="at least 2"):
        train(stage_devices=["/cpu:0"])
