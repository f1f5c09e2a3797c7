"""Forking children from a preloaded interpreter: the primitives every fork server of
tensorfleet shares.

Three processes import torch (and more) once and then fork children that do the work: the
sweeps' warm executor (a trial per fork, :mod:`tensorfleet.patterns.warm_executor`), the
sweeps' preloaded interpreter (an executor per fork,
:mod:`tensorfleet.patterns.preloaded_interpreter_main`) and the launcher's task fork server
(a task per fork, :mod:`tensorfleet.launch.backends.task_fork_server_main`). What they share
is here, below both the launcher and the patterns (it imports nothing of tensorfleet): the
loop that forks on request over a ``SOCK_SEQPACKET`` socket and reaps each child by its
pidfd (:func:`serve_fork_requests`), the fork itself with the collector's generations
frozen (:func:`fork_frozen`), the check that no thread was started since the imports
(:func:`current_threads`: forking a process with threads is unsafe), what a child does
first and last (:func:`set_parent_death_signal`, :func:`reseed_generators`,
:func:`failed_in_fork`, :func:`end_fork`).

Why a module of its own: these lived in the warm executor, which came first, and grew it
past 600 lines with a second role; the launcher's task fork server imported them from there,
though it forks tasks, not trials.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import json
import os
import select
import socket
import sys
from collections.abc import Callable
from typing import Any, NoReturn

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``): in a child, before its work or its ``exec``."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_parent(sig: int) -> Callable[[], None]:
    """A ``preexec_fn`` asking Linux to send ``sig`` to the child when its parent dies."""
    return functools.partial(set_parent_death_signal, sig)


def current_threads() -> set[str]:
    """The ids of this process's threads (a fork is safe only with the ones it started with)."""
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: nothing to compare, so never fork
        return {"unknown"}


def fork_frozen() -> int:
    """``os.fork()`` after flushing Python's output buffers (else the child would print them
    again) and moving every object imported so far to the collector's permanent generation:
    a child's collections then neither walk them nor write to their pages (which would copy
    them); measured 1.07-1.25 s against 1.15-1.29 s for a 1 s trial, in-process 1.16."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    return os.fork()


#: What a fork request's handler answers: ``{"event": "forked", "pid": ...}`` or
#: ``{"event": "declined", "why": ...}``.
ForkReply = dict[str, Any]


def serve_fork_requests(
    channel: socket.socket,
    message_bytes: int,
    max_fds: int,
    fork_one: Callable[[bytes, list[int], tuple[int, ...]], ForkReply],
) -> int:
    """The loop of a process that forks children on request over ``channel`` (a
    ``SOCK_SEQPACKET`` socket): the sweeps' preloaded interpreter and the launcher's task fork
    server. Each child's end is reaped and said (``{"event": "ended", "pid": ...,
    "returncode": ...}``) as its pidfd reports it; each request (up to ``message_bytes``, with
    up to ``max_fds`` descriptors) goes to ``fork_one(data, fds, close)``, which closes the
    descriptors in this process and answers (:data:`ForkReply`), ``close`` being what a child
    must close (the channel, the other children's pidfds). Returns 0 once the channel closed."""

    def say(message: dict[str, Any]) -> None:
        channel.send(json.dumps(message).encode())

    children: dict[int, int] = {}  # pidfd -> child pid
    while True:
        readable, _, _ = select.select([channel, *children], [], [])
        for pidfd in [fd for fd in readable if fd in children]:
            pid = children.pop(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(pid, 0)
            say({"event": "ended", "pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
        if channel not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(channel, message_bytes, max_fds)
        if not data:  # the other side closed the channel (or ended): so do we
            for fd in fds:
                os.close(fd)
            return 0
        reply = fork_one(data, fds, (channel.fileno(), *children))
        say(reply)
        if reply.get("event") == "forked":
            children[os.pidfd_open(reply["pid"])] = reply["pid"]


def failed_in_fork() -> int:
    """A forked child's exception before (or around) its work: its traceback to the child's
    output, and the status it ends with (1)."""
    import traceback

    traceback.print_exc()
    return 1


def end_fork(code: int) -> NoReturn:
    """End a forked child with ``code``: its output flushed, then ``os._exit`` (no atexit
    handler and no finalizer of what it inherited from its parent runs twice)."""
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


#: The seed torch's default generator had right after the forking process imported torch
#: (:func:`note_torch_start_seed`), or None.
_torch_start_seed: int | None = None
#: The seed torch releases that seed their default generator at a fixed value start with.
TORCH_FIXED_DEFAULT_SEED = 67280421310721


def note_torch_start_seed() -> None:
    """Record torch's start seed, right after ``import torch`` in a process that will fork
    (so that :func:`reseed_generators` can tell it from a seed the user's code set since)."""
    global _torch_start_seed
    torch = sys.modules.get("torch")
    _torch_start_seed = None if torch is None else torch.initial_seed()


def reseed_generators() -> None:
    """A fresh interpreter seeds Python's (and numpy's) global generators from the OS; forked
    children would all share the forking process's state, so reseed them the same way.
    Torch's default generator too, when a fresh interpreter of this torch seeds it from the
    OS (torch 2.13 does: ``torch.initial_seed()`` differs from one process to the next) and
    nothing set it since the import (:func:`note_torch_start_seed`): every trial of a warm
    sweep and every forked task started with the same torch random state before. A seed the
    user's preloaded code set (``torch.manual_seed``) is kept, as a fresh interpreter running
    that code would have it; a torch whose start seed is fixed is left as it is."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and _torch_start_seed is not None
        and _torch_start_seed != TORCH_FIXED_DEFAULT_SEED
        and torch.initial_seed() == _torch_start_seed
    ):
        torch.seed()  # from the OS, as a fresh interpreter of this torch does
