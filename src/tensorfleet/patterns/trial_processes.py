"""How a sweep's trials become processes: a Python entry point in a child forked from the
preloaded executor (one for every slot) (:mod:`tensorfleet.patterns.warm_executor` says why), or a fresh
process (a command, a trial with its own cluster through ``tensorfleet launch``, or entry
trials when the executors cannot be used), with the environment every trial gets.

A role of its own beside :class:`~tensorfleet.patterns.sweep.Sweep`, which decides which
trial runs when and records what they did; this module owns the executors, the check of the
entry before anything starts, and the fall back to fresh processes (said once, in the
sweep's progress).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from tensorfleet.patterns.preloaded_interpreter import current_preloaded, fork_executor_process
from tensorfleet.patterns.search import PlannedTrial
from tensorfleet.patterns.search_space import SweepConfigError
from tensorfleet.patterns.sweep_config import SweepConfig
from tensorfleet.patterns.sweep_report import PlainProgress
from tensorfleet.patterns.trial import (
    OUTPUT_FILE,
    TRIAL_DIR_VAR,
    TRIAL_PARAMS_VAR,
    TRIAL_SLOT_VAR,
)
from tensorfleet.patterns.trial_main import (
    ENTRY_CHECK_TIMEOUT_S,
    check_entry,
    entry_check_verdict,
    finish_entry_check,
    start_entry_check,
)
from tensorfleet.patterns.warm_executor import (
    TrialProcess,
    WarmExecutor,
    shared_executor_possible,
    signal_group,
)
from tensorfleet.process_forks import die_with_parent


class ProcessTrial:
    """A trial in a fresh process (a command, a launched cluster, or ``executor: fresh``)."""

    def __init__(self, process: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        self.process = process
        self._log = log
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # Linux 5.3 and later
            self._pidfd = os.pidfd_open(process.pid)

    def poll(self) -> int | None:
        return self.process.poll()

    def fileno(self) -> int | None:
        return self._pidfd

    def signal(self, sig: int) -> None:
        signal_group(self.process.pid, sig)

    def lost(self) -> str | None:
        return None

    def declined(self) -> str | None:
        return None

    def close(self) -> None:
        self._log.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def start_process_trial(
    argv: list[str], env: Mapping[str, str], output: Path, sig: int
) -> ProcessTrial:
    """Start ``argv`` as a trial in a new session, its output in ``output``; it gets ``sig``
    when the sweep dies. Raises OSError when the program cannot be started."""
    log = open(output, "wb")  # noqa: SIM115 (closed when the trial ends)
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            preexec_fn=die_with_parent(sig),
        )
    except OSError:
        log.close()
        raise
    return ProcessTrial(process, log)


class TrialProcesses:
    """The processes of one sweep's trials: the slots' executors while they can be used."""

    def __init__(self, config: SweepConfig, progress: PlainProgress) -> None:
        self.config = config
        self.progress = progress
        #: One executor serves every slot where the kernel has pidfds (Linux 5.3 and later:
        #: it then waits for several trials at once), else one per slot; by slot.
        self._shared = shared_executor_possible()
        self._executors: dict[int, WarmExecutor] = {}
        self._check: subprocess.Popen[str] | None = None  # the entry's check, under way
        #: How many of this sweep's executors were forked from the preloaded interpreter.
        self.executors_forked_from_preloaded = 0
        self._preloaded_note_said = False
        self._warm = (
            config.entry is not None and config.workers_per_trial == 1 and config.executor == "warm"
        )

    def start(self, planned: PlannedTrial, slot: int, trial_dir: Path) -> TrialProcess:
        """Start ``planned`` in ``slot``: forked from the slot's executor where one is used
        and can take it, else in a fresh process."""
        process = self._start_warm(planned, slot, trial_dir) if self._warm else None
        return process if process is not None else self._start_fresh(planned, slot, trial_dir)

    def go_fresh(self, slot: int) -> None:
        """From now on every trial runs in a fresh process (``slot``'s executor declined to
        fork); the other slots' executors finish the trials they run."""
        self._warm = False
        if not self._shared:  # a shared executor still runs the other slots' trials
            executor = self._executors.pop(slot, None)
            if executor is not None:
                executor.close()

    def start_executors(self) -> None:
        """Start the slots' executors (or, for trials in fresh processes, the entry's check
        process) and return at once: they import torch and the entry's module while the
        sweep prepares its directory and study; :meth:`check_entry` then waits for them."""
        if self.config.entry is None:
            return
        if not self._warm:
            self._check = start_entry_check(self.config.entry, self.env())
            return
        if self._shared:
            shared = self._new_executor()
            self._executors = dict.fromkeys(range(self.config.slots), shared)
        else:
            self._executors = {slot: self._new_executor() for slot in range(self.config.slots)}

    def check_entry(self) -> list[str]:
        """Wait for the entry's check (slot 0's executor's verdict, or the check process
        :meth:`start_executors` started); raise :class:`SweepConfigError` when its module or
        function is missing. Returns notes for the progress."""
        if self.config.entry is None:
            return []
        if self._check is not None:
            check, self._check = self._check, None
            note = finish_entry_check(check, self.config.entry, self.config.pythonpath)
            return [note] if note else []
        if not self._warm:
            note = check_entry(self.config.entry, self.env(), self.config.pythonpath)
            return [note] if note else []
        if not self._executors:
            self.start_executors()
        first = self._executors[0]
        ready = first.wait_ready(time.monotonic() + ENTRY_CHECK_TIMEOUT_S)
        if ready is None:
            if first.dead:
                death = first.describe_death()
                self.close()
                self._warm = False
                note = check_entry(self.config.entry, self.env(), self.config.pythonpath)
                return [f"{death}; the trials run in fresh processes", *([note] if note else [])]
            return [
                f"entry {self.config.entry!r} not checked: importing it took more than "
                f"{ENTRY_CHECK_TIMEOUT_S:g} s; the trials start anyway and show any error"
            ]
        note = entry_check_verdict(self.config.entry, ready.get("problem"), self.config.pythonpath)
        notes = [note] if note else []
        if not ready.get("forkable"):
            notes.append(f"trials run in fresh processes: {ready.get('why')}")
            self.close()
            self._warm = False
        return notes

    def still_importing(self) -> bool:
        """Whether the first trial must still wait for an import: slot 0's executor (or the
        entry's check process) has not yet said it is ready. Never blocks."""
        if self._check is not None:
            return self._check.poll() is None
        first = self._executors.get(0)
        if first is None:
            return False
        first.pump()
        return first.ready is None and not first.dead

    def _new_executor(self) -> WarmExecutor:
        """A new executor: forked from the program's preloaded interpreter when one runs and
        can serve this sweep (:func:`~tensorfleet.patterns.preloaded_interpreter.preload`),
        else a fresh interpreter; why not, said once, when one runs and cannot."""
        assert self.config.entry is not None
        entry, metric, env = self.config.entry, self.config.metric, self.env()
        preloaded = current_preloaded()
        if preloaded is None:
            return WarmExecutor(entry, metric, env)
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 (the executor closes it)
        process, note = fork_executor_process(preloaded, entry, metric, env, stderr)
        if process is None:
            stderr.close()
            if note is not None and not self._preloaded_note_said:
                self.progress.message(note)
                self._preloaded_note_said = True
            return WarmExecutor(entry, metric, env)
        if not self.executors_forked_from_preloaded:
            self.progress.message(
                f"executor forked from the preloaded interpreter (pid {process.pid})"
            )
        self.executors_forked_from_preloaded += 1
        return WarmExecutor(entry, metric, env, started=(process, stderr))

    def _slots_of(self, slot: int) -> list[int]:
        """The slots served by ``slot``'s executor (every slot when it is shared)."""
        return list(range(self.config.slots)) if self._shared else [slot]

    def close(self) -> None:
        """Stop every slot's executor (their running trials end with them) and an entry
        check still running."""
        for executor in {id(e): e for e in self._executors.values()}.values():
            executor.close()
        self._executors.clear()
        if self._check is not None:
            check, self._check = self._check, None
            check.kill()
            check.communicate()

    def wait(self, seconds: float, running: list[TrialProcess]) -> None:
        """Sleep ``seconds``, or less when there is news: an executor said something (a
        trial started or ended; it died) or a trial in a fresh process ended (its pidfd)."""
        executors = {id(e): e for e in self._executors.values()}.values()
        channels = {e.fileno() for e in executors if not e.dead}
        channels.update(fd for p in running if (fd := p.fileno()) is not None)
        if channels:
            select.select(sorted(channels), [], [], seconds)
            for executor in executors:
                executor.pump()  # an idle one that died is marked so (else select spins)
        else:
            time.sleep(seconds)

    def _start_warm(self, planned: PlannedTrial, slot: int, trial_dir: Path) -> TrialProcess | None:
        """Hand the trial to the slot's executor (a new one when it died)."""
        for _ in range(2):
            executor = self._executors.get(slot)
            if executor is None or executor.dead:
                if executor is not None:
                    self.progress.message(
                        f"slot {slot}: {executor.describe_death()}; starting a new executor"
                    )
                    executor.close()
                executor = self._new_executor()
                for served in self._slots_of(slot):
                    self._executors[served] = executor
            process = executor.run(planned.number, trial_dir, planned.params, slot)
            if process is not None:
                return process
        return None

    def _start_fresh(self, planned: PlannedTrial, slot: int, trial_dir: Path) -> TrialProcess:
        env = self.env()
        env[TRIAL_DIR_VAR] = str(trial_dir.resolve())
        env[TRIAL_PARAMS_VAR] = json.dumps(planned.params)
        env[TRIAL_SLOT_VAR] = str(slot)
        argv = self._argv(planned.params)
        # The launcher gets SIGTERM (it stops its tasks); a plain trial SIGKILL.
        launcher = self.config.workers_per_trial > 1
        try:
            return start_process_trial(
                argv,
                env,
                trial_dir / OUTPUT_FILE,
                signal.SIGTERM if launcher else signal.SIGKILL,
            )
        except OSError as exc:
            raise SweepConfigError(f"cannot start the trial program {argv[0]!r}: {exc}") from exc

    def env(self) -> dict[str, str]:
        """The environment every trial gets (and the entry check): the sweep's, the config's
        ``env``, its ``pythonpath`` in front of ``PYTHONPATH``."""
        env = dict(os.environ)
        env.update(self.config.env)
        env["PYTHONUNBUFFERED"] = "1"
        path = [*self.config.pythonpath, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        if path:
            env["PYTHONPATH"] = os.pathsep.join(path)
        return env

    def _argv(self, params: dict[str, Any]) -> list[str]:
        if self.config.command is not None:
            values = {k: str(v) for k, v in params.items()}
            values["python"] = sys.executable
            program = [arg.format(**values) for arg in self.config.command]
        else:
            assert self.config.entry is not None
            program = [
                sys.executable,
                "-m",
                "tensorfleet.patterns.trial_main",
                self.config.entry,
                self.config.metric,
            ]
        if self.config.workers_per_trial > 1:
            return [
                sys.executable,
                "-m",
                "tensorfleet",
                "launch",
                "--ps",
                str(self.config.ps_per_trial),
                "--workers",
                str(self.config.workers_per_trial),
                "--no-live",
                "--",
                *program,
            ]
        return program
