"""A worker's heartbeat: a background thread that tells every ps shard "this task is alive"
once a second, and watches which shards answer.

Both directions matter. The ps learns which workers are alive without waiting for their
next push (a dead worker stops holding back a sync step or the staleness gate after the
ps's liveness timeout). The worker learns that a shard has gone silent, or restarted, while
its training thread is blocked in a long wait on that shard, and can stop waiting
(:meth:`Heartbeat.trouble`) instead of sitting out the whole step deadline.

The thread has its own ZeroMQ sockets (a socket belongs to one thread) in the client's
context, and every one of its waits has a deadline, so stopping it takes at most one
heartbeat interval plus one answer timeout.

**Our own silence is not the ps's.** A worker that was itself stopped (SIGSTOP, a frozen VM,
a debugger) resumes with every shard's last answer as old as the stop: counted naively, each
shard would look silent, and the wait in progress would be given up and recovered from for
nothing (a push dropped). So silence is counted only over time this thread was running
(:mod:`tensorfleet.silence_clock`): when it has not run for :data:`STALL_S` (its last round
is that old), :meth:`Heartbeat.trouble` blames no shard, and after such a stall silence is
counted from the moment the thread ran again. Measured reason: in a 10-minute fault storm, a
worker SIGCONTed after a 15 s SIGSTOP gave up its push at once with "ps:0 has not answered a
heartbeat for 16 s" while the ps had been running all along.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from tensorfleet.errors import ConfigError, TensorfleetError
from tensorfleet.ps.model_namespace import ModelClaim
from tensorfleet.silence_clock import SilenceClock
from tensorfleet.version import __version__
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.message import PROTOCOL_VERSION

log = logging.getLogger("tensorfleet.worker")

#: Seconds without a round of this thread (the interval, the answer timeouts of a round and a
#: margin, whichever is longer) after which the process itself was stopped or starved, and
#: no shard is blamed for the silence (module docstring).
STALL_S = 5.0


class Heartbeat:
    """Sends ``heartbeat`` to every shard every ``interval_s``; records when each answered."""

    def __init__(
        self,
        ps_addresses: Sequence[str],
        secret: bytes,
        task_name: str,
        instance: str,
        context: zmq.Context,
        *,
        interval_s: float = 1.0,
        silence_s: float = 10.0,
        encrypt: bool = False,
        model: ModelClaim | None = None,
        hello_fields: dict[str, Any] | None = None,
    ) -> None:
        if interval_s <= 0 or silence_s <= interval_s:
            raise ConfigError(
                f"heartbeat interval ({interval_s} s) must be > 0 and below the silence limit "
                f"({silence_s} s)"
            )
        self._addresses = list(ps_addresses)
        self._secret = secret
        self._task = task_name
        self._instance = instance
        self._context = context
        self._encrypt = encrypt
        self._model = model or ModelClaim()
        self._hello_fields = dict(hello_fields or {})
        """What this process's hellos say besides its identity (the same as the client's, e.g.
        the gradients' wire dtype): a heartbeat's hello must not contradict them."""
        self.interval_s = interval_s
        self.silence_s = silence_s
        now = time.monotonic()
        self._last_answer = [now] * len(self._addresses)
        self._silence = SilenceClock(max(STALL_S, interval_s + 2 * self._answer_s() + 1.0))
        """When this thread last ran a step of its loop: silence counts only over time it
        ran (:data:`STALL_S`, or more when one round's answer timeouts take longer)."""
        self._sessions: list[bytes | None] = [None] * len(self._addresses)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"tensorfleet-heartbeat-{task_name}", daemon=True
        )

    def start(self) -> None:
        """Start beating; silence is counted from now."""
        self._last_answer = [self._silence.ran()] * len(self._addresses)
        self._thread.start()

    def _answer_s(self) -> float:
        return min(2.0, self.interval_s * 2)

    def stop(self) -> None:
        """Stop the thread (at most one interval plus one answer timeout)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(self.interval_s + 5.0)

    def heard(self, shard: int, session: bytes | None) -> None:
        """``shard`` answered the client itself (its hello, from process ``session``): it is
        alive now, and that is the process to expect. Without this, a wait on a ps that has
        just restarted would be given up until this thread's own hello reaches the new
        process (up to an interval and an answer timeout later): its last answer is old, and
        from the old process."""
        self._last_answer[shard] = time.monotonic()
        if session is not None:
            self._sessions[shard] = session

    def trouble(self, shard: int, session: bytes | None) -> str | None:
        """Why waiting on ``shard`` is pointless, or None: it has not answered a heartbeat
        for ``silence_s``, or it answers from another process than ``session`` (it
        restarted). None while the heartbeat is not running (before the first hello)."""
        if self._thread.ident is None or self._stop.is_set():
            return None
        if self._silence.stalled():
            return None  # this process was stopped or starved: the silence is ours
        silent = self._silence.silent_for(self._last_answer[shard])
        if silent > self.silence_s:
            return f"ps:{shard} has not answered a heartbeat for {silent:.0f} s"
        seen = self._sessions[shard]
        if seen is not None and session is not None and seen != session:
            return f"ps:{shard} restarted (it answers heartbeats from a new process)"
        return None

    def _run(self) -> None:
        channels = [
            Channel(
                address,
                self._secret,
                f"ps:{i}",
                context=self._context,
                encrypt=self._encrypt,
                payload_stream=False,  # heartbeats carry no payload
            )
            for i, address in enumerate(self._addresses)
        ]
        hello = {
            "protocol": PROTOCOL_VERSION,
            "version": __version__,
            "task": self._task,
            **self._model.hello_fields(),
            **self._hello_fields,
        }
        beat = {"task": self._task, **self._model.request_fields()}
        try:
            while not self._stop.is_set():
                self._silence.ran()
                for shard, channel in enumerate(channels):
                    answer_s = self._answer_s()
                    try:
                        if channel.server_session is None:
                            channel.call(
                                "hello", {**hello, "instance": self._instance}, None, answer_s
                            )
                        channel.call("heartbeat", beat, None, answer_s)
                    except TensorfleetError as exc:
                        channel.server_session = None  # say hello again next time
                        log.debug("%s: heartbeat to ps:%d failed: %s", self._task, shard, exc)
                        self._silence.ran()
                        continue
                    self._last_answer[shard] = time.monotonic()
                    self._sessions[shard] = channel.server_session
                    self._silence.ran()
                self._stop.wait(self.interval_s)
        finally:
            for channel in channels:
                channel.close()
