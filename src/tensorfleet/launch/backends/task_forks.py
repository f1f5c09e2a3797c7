"""Tasks started as forks of one interpreter that imported torch and tensorfleet once, instead
of each in a fresh interpreter that imports them again.

What and why. Every task of a local cluster is a Python program (the built-in ps, the user's
training script) whose first seconds go to the same imports: torch (2.5-3 s of CPU on the
project's 2-core machine) and, in every process that builds a torch optimizer (every ps:
``ps/update_rules.py::warm_up_optimizers``), ``torch._dynamo`` (another 2.2 s). A cluster of
1 ps and 3 workers pays that 4 times at once on the same cores before its first step, a
restarted task pays it again before it trains, and the project's own test suite, which starts
hundreds of such clusters, spends a large share of its time there. The local backend
therefore starts one *task fork server* per run (:mod:`.task_fork_server_main`): it imports
torch, ``torch._dynamo``, numpy and tensorfleet's runtime once, and forks each task: the child
takes the task's environment, working directory, ``sys.argv``, ``sys.path`` and output pipe,
resets the signal handlers and the random generators a fresh interpreter would seed, runs
``python SCRIPT ARGS`` (``runpy.run_path``) or ``python -m MODULE ARGS`` (``runpy.run_module``)
as ``__main__``, and ends as the interpreter would (waiting for the program's non-daemon
threads, running the exit handlers, exit status from ``SystemExit``, 1 and the traceback for an
uncaught exception).

Which tasks it serves, and which start fresh as before:

* the command must be this interpreter (``sys.executable``, or ``python``/``python3`` found on
  ``PATH`` as that file in the same directory: the same environment) with a script or ``-m MODULE`` and nothing else before them
  but ``-u``: another interpreter, a shell script or any other flag starts a fresh process;
* the task's values of the variables read while the server imported must be the server's:
  the ones the imports looked up through ``os.environ`` (recorded while they ran) and those C
  libraries read when they load (:data:`C_LIBRARY_PREFIXES`: OpenMP, MKL, OpenBLAS, malloc,
  the loader, torch's C++ settings; ``PYTHON*`` but ``PYTHONPATH`` and ``PYTHONUNBUFFERED``,
  which the fork applies itself). The server starts with the first task's environment, so the
  usual run, whose tasks differ only in their identity (``TF_CONFIG``), is served whole; a task
  given other thread counts (``--intra-op-threads`` for the ps only) starts fresh;
* ``TENSORFLEET_TASK_FORKS=0`` (or ``LocalCluster(..., fork_tasks=False)``) turns it off; it
  is off on systems other than Linux (the server needs ``prctl`` and pidfds: Linux 5.3 or
  later; on an older kernel the server says so and every task starts fresh).

A task that is not served starts in a fresh interpreter, and its first output line says why
(once per reason and run).

Failures cost what they cost with fresh processes. A task that raises, exits, is killed or
hangs is its own process group, signalled, reaped and reported as before (its exit status
travels from the server, which reaps it, to the launcher: ``{"event": "ended"}``). The server
never runs a torch operation (a fork of a process that has is unsafe: OpenMP's pool) and checks
its threads before every fork, declining when it has more than after importing torch. Tasks
die with the server (``PR_SET_PDEATHSIG``), so a killed server takes its tasks with it: each is
reported killed and restarted by the supervisor's usual rules, in a fresh interpreter (the run
says so once); the server dies with the launcher the same way.

The alternatives, and why not:

* **Python's ``multiprocessing`` forkserver**: it pickles the process object it starts (the
  project never unpickles), and runs a function, not a program as ``__main__``;
* **warm spares only** (:mod:`tensorfleet.launch.warm_spares`): they hide the imports of a
  restarted worker, not of the run's start, and each holds a whole interpreter; they stay, and
  are forked too;
* **importing less**: the ps needs torch's optimizers, which import ``torch._dynamo``; torch
  itself is the floor of a fresh process.

Protocol (no pickle): a Unix ``SOCK_SEQPACKET`` socket pair. The server says ``{"event":
"ready", "pid": ...}`` once imported; the launcher asks ``{"run": {"kind": "script" | "module",
"target": ..., "args": [...], "unbuffered": false, "environ": {...}, "cwd": ...}}`` with one descriptor attached
(the write end of the task's output pipe) and gets ``{"event": "forked", "pid": ...}`` or
``{"event": "declined", "why": ...}``; ``{"event": "ended", "pid": ..., "returncode": ...}``
follows when a task ends (negative: killed by that signal, as ``Popen.returncode``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorfleet import environment
from tensorfleet.process_forks import die_with_parent

#: "0" starts every task of a local cluster in a fresh interpreter (the default forks them
#: from the run's task fork server).
TASK_FORKS_VAR = "TENSORFLEET_TASK_FORKS"
#: How long the server may take to import torch and tensorfleet before the tasks start fresh.
READY_TIMEOUT_S = 120.0
#: How long a fork request may take to be answered.
FORK_TIMEOUT_S = 30.0
#: How long a task of a dead server is given to be gone before it is reported killed.
ORPHAN_EXIT_TIMEOUT_S = 5.0
#: The start of :func:`forkable`'s answer for a program that is not this interpreter.
NOT_THIS_INTERPRETER = "is not this interpreter"
#: The largest message either side sends (a request carries the task's environment).
MESSAGE_BYTES = 1 << 20
#: Variables the C libraries the server loads read while they load, by the start of their
#: names (never seen by the recording of ``os.environ``): a task needing other values starts
#: fresh.
C_LIBRARY_PREFIXES = (
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
    "TORCH",
    "PYTORCH",
)
#: ``PYTHON*`` variables the fork applies itself (the path; the output streams' buffering).
APPLIED_IN_FORK = ("PYTHONPATH", "PYTHONUNBUFFERED")


def forks_enabled(environ: Mapping[str, str] | None = None, platform: str | None = None) -> bool:
    """Whether task forks are on: on Linux (the server needs ``prctl`` and pidfds) unless
    ``TENSORFLEET_TASK_FORKS`` is ``0``/``false``/``no``/``off``."""
    if (sys.platform if platform is None else platform) != "linux":
        return False
    value = (environment.environ() if environ is None else environ).get(TASK_FORKS_VAR, "1")
    return value.strip().lower() not in ("0", "false", "no", "off")


def import_time_difference(
    started: Mapping[str, str], wanted: Mapping[str, str], read_at_import: set[str]
) -> list[str]:
    """The names of the variables read while the server imported (``read_at_import``, and
    those of :data:`C_LIBRARY_PREFIXES`) whose values differ between the server's environment
    (``started``) and a task's (``wanted``); sorted. Empty: the task can be forked."""
    names = (set(started) | set(wanted)) - set(APPLIED_IN_FORK)
    return sorted(
        name
        for name in names
        if (name in read_at_import or name.startswith(C_LIBRARY_PREFIXES))
        and started.get(name) != wanted.get(name)
    )


@dataclass(frozen=True)
class ForkableCommand:
    """A task's command as the server runs it: ``python [-u] SCRIPT ARGS`` (``kind``
    ``"script"``, ``target`` the script's path) or ``python [-u] -m MODULE ARGS`` (``"module"``,
    the module's name); ``unbuffered``: ``-u`` was given."""

    kind: str
    target: str
    args: list[str] = field(default_factory=list)
    unbuffered: bool = False


def forkable(
    command: Sequence[str], path: str | None = None, cwd: str | None = None
) -> ForkableCommand | str:
    """The command as the server would run it, or a string saying why it cannot. ``path``:
    the ``PATH`` to find a bare ``python`` on (default: this process's); ``cwd``: the task's
    working directory, which a relative program path is relative to (as for a fresh process
    started there)."""
    if not command:
        return "an empty command"
    program = command[0]
    if os.sep in program:
        found: str | None = os.path.join(cwd or os.getcwd(), program)
    else:
        found = shutil.which(program, path=path)
    if found is None or not _is_this_interpreter(found):
        return f"its program {program!r} {NOT_THIS_INTERPRETER} ({sys.executable})"
    rest = list(command[1:])
    unbuffered = False
    while rest and rest[0] == "-u":
        unbuffered = True
        rest.pop(0)
    if not rest:
        return "it starts an interactive interpreter"
    if rest[0] == "-m":
        if len(rest) < 2 or not rest[1] or rest[1].startswith("-"):
            return "its -m names no module"
        return ForkableCommand("module", rest[1], rest[2:], unbuffered)
    if rest[0].startswith("-"):
        return f"it passes the interpreter the option {rest[0]!r}"
    return ForkableCommand("script", rest[0], rest[1:], unbuffered)


def _is_this_interpreter(program: str) -> bool:
    """Whether ``program`` is ``sys.executable``: the same path, or another name of the same
    file in the same directory (a virtual environment's ``python`` and ``python3``). The same
    file elsewhere is another environment (a venv's interpreter links to the system's)."""
    mine = os.path.abspath(sys.executable)
    theirs = os.path.abspath(program)
    if theirs == mine:
        return True
    if os.path.dirname(theirs) != os.path.dirname(mine):
        return False
    try:
        return os.path.samefile(theirs, mine)
    except OSError:
        return False


class TaskForkServer:
    """The task fork server of one run, seen from the launcher: start it, fork tasks from it,
    learn their ends. Thread safe; a reader thread dispatches the server's messages."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tensorfleet.launch.backends.task_fork_server_main",
                    str(theirs.fileno()),
                ],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=self._log,
                env=dict(env),
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        finally:
            theirs.close()
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._ready = False
        self._dead = False
        self._reply: dict[str, Any] | None = None
        self._returncodes: dict[int, int] = {}
        self._on_exit: dict[int, Callable[[], None]] = {}
        self._running: set[int] = set()
        threading.Thread(target=self._read, name="tensorfleet-task-forks", daemon=True).start()

    # -- the reader thread ---------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._socket, MESSAGE_BYTES, 1)
            except OSError:
                data, fds = b"", []
            for fd in fds:  # the server never sends descriptors: close what came
                os.close(fd)
            if not data:
                self._server_gone()
                return
            try:
                message = json.loads(data)
            except ValueError:
                continue
            if isinstance(message, dict):
                self._handle(message)

    def _handle(self, message: dict[str, Any]) -> None:
        event, pid = message.get("event"), message.get("pid")
        if event == "ended" and isinstance(pid, int):
            returncode = message.get("returncode")
            self._ended(pid, returncode if isinstance(returncode, int) else -int(signal.SIGKILL))
            return
        with self._changed:
            if event == "ready":
                self._ready = True
            elif event in ("forked", "declined"):
                if event == "forked" and isinstance(pid, int):
                    # a pid the kernel reused: what an earlier task of it left is not this one's
                    self._returncodes.pop(pid, None)
                self._reply = message
            self._changed.notify_all()

    def _ended(self, pid: int, returncode: int) -> None:
        with self._changed:
            self._running.discard(pid)
            self._returncodes[pid] = returncode
            callback = self._on_exit.pop(pid, None)
        if callback is not None:
            callback()

    def _server_gone(self) -> None:
        """The server ended: its tasks die with it (their parent-death signal); report each
        killed once it is gone."""
        with self._changed:
            self._dead = True
            orphans = sorted(self._running)
            self._changed.notify_all()
        for pid in orphans:
            _wait_gone(pid, ORPHAN_EXIT_TIMEOUT_S)
            self._ended(pid, -int(signal.SIGKILL))

    # -- the launcher's side ---------------------------------------------------------------

    def wait_ready(self, timeout: float) -> str | None:
        """None once the server finished its imports (waiting up to ``timeout`` seconds);
        else why it cannot serve (it died, with its last line, or is still importing)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._ready and not self._dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"the task fork server did not finish its imports in {timeout:.0f} s"
                self._changed.wait(min(left, 1.0))
            if self._dead:
                return self.describe_death()
        return None

    def fork(
        self, command: ForkableCommand, environ: Mapping[str, str], cwd: str, output: int,
        on_exit: Callable[[], None],
    ) -> int | str:  # fmt: skip
        """Fork a task running ``command`` (as :func:`forkable` made it) in ``environ`` and
        ``cwd``, its stdout and stderr on ``output``: its pid, or why the server did not (it
        declined, died or did not answer in :data:`FORK_TIMEOUT_S`). ``on_exit`` is called
        (from the reader thread) once the task ended and :meth:`returncode` knows its status."""
        request = {
            "run": {
                "kind": command.kind,
                "target": command.target,
                "args": list(command.args),
                "unbuffered": command.unbuffered,
                "environ": dict(environ),
                "cwd": cwd,
            }
        }
        with self._lock:
            with self._changed:
                if self._dead:
                    return self.describe_death()
                self._reply = None
            try:
                socket.send_fds(self._socket, [json.dumps(request).encode()], [output])
            except OSError as exc:
                return f"the task fork server's channel failed: {exc}"
            deadline = time.monotonic() + FORK_TIMEOUT_S
            with self._changed:
                while self._reply is None and not self._dead:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return f"the task fork server did not answer in {FORK_TIMEOUT_S:.0f} s"
                    self._changed.wait(left)
                reply = self._reply
                if reply is None:
                    return self.describe_death()
                pid = reply.get("pid")
                if reply.get("event") != "forked" or not isinstance(pid, int):
                    return str(reply.get("why", "the task fork server declined"))
                if pid in self._returncodes:  # it ended before we got here
                    done = True
                else:
                    done = False
                    self._running.add(pid)
                    self._on_exit[pid] = on_exit
        if done:
            on_exit()
        return pid

    def returncode(self, pid: int) -> int | None:
        """The exit status of task ``pid`` once the server reported its end, else None."""
        with self._changed:
            return self._returncodes.get(pid)

    @property
    def dead(self) -> bool:
        with self._changed:
            return self._dead

    def describe_death(self) -> str:
        """Why the server cannot serve: its exit and the last line it wrote."""
        code = self.process.poll()
        how = "is gone" if code is None else f"ended ({code})"
        last = ""
        with contextlib.suppress(OSError, ValueError):
            self._log.seek(0)
            lines = [ln for ln in self._log.read().decode(errors="replace").splitlines() if ln]
            last = f"; its last line: {lines[-1]}" if lines else ""
        return f"the task fork server (pid {self.process.pid}) {how}{last}"

    def close(self) -> None:
        """End the server (its tasks, if any are left, die with it). Idempotent."""
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5.0)
        with contextlib.suppress(OSError):
            self._socket.close()
        with contextlib.suppress(OSError):
            self._log.close()


def group_has_live_member(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie (Linux: read from
    ``/proc``; elsewhere, whether the group exists at all)."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return True
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def _wait_gone(pid: int, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for process ``pid`` (not our child) to be gone."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # already gone (or no pidfd: then the parent-death signal is enough)
        return
    try:
        select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
