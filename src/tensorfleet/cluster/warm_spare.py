"""A warm spare worker's wait for the identity it takes over.

A task restarted after a crash spends most of its recovery before its first step starting
over: the interpreter, ``import torch``, the user's data and model. The launcher
(:mod:`tensorfleet.launch.warm_spares`) therefore keeps a *warm spare*: the worker command
started ahead of time with :data:`~tensorfleet.environment.SPARE_PIPE_VAR` naming a named
pipe (FIFO) in the launcher's private run directory instead of an identity. The spare runs
the user's script up to :func:`~tensorfleet.cluster.resolver.resolve_task`, which calls
:func:`wait_for_identity` here: it says it is waiting (:data:`READY_LINE` on stdout, which
the launcher reads and does not show) and blocks on the pipe. When a worker dies, the
launcher writes one JSON line, ``{"variables": {...}}``: every variable that worker was
started with (``TF_CONFIG``, the secret, ``TENSORFLEET_PREDECESSOR_DEAD=1``, its resources);
the spare sets them in its environment, forgets that it was a spare, and resolves as any
task does.

Every wait has its end: the spare exits with status 0 and one line when its wait
(:data:`~tensorfleet.environment.SPARE_WAIT_VAR` seconds, default :data:`DEFAULT_WAIT_S`)
passes unused (the launcher starts a fresh one), and when the launcher goes away or closes
the pipe (the end of the pipe: no writer is left; or the launcher's process, named in
:data:`~tensorfleet.environment.SPARE_LAUNCHER_VAR`, is gone: checked every
:data:`CHECK_INTERVAL_S`, for a launcher that died before the spare opened the pipe). A malformed message is an error naming
what was wrong. Why a pipe rather than a file the spare polls: the pipe's end is how the
spare learns at once that the launcher is gone, and nothing with the secret is left on disk.
"""

from __future__ import annotations

import json
import os
import select
import time
from collections.abc import Mapping

from tensorfleet import environment
from tensorfleet.errors import ClusterConfigError

#: What a spare prints (one line, followed by `` (pid N)``) once it waits for its identity.
READY_LINE = "tensorfleet: warm spare waiting for an identity"
#: Seconds a spare waits for an identity when the launcher does not say.
DEFAULT_WAIT_S = 3600.0
#: Seconds between two checks that the launcher's process is still there.
CHECK_INTERVAL_S = 1.0
#: The longest identity message read, in bytes.
MAX_MESSAGE_BYTES = 1 << 20


def is_spare(environ: Mapping[str, str]) -> bool:
    """Whether this process was started as a warm spare (and has not taken an identity)."""
    return bool(environ.get(environment.SPARE_PIPE_VAR))


def wait_for_identity(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Block until the launcher hands this spare an identity; set the variables it sends in
    this process's environment and return them.

    Exits the process (``SystemExit(0)``, after one line saying why) when the wait passes
    unused or the launcher goes away. Raises :class:`ClusterConfigError` for a malformed
    message or wait.
    """
    env = environment.environ() if environ is None else environ
    path = env[environment.SPARE_PIPE_VAR]
    raw_wait = env.get(environment.SPARE_WAIT_VAR, "")
    try:
        wait_s = float(raw_wait) if raw_wait else DEFAULT_WAIT_S
    except ValueError:
        raise ClusterConfigError(
            f"{environment.SPARE_WAIT_VAR}={raw_wait!r} is not a number of seconds; the "
            "launcher sets it for a warm spare (unset it to run this process as a task)"
        ) from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        _leave(f"cannot open its pipe {path} ({exc.strerror}): the launcher is gone")
    try:
        print(f"{READY_LINE} (pid {os.getpid()})", flush=True)
        launcher = _launcher_pid(env)
        message = _read_line(fd, path, time.monotonic() + wait_s, wait_s, launcher)
    finally:
        os.close(fd)
    variables = _parse(message, path)
    environment.adopt(variables, drop=(environment.SPARE_PIPE_VAR, environment.SPARE_WAIT_VAR))
    return variables


def _launcher_pid(env: Mapping[str, str]) -> int | None:
    raw = env.get(environment.SPARE_LAUNCHER_VAR, "")
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ClusterConfigError(
            f"{environment.SPARE_LAUNCHER_VAR}={raw!r} is not a process id; the launcher sets "
            "it for a warm spare (unset it to run this process as a task)"
        ) from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_line(fd: int, path: str, deadline: float, wait_s: float, launcher: int | None) -> bytes:
    """The bytes up to the first newline on the pipe, before ``deadline``, while the
    launcher (when its pid is known) is alive."""
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            _leave(f"no task needed it within {wait_s:g} s ({environment.SPARE_WAIT_VAR})")
        readable, _, _ = select.select([fd], [], [], min(left, CHECK_INTERVAL_S))
        if not readable:
            if launcher is not None and not _alive(launcher):
                _leave(f"the launcher (pid {launcher}) is gone")
            continue
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            continue
        if not chunk:
            _leave(f"its pipe {path} was closed: the launcher is gone or no longer needs it")
        data += chunk
        if len(data) > MAX_MESSAGE_BYTES:
            raise ClusterConfigError(
                f"the identity message on {path} is longer than {MAX_MESSAGE_BYTES} bytes "
                "without a newline; only the launcher should write to that pipe"
            )
    return data.split(b"\n", 1)[0]


def _parse(message: bytes, path: str) -> dict[str, str]:
    try:
        document = json.loads(message)
    except ValueError as exc:
        raise ClusterConfigError(
            f"the identity message on {path} is not JSON ({exc}); only the launcher should "
            "write to that pipe"
        ) from None
    variables = document.get("variables") if isinstance(document, dict) else None
    if not isinstance(variables, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in variables.items()
    ):
        raise ClusterConfigError(
            f'the identity message on {path} must be {{"variables": {{name: value}}}} with '
            f"string names and values, got {message[:200]!r}"
        )
    if environment.TF_CONFIG_VAR not in variables:
        raise ClusterConfigError(
            f"the identity message on {path} names no {environment.TF_CONFIG_VAR}: a spare "
            "cannot tell which task it becomes"
        )
    return variables


def _leave(why: str) -> None:
    """End this spare cleanly: one line, exit status 0."""
    print(f"tensorfleet: warm spare (pid {os.getpid()}) exiting: {why}", flush=True)
    raise SystemExit(0)
