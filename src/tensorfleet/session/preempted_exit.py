"""How a training session ends after a SIGTERM (a preemption:
:mod:`~tensorfleet.session.preemption`): the chief's checkpoint, the shards told this worker
left, status 143.

A role split out of :mod:`tensorfleet.session.training_session` (these functions read and set
the session's own state, as its methods would). Three ways in:

* the step, or ``should_stop()`` in a collective mode, after the notice:
  :func:`leave_preempted`;
* an error that ends the session's ``with`` block after the notice (a DataLoader whose
  workers died of the same signal): :func:`ended_by_the_preemption` says so, and
  :func:`leave_after_the_error` takes part first in the collective checkpoint where the mode
  has one (the others agree on it at their ``should_stop()``, or at their own exit after the
  same error);
* :class:`~tensorfleet.errors.Preempted` raised below the session (its recovery or hello cut
  short by the signal: the parameter servers are unreachable): :func:`end_without_the_ps`
  says nothing more to them (a ``done`` would wait for their silence to be noticed, then
  recover again).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from tensorfleet import task_markers
from tensorfleet.errors import Preempted

if TYPE_CHECKING:
    from tensorfleet.session.training_session import TrainingSession

log = logging.getLogger("tensorfleet.session")


def leave_preempted(
    session: TrainingSession, saved_in: Path | None = None, by_another_worker: bool = False
) -> NoReturn:
    """The chief saves a checkpoint (in a collective mode every worker took part in it
    already: the chief's directory is ``saved_in``), the shards are told this worker left,
    and :class:`Preempted` ends the process with status 143 so that it is restarted.
    ``by_another_worker``: in a collective mode this worker got no SIGTERM (before the
    agreement) and leaves because another did: the group restarts together."""
    session._preemption.leaving()  # a loader's worker dying now is logged, not raised
    collective = session._updater.collective
    if not collective and session.is_chief and session.checkpoints is not None:
        if session._saved_step == session.global_step:  # e.g. the one a preempted ps asked
            saved_in = session.last_checkpoint  # for: that ps may have ended after it
        else:
            saved_in = session._save()
    saved = "" if saved_in is None else f"; checkpoint saved in {saved_in}"
    if not by_another_worker:
        log.warning(
            "%s: preempted (SIGTERM) at global step %d%s; exiting with status 143 (a preemption)",
            session.task_name,
            session.global_step,
            saved,
        )
    else:  # allreduce: another worker was preempted, and the group restarts together
        log.warning(
            "%s: another worker was preempted (SIGTERM): leaving with the group at global "
            "step %d%s; exiting with status 143 so that the group restarts from there",
            session.task_name,
            session.global_step,
            saved,
        )
    session._closed = True
    try:
        session._updater.leave()
    finally:
        session._release()
    if not collective:  # nothing sent from here on: a launcher restarts it now
        task_markers.mark_left(session.task_name)
    raise Preempted(f"{session.task_name}: preempted at global step {session.global_step}")


def ended_by_the_preemption(session: TrainingSession, error: Exception) -> bool:
    """Whether ``error`` ends the session's ``with`` block after a SIGTERM it took: then it
    is the preemption's doing (a DataLoader whose workers died of the same signal), and the
    session leaves as preempted instead of failing (a failed chief would declare training
    over)."""
    if not session._preemption.received.is_set() or session._closed:
        return False
    log.warning(
        "%s: the training loop ended with %r after a SIGTERM (a preemption: child processes "
        "such as a DataLoader's workers die of the same signal); handled as the preemption",
        session.task_name,
        error,
    )
    return True


def leave_after_the_error(session: TrainingSession) -> NoReturn:
    """:func:`leave_preempted`, after the collective checkpoint where the mode has one."""
    saved_in = None
    if session._updater.collective:
        session._updater.agree(True, True, preempted=True)  # the others leave with it
        saved_in = session._save()
    leave_preempted(session, saved_in)


def end_without_the_ps(session: TrainingSession) -> None:
    """The session ends, its connections released, without a word to the shards."""
    session._closed = True
    session._release()
