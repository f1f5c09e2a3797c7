"""What a session's ``data=`` takes: an object that says where this worker is in its data
(``state_dict()``) and can be put back there (``load_state_dict()``), such as
:class:`tensorfleet.datasets.BatchStream`. The chief saves every worker's position with each
checkpoint and a resumed worker continues from it, so no batch is replayed or skipped.

The check is made when the session is built: a plain iterator or generator (what
``next(batches)`` reads in most training loops) has no position to save, and without the
check it failed at the first step's ``state_dict()`` with a bare ``AttributeError``.
"""

from __future__ import annotations

from typing import Any, Protocol

from tensorfleet.errors import ConfigTypeError


class DataPosition(Protocol):
    """Where a worker is in its data: what ``data=`` takes (a BatchStream is one)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def checked_data_position(data: object) -> DataPosition | None:
    """``data`` when it has ``state_dict`` and ``load_state_dict`` (or is None); otherwise
    ConfigTypeError naming its type and the fix."""
    if data is None:
        return None
    missing = [
        name
        for name in ("state_dict", "load_state_dict")
        if not callable(getattr(data, name, None))
    ]
    if missing:
        raise ConfigTypeError(
            f"data= takes an object that saves and restores its position in the data "
            f"(state_dict() and load_state_dict(), e.g. tensorfleet.datasets.BatchStream); got "
            f"{type(data).__name__}, which has no {' or '.join(missing)}. Fix: pass a "
            f"BatchStream (from tensorfleet.datasets import BatchStream; batches = "
            f"BatchStream(images, labels, batch_size)), or leave data= out (a resumed worker "
            f"then starts its data from the beginning)"
        )
    return data  # type: ignore[return-value]
