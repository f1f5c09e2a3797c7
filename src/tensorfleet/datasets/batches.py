"""Endless, reproducible, resumable mini-batches over one worker's shard of a data set.

In between-graph replication every worker feeds its own replica, so each needs its own
stream of batches: disjoint from the other workers' (or the workers would train on the same
examples while others go unseen), reshuffled every epoch, reproducible from a seed, and
resumable after a restart without replaying batches already trained on.

:class:`BatchStream` does that with no state beyond four integers (seed, shard, epoch,
offset): the order of epoch ``e`` of shard ``i`` is a permutation drawn from a generator
seeded by ``(seed, i, e)``, so it can be recomputed anywhere instead of stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from tensorfleet.errors import ConfigError

#: What a stream can batch: a torch tensor or a numpy array, indexed along its first dim.
Array = torch.Tensor | np.ndarray

#: Keys of :meth:`BatchStream.state_dict`; all values are plain ints.
STATE_KEYS = ("epoch", "offset", "seed", "shard_index", "num_shards", "num_examples")


class BatchStream:
    """An endless iterator of ``(x, y)`` mini-batches over one shard of ``(images, labels)``.

    **Sharding is strided**: shard ``i`` of ``n`` holds examples ``i, i + n, i + 2n, ...``
    (as ``tf.data.Dataset.shard``). Shards are disjoint, together cover every example, and
    differ in size by at most one; striding also spreads any ordering of the source (e.g. by
    class) evenly over the workers, where contiguous blocks would not.

    **Epochs**: each epoch visits the shard in a fresh order, a permutation drawn from
    ``numpy.random.default_rng([seed, shard_index, epoch])``, so the same arguments always
    give the same batches on any machine. Every batch holds exactly ``batch_size`` examples
    (what synchronous training needs to average correctly); the ``shard_size % batch_size``
    examples left at the end of an epoch are skipped for that epoch only, and since the order
    changes every epoch, different examples are skipped each time.

    **Position** is ``(epoch, offset)``: the epoch of the next batch and how many examples
    of that epoch's order were already handed out. Pass ``position=`` to start there, or
    save :meth:`state_dict` with a checkpoint and :meth:`load_state_dict` it after a restart:
    the stream continues with the next batch it would have given, replaying none.

    ``images`` and ``labels`` may be torch tensors or numpy arrays (batches are of the same
    kind); ``transform``, if given, is applied to each batch of images (e.g.
    :func:`~tensorfleet.datasets.normalize`).
    """

    def __init__(
        self,
        images: Array,
        labels: Array,
        batch_size: int,
        *,
        shard_index: int = 0,
        num_shards: int = 1,
        seed: int = 0,
        position: tuple[int, int] = (0, 0),
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        num_examples = len(images)
        if len(labels) != num_examples:
            raise ConfigError(
                f"images and labels differ in length: {num_examples} images, {len(labels)} labels"
            )
        _check_int("batch_size", batch_size, minimum=1)
        _check_int("num_shards", num_shards, minimum=1)
        _check_int("seed", seed, minimum=0)
        _check_int("shard_index", shard_index, minimum=0)
        if shard_index >= num_shards:
            raise ConfigError(
                f"shard_index {shard_index} out of range for num_shards={num_shards} "
                f"(expected 0 .. {num_shards - 1}); it is usually the worker's task index"
            )
        if num_shards > num_examples:
            raise ConfigError(
                f"more shards than examples: num_shards={num_shards}, {num_examples} examples; "
                "some workers would get no data. Use fewer workers or a larger data set"
            )
        shard_size = len(range(shard_index, num_examples, num_shards))
        if batch_size > shard_size:
            raise ConfigError(
                f"batch_size {batch_size} is larger than this worker's shard of {shard_size} "
                f"examples ({num_examples} examples over {num_shards} shards); no full batch "
                "can be made. Use a smaller batch_size or fewer workers"
            )
        self._images = images
        self._labels = labels
        self._batch_size = batch_size
        self._shard_index = shard_index
        self._num_shards = num_shards
        self._seed = seed
        self._num_examples = num_examples
        self._transform = transform
        self._indices = np.arange(shard_index, num_examples, num_shards, dtype=np.int64)
        self._order_epoch = -1
        self._order = self._indices
        self._epoch = 0
        self._offset = 0
        self._set_position(position)

    # -- what it is ------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Examples per batch."""
        return self._batch_size

    @property
    def shard_index(self) -> int:
        """Which shard this stream reads (usually the worker's task index)."""
        return self._shard_index

    @property
    def num_shards(self) -> int:
        """Into how many shards the data set is split (usually the number of workers)."""
        return self._num_shards

    @property
    def seed(self) -> int:
        """The seed all epochs' orders derive from."""
        return self._seed

    @property
    def shard_size(self) -> int:
        """Number of examples in this shard."""
        return len(self._indices)

    @property
    def batches_per_epoch(self) -> int:
        """Full batches per epoch (the remainder of the shard is skipped each epoch)."""
        return self.shard_size // self._batch_size

    @property
    def indices(self) -> np.ndarray:
        """Indices into the whole data set of this shard's examples, in ascending order."""
        view = self._indices.view()
        view.flags.writeable = False
        return view

    # -- where it is -----------------------------------------------------------------------

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, offset)`` of the next batch; offset counts examples into the epoch."""
        return (self._epoch, self._offset)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order in which ``epoch`` visits this shard: data-set indices, a permutation of
        :attr:`indices` drawn from a generator seeded by ``(seed, shard_index, epoch)``."""
        _check_int("epoch", epoch, minimum=0)
        view = self._epoch_order(epoch).view()
        view.flags.writeable = False
        return view

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """:meth:`epoch_order`, computed once per epoch and kept for its batches."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self._seed, self._shard_index, epoch])
            self._order = self._indices[rng.permutation(len(self._indices))]
            self._order_epoch = epoch
        return self._order

    def state_dict(self) -> dict[str, int]:
        """The stream's position and identity as plain ints, to save with a checkpoint."""
        return {
            "epoch": self._epoch,
            "offset": self._offset,
            "seed": self._seed,
            "shard_index": self._shard_index,
            "num_shards": self._num_shards,
            "num_examples": self._num_examples,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a :meth:`state_dict`.

        The state must come from a stream over the same data set, shard and seed: anything
        else would silently hand out batches other than the ones that were due, so it is a
        ``ValueError`` naming the difference. ``batch_size`` may differ (offsets count
        examples, not batches).
        """
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ConfigError(
                f"batch stream state lacks {', '.join(missing)}; expected keys "
                f"{', '.join(STATE_KEYS)} as state_dict() returns them"
            )
        for key in ("seed", "shard_index", "num_shards", "num_examples"):
            _check_int(key, state[key], minimum=0)
            if state[key] != getattr(self, f"_{key}"):
                raise ConfigError(
                    f"batch stream state is for {key}={state[key]} but this stream has "
                    f"{key}={getattr(self, f'_{key}')}; restoring it would hand out other "
                    "batches than the ones due. Create the stream with the same arguments"
                )
        self._set_position((state["epoch"], state["offset"]))

    def _set_position(self, position: tuple[int, int]) -> None:
        """Move to ``(epoch, offset)`` after checking it lies within an epoch."""
        try:
            epoch, offset = position
        except (TypeError, ValueError):
            raise ConfigError(
                f"position must be a pair (epoch, offset), got {position!r}"
            ) from None
        _check_int("epoch", epoch, minimum=0)
        _check_int("offset", offset, minimum=0)
        epoch_length = self.batches_per_epoch * self._batch_size
        if offset > epoch_length:
            raise ConfigError(
                f"offset {offset} is past the end of an epoch of {epoch_length} examples "
                f"({self.batches_per_epoch} batches of {self._batch_size})"
            )
        if offset + self._batch_size > self.shard_size:  # nothing left in this epoch
            epoch, offset = epoch + 1, 0
        self._epoch, self._offset = epoch, offset

    # -- the batches -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return self

    def __next__(self) -> tuple[Any, Any]:
        """The next ``(x, y)`` batch; the stream never ends."""
        order = self._epoch_order(self._epoch)
        picked = order[self._offset : self._offset + self._batch_size]
        self._offset += self._batch_size
        if self._offset + self._batch_size > len(order):
            self._epoch, self._offset = self._epoch + 1, 0
        x = _take(self._images, picked)
        y = _take(self._labels, picked)
        if self._transform is not None:
            x = self._transform(x)
        return x, y

    def __repr__(self) -> str:
        return (
            f"BatchStream(batch_size={self._batch_size}, shard={self._shard_index}/"
            f"{self._num_shards}, shard_size={self.shard_size}, seed={self._seed}, "
            f"position={self.position})"
        )


def _take(data: Any, picked: np.ndarray) -> Any:
    """``data[picked]`` for torch tensors and numpy arrays alike."""
    if isinstance(data, torch.Tensor):
        return data[torch.from_numpy(picked)]
    return data[picked]


def _check_int(name: str, value: object, *, minimum: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
