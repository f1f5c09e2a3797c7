"""The preloaded interpreter's own code: started by
:func:`~tensorfleet.patterns.preloaded_interpreter.preload` as
``python -m tensorfleet.patterns.preloaded_interpreter_main SOCKET_FD``, it imports torch,
``torch._dynamo`` and tensorfleet once, says it is ready, and forks one executor per request
of the program that started it, in that sweep's environment; the executor then serves the
sweep (:func:`tensorfleet.patterns.warm_executor.serve`).

A module of its own beside :mod:`tensorfleet.patterns.preloaded_interpreter` (the program's
side: starting it, asking it for executors, their ends), as ``trial_main`` is beside the sweep:
what runs in the other process, with its own checks of the bytes it is sent (a request is
refused, and said so, unless it is a JSON object with string fields and three descriptors).
Why a preloaded interpreter, and its protocol: that module's docstring.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any

from tensorfleet.patterns.preloaded_interpreter import MESSAGE_BYTES
from tensorfleet.patterns.warm_executor import PRELOADED, serve
from tensorfleet.process_forks import (
    current_threads,
    die_with_parent,
    end_fork,
    failed_in_fork,
    fork_frozen,
    serve_fork_requests,
)


def _serve(channel: socket.socket) -> int:
    os.dup2(2, 1)  # what imports print goes to the log, never anywhere else

    def say(message: dict[str, Any]) -> None:
        channel.send(json.dumps(message).encode())

    import torch  # noqa: F401 (the point: imported once, for every executor it forks)

    allowed = current_threads()  # torch's import starts numpy's OpenBLAS server: safe to fork
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an executor that needs it imports it, and fails, itself
            print(f"preloaded interpreter: could not preload {name}: {exc!r}", file=sys.stderr)
    say({"event": "ready", "pid": os.getpid()})

    def fork_one(data: bytes, fds: list[int], close: tuple[int, ...]) -> dict[str, Any]:
        request = _parse_fork_request(data, fds)
        extra = current_threads() - allowed
        if isinstance(request, str) or extra:
            for fd in fds:
                os.close(fd)
            why = request if isinstance(request, str) else (
                f"the preloaded interpreter has {len(extra)} thread(s) more than after "
                "importing torch; forking it is unsafe"
            )  # fmt: skip
            return {"event": "declined", "why": why}
        parent = os.getpid()
        pid = fork_frozen()
        if pid == 0:
            _executor_child(request, fds, parent, close=close)
        for fd in fds:
            os.close(fd)
        return {"event": "forked", "pid": pid}

    return serve_fork_requests(channel, MESSAGE_BYTES, 3, fork_one)


def _parse_fork_request(data: bytes, fds: list[int]) -> dict[str, Any] | str:
    """The fork request in ``data``, checked; a string saying what is wrong otherwise."""
    try:
        message = json.loads(data)
        request = message["fork"]
        entry, metric, cwd = request["entry"], request["metric"], request["cwd"]
        environ = request["environ"]
    except (ValueError, KeyError, TypeError):
        return f"a malformed request ({data[:200]!r})"
    if len(fds) != 3:
        return f"a fork request needs 3 descriptors (stdin, stdout, stderr), it had {len(fds)}"
    if not (
        isinstance(entry, str)
        and isinstance(metric, str)
        and isinstance(cwd, str)
        and isinstance(environ, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in environ.items())
    ):
        return "a fork request's entry, metric, cwd and environ must be strings"
    return request


def _executor_child(
    request: Mapping[str, Any], fds: list[int], parent: int, close: tuple[int, ...]
) -> None:
    """The forked executor: never returns (``os._exit`` with the executor's status)."""
    code = 1
    try:
        os.setsid()
        die_with_parent(signal.SIGKILL)()
        if os.getppid() != parent:  # the interpreter died before the line above
            os._exit(128 + int(signal.SIGKILL))
        for fd in close:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        _take_environment(request["environ"], request["cwd"])
        code = serve(request["entry"], request["metric"])
    except BaseException:
        code = failed_in_fork()
    finally:
        end_fork(code)


def _take_environment(environ: Mapping[str, str], cwd: str) -> None:
    """Make this fork's ``os.environ`` and ``sys.path`` what a fresh ``python -m`` started in
    ``cwd`` with ``environ`` would have: ``cwd``, then ``PYTHONPATH``'s entries, in front of
    the rest of the path (the interpreter's own were those of its start)."""

    def entries(pythonpath: str) -> list[str]:
        return [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]

    started_front = {sys.path[0], *entries(os.environ.get("PYTHONPATH", ""))} if sys.path else set()
    front = [cwd, *entries(environ.get("PYTHONPATH", ""))]
    rest = [p for p in sys.path if p not in started_front and p not in front]
    sys.path[:] = list(dict.fromkeys(front)) + rest
    os.environ.clear()
    os.environ.update(environ)
    importlib.invalidate_caches()  # files written since the interpreter started


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print(
            "usage: python -m tensorfleet.patterns.preloaded_interpreter_main SOCKET_FD "
            "(started by tensorfleet.patterns.preload())",
            file=sys.stderr,
        )
        return 2
    return _serve(socket.socket(fileno=int(args[0])))


if __name__ == "__main__":
    raise SystemExit(main())
