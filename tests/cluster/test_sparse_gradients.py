"""``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` train in every ps mode
(async, sync, bounded staleness) across processes: no crash, and the loss falls."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tensorfleet.ps.shard_checkpoint import decode_shard
from tensorfleet.worker.sparse_gradient import densify_sparse_gradients

from .conftest import PROGRAMS, run_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
STEPS = 40


@pytest.mark.parametrize(
    ("mode", "extra"),
    [("async", []), ("sync", []), ("async", ["--max-staleness", "1"]), ("async", ["--table"])],
)
def test_sparse_embeddings_converge_across_processes(tmp_path, mode, extra):
    """``--table``: the first lookup is a ``tfl.EmbeddingTable`` on the ps shards; the
    final checkpoint then holds each shard's rows and the partition plan in its manifest."""
    out = tmp_path / "result.json"
    if "--table" in extra:
        extra = [*extra, "--checkpoint-dir", str(tmp_path / "checkpoints")]
    command = [
        sys.executable, str(PROGRAMS / "sparse_embedding_worker.py"), str(out), mode, str(STEPS),
        *extra,
    ]  # fmt: skip
    run = run_local_cluster(2, 2, command, timeout_s=200)
    assert run.returncode == 0, str(run)
    result = json.loads(out.read_text())
    assert result["global_step"] >= STEPS, str(run)  # async workers may finish one step past
    assert result["after"] < 0.5 * result["before"], f"{result}\n{run}"
    if "--table" in extra:
        (newest,) = sorted((tmp_path / "checkpoints").glob("step-*"))[-1:]
        manifest = json.loads((newest / "manifest.json").read_text())
        assert manifest["placement"]["table/embedding"]["shards"] == 2, manifest
        for shard in range(2):
            document = (newest / f"shard-{shard}-of-2.safetensors").read_bytes()
            assert set(decode_shard(document).tables) == {"embedding"}, str(run)


def test_a_sparse_gradient_becomes_the_dense_gradient_with_duplicates_summed():
    embedding = torch.nn.Embedding(6, 3, sparse=True)
    embedding(torch.tensor([1, 4, 1])).sum().backward()
    sparse = embedding.weight.grad
    expected = sparse.to_dense()
    assert densify_sparse_gradients([("w", embedding.weight)]) == ["w"]
    assert not embedding.weight.grad.is_sparse
    assert torch.equal(embedding.weight.grad, expected)
    assert torch.equal(embedding.weight.grad[1], torch.full((3,), 2.0))
    assert densify_sparse_gradients([("w", embedding.weight)]) == []  # dense: left alone
