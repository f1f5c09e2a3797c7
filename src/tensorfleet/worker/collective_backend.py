"""Which torch.distributed backend an all-reduce group uses, from where its ranks compute.

NCCL is the fast path between GPUs, but it refuses two ranks on one GPU ("Duplicate GPU
detected : rank 2 and rank 0 both on CUDA device 60", a raw traceback from every worker),
and several workers on one GPU is the first thing a user with one GPU tries. So before the
group picks a backend, every rank says where it computes (:class:`DeviceIdentity`: the host
and the GPU's UUID, or its physical index through ``CUDA_VISIBLE_DEVICES``), the identities
are exchanged over gloo (fixed-size tensors, no pickling), and :func:`choose_backend`, a pure
function of them, decides:

- every rank on its own GPU: ``nccl``;
- some ranks share a GPU: ``gloo`` over the CUDA tensors (gloo all-reduces CUDA tensors
  through host memory), naming the ranks and the GPU they share;
- every rank on the CPU, or a mix of CPU and GPU ranks: ``gloo``.

The choice and its reason are one log line (:meth:`BackendChoice.describe`).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from tensorfleet import environment
from tensorfleet.errors import ConfigError

#: Bytes of one rank's identity on the wire of the exchange (JSON, zero-padded).
IDENTITY_BYTES = 512


@dataclass(frozen=True)
class DeviceIdentity:
    """Where one rank computes. ``gpu`` is None on the CPU; else a string unique to the
    physical GPU on ``host`` (its UUID, or ``index:<physical index>``). ``label`` is for
    people: ``"GPU 0 (NVIDIA H200) of host-a"``."""

    host: str
    gpu: str | None
    label: str

    def to_bytes(self) -> bytes:
        """The identity as JSON (at most :data:`IDENTITY_BYTES`)."""
        raw = json.dumps({"host": self.host, "gpu": self.gpu, "label": self.label}).encode()
        if len(raw) > IDENTITY_BYTES:
            raw = json.dumps(
                {"host": self.host[:100], "gpu": (self.gpu or "")[:100] or None, "label": ""}
            ).encode()
        return raw

    @classmethod
    def from_bytes(cls, raw: bytes) -> DeviceIdentity:
        """The identity :meth:`to_bytes` wrote (trailing zero bytes ignored)."""
        fields = json.loads(raw.rstrip(b"\0"))
        return cls(host=str(fields["host"]), gpu=fields["gpu"], label=str(fields["label"]))


@dataclass(frozen=True)
class BackendChoice:
    """The backend of the group and why; ``shared`` lists the ranks of each shared GPU."""

    backend: str
    reason: str
    shared: Mapping[str, tuple[int, ...]]

    def describe(self, rank: int) -> str:
        """The log line: ``worker 0: all-reduce over nccl: ...``."""
        return f"worker {rank}: all-reduce over {self.backend}: {self.reason}"


def choose_backend(identities: Sequence[DeviceIdentity]) -> BackendChoice:
    """The backend for ranks computing on ``identities`` (index = rank). NCCL only when
    every rank has a GPU and no two ranks have the same one."""
    if not identities:
        raise ConfigError("an all-reduce group needs at least one rank")
    on_gpu = [i for i, identity in enumerate(identities) if identity.gpu is not None]
    if not on_gpu:
        return BackendChoice("gloo", "every worker computes on the CPU", {})
    if len(on_gpu) != len(identities):
        on_cpu = [i for i in range(len(identities)) if i not in on_gpu]
        return BackendChoice(
            "gloo",
            f"worker(s) {_ranks(on_cpu)} compute on the CPU and worker(s) {_ranks(on_gpu)} on "
            "a GPU; NCCL needs a GPU in every worker",
            {},
        )
    by_gpu: dict[tuple[str, str], list[int]] = {}
    for rank, identity in enumerate(identities):
        by_gpu.setdefault((identity.host, identity.gpu or ""), []).append(rank)
    shared = {
        identities[ranks[0]].label: tuple(ranks) for ranks in by_gpu.values() if len(ranks) > 1
    }
    if shared:
        where = "; ".join(f"workers {_ranks(list(r))} on {label}" for label, r in shared.items())
        return BackendChoice(
            "gloo",
            f"workers share a GPU ({where}) and NCCL refuses two workers on one GPU; gloo "
            "all-reduces the CUDA gradients through host memory (slower). Give each worker its "
            "own GPU for NCCL: more GPUs, or fewer workers (tensorfleet launch gives one GPU "
            "per worker while there are enough)",
            shared,
        )
    return BackendChoice("nccl", f"each of the {len(identities)} worker(s) has its own GPU", {})


def device_identity(
    device: torch.device,
    *,
    environ: Mapping[str, str] | None = None,
    hostname: Callable[[], str] = socket.gethostname,
    uuid_of: Callable[[int], str | None] | None = None,
    name_of: Callable[[int], str] | None = None,
) -> DeviceIdentity:
    """Where this process computes on ``device``. A GPU is named by its UUID when torch
    gives one, else by its physical index (``CUDA_VISIBLE_DEVICES`` maps the process's index
    to the host's). The callables default to socket and torch.cuda (tests pass their own)."""
    host = hostname()
    if device.type != "cuda":
        return DeviceIdentity(host, None, f"the CPU of {host}")
    index = device.index if device.index is not None else 0
    env = environment.environ() if environ is None else environ
    physical = _physical_index(index, env.get(environment.CUDA_VISIBLE_DEVICES_VAR))
    uuid = (uuid_of or _cuda_uuid)(index)
    name = (name_of or torch.cuda.get_device_name)(index)
    return DeviceIdentity(
        host,
        uuid if uuid else f"index:{physical}",
        f"GPU {physical} ({name}) of {host}",
    )


def _physical_index(index: int, visible: str | None) -> str:
    """The host's name for the process's GPU ``index``: the ``index``-th entry of
    ``CUDA_VISIBLE_DEVICES`` when set, else ``index`` itself."""
    if visible is None:
        return str(index)
    entries = [part.strip() for part in visible.split(",") if part.strip()]
    return entries[index] if index < len(entries) else str(index)


def _cuda_uuid(index: int) -> str | None:  # pragma: no cover - needs a GPU
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else None


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def encode_identity(identity: DeviceIdentity) -> torch.Tensor:
    """``identity`` as a zero-padded uint8 tensor of :data:`IDENTITY_BYTES` (for all_gather)."""
    raw = identity.to_bytes()
    buffer = torch.zeros(IDENTITY_BYTES, dtype=torch.uint8)
    buffer[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buffer


def decode_identity(buffer: torch.Tensor) -> DeviceIdentity:
    """The identity :func:`encode_identity` wrote."""
    return DeviceIdentity.from_bytes(buffer.numpy().tobytes())
