"""How a :class:`~tensorfleet.worker.client.ParameterClient` recovers when a ps fails,
restarts or is cut off in the middle of an operation: say hello again with back-off until
every shard answers, have restarted shards restored (the chief, from the newest checkpoint or
its own values) or wait until they are (the others), then try the operation again.

The hello of a recovery is the question whether the ps is back, so it is not given up while
the heartbeat still reports the ps silent: ZeroMQ delivers it the moment the restarted ps
listens, and the recovery goes on at once (before, it was given up at once while the
heartbeat's own reconnection lagged, and tried again with a back-off growing to 5 s: most of
a ps restart's 19-40 s in a fault storm). A shard that answers it counts as heard by the
heartbeat, so the first request after the recovery is not given up for the heartbeat's
stale view either.

A role of its own, mixed into the client: the client's operations wrap themselves in
:meth:`ClientRecovery._recovering`; the decisions are made on the error's type
(:data:`RECOVERABLE`), never on its text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tensorfleet.errors import (
    DeadlineExceeded,
    NotInitialized,
    Preempted,
    RemoteError,
    ServiceRestarted,
)
from tensorfleet.preemption_event import wait_unless_preempted
from tensorfleet.worker.timeouts import ClientTimeouts

log = logging.getLogger("tensorfleet.worker")

T = TypeVar("T")

#: Failures after which the client recovers and tries again: the ps restarted, fell silent,
#: did not answer in time, or answered from a new process that has no variables yet.
RECOVERABLE = (ServiceRestarted, DeadlineExceeded, NotInitialized)

#: The longest a recovery's hello waits for its answer before it is sent again. The hello is
#: not given up while the heartbeat reports the ps silent (a ps that died *is* silent, and the
#: hello is the question whether it is back): ZeroMQ keeps it until the restarted ps listens
#: and delivers it then, so the answer comes the moment the new process can give it.
HELLO_WAIT_S = 10.0
#: The pause after a hello that failed sooner (its connection dropped: the old process was
#: still exiting; a refusal), doubling with each failure in a row up to :data:`MAX_RETRY_S`.
FIRST_RETRY_S = 0.25
MAX_RETRY_S = 2.0


class ClientRecovery:
    """The recovery of a ParameterClient (which provides the attributes and the hello,
    create, restore and wait-ready requests named below)."""

    task_name: str
    timeouts: ClientTimeouts
    is_chief: bool
    restore_shards: Callable[[], tuple[int, Sequence[bytes]] | None] | None
    recreate_tables: Callable[[Sequence[int]], None] | None
    recreate_buffers: Callable[[], None] | None
    _fused: Any
    _last_global_step: int
    _hello: Callable[..., Any]
    _wait_ready: Callable[..., Any]
    _restore_now: Callable[..., Any]
    _create: Callable[..., Any]

    def recover(self, failure: Exception, reinitialize: bool = True) -> None:
        """After an exchange failed (a ps died, restarted, or was cut off): say hello again
        until every shard answers (each hello waits up to :data:`HELLO_WAIT_S` for a ps that
        is still starting; one that fails sooner is sent again after a pause of
        :data:`FIRST_RETRY_S` doubling to :data:`MAX_RETRY_S`); have restarted shards restored
        (the chief) or wait until they are (the others; not when ``reinitialize`` is False,
        e.g. for a worker that only says it is done). DeadlineExceeded after ``recover_s``."""
        log.warning("%s: %s; recovering", self.task_name, failure)
        deadline = time.monotonic() + self.timeouts.recover_s
        delay, last = FIRST_RETRY_S, failure
        while time.monotonic() < deadline:
            try:
                wait_s = min(HELLO_WAIT_S, max(1.0, deadline - time.monotonic()))
                try:
                    replies = self._hello(wait_s, abort_when_silent=False)
                except Preempted:  # its wait ended on the signal: say what that means here
                    raise Preempted(self._preempted_message(last)) from None
                fresh = [i for i, r in enumerate(replies) if r.body.get("initialized") is not True]
                if fresh and reinitialize and self._fused is not None:
                    self._reinitialize(fresh, deadline)
                log.warning(
                    "%s: recovered%s", self.task_name, f" (ps {fresh} restored)" if fresh else ""
                )
                return
            except (DeadlineExceeded, RemoteError) as exc:
                last = exc
                log.warning(
                    "%s: not recovered yet (%s); trying again in %.1f s", self.task_name, exc, delay
                )
            # The back-off, cut short by a preemption (set before it, it returns at once).
            if wait_unless_preempted(min(delay, deadline - time.monotonic())):
                message = self._preempted_message(last)
                log.warning("%s", message)
                raise Preempted(message)
            delay = min(delay * 2, MAX_RETRY_S)
        raise DeadlineExceeded(
            f"{self.task_name}: the parameter servers did not come back within "
            f"{self.timeouts.recover_s:.0f} s (last error: {last}). Restart the failed ps task "
            "(tensorfleet launch --max-restarts N restarts it in place)"
        )

    def _preempted_message(self, last: Exception) -> str:
        return (
            f"{self.task_name}: preempted (SIGTERM) while the parameter servers were "
            f"unreachable ({last}): nothing could be saved since the last checkpoint; "
            "exiting with status 143 (a preemption: restarted where tasks are)"
        )

    def _reinitialize(self, fresh: list[int], deadline: float) -> None:
        if not self.is_chief:
            self._wait_ready(fresh, min(30.0, max(1.0, deadline - time.monotonic())))
            return
        checkpoint = self.restore_shards() if self.restore_shards is not None else None
        if checkpoint is not None:
            now = self._restore_now(checkpoint[1], checkpoint[0], fresh)
            if now > checkpoint[0]:  # the chief's line named the checkpoint's step only
                log.warning(
                    "%s: ps %s restored from the checkpoint of global step %d, then replayed "
                    "its update log to global step %d",
                    self.task_name,
                    fresh,
                    checkpoint[0],
                    now,
                )
        else:
            self._recreate(fresh)
        if self.recreate_buffers is not None:  # the others' buffer requests wait for it
            self.recreate_buffers()

    def _recreate(self, fresh: list[int]) -> None:
        log.warning(
            "%s: ps %s restarted without variables and there is no checkpoint to restore; "
            "re-creating them from the chief's current values at global step %d (their "
            "optimizer state is lost)",
            self.task_name,
            fresh,
            self._last_global_step,
        )
        if self.recreate_tables is not None:  # before the variables: the others wait for those
            self.recreate_tables(fresh)
        self._create(fresh, self.timeouts.step_s, global_step=self._last_global_step)

    def _recovering(self, attempt: Callable[[], T], reinitialize: bool = True) -> T:
        """``attempt()``, recovering and trying again while it fails with a RECOVERABLE
        error, up to ``recover_s`` after the first failure (then the last error is raised;
        a recovery that cannot reach the ps raises DeadlineExceeded itself)."""
        deadline: float | None = None
        while True:
            try:
                return attempt()
            except RECOVERABLE as exc:
                now = time.monotonic()
                deadline = now + self.timeouts.recover_s if deadline is None else deadline
                if now >= deadline:
                    raise
                self.recover(exc, reinitialize)
