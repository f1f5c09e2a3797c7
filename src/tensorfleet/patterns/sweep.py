"""Hyperparameter sweeps: many trials, as many at once as there are slots.

:func:`run_sweep` (and ``tensorfleet sweep CONFIG``) runs each trial in its own process
group: a Python entry point in a process forked from its slot's preloaded executor (which
imported torch, tensorfleet and the entry's module once: :mod:`tensorfleet.patterns.warm_executor`
says why and how), or a command in a fresh process; with ``workers_per_trial > 1`` the trial
is a whole local cluster started by ``tensorfleet launch`` (a slot is then that group of
workers). Trials report metrics through files in their
directory (:mod:`tensorfleet.patterns.trial`), which the sweep reads as they come: they drive
the live progress, the Optuna pruner and the results.

Between trials the sweep waits for news, not on a clock: a trial's end wakes it (the
executor's channel, or a fresh process's pidfd), and it looks at its trials on its own only
every :data:`POLL_S` while a pruner may stop a trial on its new values, else every
:data:`PROGRESS_S` (for the progress) or at a trial's deadline. It starts the executors first
and opens the study while they import torch. Measured on the 2-core machine at load 3.5:
between one trial's end and the next one's start about 58 ms of a 1-slot sweep (Optuna's ask
on the SQLite study about 21 ms, its tell 10 ms, the fork and the trial's own set-up 12 ms,
the trial's exit seen 14 ms), where a hand-written loop with an in-memory study spends about
2 ms of CPU per trial outside its trials; the study is now a journal file
(:mod:`~tensorfleet.patterns.study_storage`: 4-7 ms of Optuna per trial instead of 47-51).

The sweep directory holds everything, so that a killed sweep resumes where it stopped::

    DIR/sweep.json            the configuration (a resume with another one is refused)
    DIR/lock                  exists while a sweep runs here (a second one is refused)
    DIR/study.journal         the Optuna study (search: optuna; study.db for a sweep begun
                              before the journal)
    DIR/trials/0003/          params.json, metrics.jsonl, output.log, result.json, error.json
    DIR/interrupted/0003-1/   what a trial interrupted by a killed sweep had left
    DIR/results.csv, results.json, metric_vs_params.png

``DIR/lock`` is removed when the sweep ends; a sweep killed with SIGKILL leaves it, which is
harmless: the lock is the ``flock`` on it, which dies with the process, not the file.

A trial's ``result.json`` is written (atomically) when it ends; a trial without one was
interrupted and is run again; a trial with one is never run again. A trial that raises, exits
non-zero or is killed is recorded as failed with its error, and the sweep goes on; it is
pruned when the sweep stopped it as pruned, or when an entry-point trial raised
``TrialPruned`` (:data:`~tensorfleet.patterns.trial_main.PRUNED_EXIT`; a command exiting with
that status on its own is failed). Trial processes die with the sweep (``PR_SET_PDEATHSIG``),
so a killed sweep leaves nothing running. An entry point is looked up once before the first
trial (by the executor, or :func:`~tensorfleet.patterns.trial_main.check_entry` when the
trials run in fresh processes); a missing one is refused, and what the sweep had created in
the meantime (its directory, or the files it added to one) is removed.

Why processes and the launcher, not threads: a trial is a training run that may crash, hang,
leak or need its own cluster; a process group is the unit that can be stopped for sure.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorfleet.errors import TensorfleetError
from tensorfleet.patterns.output_tail import output_tail
from tensorfleet.patterns.search import (
    COMPLETE,
    FAILED,
    PRUNED,
    IndexedSearch,
    OptunaSearch,
    PlannedTrial,
    Search,
)
from tensorfleet.patterns.search_space import SweepConfigError, grid_summary
from tensorfleet.patterns.study_storage import STUDY_FILES
from tensorfleet.patterns.sweep_config import SweepConfig
from tensorfleet.patterns.sweep_report import (
    PlainProgress,
    TrialRecord,
    choose_progress,
    plot_results,
    prepare_plot,
    why_no_plot,
    write_results,
)
from tensorfleet.patterns.trial import (
    ERROR_FILE,
    METRICS_FILE,
    OUTPUT_FILE,
    PARAMS_FILE,
    STOP_FILE,
    TRIAL_DIR_VAR,
    MetricsReader,
)
from tensorfleet.patterns.trial_main import (
    PRUNED_EXIT,
)
from tensorfleet.patterns.trial_processes import TrialProcesses
from tensorfleet.patterns.warm_executor import (
    TrialProcess,
)

RESULT_FILE = "result.json"
#: How often the sweep looks at its trials when something must be seen soon: new metric
#: lines while a pruner may stop a trial on them, or the exit of a trial that has no channel
#: to wake the sweep (see :meth:`Sweep._next_look`).
POLL_S = 0.05
#: Otherwise the sweep sleeps until a trial ends (its executor's channel, or its process's
#: pidfd, wakes it) or a deadline, and reads the new metric lines for the progress at least
#: this often.
PROGRESS_S = 0.5
#: After SIGTERM (pruned, timed out, sweep interrupted), SIGKILL follows after this long.
KILL_AFTER_S = 5.0


class SweepBusy(TensorfleetError, RuntimeError):
    """Another sweep is running in the same directory."""


@dataclass
class _Running:
    """A trial under way."""

    planned: PlannedTrial
    record: TrialRecord
    process: TrialProcess
    reader: MetricsReader
    directory: Path
    stopping: str | None = None
    """Why the sweep is stopping it (pruned, timed out), or None."""
    stop_sent_at: float = 0.0
    killed: bool = False


@dataclass
class SweepResult:
    """What a finished sweep produced."""

    directory: Path
    records: list[TrialRecord]
    best: dict[str, Any] | None
    results_csv: Path
    results_json: Path
    plot: Path | None
    started_now: list[int] = field(default_factory=list)
    """Trials this run started (a resumed sweep starts only the unfinished ones)."""

    def by_number(self) -> dict[int, TrialRecord]:
        return {r.number: r for r in self.records}


def run_sweep(
    config: SweepConfig,
    directory: str | os.PathLike[str],
    progress: PlainProgress | None = None,
    live: bool | None = None,
) -> SweepResult:
    """Run (or resume) the sweep of ``config`` in ``directory``; return its results.

    ``progress``: where progress goes (default: a live table on a terminal, plain lines
    otherwise; ``live=False`` forces plain lines).
    """
    return Sweep(config, Path(directory), progress or choose_progress(config.metric, live)).run()


class Sweep:
    """One sweep in one directory; :meth:`run` runs it to the end."""

    def __init__(self, config: SweepConfig, directory: Path, progress: PlainProgress) -> None:
        self.config = config
        self.directory = directory
        self.progress = progress
        self._records: dict[int, TrialRecord] = {}
        self._running: dict[int, _Running] = {}  # by slot
        self._started_now: list[int] = []
        self._processes = TrialProcesses(config, progress)

    # --- the directory -----------------------------------------------------------------

    def _prepare(self) -> list[Path]:
        """Check or write ``sweep.json``; the paths this run creates in a directory that held
        no sweep (removed again when the entry is refused)."""
        created = []
        if not (self.directory / "sweep.json").exists():
            created = [
                self.directory / name
                for name in (*STUDY_FILES, "sweep.json", "trials")
                if not (self.directory / name).exists()
            ]
        (self.directory / "trials").mkdir(parents=True, exist_ok=True)
        stored = self.directory / "sweep.json"
        described = self.config.describe()
        if stored.exists():
            previous = json.loads(stored.read_text())
            now = json.loads(json.dumps(described))  # as it would read back from the file
            if previous != now:
                changed = sorted(
                    k for k in set(previous) | set(now) if previous.get(k) != now.get(k)
                )
                was = ", ".join(
                    f"{k}: {previous.get(k)!r} there, {now.get(k)!r} now" for k in changed
                )
                raise SweepConfigError(
                    f"{self.directory} holds a sweep with another configuration (differs in "
                    f"{changed}: {was}); resume it with the same config, or use a new directory"
                )
        else:
            _write_atomic(stored, json.dumps(described, indent=2))
        return created

    def _undo_start(self, existed: bool, created: list[Path]) -> None:
        """Remove what this run created before its entry was refused, so that the corrected
        configuration starts afresh (a ``sweep.json`` left behind would refuse it as another
        configuration): the whole directory when there was none, else the files it added."""
        if not existed:
            shutil.rmtree(self.directory, ignore_errors=True)
            return
        for path in created:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _finished_trials(self) -> dict[int, TrialRecord]:
        """Trials with a recorded result; move what interrupted ones left aside."""
        done = {}
        for trial_dir in sorted((self.directory / "trials").iterdir()):
            if not trial_dir.name.isdigit():
                continue
            result = trial_dir / RESULT_FILE
            if result.exists():
                data = json.loads(result.read_text())
                done[int(trial_dir.name)] = TrialRecord(
                    **{
                        k: data[k]
                        for k in (
                            "number",
                            "params",
                            "state",
                            "value",
                            "step",
                            "seconds",
                            "error",
                            "slot",
                        )
                    }
                )
            else:
                aside = self.directory / "interrupted"
                aside.mkdir(exist_ok=True)
                k = 1
                while (aside / f"{trial_dir.name}-{k}").exists():
                    k += 1
                trial_dir.rename(aside / f"{trial_dir.name}-{k}")
        return done

    # --- running ------------------------------------------------------------------------

    def run(self) -> SweepResult:
        existed = self.directory.exists()
        lock = self._lock()
        try:
            # The executors import torch and the entry's module (seconds) while this process
            # prepares the directory and opens the study (Optuna's SQLite schema: about 1 s),
            # rather than one after the other.
            self._processes.start_executors()
            created = self._prepare()
            self._records = self._finished_trials()
            search = self._search()
            if self._processes.still_importing():
                # The first trial waits for the executor's import of torch (seconds, on one
                # core): import the plotting library now, on a core that is free, rather
                # than while the last trials run on every core (measured with the command:
                # benchmarks/patterns.py --only commands, docs/patterns.md).
                prepare_plot()
            try:
                notes = self._processes.check_entry()
            except SweepConfigError:  # a missing entry: refused, and nothing left behind
                search.close()
                self._undo_start(existed, created)
                raise
            with self.progress:
                for note in notes:
                    self.progress.message(note)
                if self.config.search == "grid":
                    self.progress.message(grid_summary(self.config.parameters))
                resumed = len(self._records)
                if resumed:
                    self.progress.message(
                        f"resuming in {self.directory}: {resumed} trial(s) already finished"
                    )
                self._loop(search)
            search.close()
            return self._results()
        finally:
            self._stop_all("the sweep ended")
            self._processes.close()
            (self.directory / "lock").unlink(missing_ok=True)  # still ours: we hold the flock
            lock.close()

    def _lock(self) -> Any:
        """Take ``DIR/lock`` (an exclusive ``flock``), or raise :class:`SweepBusy`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "lock"
        while True:
            lock = open(path, "w")  # noqa: SIM115 (held for the whole run)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                raise SweepBusy(self._busy_reason(path)) from None
            try:
                if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                    return lock
            except FileNotFoundError:
                pass
            lock.close()  # the sweep before us removed the file as we opened it: again

    def _busy_reason(self, path: Path) -> str:
        """Why the lock is taken: another sweep, or (a trial of this very sweep starting it
        again) the entry's module calling the sweep when the trial imports it."""
        trial = os.environ.get(TRIAL_DIR_VAR)
        if trial and Path(trial).resolve().is_relative_to(self.directory.resolve()):
            return (
                f"this process is a trial of the sweep in {self.directory} ({TRIAL_DIR_VAR}="
                f"{trial}) and started that sweep again: the trial imported the entry's module, "
                "whose top level calls run_sweep / run_ensemble / run_cross_validation; fix: put "
                'that call under `if __name__ == "__main__":` (or the entry function in a '
                "module of its own)"
            )
        return (
            f"another sweep is running in {self.directory} (it holds {path}); wait for it, or "
            "use another directory"
        )

    def _search(self) -> Search:
        if self.config.search == "optuna":
            search = OptunaSearch(self.config, self.directory)
            if search.interrupted:
                self.progress.message(
                    f"trials {search.interrupted} were interrupted; running their configurations again"
                )
            if search.storage_note:
                self.progress.message(search.storage_note)
            if search.seed_note:
                self.progress.message(search.seed_note)
            return search
        return IndexedSearch(self.config, self._records)

    def _loop(self, search: Search) -> None:
        exhausted = plot_ready = False
        while True:
            for slot in range(self.config.slots):
                if exhausted or slot in self._running:
                    continue
                planned = search.next_trial(running=len(self._running))
                if planned is None:
                    exhausted = True
                    break
                self._running[slot] = self._start(planned, slot)
            if exhausted and not self._running:
                return
            ended = False
            for slot, trial in list(self._running.items()):
                if self._poll(trial, search):
                    del self._running[slot]
                    ended = True
            last_started = len(self._records) >= self.config.total_trials
            if (exhausted or last_started) and not plot_ready:
                # The last trials run in their own processes: import the plotting library
                # meanwhile rather than after them.
                prepare_plot()
                plot_ready = True
            if not ended:  # a slot just freed starts its next trial at once
                self._processes.wait(
                    self._next_look(search), [t.process for t in self._running.values()]
                )

    def _next_look(self, search: Search) -> float:
        """How long the loop may wait for news (a trial's end, an executor's event) before it
        must look at its trials anyway: :data:`POLL_S` while a trial's new values may prune it
        or a trial has no channel that wakes the sweep when it ends, else until the next
        deadline (a trial's timeout, the SIGKILL after a SIGTERM) or :data:`PROGRESS_S`."""
        if search.prunes or any(t.process.fileno() is None for t in self._running.values()):
            return POLL_S
        now, wait = time.monotonic(), PROGRESS_S
        timeout = self.config.trial_timeout_s
        for trial in self._running.values():
            if trial.stopping and not trial.killed:
                wait = min(wait, trial.stop_sent_at + KILL_AFTER_S - now)
            elif trial.stopping is None and timeout:
                wait = min(wait, trial.record.started + timeout - now)
        return max(wait, 0.0)

    def _start(self, planned: PlannedTrial, slot: int) -> _Running:
        trial_dir = self.directory / "trials" / f"{planned.number:04d}"
        trial_dir.mkdir(parents=True, exist_ok=True)
        for stale in (METRICS_FILE, STOP_FILE, ERROR_FILE, RESULT_FILE, OUTPUT_FILE):
            (trial_dir / stale).unlink(missing_ok=True)
        _write_atomic(
            trial_dir / PARAMS_FILE,
            json.dumps({"number": planned.number, "params": planned.params}),
            durable=False,  # lost in a crash of the machine, the trial reruns and rewrites it
        )
        process = self._processes.start(planned, slot, trial_dir)
        record = TrialRecord(planned.number, planned.params, slot=slot)
        self._records[planned.number] = record
        self._started_now.append(planned.number)
        self.progress.started(record)
        return _Running(
            planned, record, process, MetricsReader(trial_dir / METRICS_FILE), trial_dir
        )

    def _poll(self, trial: _Running, search: Search) -> bool:
        """Read the trial's new metrics, stop it if pruned or late; True once it ended."""
        record = trial.record
        for point in trial.reader.read_new():
            value = point.metrics.get(self.config.metric)
            if value is None:
                continue
            record.value = value
            if point.step is not None:
                record.step = point.step
                if trial.stopping is None and search.report(trial.planned, point.step, value):
                    self._stop(trial, "pruned")
            self.progress.updated(record)
        timeout = self.config.trial_timeout_s
        if trial.stopping is None and timeout and time.monotonic() - record.started > timeout:
            self._stop(trial, f"timed out after {timeout:g} s")
        if (
            trial.stopping
            and not trial.killed
            and time.monotonic() - trial.stop_sent_at > KILL_AFTER_S
        ):
            trial.process.signal(signal.SIGKILL)
            trial.killed = True
        returncode = trial.process.poll()
        if returncode is None:
            return False
        declined = trial.process.declined()
        if declined is not None:  # the executor cannot fork safely: fresh processes from now
            self.progress.message(f"trials run in fresh processes from now: {declined}")
            slot = record.slot or 0
            self._processes.go_fresh(slot)  # the other slots' executors finish their trials first
            trial.process = self._processes.start(trial.planned, slot, trial.directory)
            return False
        trial.process.close()
        for point in trial.reader.read_new():  # lines written just before the end
            if self.config.metric in point.metrics:
                record.value = point.metrics[self.config.metric]
                record.step = point.step if point.step is not None else record.step
        trial.process.signal(signal.SIGKILL)  # anything the trial left in its group
        record.seconds = time.monotonic() - record.started
        record.state, record.error = self._outcome(trial, returncode)
        if trial.reader.malformed:
            note = f"{trial.reader.malformed} malformed line(s) in {METRICS_FILE} ignored"
            record.error = f"{record.error}; {note}" if record.error else note
        search.finish(trial.planned, record.state, record.value)
        _write_atomic(trial.directory / RESULT_FILE, json.dumps(record.as_dict()))
        self.progress.finished(record)
        return True

    def _outcome(self, trial: _Running, returncode: int) -> tuple[str, str | None]:
        if trial.stopping == "pruned":
            return PRUNED, None
        if trial.stopping:
            return FAILED, trial.stopping
        lost = trial.process.lost()
        if lost:
            return FAILED, lost
        if returncode == PRUNED_EXIT and self.config.entry is not None:
            # trial_main exits with it only when the entry point raised TrialPruned; from a
            # command, status 3 is the program's own failure like any other.
            return PRUNED, None
        if returncode == 0:
            if trial.record.value is None:
                return FAILED, (
                    f"exited 0 without reporting {self.config.metric!r} (report it with "
                    "current_trial().report(...) or return it from the entry point)"
                )
            return COMPLETE, None
        error_file = trial.directory / ERROR_FILE
        if error_file.exists():
            try:
                error = json.loads(error_file.read_text())
                return FAILED, f"{error['type']}: {error['message']}"
            except (ValueError, KeyError, TypeError):
                pass
        if returncode < 0:
            return FAILED, f"killed by {signal.Signals(-returncode).name}"
        tail = _tail(trial.directory / OUTPUT_FILE)
        return FAILED, f"exited with status {returncode}" + (f": {tail}" if tail else "")

    def _stop(self, trial: _Running, why: str) -> None:
        trial.stopping = why
        trial.stop_sent_at = time.monotonic()
        (trial.directory / STOP_FILE).touch()
        trial.process.signal(signal.SIGTERM)

    def _stop_all(self, why: str) -> None:
        """Stop every trial still running (an exception or Ctrl-C in the sweep)."""
        for trial in self._running.values():
            trial.process.signal(signal.SIGTERM)
        for trial in self._running.values():
            if not _ended_by(trial.process, time.monotonic() + KILL_AFTER_S):
                trial.process.signal(signal.SIGKILL)
                _ended_by(trial.process, time.monotonic() + KILL_AFTER_S)
            trial.process.signal(signal.SIGKILL)
            trial.process.close()
        self._running.clear()

    def _results(self) -> SweepResult:
        records = sorted(self._records.values(), key=lambda r: r.number)
        document = write_results(self.directory, records, self.config.metric, self.config.direction)
        plot = plot_results(
            self.directory / "metric_vs_params.png",
            records,
            self.config.metric,
            self.config.direction,
        )
        counts = document["counts"]
        best = document["best"]
        self.progress.message(
            f"{counts['complete']} complete, {counts['pruned']} pruned, {counts['failed']} failed; "
            + (
                f"best {self.config.metric}={best['value']:.6g} (trial {best['trial']}) {best['params']}"
                if best
                else "no trial completed"
            )
        )
        self.progress.message(
            f"results: {self.directory / 'results.csv'}, {self.directory / 'results.json'}"
            + (
                f", plot: {plot}"
                if plot
                else f" (no plot: {why_no_plot(records, self.config.metric)})"
            )
        )
        return SweepResult(
            self.directory,
            records,
            best,
            self.directory / "results.csv",
            self.directory / "results.json",
            plot,
            list(self._started_now),
        )


def _ended_by(process: TrialProcess, deadline: float) -> bool:
    """Wait (polling) until ``process`` ended or ``deadline``; whether it ended."""
    while process.poll() is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _tail(path: Path) -> str:
    try:
        return output_tail(path.read_text(errors="replace"))
    except OSError:
        return ""


def _write_atomic(path: Path, text: str, durable: bool = True) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it); ``durable``:
    synced to the disk first, so that it survives a crash of the machine, not only of the
    sweep (a few ms, tens under load)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
