"""Fast compute through real clusters: async through a ps with channels-last, bf16 autocast,
bf16 gradients on the wire and the fused Adam; async with bf16 values in the replies to
pushes (through the buckets of the overlap); sync with both directions in bf16; all-reduce (DDP) with channels-last and bf16
autocast. Training goes down, nothing is refused, the parameters keep their names and shapes,
and the checkpoint the chief wrote loads strictly into a plain model."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import tensorfleet as tfl

from .conftest import PROGRAMS, run_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
STEPS = 20


def _program():
    spec = importlib.util.spec_from_file_location("compute_worker", PROGRAMS / "compute_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("mode", "num_ps", "flags"),
    [
        ("async", 1, ["--channels-last", "--autocast", "bf16", "--wire-dtype", "bf16", "--fused"]),
        ("async", 1, ["--channels-last", "--values-wire-dtype", "bf16", "--fused"]),
        ("sync", 1, ["--channels-last", "--wire-dtype", "bf16", "--values-wire-dtype", "bf16"]),
        ("allreduce", 0, ["--channels-last", "--autocast", "bf16"]),
    ],
    ids=["async", "async-bf16-values", "sync-bf16-wire", "allreduce"],
)
def test_options_train_through_a_cluster_and_checkpoint_plain_names(
    tmp_path, python, mode: str, num_ps: int, flags: list[str]
) -> None:
    out, checkpoints = tmp_path / "result.json", tmp_path / "checkpoints"
    command = [python, str(PROGRAMS / "compute_worker.py"), str(out), str(checkpoints), mode]
    run = run_local_cluster(num_ps, 2, [*command, str(STEPS), *flags], timeout_s=150)
    assert run.returncode == 0, str(run)
    result = json.loads(out.read_text())
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses))), f"{losses}\n{run}"
    # The model the chief ended with against the one it started from, on the batch every
    # worker trains on: in async mode the chief may take only a few of the 20 global steps
    # (the other worker running ahead under load), so its own losses are not compared.
    assert result["final_loss"] < result["initial_loss"] - 0.05, (
        f"the loss did not decrease: {result['initial_loss']} -> {result['final_loss']} "
        f"(the chief's steps: {losses})\n{run}"
    )
    assert result["refused"] == 0, str(run)
    assert result["channels_last"], "the ps's values must keep the model's memory order"
    plain = _program().SmallCNN()
    assert result["names"] == [[n, list(p.shape)] for n, p in plain.named_parameters()]
    state = tfl.load_checkpoint(checkpoints, plain, strict=True)
    assert sorted(state) == sorted(plain.state_dict())
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in state.values())
    if "--values-wire-dtype" in flags:
        # From the second step on, the chief's parameters are what replies to pushes
        # brought (its buckets' replies, prefetched or not): bf16 values. The first step
        # starts from the exact pull; the end brings the exact values back.
        assert all(result["rounded_after_step"][1:]), result["rounded_after_step"]
        assert result["exact_at_end"], "the model must end with the ps's exact values"
