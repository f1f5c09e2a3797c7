"""Where the next trial's configuration comes from: grid, random, or an Optuna study.

Each search hands out trials (a number and a configuration), hears their intermediate
values (an Optuna pruner may answer "stop it") and their end, and knows how to resume:

* grid and random: trial ``n``'s configuration is a pure function of the config (the n-th
  grid point; random draws seeded by ``(seed, n)``), so a resumed sweep reruns exactly the
  numbers that have no recorded result and nothing else;
* optuna: the study lives in the sweep directory (Optuna's journal, ``study.journal``, or
  the SQLite ``study.db`` of a sweep begun before it: :mod:`~tensorfleet.patterns.study_storage`
  says why; ``load_if_exists``); trials the killed sweep left RUNNING are marked FAIL
  (tagged ``interrupted``, not counted) and their configurations enqueued again, so each is
  rerun once and no finished trial runs twice. A resumed study's sampler is seeded with
  :func:`resumed_sampler_seed` (``seed`` mixed with the number of trials the study already
  holds): re-seeding it with ``seed`` itself would replay the first run's random draws and
  run the finished configurations again. A fresh study uses ``seed`` as given, so a fresh run
  is reproducible.

One sweep process writes the study (trials are processes that report through files), so
no multi-writer locking is needed: a second sweep on the same directory is refused by the
sweep's lock.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tensorfleet.patterns.search_space import SweepConfigError, grid, random_configuration
from tensorfleet.patterns.study_storage import close_study_storage, open_study_storage
from tensorfleet.patterns.sweep_config import PRUNER_CLASSES, SweepConfig

COMPLETE, PRUNED, FAILED = "complete", "pruned", "failed"
STATES = (COMPLETE, PRUNED, FAILED)
#: Samplers whose random draws depend on the seed alone: a resumed study re-seeds them (see
#: :func:`resumed_sampler_seed`). ``qmc`` is not among them: its position in the sequence is
#: kept in the study, so it continues where it stopped with the seed it was given.
RESEEDED_ON_RESUME = ("tpe", "random", "cmaes", "gp")


@dataclass
class PlannedTrial:
    """A trial to run: its number (its directory's name), configuration, and the search's
    own handle (an Optuna trial)."""

    number: int
    params: dict[str, Any]
    handle: Any = None


class Search(Protocol):
    """What the sweep asks of a search strategy."""

    prunes: bool
    """Whether :meth:`report` may answer "stop it" (the sweep then reads metrics often)."""

    def next_trial(self, running: int) -> PlannedTrial | None:
        """The next trial to start, or None when every trial has started (``running`` are
        under way)."""

    def report(self, trial: PlannedTrial, step: int, value: float) -> bool:
        """Hear an intermediate value; True when the trial should be stopped (pruned)."""

    def finish(self, trial: PlannedTrial, state: str, value: float | None) -> None:
        """Hear the end of a trial (state one of :data:`STATES`)."""

    def close(self) -> None:
        """Release what the search holds open (the study's database connections)."""


class IndexedSearch:
    """Grid, random or listed configurations: trial ``n`` is the n-th configuration of a fixed sequence;
    ``done`` numbers (recorded in the sweep directory) are not run again."""

    prunes = False

    def __init__(self, config: SweepConfig, done: Iterable[int]) -> None:
        if config.search == "list":
            self._configs = [dict(c) for c in config.configurations or []]
        elif config.search == "grid":
            self._configs = list(grid(config.parameters))
        else:
            self._configs = [
                random_configuration(config.parameters, config.seed, n)
                for n in range(config.total_trials)
            ]
        self._todo = [n for n in range(len(self._configs)) if n not in set(done)]

    def next_trial(self, running: int) -> PlannedTrial | None:
        if not self._todo:
            return None
        number = self._todo.pop(0)
        return PlannedTrial(number, dict(self._configs[number]))

    def report(self, trial: PlannedTrial, step: int, value: float) -> bool:
        return False

    def finish(self, trial: PlannedTrial, state: str, value: float | None) -> None:
        pass

    def close(self) -> None:
        pass


class OptunaSearch:
    """Optuna's samplers and pruners over the study kept in the sweep directory
    (:mod:`~tensorfleet.patterns.study_storage`)."""

    def __init__(self, config: SweepConfig, directory: Path) -> None:
        try:
            import optuna
        except ImportError:
            raise SweepConfigError(
                "search: optuna needs Optuna: pip install 'tensorfleet[sweep]'"
            ) from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self._config = config
        self.prunes = config.pruner != "none"
        storage, self.storage_note = open_study_storage(optuna, directory)
        self._storage = storage
        try:
            held = len(
                storage.get_all_trials(storage.get_study_id_from_name(config.name), deepcopy=False)
            )
        except KeyError:  # no study of this name yet: a fresh run
            held = 0
        self.sampler_seed = config.seed
        #: Said to the user when the sampler's seed is not the configured one (a resume).
        self.seed_note: str | None = None
        if held and config.sampler in RESEEDED_ON_RESUME:
            self.sampler_seed = resumed_sampler_seed(config.seed, held)
            self.seed_note = (
                f"the study already holds {held} trial(s): the {config.sampler} sampler is "
                f"seeded with {self.sampler_seed} (derived from seed {config.seed} and {held}), "
                "not with the seed itself, so that it does not repeat the first run's draws"
            )
        self._study = optuna.create_study(
            study_name=config.name,
            storage=storage,
            sampler=_sampler(optuna, config, self.sampler_seed),
            pruner=_pruner(optuna, config),
            direction=config.direction,
            load_if_exists=True,
        )
        self.interrupted = self._requeue_interrupted()
        #: Trials that ended and count towards ``trials``: read from the study once, then
        #: counted here as they end (this process is the study's only writer), which saves
        #: two storage queries (every trial, every attribute) per trial handed out.
        self._ended = self._counted()

    def _requeue_interrupted(self) -> list[int]:
        """Trials a killed sweep left RUNNING: marked FAIL (interrupted) and enqueued again."""
        states = self._optuna.trial.TrialState
        interrupted = []
        for frozen in self._study.get_trials(deepcopy=False, states=(states.RUNNING,)):
            self._study.set_user_attr(f"interrupted_{frozen.number}", True)
            self._study.tell(frozen.number, state=states.FAIL)
            self._study.enqueue_trial(dict(frozen.params), skip_if_exists=False)
            interrupted.append(frozen.number)
        return interrupted

    def _counted(self) -> int:
        """Trials that ended and count towards ``trials`` (not the interrupted ones)."""
        states = self._optuna.trial.TrialState
        attrs = self._study.user_attrs
        return sum(
            1
            for t in self._study.get_trials(
                deepcopy=False, states=(states.COMPLETE, states.PRUNED, states.FAIL)
            )
            if not attrs.get(f"interrupted_{t.number}")
        )

    def next_trial(self, running: int) -> PlannedTrial | None:
        if self._ended + running >= self._config.total_trials:
            return None
        trial = self._study.ask()
        params = {name: p.suggest(trial) for name, p in self._config.parameters.items()}
        return PlannedTrial(trial.number, params, trial)

    def report(self, trial: PlannedTrial, step: int, value: float) -> bool:
        if self._config.pruner == "none":
            # Nothing judges it: not stored in the study (it is in the trial's metrics.jsonl),
            # which saves two storage round trips per reported value.
            return False
        trial.handle.report(value, step)
        return bool(trial.handle.should_prune())

    def finish(self, trial: PlannedTrial, state: str, value: float | None) -> None:
        states = self._optuna.trial.TrialState
        self._ended += 1
        if state == COMPLETE and value is not None and math.isfinite(value):
            self._study.tell(trial.handle, value)
        elif state == PRUNED:
            self._study.tell(trial.handle, state=states.PRUNED)
        else:
            self._study.tell(trial.handle, state=states.FAIL)

    def close(self) -> None:
        close_study_storage(self._storage)


def resumed_sampler_seed(seed: int, trials_held: int) -> int:
    """The seed of a resumed study's sampler: a pure function of the configured ``seed`` and
    the number of trials the study already holds (so a resume is reproducible too), different
    from ``seed`` and from every earlier resume's (each run adds trials), so that the sampler's
    random draws never replay the ones that produced the trials already in the study."""
    digest = hashlib.sha256(f"tensorfleet-resume/{seed}/{trials_held}".encode()).digest()
    return int.from_bytes(digest[:4], "big")  # numpy's seeds are 32-bit


def _sampler(optuna: Any, config: SweepConfig, seed: int) -> Any:
    samplers = optuna.samplers
    if config.sampler == "tpe":
        # constant_liar: trials running in parallel are not all drawn at the same point.
        return samplers.TPESampler(seed=seed, constant_liar=config.slots > 1)
    if config.sampler == "random":
        return samplers.RandomSampler(seed=seed)
    if config.sampler == "cmaes":
        return samplers.CmaEsSampler(seed=seed)
    if config.sampler == "qmc":
        return samplers.QMCSampler(seed=seed)
    return samplers.GPSampler(seed=seed)


def _pruner(optuna: Any, config: SweepConfig) -> Any:
    if config.pruner == "none":
        return optuna.pruners.NopPruner()
    # the options were checked with the config (SweepConfig's check_pruner_options)
    return getattr(optuna.pruners, PRUNER_CLASSES[config.pruner])(**config.pruner_options)
