"""Same-host fast path: tensor payloads through shared memory, the wire carrying only the
envelope, the header and the chunk tags.

When a client and a service run on one host (the service's ``hello`` reply names its host,
see :func:`host_identity`, and the client finds it equal to its own), the client keeps two
anonymous shared-memory files: one for the payloads of its requests, one for the payloads of
the replies. A request whose payload goes that way names the file in its header (``shm``);
the service maps the file and reads the buffers where they lie, without a copy; a reply is
written by the service straight into the client's reply file (instead of into a snapshot
for ZeroMQ). Both are authenticated exactly as frames are: the chunk tags cover the bytes in
shared memory, and no buffer is handed out before they verify (:mod:`tensorfleet.wire.message`).
The client copies a reply's payload into its own memory *before* verifying it, so nothing
can change it after the check.

The choice: ``memfd_create`` files, opened by the peer through ``/proc/<pid>/fd/<fd>``.
Such a file has no name anywhere: it disappears when the last process holding it (open or
mapped) ends, whatever way it ends, so a killed task can never leave anything behind in
``/dev/shm``. The peer checks that the file is the one named in the authenticated header
(its ``/proc`` link names a random token, and its size) before mapping it: a file retired or
replaced since (a stale segment) is refused with an error naming it.

The alternatives: POSIX shared memory (``shm_open``, Python's
``multiprocessing.shared_memory``) gives every segment a name in ``/dev/shm`` that someone
must unlink; a task killed between creating and unlinking leaks it until reboot (the
resource tracker of ``multiprocessing`` only helps processes it started). Passing the file
descriptor over a Unix socket (``SCM_RIGHTS``, as ``torch.multiprocessing`` does) is as
leak-free but needs a second socket per service and a handshake beside ZeroMQ; ``/proc``
needs neither, and works between any two processes of one user in one pid namespace (the
host identity includes it, so containers with their own pid namespace use TCP).

Lifetimes: a client writes a request payload only when no earlier request that used the
file is still in flight, and retires both files (fresh ones next time) when a request that
used them was abandoned (a timeout, a lost connection), so a late answer or a held request
never sees its bytes change. A service keeps at most :data:`MAX_MAPPED` peers' files mapped
(least recently used are unmapped) and unmaps all when it closes.

Measured on this project's 2-vCPU machine (``benchmarks/wire.py``): see benchmarks/README.md.
``TENSORFLEET_SHARED_MEMORY=0`` turns the fast path off (every payload goes through ZeroMQ).
"""

from __future__ import annotations

import mmap
import os
import secrets
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from tensorfleet import environment
from tensorfleet.errors import ProtocolError
from tensorfleet.wire.auth import Buffer
from tensorfleet.wire.buffer_pool import ALIGN, BufferPool, offsets

#: Payloads smaller than this go in ZeroMQ frames (the copy into shared memory and the
#: bookkeeping cost more than they save).
MIN_BYTES = 64 << 10
#: Private buffers a client keeps for reply payloads (see ClientSegments._private). With the
#: gradients pushed in buckets, a step's replies (one per bucket) are all adopted as the
#: model's parameters until the next step's replace them: the pool holds two steps' worth.
PRIVATE_POOL = 8
#: A service keeps at most this many peers' segments mapped.
MAX_MAPPED = 64
_NAME_PREFIX = "tensorfleet-"


def enabled(environ: Any = None) -> bool:
    """Whether the fast path may be used (``TENSORFLEET_SHARED_MEMORY`` is not ``0``) and
    this system has what it needs (``memfd_create``, ``/proc``)."""
    value = (environment.environ() if environ is None else environ).get(
        environment.SHARED_MEMORY_VAR, "1"
    )
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def host_identity() -> str | None:
    """Equal for two processes exactly when they can share memory this way: same boot of
    the same kernel, same pid namespace, same user. None where it cannot be told."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{boot}/{pid_namespace}/{os.getuid()}"


class Segment:
    """One anonymous shared-memory file of this process, mapped."""

    def __init__(self, size: int) -> None:
        self.size = max(ALIGN, -(-size // ALIGN) * ALIGN)
        self.token = secrets.token_hex(12)
        self.fd = os.memfd_create(_NAME_PREFIX + self.token, os.MFD_CLOEXEC)
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
        return _write(self.bytes, buffers)

    def close(self) -> None:
        """Unmap and close (the memory is freed once the peer has unmapped it too)."""
        self.bytes = None
        _close_map(self.map)
        os.close(self.fd)


class ClientSegments:
    """A client's two segments towards one service, and which request may use them.

    One request at a time uses shared memory (``busy``); others go through ZeroMQ.
    """

    def __init__(self) -> None:
        self._request: Segment | None = None
        self._reply: Segment | None = None
        self._reply_wanted = 0
        self._busy: int | None = None
        self._private = BufferPool(keep=PRIVATE_POOL)
        """Private memory for reply payloads (often adopted as the model's parameters)."""
        self.retired = 0
        """Segment pairs retired because a request that used them was abandoned."""

    def headers(
        self, request_id: int, buffers: Sequence[Buffer], pending: Any
    ) -> tuple[dict[str, Any], list[memoryview] | None]:
        """Header entries for request ``request_id`` and, when its buffers go in shared
        memory, their copies there (to be signed); ``pending`` holds the ids still awaited."""
        if self._busy is not None:
            if self._busy in pending:
                return {}, None  # the segments are in use: this one goes through ZeroMQ
            self._retire()  # abandoned while in flight: a late answer must touch nothing
        extra: dict[str, Any] = {}
        placed = None
        total = offsets([memoryview(b).nbytes for b in buffers])[1]
        if total >= MIN_BYTES:
            if self._request is None or self._request.size < total:
                if self._request is not None:
                    self._request.close()
                self._request = Segment(total)
            placed = self._request.write(buffers)
            extra["shm"] = self._request.describe()
        wanted = max(self._reply_wanted, total)
        if wanted >= MIN_BYTES:
            if self._reply is None or self._reply.size < wanted:
                if self._reply is not None:
                    self._reply.close()
                self._reply = Segment(wanted)
            extra["shm_reply"] = self._reply.describe()
        if extra:
            self._busy = request_id
        return extra, placed

    def staging(self, sizes: Sequence[int], pending: Any) -> list[memoryview] | None:
        """Writable views, at their :func:`offsets` in the request segment, where the caller
        may build the payload of its next request (buffers of ``sizes`` bytes) instead of in
        memory of its own: :meth:`headers` then finds them in place and copies nothing.
        None when that request would not go through shared memory (too small, or the
        segments are held by a request in ``pending``): build it elsewhere."""
        if self._busy is not None and self._busy in pending:
            return None
        total = offsets(sizes)[1]
        if total < MIN_BYTES:
            return None
        if self._busy is not None:
            self._retire()  # abandoned while in flight: a late answer must touch nothing
        if self._request is None or self._request.size < total:
            if self._request is not None:
                self._request.close()
            self._request = Segment(total)
        starts, _ = offsets(sizes)
        view = memoryview(self._request.bytes.numpy())
        return [view[start : start + size] for start, size in zip(starts, sizes, strict=True)]

    def arrived(self, header: dict[str, Any]) -> None:
        """A verified reply arrived: its request no longer holds the segments; a large
        payload that came in frames sets the size of the next reply segment."""
        if "shm" not in header:
            self._reply_wanted = max(self._reply_wanted, offsets(header["sizes"])[1])
        if header.get("re") == self._busy:
            self._busy = None

    def resolve(self, header: dict[str, Any], sizes: list[int]) -> list[Buffer]:
        """The buffers of a reply in the reply segment, copied out (then verified by the
        caller); ProtocolError when this reply may not be there."""
        if header.get("re") != self._busy or self._reply is None:
            raise ProtocolError("a reply in shared memory to a request that offered none")
        starts, end = offsets(sizes)
        if end > self._reply.size:
            raise ProtocolError(f"a reply of {end} bytes in a reply segment of {self._reply.size}")
        private = self._private.take(end)
        private.copy_(self._reply.bytes[:end])
        view = memoryview(private.numpy())
        return [view[start : start + size] for start, size in zip(starts, sizes, strict=True)]

    def _retire(self) -> None:
        for segment in (self._request, self._reply):
            if segment is not None:
                segment.close()
        self._request = self._reply = None
        self._busy = None
        self.retired += 1

    def close(self) -> None:
        self._retire()


class PeerSegments:
    """A service's mappings of its clients' segments (at most :data:`MAX_MAPPED`)."""

    def __init__(self, max_mapped: int = MAX_MAPPED) -> None:
        self._maps: OrderedDict[tuple[int, int, str], mmap.mmap] = OrderedDict()
        self._max_mapped = max_mapped

    @property
    def mapped(self) -> int:
        return len(self._maps)

    def bytes_of(self, description: object) -> torch.Tensor:
        """The bytes of the segment ``description`` names (from an authenticated header),
        mapping it on first use; ProtocolError naming the segment when it is not there."""
        if not isinstance(description, dict):
            raise ProtocolError(
                f"a shared-memory segment is described by a map, got {description!r:.80}"
            )
        pid, fd, token, size = (description.get(k) for k in ("pid", "fd", "token", "size"))
        if not (
            all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (pid, fd, size))
            and isinstance(token, str)
            and token.isalnum()
            and len(token) <= 64
        ):
            raise ProtocolError(f"malformed shared-memory segment description {description!r:.200}")
        key = (pid, fd, token)
        mapped = self._maps.get(key)
        if mapped is None:
            mapped = self._maps[key] = self._map(pid, fd, token, size)
            while len(self._maps) > self._max_mapped:
                _close_map(self._maps.popitem(last=False)[1])
        self._maps.move_to_end(key)
        if len(mapped) != size:
            raise ProtocolError(
                f"shared-memory segment {token} has {len(mapped)} bytes, the header says {size}"
            )
        return torch.frombuffer(mapped, dtype=torch.uint8)

    @staticmethod
    def _map(pid: int, fd: int, token: str, size: int) -> mmap.mmap:
        """Map the client's segment. Its name is checked on the opened file
        (``/proc/self/fd``), not only on the path: the client may retire the segment at any
        moment (an abandoned request), and its descriptor number may then name another file
        between a check of the path and the open."""
        path = f"/proc/{pid}/fd/{fd}"
        expected = f"/memfd:{_NAME_PREFIX}{token} (deleted)"
        # The name is checked before the open (so that nothing but a segment is ever opened:
        # no tty, no FIFO) and again on the opened file below.
        try:
            link = os.readlink(path)
            if link == expected:
                opened = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as exc:
            raise ProtocolError(
                f"stale shared-memory segment: {path} cannot be opened ({exc.strerror}); the "
                "sending process has ended or retired it. Set TENSORFLEET_SHARED_MEMORY=0 if "
                "this system does not let tasks of one user open each other's /proc/PID/fd"
            ) from None
        if link != expected:
            raise ProtocolError(
                f"stale shared-memory segment: {path} is {link!r}, expected {expected!r}; the "
                "sending process has retired it"
            )
        try:
            link = os.readlink(f"/proc/self/fd/{opened}")
            if link != expected:
                raise ProtocolError(
                    f"stale shared-memory segment: {path} is {link!r}, expected {expected!r}; "
                    "the sending process has retired it"
                )
            actual = os.fstat(opened).st_size
            if actual != size:
                raise ProtocolError(
                    f"shared-memory segment {token} has {actual} bytes, the header says {size}"
                )
            return mmap.mmap(opened, size)
        finally:
            os.close(opened)  # the mapping keeps the memory

    def buffers(self, description: object, sizes: list[int]) -> list[Buffer]:
        """Views of the buffers of ``sizes`` in the segment (zero-copy)."""
        tensor = self.bytes_of(description)
        starts, end = offsets(sizes)
        if end > tensor.numel():
            raise ProtocolError(
                f"buffers of {end} bytes in a shared-memory segment of {tensor.numel()}"
            )
        view = memoryview(tensor.numpy())
        return [view[start : start + size] for start, size in zip(starts, sizes, strict=True)]

    def write(self, description: object, buffers: Sequence[Buffer]) -> list[memoryview] | None:
        """Copy ``buffers`` into the segment (a reply) and return views of the copies; None
        when they do not fit."""
        tensor = self.bytes_of(description)
        if offsets([memoryview(b).nbytes for b in buffers])[1] > tensor.numel():
            return None
        return _write(tensor, buffers)

    def close(self) -> None:
        while self._maps:
            _close_map(self._maps.popitem()[1])


def _write(target: torch.Tensor, buffers: Sequence[Buffer]) -> list[memoryview]:
    starts, _ = offsets([memoryview(b).nbytes for b in buffers])
    view = memoryview(target.numpy())
    placed = []
    for start, buffer in zip(starts, buffers, strict=True):
        source = _as_bytes_tensor(buffer)
        destination = target[start : start + source.numel()]
        if source.numel() and source.data_ptr() == destination.data_ptr():
            pass  # built in place (ClientSegments.staging): nothing to copy
        else:
            destination.copy_(source)
        placed.append(view[start : start + source.numel()])
    return placed


def _as_bytes_tensor(buffer: Buffer) -> torch.Tensor:
    view = memoryview(buffer)
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    with warnings.catch_warnings():
        # A read-only source (bytes, a received frame) is only read from here.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def _close_map(mapped: mmap.mmap) -> None:
    """Unmap now, or (while tensors still view it) when the last of them goes."""
    try:
        mapped.close()
    except BufferError:
        pass  # exported views keep the mapping alive; it is unmapped with the last one
