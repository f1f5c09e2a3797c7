"""The exceptions tensorfleet raises, one class per thing that can go wrong.

Every message says what is wrong, the value that was seen, and what to do about it.
Classes also derive from the closest built-in exception (``ValueError``,
``TimeoutError``, ...) so callers that already catch those keep working.
"""

from __future__ import annotations


class TensorfleetError(Exception):
    """Base class of every error tensorfleet raises on purpose."""


class ClusterConfigError(TensorfleetError, ValueError):
    """A cluster spec, task identity, address or device string is malformed or inconsistent."""


class DeadlineExceeded(TensorfleetError, TimeoutError):
    """A wait ran past its deadline; the message names what was awaited and from whom."""


class AuthenticationError(TensorfleetError):
    """A peer does not hold the cluster secret we hold (or a message failed verification)."""


class ProtocolError(TensorfleetError):
    """A message is malformed, too large, of another protocol version, or not understood."""


class RemoteError(TensorfleetError):
    """A parameter server refused a request; the message carries the server's explanation."""


class ServiceRestarted(RemoteError):
    """A parameter server answered from a new incarnation: it restarted since this client
    said hello, so the client must say hello again (and the shard may need restoring)."""


class ConnectionLost(DeadlineExceeded):
    """A parameter server stopped answering heartbeats while a request waited on it."""


class CheckpointError(TensorfleetError):
    """A checkpoint cannot be written, found, verified or restored."""


class NonFiniteError(TensorfleetError, ArithmeticError):
    """A loss or gradient was NaN or infinite and the NaN guard was told to stop."""


class DatasetError(TensorfleetError, FileNotFoundError):
    """A dataset cannot be found, read or downloaded."""


class LaunchError(TensorfleetError):
    """The local launcher could not start or supervise the cluster."""
