"""Which worker tasks a ps shard counts as alive, lost or done, and which process holds each
task's identity.

The rules (each one a method of :class:`WorkerRoster`):

* **Only the cluster's workers count.** A request naming a task that is not one of the
  cluster's worker tasks is refused (:meth:`WorkerRoster.worker_of`, one check for every
  operation, a :class:`ProtocolError` naming the task and the workers).
* **Heard means alive.** Every request of a worker task, and its heartbeats (one a second),
  mark it heard (:meth:`WorkerRoster.heard_from`). A worker not heard from for
  ``liveness_timeout_s`` is *lost* (:meth:`WorkerRoster.check_liveness`); heard again, it is
  back. A worker that said ``done`` is never lost.
* **The shard's own silence is not the workers'.** Silence is counted only over time this
  shard's loop ran (:mod:`tensorfleet.silence_clock`): when
  :meth:`WorkerRoster.check_liveness` comes :data:`STALL_S` or more after the previous check
  (the ps process was stopped, its VM frozen, or one request held the loop that long: a big
  restore), the workers' heartbeats of that time wait unread in
  the socket, so silence counts from this check, not from their last request read. Otherwise
  a ps SIGSTOPped for the liveness timeout would, on SIGCONT, declare every worker whose
  queued heartbeat it had not read yet lost (and fail a sync step whose discipline is
  ``fail``). A worker that said it left stays lost through such a gap.
* **One process per identity.** A worker process says hello with an *instance* id (random,
  one per process) on each of its channels (the authenticated session of the request). The
  first instance holds the task's identity. Another instance is let in
  (:meth:`WorkerRoster.claim`) only when the holder is lost, done, or its launcher says it
  is dead (``takeover``); otherwise it is refused with :class:`IdentityInUse`, so no second
  chief can appear by accident. When a new instance takes the identity, requests still
  arriving on the channels of the old one are refused (:meth:`WorkerRoster.admit`, again
  :class:`IdentityInUse`), so at most one process per task is ever served.
* **Takeover.** A restarted task whose launcher knows the predecessor died says hello with
  ``"takeover": true`` (``TENSORFLEET_PREDECESSOR_DEAD=1`` in its environment): it takes the
  identity at once instead of ``liveness_timeout_s`` later, and the takeover is logged.
  ``takeover`` only decides *which* instance holds the identity: the hello is authenticated
  like every message (a peer without the cluster secret never reaches the roster).
* **Running** workers are those neither done nor lost: the chief's ``wait_done`` waits for
  them.

Invariants: ``done`` and ``lost`` are disjoint subsets of the workers; a task has at most one
holder; a session maps to one (task, instance) and is refused once its instance no longer
holds the task.

Why not notice the predecessor's connections closing (ZeroMQ's ``ROUTER_NOTIFY``, which
delivers an empty message with the routing id of each connection that closes)? It is a DRAFT
option of libzmq 4.3: the libzmq that pyzmq ships (4.3.5 in pyzmq 27) is built without the
draft API, and ``setsockopt(zmq.ROUTER_NOTIFY, zmq.NOTIFY_DISCONNECT)`` raises ``EINVAL``
there. The fallback, a socket monitor's ``EVENT_DISCONNECTED``, names the file descriptor,
not the routing id; mapping it back through each message's ``SRCFD`` is unsound because the
kernel hands the closed descriptor's number to the very next connection (typically the
restarted task's), and libzmq does not order monitor events against messages. So a
restarted task is let in at once when its launcher vouches for the predecessor's death, and
otherwise after the liveness timeout (the ps hears nothing from a dead process).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from tensorfleet.errors import ConfigError, IdentityInUse, ProtocolError
from tensorfleet.silence_clock import SilenceClock

log = logging.getLogger("tensorfleet.ps")

#: Seconds between two liveness checks after which the shard itself was stopped or held, and
#: the workers' silence counts from the later check (module docstring). The loop checks at
#: least every 0.2 s when idle and after every request.
STALL_S = 5.0
#: An instance id is a short string (the client sends 16 hex digits).
MAX_INSTANCE_CHARS = 64
#: Sessions remembered (two per worker process per shard: its channel and its heartbeat's).
MAX_SESSIONS = 4096


@dataclass(frozen=True)
class LivenessChange:
    """What :meth:`WorkerRoster.check_liveness` found."""

    newly_lost: tuple[str, ...] = ()
    back: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.newly_lost or self.back)


@dataclass
class WorkerRoster:
    """Liveness and identity of the worker tasks of one ps shard (see the module's rules)."""

    workers: tuple[str, ...]
    """Every worker task of the cluster (``worker:0`` ...)."""
    liveness_timeout_s: float
    """A worker not heard from for this long is lost."""
    shard: str = "ps"
    """This shard's name, for the log."""
    clock: Callable[[], float] = time.monotonic
    done: set[str] = field(default_factory=set)
    """Workers that said ``done`` (and have not come back as a new process)."""
    lost: set[str] = field(default_factory=set)
    """Workers not heard from for ``liveness_timeout_s``."""
    heard: dict[str, float] = field(default_factory=dict)
    """When each worker was last heard from (``clock`` seconds)."""
    left: set[str] = field(default_factory=set)
    """Workers that said they left (preempted) and have not said hello since."""
    holders: dict[str, str] = field(default_factory=dict)
    """The instance (process) that holds each worker's identity."""
    _sessions: OrderedDict[bytes, tuple[str, str]] = field(default_factory=OrderedDict)
    _silence: SilenceClock = field(init=False, repr=False)
    """When :meth:`check_liveness` last ran: silence counts only over time the shard ran."""

    def __post_init__(self) -> None:
        if not self.liveness_timeout_s > 0:
            raise ConfigError(f"liveness_timeout_s must be > 0, got {self.liveness_timeout_s}")
        self._silence = SilenceClock(STALL_S, self.clock)

    # -- who sent this ----------------------------------------------------------------------------

    def is_worker(self, task: object) -> bool:
        return isinstance(task, str) and task in self.workers

    def worker_of(self, op: str, task: object) -> str:
        """``task`` if it is one of the workers; otherwise a :class:`ProtocolError` naming the
        operation, the task seen and the workers."""
        if not self.is_worker(task):
            raise ProtocolError(
                f"{op} from unknown task {task!r}; workers are {list(self.workers)}"
            )
        return task  # type: ignore[return-value]

    # -- identity -------------------------------------------------------------------------------

    def claim(self, task: object, instance: object, session: bytes, takeover: bool = False) -> None:
        """A hello of ``task`` from process ``instance`` on channel ``session``: take (or keep)
        the identity, or :class:`IdentityInUse` while another live process holds it and
        ``takeover`` is not set. A hello marks the task heard and not lost; a new process of
        a finished task is back (no longer done). A hello without a valid instance (an older
        or a test client) claims nothing and is only heard."""
        if not self.is_worker(task):
            return
        assert isinstance(task, str)
        if isinstance(instance, str) and 0 < len(instance) <= MAX_INSTANCE_CHARS:
            holder = self.holders.get(task)
            if holder is not None and holder != instance:
                if self._holder_alive(task) and not takeover:
                    age = self.clock() - self.heard[task]
                    raise IdentityInUse(
                        f"{task} is already running in another process (heard from {age:.1f} s "
                        "ago): two processes with one task identity would corrupt training. Stop "
                        "the other one; a restarted task is let in "
                        f"{self.liveness_timeout_s:g} s after its predecessor fell silent, or at "
                        "once when its launcher says the predecessor is dead "
                        "(TENSORFLEET_PREDECESSOR_DEAD=1)"
                    )
                if self._holder_alive(task):
                    log.warning(
                        "%s: %s: process %s takes over from process %s (its launcher, or "
                        "whoever ran it again, says that one is dead: "
                        "TENSORFLEET_PREDECESSOR_DEAD=1); requests of the old process are "
                        "refused from now on",
                        self.shard,
                        task,
                        instance,
                        holder,
                    )
                self.done.discard(task)  # a new process of a finished task: it is back
            self.holders[task] = instance
            self._sessions[session] = (task, instance)
            self._sessions.move_to_end(session)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        self.heard[task] = self.clock()
        self.lost.discard(task)
        self.left.discard(task)

    def admit(self, session: bytes) -> None:
        """Refuse (:class:`IdentityInUse`) a request on a channel whose process no longer
        holds its task's identity (another instance took it over)."""
        claim = self._sessions.get(session)
        if claim is None:
            return
        task, instance = claim
        holder = self.holders.get(task)
        if holder is not None and holder != instance:
            raise IdentityInUse(
                f"{task}'s identity was taken over by another process ({holder}; this is "
                f"{instance}): a restarted copy of this task runs now. Stop this process"
            )

    def _holder_alive(self, task: str) -> bool:
        return task in self.heard and task not in self.lost and task not in self.done

    # -- liveness -------------------------------------------------------------------------------

    def heard_from(self, task: object) -> None:
        """A request naming ``task`` arrived (anything but a hello, which :meth:`claim` takes)."""
        if self.is_worker(task):
            self.heard[task] = self.clock()  # type: ignore[index]

    def check_liveness(self) -> LivenessChange:
        """Mark workers silent for ``liveness_timeout_s`` lost, and heard ones back (silence
        counted only over time the shard ran: the module docstring)."""
        now = self._silence.ran()
        lost = {
            task
            for task, heard in self.heard.items()
            if task not in self.done
            and (now - heard if task in self.left else self._silence.silent_for(heard, now))
            > self.liveness_timeout_s
        }
        change = LivenessChange(
            newly_lost=tuple(sorted(lost - self.lost)), back=tuple(sorted(self.lost - lost))
        )
        self.lost = lost
        return change

    def mark_left(self, task: str) -> None:
        """``task`` stopped for now (preempted) and will be back: the next
        :meth:`check_liveness` finds it lost, as if silent for the liveness timeout, and a
        new process may take its identity at once."""
        if task in self.heard:
            self.heard[task] = min(self.heard[task], self.clock() - self.liveness_timeout_s - 1.0)
            self.left.add(task)

    def mark_done(self, task: str) -> None:
        """``task`` has finished training; it is no longer lost."""
        self.done.add(task)
        self.lost.discard(task)

    # -- views ----------------------------------------------------------------------------------

    def running(self, exclude: object = None) -> list[str]:
        """Workers neither done nor lost (other than ``exclude``), in cluster order."""
        return [
            t for t in self.workers if t != exclude and t not in self.done and t not in self.lost
        ]

    def never_heard(self, exclude: object = None) -> list[str]:
        """Workers this shard never heard from (other than ``exclude``), in cluster order: not
        started yet, or their messages are refused (another secret)."""
        return [t for t in self.workers if t != exclude and t not in self.heard]

    @property
    def all_done(self) -> bool:
        """Every worker said done (never true without workers)."""
        return bool(self.workers) and self.done >= set(self.workers)

    @property
    def all_done_or_lost(self) -> bool:
        """Every worker is done or lost, and at least one is done (training is over and
        whoever is not done is gone)."""
        return bool(self.workers and self.done) and self.done | self.lost >= set(self.workers)

    def departed(self, including_lost: bool) -> set[str]:
        """Workers a sync step does not wait for: the done ones, and the lost ones too when
        ``including_lost`` (``lost_worker='shrink'``)."""
        return self.done | self.lost if including_lost else set(self.done)
