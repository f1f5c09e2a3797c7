"""The client of the ps operations between model namespaces (:mod:`tensorfleet.ps.namespace_copy`):
copy one model's state onto another's, and retune a model's update rule, on every ps task.

Used by population-based training (:mod:`tensorfleet.patterns.pbt`), whose driver is no
worker of any model: it names none in its requests, so no model's roster counts it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from tensorfleet.errors import ConfigError
from tensorfleet.ps.model_namespace import check_model_name
from tensorfleet.ps.namespace_copy import CONTROL_HELLO
from tensorfleet.version import __version__
from tensorfleet.wire.channel import Channel
from tensorfleet.wire.message import PROTOCOL_VERSION


@dataclass(frozen=True)
class CopyVersion:
    """What one ``copy_model`` did: per ps task, the source's update count and global step at
    the copy (the target's state equals the source's at that version), and the target's."""

    source_versions: tuple[int, ...]
    source_global_step: int
    """The source's global step at the copy (ps task 0's, which owns it)."""
    target_versions: tuple[int, ...]


class NamespaceControl:
    """Channels to every ps task of a cluster for ``copy_model`` and ``set_hyperparameters``.
    Every call waits at most ``timeout_s`` per ps task (DeadlineExceeded after it)."""

    def __init__(
        self,
        ps_addresses: Sequence[str],
        secret: bytes,
        name: str = "pbt",
        timeout_s: float = 60.0,
        encrypt: bool = False,
    ) -> None:
        if not ps_addresses:
            raise ConfigError("NamespaceControl needs at least one ps address, got none")
        self.name = name
        self.timeout_s = timeout_s
        self._context = zmq.Context(io_threads=1)
        self._channels = [
            Channel(
                address,
                secret,
                f"ps:{i}",
                context=self._context,
                encrypt=encrypt,
                payload_stream=False,  # control requests carry no payload
            )
            for i, address in enumerate(ps_addresses)
        ]
        try:  # a channel's first request is a hello; this one opens no model
            self._call_all(
                "hello",
                {
                    "protocol": PROTOCOL_VERSION,
                    "version": __version__,
                    "task": name,
                    CONTROL_HELLO: True,
                },
            )
        except BaseException:
            self.close()
            raise

    def _call_all(self, op: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """Send ``op`` to every ps task at once, then wait for each reply."""
        ids = [channel.send(op, body, None, self.timeout_s) for channel in self._channels]
        return [
            channel.wait(request, self.timeout_s).body
            for channel, request in zip(self._channels, ids, strict=True)
        ]

    def copy_model(self, source: str, target: str) -> CopyVersion:
        """Make ``target``'s variables and optimizer state a copy of ``source``'s on every ps
        task (each task's copy is atomic; keep ``target``'s workers from pushing meanwhile
        when the model spans several tasks)."""
        check_model_name(source)
        check_model_name(target)
        replies = self._call_all(
            "copy_model", {"task": self.name, "model": target, "source": source}
        )
        return CopyVersion(
            tuple(int(r["source_version"]) for r in replies),
            int(replies[0]["source_global_step"]),
            tuple(int(r["version"]) for r in replies),
        )

    def set_hyperparameters(self, model: str, hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
        """Give ``model``'s update rule ``hyperparameters`` (e.g. ``{"lr": 0.01}``) from its
        next update on, on every ps task; return the rule's hyperparameters (ps task 0's)."""
        check_model_name(model)
        replies = self._call_all(
            "set_hyperparameters",
            {"task": self.name, "model": model, "hyperparameters": dict(hyperparameters)},
        )
        return dict(replies[0]["hyperparameters"])

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._context.term()
