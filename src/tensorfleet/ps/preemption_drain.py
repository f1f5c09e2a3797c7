"""A ps task that is preempted (SIGTERM from outside) saves what it can before it exits.

A ps holds the only copy of the variables, the optimizer state and the global step between
checkpoints, but it writes no files: the chief writes every checkpoint from the shards'
documents (``save``). So a preempted ps cannot save itself; it asks the chief to.

Rule. From the notice on, every reply that carries the progress (push, pull, heartbeat,
restore) says ``checkpoint: true``, and the chief of each model, when it keeps checkpoints,
writes one at once (:class:`~tensorfleet.session.training_session.TrainingSession` reacts to
the flag). The task keeps serving until every model it holds is *drained*:

* its chief saved a checkpoint (a ``save`` was answered) after the notice; or
* its chief keeps no checkpoints (it said so when it created the variables), or no chief
  ever created variables here; or
* its chief is done, or left (preempted itself, its own checkpoint written);

or until ``preempt_grace_s`` has passed since the notice (a warning names the models not
saved). It then ends with the outcome ``preempted``, and the process exits with status 143
(128 + SIGTERM), which a launcher or cluster manager that restarts tasks treats as a kill by
a signal: it restarts the task, and the chief restores the restarted shard from that
checkpoint.

A chief lost by silence is waited for within the grace: it may come back (a SIGSTOP ends,
its warm spare takes over in about a second) and then saves. Measured reason: in the
10-minute storm of seed 7 a ps SIGTERMed 10 s into a 15 s SIGSTOP of the chief found it
lost 5 s later, exited without a checkpoint and lost 499 steps, though the chief was running
again by then, well within the 10 s grace.

The ps cannot tell who sent the SIGTERM: a cluster manager reclaiming the machine, the
launcher stopping the whole cluster after an error (it restarts nothing then), or a user's
``kill``. So its log lines say what it does and what status 143 means to whoever restarts
tasks, never that it "will be restarted".

Invariant. The request loop ends before it handles any request after the save that drained
the last model, so the checkpoint holds every update the shard applied: a preemption loses
no step that the chief's checkpoint could have kept.

Why ask the chief rather than write a file from the ps: checkpoints need no filesystem
shared by the machines, only the chief writes them, and the manifest is written last by
the one process that orders the writes (docs/architecture.md, "The life of one
checkpoint"). A ps writing its own emergency file would need a directory on every ps
machine, and a restore that merges files written by different processes at different steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from tensorfleet.errors import PREEMPTED_EXIT_STATUS

log = logging.getLogger("tensorfleet.ps")


class DrainableService(Protocol):
    """What the drain reads of one model's service."""

    checkpoint_wanted: bool
    """Set by the drain: every reply with the progress asks the chief for a checkpoint."""

    def chief_saved_since(self, when: float) -> bool | None:
        """True when a checkpoint was saved after ``when`` (monotonic seconds); None when no
        checkpoint will come (no chief keeps checkpoints here, or it is not running)."""


@dataclass
class PreemptionDrain:
    """The drain of one ps task after a preemption notice at ``noticed_at`` (see the rule)."""

    noticed_at: float
    grace_s: float
    task: str = "ps"

    def start(self, services: Mapping[str, DrainableService]) -> None:
        """Ask every model's chief for a checkpoint (the flag in every progress reply)."""
        for service in services.values():
            service.checkpoint_wanted = True
        log.warning(
            "%s: SIGTERM: asking the chief for a checkpoint, then exiting with status %d "
            "(within %g s), which a launcher or cluster manager that restarts tasks treats as "
            "a preemption (it restarts this task; when the cluster is being stopped, nothing "
            "restarts it)",
            self.task,
            PREEMPTED_EXIT_STATUS,
            self.grace_s,
        )

    def drained(self, services: Mapping[str, DrainableService]) -> bool:
        """Whether every model is drained, or the grace period is over."""
        waiting = [
            name
            for name, service in services.items()
            if service.chief_saved_since(self.noticed_at) is False
        ]
        if not waiting:
            return True
        if time.monotonic() - self.noticed_at >= self.grace_s:
            log.warning(
                "%s: no checkpoint from the chief of %s within %g s of the SIGTERM; exiting "
                "without it (a restart of this task loses the steps since the newest "
                "checkpoint)",
                self.task,
                ", ".join(repr(name) if name else "the default model" for name in waiting),
                self.grace_s,
            )
            return True
        return False
