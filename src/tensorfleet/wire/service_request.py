"""A request as a service holds it (:class:`Request`), and the headers of its answers.

Split from :mod:`tensorfleet.wire.service_socket`, which receives requests and sends the
answers: the services above it (the ps, the patterns' servers) build and read these, and
:mod:`tensorfleet.wire.service_socket` re-exports them where they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorfleet.wire.auth import Buffer
from tensorfleet.wire.encryption import Sealer


@dataclass
class Request:
    """A request received by a service, with what is needed to answer it."""

    peer: bytes
    op: str
    request_id: int
    body: dict[str, Any]
    buffers: list[Buffer]
    deadline: float
    """``time.monotonic()`` after which the requester no longer waits for the answer."""
    session_id: bytes
    reply_segment: object = None
    """Where the requester wants the reply's payload (its shared-memory segment), or None."""
    sealer: Sealer | None = None
    """Seals the answer (the request came sealed), or None: the answer goes signed."""
    shared_memory_refused: str | None = None
    """Why this service cannot reach the shared memory a ``hello`` offered (its probe
    segment), or None: told to the client, which then sends its payloads over the socket."""


def reply_header(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """The header of a successful answer to ``request``."""
    return {"re": request.request_id, "to": request.session_id, "ok": True, "body": body}


def failure_header(request: Request, error_type: str, text: str) -> dict[str, Any]:
    """The header of an error answer to ``request``. ``error_type`` is the refusal's *code*
    (a :class:`~tensorfleet.errors.RemoteError` subclass's ``code``); the client raises
    ``remote_error_class(code)`` with ``text`` in its message."""
    return {
        "re": request.request_id,
        "to": request.session_id,
        "ok": False,
        "body": {},
        "error_type": error_type,
        "error": text,
    }
