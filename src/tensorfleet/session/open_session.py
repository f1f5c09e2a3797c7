"""The one check of the :class:`~tensorfleet.session.training_session.TrainingSession` methods
that use the session's connections (``step``, ``pull``, ``cluster_stats``,
``moving_average``, ``save_checkpoint``).

Before ``start()`` nothing is connected, and after the ``with`` block the connections to the
ps tasks (or the all-reduce group) are released: a call then would fail deep in the
transport (a ZeroMQ "Socket operation on non-socket", a torch.distributed error) or, in one
process, work where the same script fails on a cluster. It fails here instead, the same in
every mode, with a :class:`~tensorfleet.errors.UsageError` saying where the call belongs.
"""

from __future__ import annotations

from tensorfleet.errors import UsageError


def require_open(call: str, *, started: bool, closed: bool) -> None:
    """UsageError unless the session has started and is not closed; ``call`` is what was
    called (e.g. ``"cluster_stats()"``), named in the message."""
    if not started:
        raise UsageError(
            f"{call} needs a started, open session, and this one has not started: call it "
            "inside `with TrainingSession(...) as sess:` (or after sess.start())"
        )
    if closed:
        raise UsageError(
            f"{call} needs a started, open session, and this one is closed (its `with` block "
            "ended, or it failed): its connections are released. Call it inside the `with` "
            "block, e.g. after the training loop and before the block ends"
        )
