"""``Segment``: one anonymous shared-memory file (``memfd_create``) of this process, mapped,
and the byte-level helpers the same-host path uses on it.

Why memfd files and not POSIX shared memory or descriptors passed over a Unix socket, and how
a peer reaches them: :mod:`tensorfleet.wire.shared_memory`. This module is only the file: its
creation, its description for an authenticated header (pid, descriptor, random token, size),
copying buffers into it, and closing it.
"""

from __future__ import annotations

import mmap
import os
import secrets
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from tensorfleet.wire.auth import Buffer
from tensorfleet.wire.buffer_pool import ALIGN, offsets

#: The name every segment's file starts with (its ``/proc`` link shows it, with the token).
NAME_PREFIX = "tensorfleet-"


class Segment:
    """One anonymous shared-memory file of this process, mapped."""

    def __init__(self, size: int) -> None:
        self.size = max(ALIGN, -(-size // ALIGN) * ALIGN)
        self.token = secrets.token_hex(12)
        self.fd = os.memfd_create(NAME_PREFIX + self.token, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.bytes: torch.Tensor | None = torch.frombuffer(self.map, dtype=torch.uint8)

    def describe(self) -> dict[str, Any]:
        """What a peer needs to map this segment (goes into an authenticated header)."""
        return {"pid": os.getpid(), "fd": self.fd, "token": self.token, "size": self.size}

    def write(self, buffers: Sequence[Buffer]) -> list[memoryview]:
        """Copy ``buffers`` to their :func:`offsets`; return views of the copies."""
        return write_buffers(self.bytes, buffers)

    def close(self) -> None:
        """Unmap and close (the memory is freed once the peer has unmapped it too)."""
        self.bytes = None
        close_map(self.map)
        os.close(self.fd)


def write_buffers(target: torch.Tensor, buffers: Sequence[Buffer]) -> list[memoryview]:
    """Copy ``buffers`` into ``target`` (bytes) at their :func:`~tensorfleet.wire.buffer_pool.offsets`
    (none that already lies there); views of the copies."""
    starts, _ = offsets([memoryview(b).nbytes for b in buffers])
    view = memoryview(target.numpy())
    placed = []
    for start, buffer in zip(starts, buffers, strict=True):
        source = as_bytes_tensor(buffer)
        destination = target[start : start + source.numel()]
        if source.numel() and source.data_ptr() == destination.data_ptr():
            pass  # built in place (ClientSegments.staging): nothing to copy
        else:
            destination.copy_(source)
        placed.append(view[start : start + source.numel()])
    return placed


def as_bytes_tensor(buffer: Buffer) -> torch.Tensor:
    """``buffer`` as a flat uint8 tensor over the same memory (no copy)."""
    view = memoryview(buffer)
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    with warnings.catch_warnings():
        # A read-only source (bytes, a received frame) is only read from here.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def close_map(mapped: mmap.mmap) -> None:
    """Unmap now, or (while tensors still view it) when the last of them goes."""
    try:
        mapped.close()
    except BufferError:
        pass  # exported views keep the mapping alive; it is unmapped with the last one
