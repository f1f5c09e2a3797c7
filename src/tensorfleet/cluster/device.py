"""Device strings in TensorFlow's form: ``/job:worker/task:1/device:gpu:0``.

A :class:`DeviceSpec` names where something runs or lives: a task of the cluster and,
optionally, one of its devices. Any part may be left unset, and :meth:`DeviceSpec.merge`
fills unset parts from an outer scope the way nested ``tf.device`` blocks do.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from tensorfleet.cluster.spec import check_job_name, check_task_index, show
from tensorfleet.errors import ClusterConfigError

#: Accepted spellings of device types (compared lowercased) and the canonical type each names.
DEVICE_TYPES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu"}

_DIGITS_RE = re.compile(r"[0-9]+")
_FORMS = (
    "'/job:NAME', '/replica:0', '/task:N', '/device:cpu:N', '/device:gpu:N', '/cpu:N', "
    "'/gpu:N' (N may be '*' for any)"
)


@dataclass(frozen=True)
class DeviceSpec:
    """A (partial) device name: job, task, device type and device index, each optional.

    ``device_type`` is ``"cpu"`` or ``"gpu"``; ``"CPU"``, ``"GPU"`` and ``"cuda"`` are
    accepted and normalized, so ``DeviceSpec(device_type="cuda")`` has ``device_type == "gpu"``.
    A ``device_index`` needs a ``device_type``. ``str()`` gives :meth:`to_string`.
    """

    job: str | None = None
    task: int | None = None
    device_type: str | None = None
    device_index: int | None = None

    def __post_init__(self) -> None:
        if self.job is not None:
            check_job_name(self.job, "device spec: job")
        if self.task is not None:
            _check_int(self.task, "device spec: task")
        if self.device_type is not None:
            object.__setattr__(self, "device_type", _device_type(self.device_type))
        if self.device_index is not None:
            _check_int(self.device_index, "device spec: device index")
            if self.device_type is None:
                raise ClusterConfigError(
                    f"device spec: device index {self.device_index} without a device type; "
                    "give device_type='cpu' or 'gpu' as well"
                )

    @classmethod
    def parse(cls, text: str) -> DeviceSpec:
        """Read a device string; every part is optional and the leading ``/`` too.

        Accepted: ``"/job:worker/task:1/device:gpu:0"``, ``"/job:ps/task:0/cpu:0"``,
        ``"/cpu:0"``, ``"/gpu:1"``, ``"/device:GPU:0"``, ``"/job:worker"``, ``"gpu:0"``,
        ``""`` (nothing set). ``replica:0`` (always 0 in TensorFlow's between-graph setting)
        is accepted and ignored. Raises :class:`ClusterConfigError` naming the string for an
        unknown field, a bad index, or a field given twice.
        """
        if not isinstance(text, str):
            raise ClusterConfigError(
                f"a device string must be a str such as '/job:worker/task:0/device:gpu:0', "
                f"got {show(text)} of type {type(text).__name__}"
            )
        body = text.strip()
        body = body[1:] if body.startswith("/") else body
        if not body:
            return cls()
        job: str | None = None
        task: int | None = None
        device_type: str | None = None
        device_index: int | None = None
        seen: set[str] = set()
        for part in body.split("/"):
            pieces = part.split(":")
            key = pieces[0]
            if key == "job" and len(pieces) == 2:
                field = "job"
                job = check_job_name(pieces[1], f"device string {text!r}: job")
            elif key == "task" and len(pieces) == 2:
                field = "task"
                task = _index(pieces[1], text, "task", allow_any=False)
            elif key == "replica" and len(pieces) == 2:
                field = "replica"
                if pieces[1] != "0":
                    raise ClusterConfigError(
                        f"device string {text!r}: replica {pieces[1]!r} is not supported; "
                        "tensorfleet tasks are always replica 0 (drop the '/replica:' part)"
                    )
            elif (key == "device" and len(pieces) in (2, 3)) or (
                key.lower() in DEVICE_TYPES and len(pieces) in (1, 2)
            ):
                field = "device"
                if key == "device":
                    pieces = pieces[1:]
                device_type = _device_type(pieces[0], text)
                if len(pieces) == 2:
                    device_index = _index(pieces[1], text, "device", allow_any=True)
            else:
                raise ClusterConfigError(
                    f"device string {text!r}: unknown part {part!r}; the parts are {_FORMS}"
                )
            if field in seen:
                raise ClusterConfigError(
                    f"device string {text!r} gives the {field} twice; give it once"
                )
            seen.add(field)
        return cls(job, task, device_type, device_index)

    def to_string(self) -> str:
        """The canonical string, omitting unset parts: ``"/job:worker/task:1/device:gpu:0"``,
        ``"/device:cpu:0"``, ``"/device:gpu:*"`` (type without index), ``""`` (nothing set)."""
        out = ""
        if self.job is not None:
            out += f"/job:{self.job}"
        if self.task is not None:
            out += f"/task:{self.task}"
        if self.device_type is not None:
            index = "*" if self.device_index is None else self.device_index
            out += f"/device:{self.device_type}:{index}"
        return out

    def __str__(self) -> str:
        return self.to_string()

    def merge(self, other: DeviceSpec | str) -> DeviceSpec:
        """A spec with ``other``'s set fields and ``self``'s for the rest, as TensorFlow's
        ``DeviceSpec.make_merged_spec``: an inner device scope refines an outer one."""
        if isinstance(other, str):
            other = DeviceSpec.parse(other)
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(other, f.name)
                for f in dataclasses.fields(other)
                if getattr(other, f.name) is not None
            },
        )

    def torch_device(self) -> str:
        """The device as ``torch.device`` takes it: ``"cpu"`` when no type is set or it is
        ``cpu``; ``"cuda:N"`` for ``gpu:N``, and ``"cuda"`` (torch's current CUDA device) for
        a GPU without an index."""
        if self.device_type != "gpu":
            return "cpu"
        return "cuda" if self.device_index is None else f"cuda:{self.device_index}"


def _check_int(value: object, where: str) -> int:
    """Like :func:`check_task_index` but for Python callers: an ``int``, not a digit string."""
    if isinstance(value, str):
        raise ClusterConfigError(f"{where} must be an int, got the string {value!r}")
    return check_task_index(value, where)


def _device_type(value: object, text: str | None = None) -> str:
    where = "device spec" if text is None else f"device string {text!r}"
    if not isinstance(value, str) or value.lower() not in DEVICE_TYPES:
        raise ClusterConfigError(
            f"{where}: unknown device type {show(value)}; use 'cpu' or 'gpu' "
            "('CPU', 'GPU' and 'cuda' are accepted too)"
        )
    return DEVICE_TYPES[value.lower()]


def _index(value: str, text: str, what: str, *, allow_any: bool) -> int | None:
    if allow_any and value == "*":
        return None
    if not _DIGITS_RE.fullmatch(value):
        wanted = "a non-negative integer" + (" or '*'" if allow_any else "")
        raise ClusterConfigError(f"device string {text!r}: {what} index {value!r} is not {wanted}")
    return int(value)
