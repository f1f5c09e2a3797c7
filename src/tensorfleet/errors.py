"""The exceptions tensorfleet raises, one class per thing that can go wrong.

Every message says what is wrong, the value that was seen, and what to do about it.
Classes also derive from the closest built-in exception (``ValueError``,
``TimeoutError``, ...) so callers that already catch those keep working.
"""

from __future__ import annotations

import signal

#: The exit status of a task that ended because it was preempted (SIGTERM): 128 + SIGTERM,
#: what a shell reports for a process killed by that signal.
PREEMPTED_EXIT_STATUS = 128 + signal.SIGTERM


class TensorfleetError(Exception):
    """Base class of every error tensorfleet raises on purpose."""


class ConfigError(TensorfleetError, ValueError):
    """An argument or setting is invalid (out of range, unknown, or not allowed with another
    one); the message names it, the value seen and what is allowed."""


class ConfigTypeError(TensorfleetError, TypeError):
    """An argument is of the wrong type (e.g. a ``torch.optim`` optimizer where a tensorfleet
    update rule is expected); the message names the type expected."""


class UsageError(TensorfleetError, RuntimeError):
    """An API was called out of order or in the wrong state (e.g. ``step()`` before the
    session started, ``save()`` before ``register()``); the message says the right order."""


class ListenError(TensorfleetError, OSError):
    """A task cannot listen on (or start a process for) its address: the port is taken, the
    host is not this machine's, or the node refused; the message names which and the fix."""


class ClusterConfigError(ConfigError):
    """A cluster spec, task identity, address or device string is malformed or inconsistent."""


class DeadlineExceeded(TensorfleetError, TimeoutError):
    """A wait ran past its deadline; the message names what was awaited and from whom."""


class AuthenticationError(TensorfleetError):
    """A peer does not hold the cluster secret we hold (or a message failed verification)."""


class ReplayedMessage(AuthenticationError):
    """A message whose counter is not above the last one accepted in its session: a replay of
    captured traffic, or a request its client gave up on that arrived after newer ones (its
    old connection's messages, read late by a service that was stopped meanwhile). Refused
    either way; told apart from a wrong secret so that the log does not blame the secret."""


class ProtocolError(TensorfleetError):
    """A message is malformed, too large, of another protocol version, or not understood."""


class RemoteError(TensorfleetError):
    """A parameter server refused a request; the message carries the server's explanation.

    A refusal crosses the wire as a *code* (the class's ``code``) plus the server's text; the
    client raises the class registered for that code (:func:`remote_error_class`), so callers
    decide by type (``except IdentityInUse``), never by the words of a message. An unknown
    code (a newer server) is raised as plain ``RemoteError``.
    """

    code = "RemoteError"


class ServiceRestarted(RemoteError):
    """A parameter server answered from a new incarnation: it restarted since this client
    said hello, so the client must say hello again (and the shard may need restoring)."""

    code = "StaleSession"


class PayloadStreamLost(ServiceRestarted):
    """The payload of a request sent on the payload stream did not reach the service whole
    (the stream was cut, or the payload was late or altered): the service closed that stream
    and refused the request. Nothing of it was applied. A worker's client recovers from it by
    itself, as from a restart (:class:`ServiceRestarted`, of which this is one): it says hello
    again, which opens a new stream, and goes on (a push is dropped, as after a ps restart,
    and the values pulled again); training code does not see it. Code that sends requests on
    a :class:`~tensorfleet.wire.channel.Channel` of its own does, and does the same."""

    code = "PayloadStreamLost"


class IdentityInUse(RemoteError):
    """Another live process holds this task's identity (e.g. the predecessor of a restarted
    task that has not been declared dead yet); asking again later may succeed."""

    code = "IdentityInUse"


class NotInitialized(RemoteError):
    """The shard has no variables yet: the chief has not created (or restored) them."""

    code = "NotInitialized"


class WorkerLost(RemoteError):
    """A sync step needs a worker that the ps declared lost, and ``lost_worker='fail'``."""

    code = "WorkerLost"


class RequestRefused(RemoteError, ValueError):
    """The server found the request's content invalid (a value, shape or name that does not
    fit); retrying the same request cannot succeed."""

    code = "RequestRefused"


class RemoteProtocolError(RemoteError):
    """The server could not understand the request (malformed, unknown operation, other
    protocol version)."""

    code = "ProtocolError"


class RemoteDeadlineExceeded(RemoteError, TimeoutError):
    """The server held the request (a sync step, the staleness gate, the chief's
    initialization) past its deadline and says what it was still waiting for."""

    code = "DeadlineExceeded"


class EncryptionMismatch(RemoteError):
    """The two ends disagree about encryption: one runs with ``--encrypt`` /
    ``TENSORFLEET_ENCRYPT=1`` and the other without. Every task of a cluster must agree; the
    message says which end to change."""

    code = "EncryptionMismatch"


def remote_error_class(code: object) -> type[RemoteError]:
    """The exception class a client raises for a refusal with ``code``."""
    for cls in (
        ServiceRestarted,
        PayloadStreamLost,
        IdentityInUse,
        NotInitialized,
        WorkerLost,
        RequestRefused,
        RemoteProtocolError,
        RemoteDeadlineExceeded,
        EncryptionMismatch,
    ):
        if cls.code == code:
            return cls
    return RemoteError


class ConnectionLost(DeadlineExceeded):
    """A parameter server stopped answering heartbeats while a request waited on it."""


class CheckpointError(TensorfleetError):
    """A checkpoint cannot be written, found, verified or restored."""


class CheckpointMismatch(CheckpointError, ValueError):
    """A checkpoint document cannot be read, or does not fit this model (another shape, dtype,
    parameter or update rule); nothing was changed."""


class NonFiniteError(TensorfleetError, ArithmeticError):
    """A loss or gradient was NaN or infinite and the NaN guard was told to stop."""


class DatasetError(TensorfleetError, FileNotFoundError):
    """A dataset cannot be found, read or downloaded."""


class LaunchError(TensorfleetError):
    """The local launcher could not start or supervise the cluster, or another process
    tensorfleet starts on this host could not be started (a sweep's preloaded interpreter)."""


class LaunchConfigError(LaunchError, ValueError):
    """An argument of the launcher is invalid (a negative restart limit, a Ray address that
    does not answer); raised before anything starts."""


class Preempted(SystemExit):
    """This task was preempted (SIGTERM from outside, e.g. a cluster manager reclaiming its
    machine): it saved what it could (the chief a checkpoint) and ends the process with exit
    status 143 (128 + SIGTERM), which the launcher and cluster managers treat as a kill by a
    signal and restart. A ``SystemExit``, not an ``Exception``: a broad ``except Exception``
    in a training loop does not swallow it."""

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPTED_EXIT_STATUS)
        self.message = message

    def __str__(self) -> str:
        return self.message


def refusal_code(exc: Exception) -> str:
    """The code a refusal caused by ``exc`` carries on the wire: a :class:`RemoteError`'s own
    code (the ps raises the class the client will raise), ``ProtocolError`` for a request it
    cannot understand, ``RequestRefused`` for content that does not fit (a ``ValueError``)."""
    if isinstance(exc, RemoteError):
        return exc.code
    if isinstance(exc, ProtocolError):
        return RemoteProtocolError.code
    return RequestRefused.code
