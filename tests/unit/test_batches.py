"""BatchStream: disjoint shards, reproducible epochs, exact resume, clear argument errors."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest
import torch

from tensorfleet.datasets import BatchStream, normalize


def dataset(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n examples whose every pixel and label is the example's own index (mod 256 / plain)."""
    images = (torch.arange(n) % 256).to(torch.uint8).view(n, 1, 1).expand(n, 28, 28).clone()
    return images, torch.arange(n)


def take(stream: BatchStream, k: int) -> list[torch.Tensor]:
    return [y for _, y in islice(stream, k)]


@pytest.mark.parametrize(("n", "shards"), [(100, 1), (100, 3), (101, 4), (7, 7)])
def test_shards_are_strided_disjoint_and_cover(n: int, shards: int) -> None:
    images, labels = dataset(n)
    streams = [
        BatchStream(images, labels, 1, shard_index=i, num_shards=shards) for i in range(shards)
    ]
    for i, stream in enumerate(streams):
        np.testing.assert_array_equal(stream.indices, np.arange(i, n, shards))
    sizes = [s.shard_size for s in streams]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert sorted(np.concatenate([s.indices for s in streams]).tolist()) == list(range(n))


def test_epoch_visits_each_shard_example_once_and_only_its_own() -> None:
    images, labels = dataset(90)
    seen = []
    for i in range(3):
        stream = BatchStream(images, labels, 10, shard_index=i, num_shards=3, seed=5)
        batches = take(stream, stream.batches_per_epoch)
        epoch = torch.cat(batches).tolist()
        assert sorted(epoch) == stream.indices.tolist()
        assert stream.position == (1, 0)
        seen.extend(epoch)
    assert sorted(seen) == list(range(90))


def test_batches_are_the_indexed_examples() -> None:
    images, labels = dataset(40)
    stream = BatchStream(images, labels, 8, seed=1, transform=normalize)
    x, y = next(stream)
    assert x.shape == (8, 1, 28, 28) and x.dtype == torch.float32
    assert torch.allclose(x[:, 0, 0, 0], y.float() / 255)


def test_numpy_inputs_give_numpy_batches() -> None:
    images, labels = (t.numpy() for t in dataset(20))
    x, y = next(BatchStream(images, labels, 4))
    assert isinstance(x, np.ndarray) and x.shape == (4, 28, 28)
    np.testing.assert_array_equal(x[:, 0, 0], y)


def test_reshuffled_every_epoch_and_remainder_dropped() -> None:
    images, labels = dataset(25)
    stream = BatchStream(images, labels, 10, seed=3)
    assert stream.batches_per_epoch == 2
    epochs = [torch.cat(take(stream, 2)).tolist() for _ in range(3)]
    assert all(len(e) == 20 and len(set(e)) == 20 for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert all(len(y) == 10 for y in take(stream, 7))


def test_reproducible_from_seed_and_differs_across_seeds() -> None:
    images, labels = dataset(64)

    def run(seed: int) -> list[list[int]]:
        stream = BatchStream(images, labels, 8, shard_index=1, num_shards=2, seed=seed)
        return [y.tolist() for y in take(stream, 10)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_state_round_trip_resumes_without_replay() -> None:
    images, labels = dataset(50)
    reference = BatchStream(images, labels, 6, shard_index=0, num_shards=2, seed=11)
    expected = [y.tolist() for y in take(reference, 12)]  # crosses several epochs

    first = BatchStream(images, labels, 6, shard_index=0, num_shards=2, seed=11)
    done = [y.tolist() for y in take(first, 5)]
    state = json.loads(json.dumps(first.state_dict()))  # plain ints survive JSON
    assert all(type(v) is int for v in state.values())

    resumed = BatchStream(images, labels, 6, shard_index=0, num_shards=2, seed=11)
    resumed.load_state_dict(state)
    assert resumed.position == first.position
    rest = [y.tolist() for y in take(resumed, 7)]
    assert done + rest == expected

    at = BatchStream(
        images,
        labels,
        6,
        shard_index=0,
        num_shards=2,
        seed=11,
        position=(state["epoch"], state["offset"]),
    )
    assert [y.tolist() for y in take(at, 7)] == rest


def test_position_tracks_epoch_and_offset() -> None:
    images, labels = dataset(20)
    stream = BatchStream(images, labels, 6)  # 3 batches per epoch, 2 examples skipped
    assert stream.position == (0, 0)
    next(stream)
    assert stream.position == (0, 6)
    take(stream, 2)
    assert stream.position == (1, 0) and stream.epoch == 1
    # An offset at the very end of an epoch is the start of the next.
    assert BatchStream(images, labels, 6, position=(2, 18)).position == (3, 0)


def test_load_state_from_another_stream_is_refused() -> None:
    images, labels = dataset(30)
    state = BatchStream(images, labels, 5, shard_index=1, num_shards=3, seed=2).state_dict()
    other_shard = BatchStream(images, labels, 5, shard_index=0, num_shards=3, seed=2)
    with pytest.raises(ValueError, match="shard_index=1"):
        other_shard.load_state_dict(state)
    with pytest.raises(ValueError, match="seed=2"):
        BatchStream(images, labels, 5, shard_index=1, num_shards=3, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks offset"):
        other_shard.load_state_dict({"epoch": 0})
    # A different batch size is fine: offsets count examples.
    BatchStream(images, labels, 2, shard_index=1, num_shards=3, seed=2).load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size must be at least 1"),
        ({"batch_size": -3}, "batch_size must be at least 1"),
        ({"batch_size": 2.0}, "batch_size must be an int"),
        ({"batch_size": True}, "batch_size must be an int"),
        ({"batch_size": 11}, "larger than this worker's shard"),
        ({"shard_index": 3, "num_shards": 3}, "shard_index 3 out of range"),
        ({"shard_index": -1, "num_shards": 3}, "shard_index must be at least 0"),
        ({"num_shards": 0}, "num_shards must be at least 1"),
        ({"num_shards": 11}, "more shards than examples"),
        ({"seed": -1}, "seed must be at least 0"),
        ({"position": (0, -1)}, "offset must be at least 0"),
        ({"position": (0, 11)}, "past the end of an epoch"),
        ({"position": 3}, "pair"),
    ],
)
def test_argument_errors(kwargs: dict, match: str) -> None:
    images, labels = dataset(10)
    args = {"batch_size": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        BatchStream(images, labels, **args)


def test_length_mismatch() -> None:
    images, labels = dataset(10)
    with pytest.raises(ValueError, match="10 images, 9 labels"):
        BatchStream(images, labels[:9], 2)
