"""Checkpoints on disk (:mod:`tensorfleet.session.checkpoints`), with shard documents made by
:func:`encode_shard` (no cluster, no subprocess).

Covered: :meth:`CheckpointDirectory.write` keeps the newest ``keep`` checkpoints, replaces a
step written twice, removes staging directories left by other processes, and fails with a
:class:`CheckpointError` naming the directory when it cannot write; :meth:`newest_valid` returns
the newest checkpoint whose files match its manifest and skips corrupt, truncated and
manifest-less ones with a warning; :func:`load_checkpoint` puts a parameter split across two
shards back together (by the manifest's placement) and loads it into a module, refuses a
moving average that was not kept and a directory without checkpoints; :func:`export_checkpoint`
writes one safetensors file with the model's ``state_dict`` names.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tensorfleet.errors import CheckpointError
from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.shard_checkpoint import decode_shard, encode_shard
from tensorfleet.ps.update_rules import SGD
from tensorfleet.session.checkpoints import (
    MANIFEST,
    CheckpointDirectory,
    export_checkpoint,
    load_checkpoint,
    read_checkpoint,
    shard_file_name,
)
from tensorfleet.wire.tensors import as_buffer, dtype_name

pytestmark = pytest.mark.timeout(60)

LOGGER = "tensorfleet.checkpoints"


def _bits(tensor: torch.Tensor) -> bytes:
    return bytes(as_buffer(tensor.contiguous()))


def _encode(
    shard: int,
    values: dict[str, torch.Tensor],
    global_step: int,
    ema: dict[str, torch.Tensor] | None = None,
) -> bytes:
    """The document a ps shard holding these variables would send for ``save``."""
    layout = FusedLayout.of(
        [StoredVariable(name, tuple(t.shape), dtype_name(t.dtype)) for name, t in values.items()]
    )
    return encode_shard(
        shard=shard,
        global_step=global_step,
        version=global_step,
        rule=SGD(lr=0.1).to_wire(),
        layout=layout,
        values=values,
        ema=ema,
        optimizer={},
        worker_data={},
    )


def _documents(global_step: int) -> list[bytes]:
    """Two shards whose values depend on the step (so checkpoints are told apart)."""
    return [
        _encode(0, {"a": torch.full((2, 2), float(global_step))}, global_step),
        _encode(1, {"b": torch.arange(3, dtype=torch.float64) + global_step}, global_step),
    ]


PLACEMENT = {
    "a": {"param": "a", "rows": None, "shard": 0},
    "b": {"param": "b", "rows": None, "shard": 1},
}


def _write(directory: CheckpointDirectory, global_step: int) -> Path:
    return directory.write(global_step, _documents(global_step), PLACEMENT, {"mode": "async"})


def _names(root: Path) -> list[str]:
    return sorted(entry.name for entry in root.iterdir())


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"]


# -- writing and finding ---------------------------------------------------------------------------


def test_only_the_newest_keep_checkpoints_remain(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path / "run", keep=2)
    paths = [_write(directory, step) for step in (10, 20, 30)]
    assert paths == [tmp_path / "run" / f"step-000000{s}" for s in (10, 20, 30)]
    assert _names(tmp_path / "run") == ["step-00000020", "step-00000030"]
    assert directory.step_directories() == [(30, paths[2]), (20, paths[1])]
    assert sorted(p.name for p in paths[2].iterdir()) == [
        MANIFEST,
        "shard-0-of-2.safetensors",
        "shard-1-of-2.safetensors",
    ]


def test_newest_valid_returns_the_newest_with_its_documents_and_manifest(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path, keep=3)
    for step in (10, 20, 30):
        _write(directory, step)
    checkpoint = directory.newest_valid()
    assert checkpoint is not None
    assert (checkpoint.path, checkpoint.global_step) == (tmp_path / "step-00000030", 30)
    assert checkpoint.documents == _documents(30)
    manifest = checkpoint.manifest
    assert (manifest["format"], manifest["global_step"], manifest["mode"]) == (1, 30, "async")
    assert manifest["placement"] == PLACEMENT
    assert [s["file"] for s in manifest["shards"]] == [shard_file_name(i, 2) for i in (0, 1)]
    assert [s["bytes"] for s in manifest["shards"]] == [len(d) for d in _documents(30)]
    assert decode_shard(checkpoint.documents[1]).values["b"].tolist() == [30.0, 31.0, 32.0]
    assert read_checkpoint(checkpoint.path).documents == checkpoint.documents


def test_newest_valid_of_an_empty_or_missing_directory_is_none(tmp_path: Path) -> None:
    assert CheckpointDirectory(tmp_path).newest_valid() is None
    assert CheckpointDirectory(tmp_path / "missing").newest_valid() is None
    assert CheckpointDirectory(tmp_path / "missing").step_directories() == []


def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = CheckpointDirectory(tmp_path, keep=3)
    _write(directory, 10)
    newest = _write(directory, 20)
    shard = newest / "shard-1-of-2.safetensors"
    _flip_byte(shard, shard.stat().st_size - 3)  # a tensor data byte: still decodes
    caplog.set_level(logging.WARNING, logger=LOGGER)

    checkpoint = directory.newest_valid()

    assert checkpoint is not None and checkpoint.global_step == 10
    assert checkpoint.documents == _documents(10)
    (warning,) = _warnings(caplog)
    assert f"checkpoint {newest}: shard-1-of-2.safetensors is corrupt (SHA-256 " in warning
    assert "skipping it and trying the previous checkpoint" in warning
    with pytest.raises(CheckpointError, match=r"shard-1-of-2.safetensors is corrupt"):
        read_checkpoint(newest)


def test_a_truncated_shard_file_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = CheckpointDirectory(tmp_path, keep=3)
    _write(directory, 10)
    newest = _write(directory, 20)
    shard = newest / "shard-0-of-2.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size - 5])
    caplog.set_level(logging.WARNING, logger=LOGGER)

    checkpoint = directory.newest_valid()

    assert checkpoint is not None and checkpoint.global_step == 10
    (warning,) = _warnings(caplog)
    assert (
        f"checkpoint {newest}: shard-0-of-2.safetensors has {size - 5} bytes, the manifest says "
        f"{size} (truncated?)"
    ) in warning


def test_a_checkpoint_without_manifest_or_with_a_missing_file_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = CheckpointDirectory(tmp_path, keep=5)
    _write(directory, 10)
    missing_file = _write(directory, 20)
    no_manifest = _write(directory, 30)
    (no_manifest / MANIFEST).unlink()
    (missing_file / "shard-1-of-2.safetensors").unlink()
    caplog.set_level(logging.WARNING, logger=LOGGER)

    checkpoint = directory.newest_valid()

    assert checkpoint is not None and checkpoint.global_step == 10
    first, second = _warnings(caplog)
    assert f"checkpoint {no_manifest} has no readable manifest" in first
    assert f"checkpoint {missing_file}: cannot read shard-1-of-2.safetensors" in second


def test_a_manifest_that_is_not_json_or_of_another_format_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = CheckpointDirectory(tmp_path, keep=5)
    _write(directory, 10)
    other_format = _write(directory, 20)
    broken = _write(directory, 30)
    (broken / MANIFEST).write_text('{"format": 1, "global_step"')
    (other_format / MANIFEST).write_text('{"format": 2, "global_step": 20, "shards": []}')
    caplog.set_level(logging.WARNING, logger=LOGGER)

    assert directory.newest_valid().global_step == 10
    first, second = _warnings(caplog)
    assert f"checkpoint {broken} has no readable manifest" in first
    assert f"checkpoint {other_format}: unknown manifest format" in second


def test_when_every_checkpoint_is_damaged_newest_valid_is_none(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path, keep=5)
    for step in (10, 20):
        path = _write(directory, step)
        _flip_byte(path / "shard-0-of-2.safetensors", 0)
    assert directory.newest_valid() is None


def test_a_leftover_staging_directory_is_ignored_and_removed_by_the_next_write(
    tmp_path: Path,
) -> None:
    directory = CheckpointDirectory(tmp_path, keep=5)
    _write(directory, 10)
    # A writer (another process) that died after writing everything but before its rename.
    leftover = tmp_path / f".tmp-step-00000050-{os.getpid() + 100000}-1234567890"
    leftover.mkdir()
    for index, document in enumerate(_documents(50)):
        (leftover / shard_file_name(index, 2)).write_bytes(document)
    (leftover / MANIFEST).write_text((tmp_path / "step-00000010" / MANIFEST).read_text())

    assert [step for step, _ in directory.step_directories()] == [10]
    assert directory.newest_valid().global_step == 10

    _write(directory, 20)

    assert _names(tmp_path) == ["step-00000010", "step-00000020"]
    assert directory.newest_valid().global_step == 20


def test_writing_the_same_step_twice_replaces_it(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path, keep=5)
    _write(directory, 10)
    first = _write(directory, 20)
    replacement = [_encode(0, {"only": torch.tensor([7.0, 8.0])}, 20)]
    second = directory.write(20, replacement, {"only": {"param": "only", "rows": None}})

    assert second == first
    assert _names(tmp_path) == ["step-00000010", "step-00000020"]  # no staging left over
    checkpoint = directory.newest_valid()
    assert checkpoint.global_step == 20
    assert checkpoint.documents == replacement
    assert sorted(p.name for p in second.iterdir()) == [MANIFEST, "shard-0-of-1.safetensors"]
    assert load_checkpoint(tmp_path)["only"].tolist() == [7.0, 8.0]


def test_a_root_that_cannot_be_a_directory_gives_a_checkpoint_error_naming_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "not-a-directory"
    root.write_text("a file where the checkpoints should go")
    with pytest.raises(CheckpointError) as caught:
        _write(CheckpointDirectory(root), 10)
    message = str(caught.value)
    assert f"cannot write the checkpoint of step 10 under {root}: " in message
    assert "earlier checkpoints are untouched" in message
    assert isinstance(caught.value.__cause__, OSError)
    assert root.read_text() == "a file where the checkpoints should go"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_root_gives_a_checkpoint_error_naming_it(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path / "run", keep=5)
    _write(directory, 10)
    (tmp_path / "run").chmod(0o500)
    try:
        with pytest.raises(
            CheckpointError, match=rf"step 20 under {re.escape(str(tmp_path / 'run'))}: "
        ):
            _write(directory, 20)
        assert directory.newest_valid().global_step == 10
    finally:
        (tmp_path / "run").chmod(0o700)


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"keep must be >= 1 checkpoint, got 0"):
        CheckpointDirectory(tmp_path, keep=0)


# -- loading and exporting -----------------------------------------------------------------------


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(2, 5)  # weight (5, 2), bias (5,)


WEIGHT = torch.arange(10, dtype=torch.float32).reshape(5, 2) / 8 - 0.5
BIAS = torch.tensor([0.25, -1.5, 3.0, 0.125, -0.0])


def _split_checkpoint(
    root: Path, *, ema: bool = False, reversed_shards: bool = False, global_step: int = 40
) -> Path:
    """A checkpoint of ``_model()`` whose weight is split by rows across two shards: rows
    [0, 3) as ``weight/part_0`` and [3, 5) as ``weight/part_1`` (shard 0 and 1, or 1 and 0)."""
    first, second = (1, 0) if reversed_shards else (0, 1)
    pieces: dict[int, dict[str, torch.Tensor]] = {first: {}, second: {}}
    pieces[first]["weight/part_0"] = WEIGHT[:3].clone()
    pieces[second]["weight/part_1"] = WEIGHT[3:].clone()
    pieces[second]["bias"] = BIAS.clone()
    documents = [
        _encode(
            shard,
            pieces[shard],
            global_step,
            ema={k: v * 2 for k, v in pieces[shard].items()} if ema else None,
        )
        for shard in (0, 1)
    ]
    placement: dict[str, Any] = {
        "weight/part_0": {"param": "weight", "rows": [0, 3], "shard": first},
        "weight/part_1": {"param": "weight", "rows": [3, 5], "shard": second},
        "bias": {"param": "bias", "rows": None, "shard": second},
    }
    return CheckpointDirectory(root).write(global_step, documents, placement, {"mode": "async"})


@pytest.mark.parametrize("reversed_shards", [False, True])
def test_load_checkpoint_reassembles_a_partitioned_parameter(
    tmp_path: Path, reversed_shards: bool
) -> None:
    path = _split_checkpoint(tmp_path, reversed_shards=reversed_shards)
    model = _model()
    assert _bits(model.weight.detach()) != _bits(WEIGHT)

    state = load_checkpoint(tmp_path, model)

    assert sorted(state) == ["bias", "weight"]
    assert state["weight"].shape == (5, 2)
    assert _bits(state["weight"]) == _bits(WEIGHT)
    assert _bits(state["bias"]) == _bits(BIAS)
    assert _bits(model.weight.detach()) == _bits(WEIGHT)
    assert _bits(model.bias.detach()) == _bits(BIAS)
    by_directory = load_checkpoint(path)  # a checkpoint directory itself works too
    assert {k: _bits(v) for k, v in by_directory.items()} == {k: _bits(v) for k, v in state.items()}


def test_load_checkpoint_uses_the_newest_valid_checkpoint(tmp_path: Path) -> None:
    _split_checkpoint(tmp_path, global_step=40)
    newest = CheckpointDirectory(tmp_path).write(
        50,
        [_encode(0, {"weight": WEIGHT + 1}, 50), _encode(1, {"bias": BIAS + 1}, 50)],
        {"weight": {"param": "weight", "rows": None}, "bias": {"param": "bias", "rows": None}},
    )
    assert _bits(load_checkpoint(tmp_path)["weight"]) == _bits(WEIGHT + 1)
    _flip_byte(newest / "shard-0-of-2.safetensors", 20)
    assert _bits(load_checkpoint(tmp_path)["weight"]) == _bits(WEIGHT)


def test_load_checkpoint_of_the_moving_average(tmp_path: Path) -> None:
    _split_checkpoint(tmp_path, ema=True)
    model = _model()
    state = load_checkpoint(tmp_path, model, moving_average=True)
    assert _bits(state["weight"]) == _bits(WEIGHT * 2)
    assert _bits(model.bias.detach()) == _bits(BIAS * 2)
    assert _bits(load_checkpoint(tmp_path)["weight"]) == _bits(WEIGHT)


def test_load_checkpoint_of_a_moving_average_that_was_not_kept_is_refused(
    tmp_path: Path,
) -> None:
    path = _split_checkpoint(tmp_path, ema=False)
    model = _model()
    before = _bits(model.weight.detach())
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint {re.escape(str(path))} has no moving average \(train with ema_decay\)",
    ):
        load_checkpoint(tmp_path, model, moving_average=True)
    assert _bits(model.weight.detach()) == before


def test_load_checkpoint_without_a_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    for path in (tmp_path, tmp_path / "does-not-exist"):
        with pytest.raises(
            CheckpointError, match=rf"no valid checkpoint in {re.escape(str(path))}: give a"
        ):
            load_checkpoint(path)
    damaged = _split_checkpoint(tmp_path / "run")
    _flip_byte(damaged / "shard-1-of-2.safetensors", 30)
    with pytest.raises(CheckpointError, match=r"no valid checkpoint in"):
        load_checkpoint(tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"shard-1-of-2.safetensors is corrupt"):
        load_checkpoint(damaged)  # a named directory is read, not skipped


def test_load_checkpoint_of_a_file_that_is_no_shard_document_is_a_checkpoint_error(
    tmp_path: Path,
) -> None:
    path = CheckpointDirectory(tmp_path).write(3, [b"garbage"], {})
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint {re.escape(str(path))}: a shard document of 7 bytes is too short",
    ):
        load_checkpoint(tmp_path)


def test_export_checkpoint_writes_the_model_state_dict_as_safetensors(tmp_path: Path) -> None:
    _split_checkpoint(tmp_path / "run", ema=True)
    output = tmp_path / "export" / "model.safetensors"

    assert export_checkpoint(tmp_path / "run", output) == output

    exported = load_file(str(output))
    assert sorted(exported) == sorted(_model().state_dict())
    assert _bits(exported["weight"]) == _bits(WEIGHT)
    assert _bits(exported["bias"]) == _bits(BIAS)
    model = _model()
    model.load_state_dict(exported)
    assert _bits(model.weight.detach()) == _bits(WEIGHT)
    assert _names(output.parent) == ["model.safetensors"]  # no staging file left

    export_checkpoint(tmp_path / "run", output, moving_average=True)  # replaces it
    assert _bits(load_file(str(output))["weight"]) == _bits(WEIGHT * 2)
