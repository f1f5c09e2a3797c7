"""An interpreter that imported torch and tensorfleet once and forks each sweep's executor, so
that a program running sweep after sweep (a notebook, a script that searches, then trains an
ensemble, then cross-validates) pays the imports once, not once per sweep.

What and why. A sweep's entry trials are forked from its executor
(:mod:`tensorfleet.patterns.warm_executor`), a fresh interpreter that imports torch,
``torch._dynamo`` (what torch's optimizers import at their first step) and tensorfleet:
5.5 s on an idle 2-core machine, before the first trial can start. Against a search of twenty
1-second trials that is a quarter of the work, and it is paid again by every sweep. With
:func:`preload` the program starts one *preloaded interpreter* that imports them once and
then stays idle; every later sweep of the program forks its executor from it (tens of
milliseconds), the executor imports the sweep's entry module (the user's code, imported fresh
by each sweep, so an edited module is seen by the next sweep) and forks the trials as before.
Calling :func:`preload` early (at the top of a notebook, before loading the data) also hides
the import behind the program's own work, so even the first sweep starts warm.

The alternatives, and why not:

* **keep each sweep's executor for the next sweep** (no second level): the executor has
  imported the previous sweep's entry module, so the next sweep would see the old code of an
  edited module, and whatever the import left in the process;
* **fork the executor from the program itself** (no process of its own): the program has
  usually run torch operations (the hand-written loop, the data loading), which starts
  OpenMP's thread pool, and a child forked from such a process hangs at its first parallel
  op (measured: a forked ``a @ a`` never returned after the parent had run one). The
  preloaded interpreter never runs a torch operation, so forking it is safe for the same
  reason forking the executor is (its docstring says why); it checks its threads before
  every fork and declines when it has more than after importing torch.
* **start an interpreter for every sweep, as without** :func:`preload`: what the sweep does
  when no preloaded interpreter runs, or when the one running cannot serve it (below).

Which sweeps it serves. A sweep's executor must run in exactly the environment a fresh one
would have. The fork takes the sweep's environment (``os.environ`` becomes the trials'
environment; the sweep's ``pythonpath`` entries go to the front of ``sys.path``, and the
working directory is the sweep's, as a fresh ``python -m`` would have them), but a variable
read while torch and the rest were imported cannot be changed afterwards (``OMP_NUM_THREADS``
sizes OpenMP's pool when the library loads). So the interpreter serves a sweep only when the
variables of :data:`IMPORT_TIME_PREFIXES` (``PYTHON*`` but ``PYTHONPATH``, ``OMP_*``,
``MKL_*``, ``CUDA*``, ``TORCH*``, ``TENSORFLEET_*``, ...) have the values it started with;
otherwise (a config's ``env`` that sets one, or a change of ``os.environ`` since
:func:`preload`) the sweep starts its executor the usual way and its progress says why,
once. Start the preloaded interpreter with the same variables (``preload(env={...})``) to
have those sweeps served. Strict equality of the whole environment was tried first and
served nothing in practice: programs change unrelated variables all the time (pytest sets
``PYTEST_CURRENT_TEST`` for every test phase).

Its lifetime: until :func:`release_preloaded`, the end of the program (it dies with it: the
kernel sends it SIGKILL when its parent ends, and executors forked from it die with it in
turn), or its own death (a sweep then starts its executor the usual way and says so). It
holds the memory of an interpreter that imported torch (about 300-400 MB resident) while idle.

Protocol (no pickle): a Unix ``SOCK_SEQPACKET`` socket pair. The interpreter says
``{"event": "ready", "pid": ...}`` once imported (its code:
:mod:`tensorfleet.patterns.preloaded_interpreter_main`); a sweep asks ``{"fork": {"entry": ...,
"metric": ..., "environ": {...}, "cwd": ...}}`` with three descriptors attached (the
executor's stdin, stdout and stderr) and gets ``{"event": "forked", "pid": ...}`` or
``{"event": "declined", "why": ...}``; ``{"event": "ended", "pid": ..., "returncode": ...}``
follows when an executor ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

from tensorfleet.errors import LaunchError
from tensorfleet.patterns.output_tail import output_tail
from tensorfleet.process_forks import die_with_parent

#: How long :func:`preload`'s interpreter may take to import torch and tensorfleet before a
#: sweep gives up on it (and starts its executor the usual way).
READY_TIMEOUT_S = 300.0
#: How long a fork request may take to be answered.
FORK_TIMEOUT_S = 30.0
#: The largest message either side sends (a fork request carries the sweep's environment).
MESSAGE_BYTES = 1 << 20


#: The variables Python, the C libraries and the modules the interpreter preloads (torch,
#: its OpenMP, BLAS and CUDA libraries, ``torch._dynamo`` with sympy, numpy, tensorfleet) may
#: read while they start, by the start of their names. A sweep whose trials need other
#: values of any of these than the interpreter started with is not served by it; every
#: other variable is simply set in the fork (nothing had read it yet).
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "LD_",
    "GLIBC_",
    "MALLOC_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO",
    "NPY_",
    "NUMPY_",
    "SYMPY",
    "CUDA",
    "NVIDIA_",
    "TORCH",
    "PYTORCH",
    "TRITON_",
    "TENSORFLEET_",
)


def environment_difference(started: Mapping[str, str], wanted: Mapping[str, str]) -> list[str]:
    """The names of the variables read at import (:data:`IMPORT_TIME_PREFIXES`;
    ``PYTHONPATH`` aside) whose values differ between the environment the preloaded
    interpreter started with and the one a sweep's trials need."""
    names = (set(started) | set(wanted)) - {"PYTHONPATH"}
    return sorted(
        name
        for name in names
        if name.startswith(IMPORT_TIME_PREFIXES) and started.get(name) != wanted.get(name)
    )


class PreloadedInterpreter:
    """The preloaded interpreter, seen from the program that started it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tensorfleet.patterns.preloaded_interpreter_main",
                    str(theirs.fileno()),
                ],
                stdin=subprocess.DEVNULL,
                stdout=self._stderr,
                stderr=self._stderr,
                env=self.env,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        finally:
            theirs.close()
        self._lock = threading.Lock()  # one request at a time (sweeps in threads)
        self._returncodes: dict[int, int] = {}
        self.ready = False
        self.dead = False

    def _receive(self, timeout: float) -> tuple[dict[str, Any], list[int]] | None:
        """One message (with the descriptors it carries), waiting up to ``timeout``; None
        when none came. Marks the interpreter dead when its end of the socket closed."""
        readable, _, _ = select.select([self._socket], [], [], max(0.0, timeout))
        if not readable:
            return None
        try:
            data, fds, _, _ = socket.recv_fds(self._socket, MESSAGE_BYTES, 1)
        except OSError:
            data, fds = b"", []
        for fd in fds:  # the interpreter never sends descriptors: close what came
            os.close(fd)
        if not data:
            self.dead = True
            return None
        try:
            message = json.loads(data)
        except ValueError:
            return {}, []
        if not isinstance(message, dict):
            return {}, []
        if message.get("event") == "ended" and isinstance(message.get("pid"), int):
            self._returncodes[message["pid"]] = int(message.get("returncode", -9))
        if message.get("event") == "ready":
            self.ready = True
        return message, []

    def _drain(self) -> None:
        while not self.dead and self._receive(0.0) is not None:
            pass

    def wait_ready(self, timeout: float) -> bool:
        """Whether it finished its imports, waiting up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self.ready and not self.dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._receive(min(left, 0.5))
        return self.ready and not self.dead

    def fork_executor(
        self,
        entry: str,
        metric: str,
        environ: Mapping[str, str],
        fds: tuple[int, int, int],
    ) -> tuple[int | None, str | None]:
        """Fork an executor for ``entry`` with ``fds`` as its stdin, stdout and stderr:
        ``(pid, None)``, or ``(None, why)`` when this interpreter cannot (it died, it declined,
        it did not answer in :data:`FORK_TIMEOUT_S`)."""
        request = {
            "fork": {
                "entry": entry,
                "metric": metric,
                "environ": dict(environ),
                "cwd": os.getcwd(),
            }
        }
        with self._lock:
            self._drain()
            if self.dead:
                return None, self.describe_death()
            try:
                socket.send_fds(self._socket, [json.dumps(request).encode()], list(fds))
            except OSError as exc:
                self.dead = True
                return None, f"the preloaded interpreter's channel failed: {exc}"
            deadline = time.monotonic() + FORK_TIMEOUT_S
            while not self.dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    return (
                        None,
                        f"the preloaded interpreter did not answer in {FORK_TIMEOUT_S:.0f} s",
                    )
                got = self._receive(left)
                if got is None:
                    continue
                message, _ = got
                if message.get("event") == "forked" and isinstance(message.get("pid"), int):
                    return message["pid"], None
                if message.get("event") == "declined":
                    return None, str(message.get("why"))
            return None, self.describe_death()

    def returncode(self, pid: int, timeout: float) -> int | None:
        """The exit status of executor ``pid`` as this interpreter reported it, waiting up to
        ``timeout``; SIGKILL's when the interpreter died (its executors die with it)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid not in self._returncodes and not self.dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._receive(min(left, 0.5))
        if pid in self._returncodes:
            return self._returncodes.pop(pid)
        return -int(signal.SIGKILL)

    def stderr_tail(self) -> str:
        """The end of what it printed (:func:`~tensorfleet.patterns.output_tail.output_tail`:
        its last error line first, as an interpreter that cannot start ends with the thread
        dump, not the error)."""
        try:
            self._stderr.seek(0)
            return output_tail(self._stderr.read().decode(errors="replace"))
        except (OSError, ValueError):
            return ""

    def describe_death(self) -> str:
        """What is known of why it ended: its exit status and the end of what it printed."""
        code = self.process.poll()
        if code is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.process.wait(timeout=1.0)
        how = (
            "closed its channel"
            if code is None
            else (
                f"was killed by {signal.Signals(-code).name}"
                if code < 0
                else f"exited with status {code}"
            )
        )
        tail = self.stderr_tail()
        return f"the preloaded interpreter (pid {self.process.pid}) {how}" + (
            f": {tail}" if tail else ""
        )

    def alive(self) -> bool:
        if not self.dead and self.process.poll() is not None:
            self.dead = True
        return not self.dead

    def close(self, timeout: float = 5.0) -> None:
        """End it (SIGKILL: it holds nothing but imports) and the executors it forked."""
        self.dead = True
        with contextlib.suppress(OSError):
            self._socket.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout)
        self._stderr.close()


class ForkedExecutorProcess:
    """An executor forked by the preloaded interpreter, with the part of
    :class:`subprocess.Popen`'s interface the sweep uses (``pid``, ``stdin``, ``stdout``,
    ``poll``, ``wait``). It is the interpreter's child, not ours: its end is seen through a
    pidfd and its exit status comes from the interpreter."""

    def __init__(
        self, interpreter: PreloadedInterpreter, pid: int, stdin: IO[bytes], stdout: IO[bytes]
    ) -> None:
        self.interpreter = interpreter
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # it already ended (and was reaped)
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], 0)
            if not readable:
                return None
        code = self.interpreter.returncode(self.pid, timeout=2.0)
        self.returncode = -int(signal.SIGKILL) if code is None else code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("executor", timeout or 0.0)
            assert self._pidfd is not None
            select.select([self._pidfd], [], [], 0.5 if left is None else min(left, 0.5))


def fork_executor_process(
    preloaded: PreloadedInterpreter,
    entry: str,
    metric: str,
    env: Mapping[str, str],
    stderr: IO[bytes],
) -> tuple[ForkedExecutorProcess | None, str | None]:
    """An executor for ``entry`` forked from ``preloaded`` (its stderr to ``stderr``), or
    None and why it could not be (then the caller starts a fresh one): the sweep's trials
    need other import-time variables, the interpreter died (said once, then forgotten) or
    did not finish its imports in :data:`READY_TIMEOUT_S`, or it declined to fork."""
    differ = environment_difference(preloaded.env, env)
    if differ:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        return None, (
            f"the preloaded interpreter was started with other values of {shown} than this "
            "sweep's trials have (see preload(env=...)); this sweep's executor imports torch itself"
        )
    if not preloaded.wait_ready(READY_TIMEOUT_S):
        if preloaded.alive():
            why = (
                f"the preloaded interpreter (pid {preloaded.process.pid}) has not finished "
                f"importing torch in {READY_TIMEOUT_S:.0f} s"
            )
        else:
            why = preloaded.describe_death()
            forget(preloaded)  # said once; later sweeps start their executors quietly
        return None, f"{why}; this sweep's executor imports torch itself"
    commands_read, commands_write = os.pipe()
    events_read, events_write = os.pipe()
    pid, why = preloaded.fork_executor(
        entry, metric, env, (commands_read, events_write, stderr.fileno())
    )
    os.close(commands_read)
    os.close(events_write)
    if pid is None:
        os.close(commands_write)
        os.close(events_read)
        if not preloaded.alive():
            forget(preloaded)  # its death is said now, once
        return None, f"{why}; this sweep's executor imports torch itself"
    stdin = os.fdopen(commands_write, "wb")
    stdout = os.fdopen(events_read, "rb")
    return ForkedExecutorProcess(preloaded, pid, stdin, stdout), None


_current: PreloadedInterpreter | None = None
_current_lock = threading.Lock()


def preload(env: Mapping[str, str] | None = None, wait: bool = False) -> None:
    """Start the program's preloaded interpreter (in the background; nothing when one runs
    with the same environment): the sweeps this program runs afterwards fork their executors
    from it instead of starting an interpreter each.

    ``env``: variables to add to ``os.environ`` for it, as a sweep config's ``env`` adds them
    for its trials (a sweep is served only when its trials' variables of
    :data:`IMPORT_TIME_PREFIXES` have the values the interpreter started with; the others are
    set in the fork). ``wait``: return only once it imported torch and tensorfleet (raises
    :class:`~tensorfleet.errors.LaunchError`, naming what it printed, when it could not).

    Example::

        from tensorfleet.patterns.preloaded_interpreter import preload, release_preloaded
        from tensorfleet.patterns.sweep import run_sweep

        preload()                    # imports torch once, in the background
        ...                          # load data, build configs: the import runs meanwhile
        run_sweep(config_a, "runs/a")   # executor forked in milliseconds
        run_sweep(config_b, "runs/b")   # and again
        release_preloaded()          # or let the program's end take it
    """
    global _current
    wanted = _trial_environment(env)
    with _current_lock:
        if _current is not None and (
            not _current.alive() or environment_difference(_current.env, wanted)
        ):
            _current.close()
            _current = None
        if _current is None:
            _current = PreloadedInterpreter(wanted)
        interpreter = _current
    if wait and not interpreter.wait_ready(READY_TIMEOUT_S):
        if interpreter.alive():
            why = f"did not finish importing them in {READY_TIMEOUT_S:.0f} s"
        else:
            why = interpreter.describe_death()
        raise LaunchError(
            f"the preloaded interpreter could not import torch and tensorfleet: {why}; sweeps "
            "will start their executors the usual way (check the environment given to "
            "preload(), or call release_preloaded())"
        )


def release_preloaded() -> None:
    """End the program's preloaded interpreter, if any (the executors of running sweeps that
    were forked from it end with it: call this between sweeps)."""
    global _current
    with _current_lock:
        if _current is not None:
            _current.close()
            _current = None


def current_preloaded() -> PreloadedInterpreter | None:
    """The program's preloaded interpreter (None when :func:`preload` was not called, or the
    interpreter was released, or its death was already reported by :func:`forget`). A dead
    one is still returned once, so that the sweep that finds it dead says so."""
    with _current_lock:
        return _current


def forget(interpreter: PreloadedInterpreter) -> None:
    """Drop ``interpreter`` (found dead, and said so) as the program's preloaded one."""
    global _current
    with _current_lock:
        if _current is interpreter:
            _current.close()
            _current = None


def _trial_environment(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONUNBUFFERED"] = "1"  # as every trial has it (it is read at start)
    return env
