"""Where a sweep's trials run: a preloaded process that forks each trial, or a fresh process
per trial.

A trial whose program is a Python entry point (``entry: module:function``) of one worker runs
in a child forked from the sweep's *executor*: a process started once per sweep
(``python -m tensorfleet.patterns.warm_executor ENTRY METRIC``, or, in a program that called
``preload()``, a fork of its preloaded interpreter: :mod:`tensorfleet.patterns.preloaded_interpreter`)
that imported torch, tensorfleet and the entry's module, and then forks one child per trial, for every slot: it
waits for its commands and for the ends of its trials at once (each trial's pidfd), so two
slots run two trials side by side. One executor rather than one per slot: a sweep of N slots
imports torch once, not N times side by side on the same cores (measured with 2 slots at
load 2 on 2 cores: the first trial 3.5 s after the sweep started instead of 5.6 s), and holds
one preloaded process in memory, not N. Where the kernel has no pidfd (Linux before 5.3)
each slot has an executor of its own (:func:`shared_executor_possible`). The child is the
trial: its own process group (the sweep signals it, as before), its output in the trial's
``output.log``, its metrics and result in the trial's files (:mod:`tensorfleet.patterns.trial`)
exactly as a fresh process writes them. A trial with a ``command`` (a program of the user's)
or with ``workers_per_trial > 1`` (its own cluster, through ``tensorfleet launch``) runs in a
fresh process as before (:class:`~tensorfleet.patterns.trial_processes.ProcessTrial`), and so does every trial with
``executor: fresh``.

The choice and its measured reason. Starting a fresh interpreter that imports torch and
tensorfleet took 2.2 s on an idle 2-core machine and 4-7 s under load, against trials of
0.3-1.3 s: a 20-trial search ran at 5.3 trials/min with 2 slots where a hand-written Optuna
loop in one process did 45.8. Importing torch is not all of it: a process's first
optimizer step imports ``torch._dynamo`` (about 830 modules, sympy among them): the same
300-step trial took 4.3-6.2 s as the first in a process that had imported torch, 0.3-0.4 s
after that (under load), so the executor imports it too (:data:`PRELOADED`: 1.7 s, no
thread). Two ways keep the imports warm:

* **fork per trial from a preloaded parent** (chosen): fork + a small torch op + exit took
  26 ms against 19 ms for the same op in the parent, i.e. about 7 ms per trial, under 1% of a
  1 s trial; and each trial starts from the same clean state (module globals, RNG state,
  torch thread settings, memory), so a trial that leaks, sets ``torch.set_num_threads`` or
  mutates a module-level cache changes nothing for the next one, and stopping or killing it
  is ending one process group, as with a fresh process.
* **one long-lived process running trial after trial** (not chosen): it saves those 7 ms, but
  every trial would inherit what the previous ones left (globals, seeds, threads, leaked
  memory, a half-torn CUDA context), and a trial that must be stopped would take the executor
  with it, costing an import (seconds) instead of a fork (milliseconds).

Why the fork is safe here: a fork copies only the calling thread, so the parent must have no
thread that holds a lock the child needs. The executor never runs a torch operation itself,
so torch's intra-op (OpenMP) and inter-op pools are never started in it (they start in each
child at its first parallel op; ``torch.get_num_threads`` does not start them). Importing
torch starts exactly one thread: the OpenBLAS server of the numpy it imports, which is idle on
a condition variable and which OpenBLAS stops itself before every fork (its
``pthread_atfork`` handler); the preloaded ``torch._dynamo`` and tensorfleet start none. The
executor records its threads after importing torch and checks again before every fork: when
a preload or the entry's import started another one (e.g. it ran a large torch op at import
time, or started a thread of its own), it forks nothing and the trials run in fresh
processes, as the sweep says once.

What the isolation users rely on still holds: a trial that raises, exits, calls ``os._exit``,
hangs past ``trial_timeout_s`` or is killed ends only its own process; the executor reports
its exit status and forks the next trial. An executor that dies (killed, out of memory)
takes the trials it runs with it (they get SIGKILL: ``PR_SET_PDEATHSIG``; with one executor
for all slots, every running trial), which are recorded as failed, and the next trial starts
a new executor. A trial that must be stopped (timed out, pruned) before the executor forked
it stops the executor itself (it is still importing), and with it the trials it runs.
Executors die with the sweep the same way, so a killed sweep leaves nothing running and resumes as before.

Protocol (no pickle): the sweep writes one JSON line per trial to the executor's stdin,
``{"number": 3, "directory": "/.../trials/0003", "params": {...}, "slot": 0}``; the executor
answers JSON lines on its stdout: ``{"event": "ready", ...}`` once imported (with the entry
check's verdict, see :func:`~tensorfleet.patterns.trial_main.find_entry_problem`),
``{"event": "started", "number": 3, "pid": 4242}`` after the fork, ``{"event": "ended",
"number": 3, "returncode": 0}`` (negative: killed by that signal) when the trial process
ended, or ``{"event": "declined", "number": 3, "why": ...}`` when it cannot fork safely.
The events of trials that run side by side interleave; each names its trial.
The executor's own stdout is moved aside at start, so nothing the entry's module prints can
corrupt that channel.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Protocol

from tensorfleet.patterns.output_tail import output_tail
from tensorfleet.process_forks import (
    current_threads,
    die_with_parent,
    end_fork,
    failed_in_fork,
    fork_frozen,
    note_torch_start_seed,
    reseed_generators,
    set_parent_death_signal,
)

#: Imported by every executor before the entry's module, so that no trial pays for them.
#: ``torch._dynamo`` (with sympy and about 800 other modules) is what torch's optimizers
#: import at their first ``step()``: 1.7 s, once per process.
PRELOADED = ("torch._dynamo", "tensorfleet", "tensorfleet.patterns.trial")


class TrialProcess(Protocol):
    """A running trial as the sweep drives it, whatever process runs it."""

    def poll(self) -> int | None:
        """Its exit status once it ended (negative: killed by that signal), else None."""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the trial's process group (nothing when it is gone)."""

    def lost(self) -> str | None:
        """Why the trial ended without its own exit status (its executor died), or None."""

    def declined(self) -> str | None:
        """Why the executor would not run it (then the sweep runs it in a fresh process)."""

    def close(self) -> None:
        """Release what the sweep held for it (its log file)."""

    def fileno(self) -> int | None:
        """A descriptor that becomes readable when there is news of the trial (it ended, its
        executor said something), for ``select``; None when there is none (then the sweep
        looks every :data:`~tensorfleet.patterns.sweep.POLL_S`)."""


class ExecutorProcess(Protocol):
    """What the sweep uses of an executor's process: a :class:`subprocess.Popen` it started,
    or one forked from the preloaded interpreter
    (:class:`~tensorfleet.patterns.preloaded_interpreter.ForkedExecutorProcess`)."""

    pid: int
    stdin: IO[bytes] | None
    stdout: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class WarmExecutor:
    """A preloaded executor (serving every slot, or one), seen from the sweep."""

    def __init__(
        self,
        entry: str,
        metric: str,
        env: Mapping[str, str],
        started: tuple[ExecutorProcess, IO[bytes]] | None = None,
    ) -> None:
        """Start a fresh executor for ``entry``, or take one already ``started`` (its process
        and the file its stderr goes to: one forked from the program's preloaded interpreter,
        :func:`~tensorfleet.patterns.preloaded_interpreter.fork_executor_process`)."""
        process: ExecutorProcess
        if started is not None:
            process, self._stderr = started
        else:
            self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
            process = subprocess.Popen(
                [sys.executable, "-m", "tensorfleet.patterns.warm_executor", entry, metric],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=dict(env),
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        self.process = process
        assert self.process.stdout is not None and self.process.stdin is not None
        os.set_blocking(self.process.stdout.fileno(), False)
        self._buffer = b""
        self._events: dict[int, deque[dict[str, Any]]] = {}  # by trial number
        self.ready: dict[str, Any] | None = None
        self.dead = False

    def fileno(self) -> int:
        """The status channel, for ``select``."""
        assert self.process.stdout is not None
        return self.process.stdout.fileno()

    def pump(self) -> None:
        """Read what the executor said since the last call (never blocks)."""
        if self.dead:
            return
        assert self.process.stdout is not None
        while True:
            try:
                chunk = os.read(self.process.stdout.fileno(), 65536)
            except BlockingIOError:
                break
            if not chunk:
                self.dead = True
                break
            self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # the channel carries only the executor's own JSON lines
            if event.get("event") == "ready":
                self.ready = event
            elif isinstance(event.get("number"), int):
                self._events.setdefault(event["number"], deque()).append(event)

    def take(self, number: int) -> deque[dict[str, Any]]:
        """The events of trial ``number`` not yet seen (its trial takes them as it polls)."""
        return self._events.setdefault(number, deque())

    def forget(self, number: int) -> None:
        """Drop what is kept for trial ``number`` (it ended)."""
        self._events.pop(number, None)

    def wait_ready(self, deadline: float) -> dict[str, Any] | None:
        """The executor's ready event, waiting until ``deadline`` (monotonic); None when it
        died or the deadline passed."""
        while self.ready is None and not self.dead:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            select.select([self.fileno()], [], [], min(left, 0.5))
            self.pump()
        return self.ready

    def send(self, command: Mapping[str, Any]) -> bool:
        """Hand a trial to the executor; False when it is gone."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write((json.dumps(command) + "\n").encode())
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            self.dead = True
            return False
        return True

    def run(
        self, number: int, directory: Path, params: Mapping[str, Any], slot: int
    ) -> WarmTrial | None:
        """Start trial ``number`` (in ``slot``) in a fork of this executor; None when the
        executor is gone."""
        command = {
            "number": number,
            "directory": str(directory.resolve()),
            "params": dict(params),
            "slot": slot,
        }
        return WarmTrial(self, number) if self.send(command) else None

    def stderr_tail(self) -> str:
        """The end of what the executor wrote to its stderr (import warnings, its errors;
        :func:`~tensorfleet.patterns.output_tail.output_tail`)."""
        try:
            self._stderr.seek(0)
            return output_tail(self._stderr.read().decode(errors="replace"))
        except (OSError, ValueError):
            return ""

    def describe_death(self) -> str:
        """What is known of why the executor ended."""
        code = self.process.poll()
        if code is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.process.wait(timeout=1.0)
        if code is None:
            how = "closed its channel"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        tail = self.stderr_tail()
        return f"the slot's executor process (pid {self.process.pid}) {how}" + (
            f": {tail}" if tail else ""
        )

    def close(self, timeout: float = 5.0) -> None:
        """End the executor at once (SIGKILL; called when no trial of it runs): it holds
        nothing worth a graceful exit (its trials' results are in their files), and an
        interpreter's teardown of torch takes seconds under load."""
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        signal_group(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout)
        assert self.process.stdout is not None
        self.process.stdout.close()
        self._stderr.close()
        self.dead = True


class WarmTrial:
    """A trial forked by a :class:`WarmExecutor`."""

    def __init__(self, executor: WarmExecutor, number: int) -> None:
        self.executor = executor
        self.number = number
        self.pid: int | None = None
        self.returncode: int | None = None
        self._lost: str | None = None
        self._declined: str | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ex = self.executor
        ex.pump()
        events = ex.take(self.number)
        while events:
            event = events.popleft()
            kind = event.get("event")
            if kind == "started":
                self.pid = int(event["pid"])
            elif kind == "ended":
                self.returncode = int(event["returncode"])
                ex.forget(self.number)
                return self.returncode
            elif kind == "declined":
                self._declined = str(event.get("why"))
                self.returncode = -int(signal.SIGKILL)
                ex.forget(self.number)
                return self.returncode
        if ex.dead:
            self._lost = ex.describe_death() + "; the trial was killed with it"
            if self.pid is not None:
                signal_group(self.pid, signal.SIGKILL)
            self.returncode = -int(signal.SIGKILL)
            return self.returncode
        return None

    def signal(self, sig: int) -> None:
        if self.pid is not None:
            signal_group(self.pid, sig)
        else:  # not forked yet: the executor is still importing, or stuck; end it
            signal_group(self.executor.process.pid, sig)

    def lost(self) -> str | None:
        return self._lost

    def declined(self) -> str | None:
        return self._declined

    def close(self) -> None:
        pass

    def fileno(self) -> int | None:
        return None if self.executor.dead else self.executor.fileno()


def shared_executor_possible() -> bool:
    """Whether one executor can serve every slot: it waits for several trials at once
    through their pidfds (``os.pidfd_open``: Linux 5.3 and later, Python 3.9 and later)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pid`` leads; nothing when it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


# --- the executor process ------------------------------------------------------------------


def serve(entry: str, metric: str) -> int:
    """Be the executor of ``entry`` (a fresh interpreter's, or one forked from the preloaded
    interpreter, where the imports below are already done): say ready, then fork the trials
    the sweep sends until it closes the channel and they have ended."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    commands = os.dup(0)  # read whole chunks (os.read), never through a buffer select misses
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # what imports print goes to the executor's log, never into the channel

    def say(event: dict[str, Any]) -> None:
        channel.write(json.dumps(event) + "\n")
        channel.flush()

    import torch  # noqa: F401 (the point: imported once, before any trial)

    note_torch_start_seed()  # before the user's code: trials get a seed of their own

    allowed = current_threads()  # torch's import starts numpy's OpenBLAS server: safe (see above)
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a trial that needs it fails in its own process, with this
            print(f"warm executor: could not preload {name}: {exc!r}", file=sys.stderr)
    from tensorfleet.patterns.trial_main import find_entry_problem, load_entry_point

    problem = find_entry_problem(entry)
    function = None
    if problem is None:
        try:
            function = load_entry_point(entry)
        except Exception as exc:  # find_entry_problem saw it fine; report, do not fork
            problem = {"missing": "", "message": f"loading {entry!r} raised {exc!r}"}
    extra = current_threads() - allowed
    why_not = None
    if function is None:
        why_not = f"the entry could not be loaded in the executor ({problem['message']})"
    elif extra:
        why_not = (
            f"importing {entry.partition(':')[0]!r} started {len(extra)} thread(s), and forking a "
            "process with threads is unsafe"
        )
    say(
        {
            "event": "ready",
            "pid": os.getpid(),
            "problem": problem,
            "forkable": why_not is None,
            "why": why_not,
        }
    )
    # The trials under way, by the pidfd that becomes readable when the trial ends: the
    # executor waits on its commands and on them at once, so that it serves every slot.
    children: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, trial number)
    pending = b""
    reading = True
    while reading or children:
        ready, _, _ = select.select([*children, *([commands] if reading else [])], [], [])
        for pidfd in [fd for fd in ready if fd in children]:
            pid, number = children.pop(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(pid, 0)
            say(
                {
                    "event": "ended",
                    "number": number,
                    "returncode": os.waitstatus_to_exitcode(status),
                }
            )
        if commands not in ready:
            continue
        chunk = os.read(commands, 65536)
        if not chunk:  # the sweep closed the channel: finish the trials under way, then end
            reading = False
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            try:
                command = json.loads(line)
                number = int(command["number"])
            except (ValueError, KeyError, TypeError):
                print(f"warm executor: ignored a malformed command {line[:200]!r}", file=sys.stderr)
                continue
            now_extra = current_threads() - allowed
            if why_not is None and now_extra:
                why_not = f"the executor has {len(now_extra)} thread(s) more than after importing torch; forking it is unsafe"
            if why_not is not None or function is None:
                say({"event": "declined", "number": number, "why": why_not})
                continue
            pid = _fork_trial(command, function, metric, (channel.fileno(), commands, *children))
            say({"event": "started", "number": number, "pid": pid})
            try:
                children[os.pidfd_open(pid)] = (pid, number)
            except OSError:  # no pidfd (Linux before 5.3): this trial alone, to its end
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                say({"event": "ended", "number": number, "returncode": code})
    return 0


def _fork_trial(
    command: Mapping[str, Any], function: Any, metric: str, close: tuple[int, ...]
) -> int:
    """Fork the trial of ``command``; its pid (the child never returns)."""
    parent = os.getpid()
    pid = fork_frozen()
    if pid == 0:
        _trial_child(command, function, metric, parent=parent, close=close)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also done by the child: whichever runs first
    return pid


def _trial_child(
    command: Mapping[str, Any], function: Any, metric: str, parent: int, close: tuple[int, ...]
) -> None:
    """The forked trial: never returns (``os._exit`` with the trial's exit status)."""
    code = 1
    try:
        os.setpgid(0, 0)
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent:  # the executor died before the line above
            os._exit(128 + int(signal.SIGKILL))
        for fd in close:
            os.close(fd)
        from tensorfleet.patterns.trial import (
            OUTPUT_FILE,
            TRIAL_DIR_VAR,
            TRIAL_PARAMS_VAR,
            TRIAL_SLOT_VAR,
            current_trial,
        )
        from tensorfleet.patterns.trial_main import record_error, run_entry

        directory = Path(command["directory"])
        out = os.open(directory / OUTPUT_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.environ[TRIAL_DIR_VAR] = str(directory)
        os.environ[TRIAL_PARAMS_VAR] = json.dumps(command["params"])
        os.environ[TRIAL_SLOT_VAR] = str(command["slot"])
        reseed_generators()
        trial = current_trial()
        try:
            code = run_entry(function, trial, metric)
        except BaseException as exc:  # run_entry records the entry's; this is ours
            code = record_error(trial, exc)
    except BaseException:  # before the trial could run: to its output, then fail
        code = failed_in_fork()
    finally:
        end_fork(code)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(
            "usage: python -m tensorfleet.patterns.warm_executor MODULE:FUNCTION METRIC",
            file=sys.stderr,
        )
        return 2
    return serve(*args)


if __name__ == "__main__":
    raise SystemExit(main())
