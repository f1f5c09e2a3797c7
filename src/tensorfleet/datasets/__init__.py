"""Data for the examples and tests: MNIST / Fashion-MNIST and per-worker batch streams.

``load_mnist`` finds (or downloads, verified) and strictly reads the idx files;
``BatchStream`` hands one worker endless, reproducible, resumable mini-batches of its shard.
"""

from __future__ import annotations

from tensorfleet.datasets.batches import BatchStream
from tensorfleet.datasets.mnist import (
    DATASETS,
    FASHION_MNIST_CLASSES,
    MNIST_CLASSES,
    DatasetInfo,
    default_cache_dir,
    load_mnist,
    normalize,
    read_idx,
    read_split,
)

__all__ = [
    "DATASETS",
    "FASHION_MNIST_CLASSES",
    "MNIST_CLASSES",
    "BatchStream",
    "DatasetInfo",
    "default_cache_dir",
    "load_mnist",
    "normalize",
    "read_idx",
    "read_split",
]
