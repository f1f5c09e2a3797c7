"""The task fork server's own code: started by
:class:`~tensorfleet.launch.backends.task_forks.TaskForkServer` as ``python -m
tensorfleet.launch.backends.task_fork_server_main SOCKET_FD``, it imports torch,
``torch._dynamo`` and tensorfleet's runtime once, says it is ready, and forks one task per
request of the launcher: the child becomes ``python SCRIPT ARGS`` (or ``python -m MODULE
ARGS``) in the task's environment, working directory and output pipe, as a fresh interpreter
would run it. Why, and the protocol: :mod:`tensorfleet.launch.backends.task_forks`.

A module of its own beside the launcher's side, as the sweeps' preloaded interpreter is: what
runs in the other process, with its own checks of the bytes it is sent (a request is refused,
and said so, unless it is a JSON object of the expected shape with one descriptor).
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import runpy
import signal
import socket
import sys
import threading
from collections.abc import Mapping
from typing import Any

from tensorfleet.launch.backends.task_forks import (
    MESSAGE_BYTES,
    import_time_difference,
)
from tensorfleet.process_forks import (
    current_threads,
    die_with_parent,
    end_fork,
    failed_in_fork,
    fork_frozen,
    note_torch_start_seed,
    reseed_generators,
    serve_fork_requests,
)

#: What every task would import anyway, imported once here: torch, what torch's optimizers
#: import at their first use (``torch._dynamo``: 2.2 s of CPU on the project's 2-core machine,
#: as much as torch itself), numpy, and tensorfleet's runtime (the ps server and the session).
PRELOADED = (
    "numpy",
    "torch._dynamo",
    "tensorfleet",
    "tensorfleet.launch.cli",
    "tensorfleet.ps.service",
    "tensorfleet.session.server",
    "tensorfleet.session.training_session",
)


class _RecordingEnviron(os._Environ):  # type: ignore[name-defined,misc]
    """``os.environ`` while the preloads import: every name looked up is recorded, so that a
    task whose value of such a variable differs is started fresh (it could not change what the
    import did with it)."""

    recorded: set[str] = set()

    def __getitem__(self, key: str) -> str:
        _RecordingEnviron.recorded.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            _RecordingEnviron.recorded.add(key)
        return super().__contains__(key)


def _preload() -> set[str]:
    """Import :data:`PRELOADED`; return the names of the variables the imports looked up."""
    plain = os.environ.__class__
    os.environ.__class__ = _RecordingEnviron
    try:
        for name in PRELOADED:
            try:
                importlib.import_module(name)
            except Exception as exc:  # a task that needs it imports it, and fails, itself
                print(f"task fork server: could not preload {name}: {exc!r}", file=sys.stderr)
    finally:
        os.environ.__class__ = plain
    return set(_RecordingEnviron.recorded)


def _serve(channel: socket.socket) -> int:
    os.dup2(2, 1)  # what imports print goes to the log, never anywhere else

    def say(message: dict[str, Any]) -> None:
        channel.send(json.dumps(message).encode())

    import torch  # the point: imported once, for every task it forks

    note_torch_start_seed()  # each task forked gets a torch seed of its own, as if fresh

    allowed = current_threads()  # torch's import starts numpy's OpenBLAS server: safe to fork
    started_with = dict(os.environ)
    read_at_import = _preload()
    # what the imports set (torch sets TORCHINDUCTOR_CACHE_DIR): a fresh import would too
    set_by_import = {k: v for k, v in os.environ.items() if started_with.get(k) != v}
    try:  # each task's end is learned through its pidfd
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as exc:
        print(f"task fork server: this system has no pidfd (Linux 5.3 or later): {exc}")
        return 3
    say({"event": "ready", "pid": os.getpid()})

    def fork_one(data: bytes, fds: list[int], close: tuple[int, ...]) -> dict[str, Any]:
        request = _parse_run_request(data, fds)
        why = request if isinstance(request, str) else _refusal(request)
        if why is not None:
            for fd in fds:
                os.close(fd)
            return {"event": "declined", "why": why}
        assert isinstance(request, dict)
        parent = os.getpid()
        pid = fork_frozen()
        if pid == 0:
            request["environ"] = {**request["environ"], **set_by_import}
            _task_child(request, fds[0], parent, close=close)
        os.close(fds[0])
        return {"event": "forked", "pid": pid}

    def _refusal(request: dict[str, Any]) -> str | None:
        """Why this server must not fork the (well-formed) ``request`` now, or None."""
        differing = import_time_difference(started_with, request["environ"], read_at_import)
        extra = current_threads() - allowed
        if differing:
            return (
                "its environment differs from the fork server's in variables read while "
                f"torch and tensorfleet were imported: {', '.join(differing[:8])}"
            )
        if extra:
            return (
                f"the fork server has {len(extra)} thread(s) more than after importing "
                "torch; forking it is unsafe"
            )
        if torch.cuda.is_initialized():  # a fork of it could not use CUDA
            return "CUDA was initialized in the fork server while it imported"
        return None

    return serve_fork_requests(channel, MESSAGE_BYTES, 1, fork_one)


def _parse_run_request(data: bytes, fds: list[int]) -> dict[str, Any] | str:
    """The run request in ``data``, checked; a string saying what is wrong otherwise."""
    try:
        message = json.loads(data)
        request = message["run"]
        kind, target, args = request["kind"], request["target"], request["args"]
        environ, cwd, unbuffered = request["environ"], request["cwd"], request["unbuffered"]
    except (ValueError, KeyError, TypeError):
        return f"a malformed request ({data[:200]!r})"
    if len(fds) != 1:
        return f"a run request needs 1 descriptor (the task's output), it had {len(fds)}"
    if not (
        kind in ("script", "module")
        and isinstance(target, str)
        and isinstance(cwd, str)
        and isinstance(unbuffered, bool)
        and isinstance(args, list)
        and all(isinstance(a, str) for a in args)
        and isinstance(environ, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in environ.items())
    ):
        return (
            "a run request's kind, target, args, unbuffered, cwd and environ must be of the "
            "documented types"
        )
    return request


def _task_child(
    request: Mapping[str, Any], output: int, parent: int, close: tuple[int, ...]
) -> None:
    """The forked task: never returns (``os._exit`` with the status a fresh interpreter
    running the same command would have ended with)."""
    code = 1
    try:
        os.setsid()  # its own session and process group, as the launcher's fresh tasks
        die_with_parent(signal.SIGKILL)()  # its exit status reaches the launcher through us
        if os.getppid() != parent:  # the server died before the line above
            os._exit(128 + int(signal.SIGKILL))
        for fd in close:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        _default_signals()
        _become(request)
        code = _run(request["kind"], request["target"])
    except BaseException:
        code = failed_in_fork()
    finally:
        end_fork(code)


def _default_signals() -> None:
    """The signal dispositions of a fresh interpreter (the server's are not the task's)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)


def _become(request: Mapping[str, Any]) -> None:
    """This process's environment, working directory, ``sys.path``, ``sys.argv``, standard
    streams and random generators as a fresh ``python SCRIPT ARGS`` (or ``-m MODULE``) started
    in the task's directory with the task's variables would have them."""
    environ, cwd = request["environ"], request["cwd"]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    if request["kind"] == "script":
        first = os.path.dirname(os.path.abspath(request["target"]))
    else:
        first = os.getcwd()

    def entries(pythonpath: str) -> list[str]:
        return [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]

    own = {sys.path[0], *entries(os.environ.get("PYTHONPATH", ""))} if sys.path else set()
    front = [first, *entries(environ.get("PYTHONPATH", ""))]
    rest = [p for p in sys.path if p not in own and p not in front]
    sys.path[:] = list(dict.fromkeys(front)) + rest
    importlib.invalidate_caches()  # files written since the server started
    sys.argv = [request["target"], *request["args"]]
    buffered = not (request["unbuffered"] or environ.get("PYTHONUNBUFFERED"))
    encoding = sys.__stdout__.encoding if sys.__stdout__ is not None else "utf-8"
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding
    )
    sys.stdout = sys.__stdout__ = _output_stream(1, buffered, encoding, "strict")
    sys.stderr = sys.__stderr__ = _output_stream(2, buffered, encoding, "backslashreplace")
    reseed_generators()


def _output_stream(fd: int, buffered: bool, encoding: str, errors: str) -> io.TextIOWrapper:
    """A text stream on ``fd`` as the interpreter makes its standard ones (CPython's
    ``create_stdio``): unbuffered under ``PYTHONUNBUFFERED`` (every write reaches the pipe at
    once); else block-buffered, but line-buffered for stderr and for a terminal."""
    raw = io.FileIO(fd, "w", closefd=False)
    if not buffered:
        return io.TextIOWrapper(raw, encoding=encoding, errors=errors, write_through=True)
    return io.TextIOWrapper(
        io.BufferedWriter(raw),
        encoding=encoding,
        errors=errors,
        line_buffering=fd == 2 or os.isatty(fd),
    )


def _run(kind: str, target: str) -> int:
    """Run the task's program as ``__main__``; its exit status as the interpreter's would be."""
    try:
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as the interpreter ends on an uncaught one
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + int(signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    return _finish(code)


def _exit_code(value: object) -> int:
    """The exit status of ``SystemExit(value)``, printing a message as the interpreter does."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _finish(code: int = 0) -> int:
    """What the interpreter does at its end: wait for the program's non-daemon threads, run
    the exit handlers (registered by the program, and by the preloaded modules, as in a fresh
    interpreter that imported them), flush the streams."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        sys.excepthook(*sys.exc_info())
    try:
        atexit._run_exitfuncs()
    except BaseException:
        sys.excepthook(*sys.exc_info())
    return code


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print(
            "usage: python -m tensorfleet.launch.backends.task_fork_server_main SOCKET_FD "
            "(started by the launcher's local backend)",
            file=sys.stderr,
        )
        return 2
    return _serve(socket.socket(fileno=int(args[0])))


if __name__ == "__main__":
    raise SystemExit(main())
