"""``Progress``: what a worker learns about training from each exchange, in every mode;
``Agreement``: what the workers agree on before each step.

Its own module so that every updater (and the :mod:`~tensorfleet.worker.updater` protocol)
can return it without importing the parameter-server client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Progress:
    """What the parameter servers (or the replicas) said about training after a pull or
    exchange."""

    global_step: int
    stop: bool
    """The chief has declared training over."""
    made_step: bool = True
    """This worker's push completed the global step (exactly one worker per step)."""
    dropped: bool = False
    """sync: this worker's gradients came too late for their step and were dropped (or the
    step was lost to a ps failure and the client recovered)."""
    recovered: bool = False
    """The exchange failed (a ps died, restarted or was cut off) and the client recovered."""
    checkpoint_requested: bool = False
    """A ps shard asks for a checkpoint now: it was preempted and exits once the chief has
    written one (:mod:`tensorfleet.ps.preemption_drain`)."""


class Agreement(NamedTuple):
    """What every worker agreed on at ``should_stop()`` (:meth:`Updater.agree`): in a
    collective mode each flag is set when any worker set it, so that all of them leave the
    loop, save, and leave after a preemption at the same step."""

    stop: bool
    """Some worker wants training to end (a hook, or the chief declared it over)."""
    checkpoint: bool
    """Some worker wants a checkpoint now (every worker takes part in it)."""
    preempted: bool = False
    """Some worker got a SIGTERM: after the checkpoint every worker leaves with status 143,
    since the group can only restart together (its process group forms again), from that
    checkpoint."""
