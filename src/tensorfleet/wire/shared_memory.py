"""Same-host fast path: tensor payloads through shared memory, the wire carrying only the
envelope and the header.

When a client and a service run on one host (the service's ``hello`` reply names its host,
see :func:`host_identity`, and the client finds it equal to its own), the client keeps a
request segment and a pool of reply segments: anonymous shared-memory files. A request whose
payload goes that way names the file in its header (``shm``); the service maps the file and
reads the buffers where they lie, without a copy; a reply is written by the service straight
into the reply segment the request offered (``shm_reply``), and the client hands it out
where it lies, again without a copy (:class:`ClientSegments`).

What is authenticated: the header, as on any message (it names the segment, its size and
the buffers' sizes). The payload bytes are not (protocol 4). The choice, and the measured
reason: four AES-GMAC passes over the payload (sign and verify, both ways) held a same-host
push+pull of 8 / 32 MB to at most 1.65x / 1.32x a raw TCP echo (the floor of that design,
``benchmarks/wire_floor.py``) where the copies and the update alone allow 6.9x / 3.3x, and
with the client's copy out of shared memory (made so that the bytes it verified could not
change after the check) the path itself reached 0.6-0.9x. The alternative, keeping the MAC,
protects against nobody: a memfd is reachable only through ``/proc/<pid>/fd`` of a process
holding it, which the kernel opens only for processes that pass its ptrace *read* check on
that process (the same user, or ``CAP_SYS_PTRACE``; Yama's ``ptrace_scope`` restricts only
attaching), and those can read the secret from the task's ``/proc/<pid>/environ`` or its
secret file anyway (the threat model is in docs/security.md). Before any payload
goes this way, the ``hello`` carries a probe segment that the service maps: where a
hardened ``/proc`` forbids it, the answer says why (``shm_refused``), and the client logs
one line and uses TCP (:func:`probe`).

The choice of file: ``memfd_create`` files, opened by the peer through
``/proc/<pid>/fd/<fd>``. Such a file has no name anywhere: it disappears when the last
process holding it (open or mapped) ends, whatever way it ends, so a killed task can never
leave anything behind in ``/dev/shm``. The peer checks that the file is the one named in the
authenticated header (its ``/proc`` link names a random token, and its size) before mapping
it: a file retired or replaced since (a stale segment) is refused with an error naming it.

The alternatives: POSIX shared memory (``shm_open``, Python's
``multiprocessing.shared_memory``) gives every segment a name in ``/dev/shm`` that someone
must unlink; a task killed between creating and unlinking leaks it until reboot (the
resource tracker of ``multiprocessing`` only helps processes it started). Passing the file
descriptor over a Unix socket (``SCM_RIGHTS``, as ``torch.multiprocessing`` does) is as
leak-free but needs a second socket per service and a handshake beside ZeroMQ; ``/proc``
needs neither, and works between any two processes of one user in one pid namespace (the
host identity includes it, so containers with their own pid namespace use TCP).

Lifetimes: a client writes a request payload only into a request segment that no request in
flight holds (it keeps up to :data:`MAX_REQUEST_SEGMENTS`, so that the buckets of a step can
be in flight together; a request that finds them all held goes through ZeroMQ); it offers a
reply region only when no request holds it and nothing references a payload handed out of it (torch's storage use count, as
:class:`~tensorfleet.wire.buffer_pool.BufferPool` tells), so the service never writes memory
the caller still reads. A request abandoned in flight (a timeout, a lost connection)
retires every segment (fresh ones next time), so a late answer or a held request never
touches memory in use. A service keeps at most :data:`MAX_MAPPED` peers' files mapped
(least recently used are unmapped) and unmaps all when it closes.

Measured on this project's 2-vCPU machine (``benchmarks/wire.py``): see
docs/wire-performance.md. ``TENSORFLEET_SHARED_MEMORY=0`` turns the fast path off (every
payload goes through ZeroMQ).
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from tensorfleet import environment
from tensorfleet.errors import ConfigError, ProtocolError
from tensorfleet.wire.auth import Buffer
from tensorfleet.wire.buffer_pool import ALIGN, offsets
from tensorfleet.wire.memfd_segment import NAME_PREFIX, Segment, close_map, write_buffers
from tensorfleet.wire.reply_regions import ReplyRegions

#: Payloads smaller than this go in ZeroMQ frames (the copy into shared memory and the
#: bookkeeping cost more than they save).
MIN_BYTES = 64 << 10
#: Requests of one client whose payloads may be in shared memory at once, each in a request
#: segment of its own until it is answered (a worker's buckets of one step, sent without
#: waiting for each other's replies); one more in flight goes through ZeroMQ.
MAX_REQUEST_SEGMENTS = 4
#: Requests whose reply's size a client remembers to learn (more: those no longer awaited go).
MAX_ASKED = 256
#: A service keeps at most this many peers' segments mapped (mapping one again costs its
#: page faults: the first write of every page).
MAX_MAPPED = 512


def enabled(environ: Any = None) -> bool:
    """Whether the fast path may be used (``TENSORFLEET_SHARED_MEMORY`` unset or ``1``; ``0``
    turns it off) and this system has what it needs (``memfd_create``, ``/proc``). Any other
    value is a :class:`~tensorfleet.errors.ConfigError` naming it: a typo must not leave the
    path on (or off) silently."""
    value = (environment.environ() if environ is None else environ).get(
        environment.SHARED_MEMORY_VAR, "1"
    )
    choice = value.strip().lower()
    if choice in ("0", "false", "no", "off"):
        return False
    if choice not in ("", "1", "true", "yes", "on"):
        raise ConfigError(
            f"{environment.SHARED_MEMORY_VAR}={value!r} is neither on nor off: set it to 1 "
            "(the same-host fast path, the default) or 0 (every payload over TCP)"
        )
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


class ClientSegments:
    """A client's segments towards one service: a few for request payloads, a pool for reply
    payloads, and which request holds what.

    A request sends its payload through a request segment no request in flight holds (at
    most :data:`MAX_REQUEST_SEGMENTS`; with all of them held it goes through ZeroMQ): the
    service reads it in place until it answers. Of the free segments the smallest that
    holds the payload is used (a step's buckets keep their sizes), else a new one, else the
    largest grows. A reply's
    payload is written by the service into the reply region the request offered (a range of
    one of the client's reply segments, :class:`ReplyRegions`), and handed to the caller
    *where it lies*, without a copy (it often becomes the model's parameters,
    ``FusedParameters.scatter``). A region is offered again only when nothing references its
    memory any more (the parameters moved on to a newer reply), which torch tells by its
    storage's use count, as :class:`~tensorfleet.wire.buffer_pool.BufferPool` does: the
    service never writes memory the caller still reads.
    """

    def __init__(self, max_reply_bytes: int | None = None) -> None:
        self._requests: list[Segment] = []
        self._replies = ReplyRegions(max_reply_bytes)
        self._reply_sizes: dict[tuple[str, int], int] = {}
        """Reply payload bytes last seen for a request of (op, payload bytes)."""
        self._asked: dict[int, tuple[str, int]] = {}
        self._holders: dict[int, Segment | None] = {}
        """Requests in flight that hold shared memory: the request segment (None: a reply
        region only)."""
        self._staged: Segment | None = None
        """The request segment :meth:`staging` last offered, for the request built in it."""
        self.retired = 0
        """Segments retired because a request that used them was abandoned."""

    def headers(
        self, request_id: int, op: str, buffers: Sequence[Buffer], pending: Any
    ) -> tuple[dict[str, Any], list[memoryview] | None]:
        """Header entries for request ``request_id`` (operation ``op``) and, when its buffers
        go in shared memory, their copies there (nothing is copied for buffers already in
        place: :meth:`staging`); ``pending`` holds the ids still awaited."""
        total = offsets([memoryview(b).nbytes for b in buffers])[1]
        asked = (op, total)
        if len(self._asked) > MAX_ASKED:  # requests abandoned without a retirement
            self._asked = {k: v for k, v in self._asked.items() if k in pending}
        self._asked[request_id] = asked  # its reply's size is learned, whichever way it comes
        self._retire_abandoned(pending)
        staged, self._staged = self._staged, None
        extra: dict[str, Any] = {}
        placed = None
        segment = None
        if total >= MIN_BYTES:
            if staged is not None and staged.size >= total and self._free(staged):
                segment = staged  # the payload was built in it (staging): nothing to copy
            else:
                segment = self._request_segment(total)
            if segment is None:
                return {}, None  # every request segment is in use: this one goes through ZeroMQ
            placed = segment.write(buffers)
            extra["shm"] = segment.describe()
        wanted = self._reply_sizes.get(asked, total)
        if wanted >= MIN_BYTES:
            region = self._replies.take(wanted, request_id)
            if region is not None:
                extra["shm_reply"] = region.describe()
        if extra:
            self._holders[request_id] = segment
        return extra, placed

    def staging(self, sizes: Sequence[int], pending: Any) -> list[memoryview] | None:
        """Writable views, at their :func:`offsets` in the request segment, where the caller
        may build the payload of its next request (buffers of ``sizes`` bytes) instead of in
        memory of its own: :meth:`headers` then finds them in place and copies nothing.
        None when that request would not go through shared memory (too small, or every
        request segment is held by a request in ``pending``): build it elsewhere."""
        total = offsets(sizes)[1]
        if total < MIN_BYTES:
            return None
        self._retire_abandoned(pending)
        segment = self._request_segment(total)
        if segment is None:
            return None
        self._staged = segment
        starts, _ = offsets(sizes)
        view = memoryview(segment.bytes.numpy())
        return [view[start : start + size] for start, size in zip(starts, sizes, strict=True)]

    def _free(self, segment: Segment) -> bool:
        """Whether no request in flight holds ``segment`` (and it is still this client's)."""
        return segment in self._requests and all(
            held is not segment for held in self._holders.values()
        )

    def _request_segment(self, total: int) -> Segment | None:
        """A request segment of at least ``total`` bytes that no request holds: the smallest
        free one that fits, else a new one (below :data:`MAX_REQUEST_SEGMENTS`), else the
        largest free one grown; None when every one is held."""
        free = sorted((s for s in self._requests if self._free(s)), key=lambda s: s.size)
        fitting = [s for s in free if s.size >= total]
        if fitting:
            return fitting[0]
        if len(self._requests) < MAX_REQUEST_SEGMENTS:
            segment = Segment(total)
            self._requests.append(segment)
            return segment
        if not free:
            return None
        grown = Segment(total)
        self._requests[self._requests.index(free[-1])] = grown
        free[-1].close()
        return grown

    def _retire_abandoned(self, pending: Any) -> None:
        """Retire every segment when a request that holds shared memory is no longer
        awaited (abandoned while in flight: a late answer must touch nothing)."""
        if any(request_id not in pending for request_id in self._holders):
            self._retire()

    def arrived(self, header: dict[str, Any]) -> None:
        """A verified reply arrived: its request no longer holds the segments (its reply
        segment stays taken while the caller references the payload in it); the size of
        its payload is what the next request of the same kind offers room for."""
        re = header.get("re")
        asked = self._asked.pop(re, None) if isinstance(re, int) else None
        if asked is not None:
            self._reply_sizes[asked] = offsets(header["sizes"])[1]
        self._replies.release(re)
        if isinstance(re, int):
            self._holders.pop(re, None)

    def resolve(self, header: dict[str, Any], sizes: list[int]) -> list[Buffer]:
        """The buffers of a reply, where the service wrote them in the reply segment that
        its request offered (no copy: the segment is not offered again while they are
        referenced); ProtocolError when this reply may not be there."""
        re = header.get("re")
        region = self._replies.held_by(re) if isinstance(re, int) and re in self._holders else None
        if region is None:
            raise ProtocolError("a reply in shared memory to a request that offered none")
        starts, end = offsets(sizes)
        if end > region.size:
            raise ProtocolError(f"a reply of {end} bytes in a reply region of {region.size}")
        view = memoryview(region.bytes[:end].numpy())  # the view holds the region taken
        return [view[start : start + size] for start, size in zip(starts, sizes, strict=True)]

    @property
    def reply_regions(self) -> int:
        """Reply regions carved so far (held, referenced or free)."""
        return self._replies.regions

    @property
    def reply_segments(self) -> int:
        """Reply segments the regions are carved from."""
        return self._replies.segments

    def _retire(self) -> None:
        """Close every segment (a request that used them was abandoned: its late answer, or
        the service still reading, must find them gone). Memory the caller still references
        stays mapped until it lets go."""
        for segment in self._requests:
            segment.close()
        self._replies.close()
        self._requests = []
        self._replies = ReplyRegions(self._replies.max_bytes)
        self._holders = {}
        self._staged = None
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
                close_map(self._maps.popitem(last=False)[1])
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
        expected = f"/memfd:{NAME_PREFIX}{token} (deleted)"
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
        """Copy ``buffers`` into the segment (a reply), into the range ``offset`` /
        ``length`` of it when the description names one, and return views of the copies;
        None when they do not fit."""
        tensor = self.bytes_of(description)
        assert isinstance(description, dict)  # bytes_of checked it
        start, length = description.get("offset", 0), description.get("length")
        if length is None:
            length = tensor.numel() - start if isinstance(start, int) else 0
        if not (
            all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (start, length))
            and start % ALIGN == 0
            and start + length <= tensor.numel()
        ):
            raise ProtocolError(
                f"a reply range of {length!r} bytes at {start!r} does not lie in the "
                f"{tensor.numel()}-byte segment {description.get('token')}"
            )
        if offsets([memoryview(b).nbytes for b in buffers])[1] > length:
            return None
        return write_buffers(tensor[start : start + length], buffers)

    def close(self) -> None:
        while self._maps:
            close_map(self._maps.popitem()[1])


def probe(description: object) -> str | None:
    """Map the probe segment a client's ``hello`` names, and unmap it: None when this
    process can reach the client's shared memory, else why not (e.g. a hardened ``/proc``
    that forbids opening another process's descriptors). Told to the client in the answer,
    so that it sends its payloads over the socket instead of failing its first push."""
    peers = PeerSegments(max_mapped=1)
    try:
        peers.bytes_of(description)
    except ProtocolError as exc:
        return str(exc)
    finally:
        peers.close()
    return None
