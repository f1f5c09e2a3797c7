"""Reusable byte buffers for payloads the wire itself produces: a payload decrypted on
arrival, a payload encrypted before it is sent. (Same-host reply segments are reused by the
same rule, :mod:`tensorfleet.wire.shared_memory`.)

A buffer is handed out again only when nothing references its memory any more, which torch
tells by the use count of the buffer's storage: a payload handed to the caller (often
adopted as the model's parameters, see ``FusedParameters.scatter``) keeps its buffer until
the next reply replaces it; a ciphertext handed to ZeroMQ without a copy keeps its buffer
until ZeroMQ has sent it and released the frame. So no tracker or callback is needed, and a
buffer is never written while anyone can still read it.

Why pool at all: a fresh allocation of megabytes is fresh pages, and faulting them in costs
about as much as the copy (or the encryption) that fills them; reusing mapped memory saves
that. Buffers larger than :data:`MAX_POOLED_BYTES` (a checkpoint document, say) are used
once and freed rather than kept.

torch is imported where a buffer is made, not when the module is: the wire's message and
encryption modules import this one, and the launcher (``tensorfleet launch``), which reads
their settings but never makes a buffer, would otherwise import torch (seconds, and hundreds
of MB) before it even parses its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Each buffer of a message starts at a multiple of this many bytes in a pooled buffer (and
#: in a shared-memory segment).
ALIGN = 64
#: Buffers a pool keeps for reuse.
KEEP = 3
#: Buffers larger than this are not kept for reuse.
MAX_POOLED_BYTES = 1 << 30


def offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each buffer of ``sizes`` starts in one pooled buffer or segment, and the bytes
    they need together."""
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += -(-size // ALIGN) * ALIGN
    return starts, end


def storage_users(tensor: torch.Tensor) -> int | None:
    """How many tensors share ``tensor``'s memory (None where torch cannot tell)."""
    import torch  # here, not at the top: see the module's last paragraph

    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(tensor.untyped_storage()._cdata)


class BufferPool:
    """At most ``keep`` reusable byte buffers (the most recently used)."""

    def __init__(self, keep: int = KEEP, max_pooled_bytes: int = MAX_POOLED_BYTES) -> None:
        self._keep = keep
        self._max_pooled_bytes = max_pooled_bytes
        self._pool: list[tuple[torch.Tensor, int | None]] = []

    def take(self, size: int) -> torch.Tensor:
        """``size`` bytes (a uint8 tensor) that nobody else references: a pooled buffer
        whose earlier user has let go of it, else a fresh one. The caller keeps the returned
        tensor (or a view of it) alive as long as it uses the bytes."""
        for index, (pooled, alone) in enumerate(self._pool):
            if pooled.numel() >= size and storage_users(pooled) == alone:
                self._pool.append(self._pool.pop(index))
                return pooled[:size]
        import torch  # here, not at the top: see the module's last paragraph

        fresh = torch.empty(size, dtype=torch.uint8)
        users = storage_users(fresh)
        if users is not None and size <= self._max_pooled_bytes:
            self._pool.append((fresh, users))
            if len(self._pool) > self._keep:
                self._pool.pop(0)
        return fresh[:size]

    def views(self, sizes: Sequence[int]) -> list[memoryview]:
        """Writable byte views of ``sizes`` bytes, at their :func:`offsets` in one buffer
        from :meth:`take` (the views keep it referenced)."""
        starts, end = offsets(sizes)
        view = memoryview(self.take(end).numpy())
        return [view[start : start + size] for start, size in zip(starts, sizes, strict=True)]
