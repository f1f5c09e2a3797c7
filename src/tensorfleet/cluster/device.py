"""Device strings in TensorFlow's form: ``/job:worker/replica:0/task:1/device:GPU:0``.

A :class:`DeviceSpec` names where something runs or lives: a task of the cluster and,
optionally, one of its devices. Any part may be left unset, and :meth:`DeviceSpec.merge`
fills unset parts from an outer scope the way nested ``tf.device`` blocks do.

The semantics are TensorFlow's ``tf.DeviceSpec`` (``tensorflow/python/framework/device_spec.py``):

- fields ``job``, ``replica``, ``task``, ``device_type``, ``device_index``, each optional;
- accepted spellings: ``/job:NAME``, ``/replica:N``, ``/task:N``, ``/device:TYPE:N``,
  ``/device:TYPE:*``, and the short forms ``/TYPE:N``, ``/TYPE:*`` and ``/TYPE``, in any
  order, the leading ``/`` optional; ``cpu``/``gpu`` in any case (``cuda`` too) are
  normalized to ``CPU``/``GPU`` as TensorFlow does;
- :meth:`to_string` is TensorFlow's canonical form, in the order job, replica, task, device
  (``/device:GPU:*`` for a type without index), so canonical strings compare equal;
- merging is field by field: each field the inner spec sets overrides, each it leaves unset
  is inherited (so ``/gpu:1`` merged with ``/cpu`` gives ``/device:CPU:1``, as in TF).

Where tensorfleet is stricter than TensorFlow, on purpose (each is a likely typo that TF would
silently accept): a field given twice in one string is an error (TF keeps the last job, task
or replica); device types other than CPU and GPU are refused (torch has nothing to run
``TPU`` or ``MyFunnyDevice`` here); an index must be a non-negative integer. Every error
names the string and the bad part.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from tensorfleet.cluster.spec import check_job_name, check_task_index, show
from tensorfleet.errors import ClusterConfigError

#: Accepted spellings of device types (compared lowercased) and the canonical type each names.
DEVICE_TYPES = {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU"}
#: Device types of TensorFlow and torch that tensorfleet does not place on: ``/tpu:1`` is
#: refused as an unknown device type, as ``/device:TPU:1`` is, not as an unknown part.
OTHER_DEVICE_TYPES = frozenset(
    {"tpu", "xpu", "mps", "ipu", "hpu", "npu", "mlu", "mtia", "xla", "xla_cpu", "xla_gpu", "meta"}
)

_DIGITS_RE = re.compile(r"[0-9]+")
_FORMS = (
    "'/job:NAME', '/replica:N', '/task:N', '/device:CPU:N', '/device:GPU:N', '/cpu:N', "
    "'/gpu:N' (the device index N may be '*' for any)"
)


@dataclass(frozen=True)
class DeviceSpec:
    """A (partial) device name: job, task, device type and index, and replica; each optional.

    ``device_type`` is ``"CPU"`` or ``"GPU"``; ``"cpu"``, ``"gpu"`` and ``"cuda"`` (any
    case) are accepted and normalized, so ``DeviceSpec(device_type="cuda")`` has
    ``device_type == "GPU"``. A ``device_index`` needs a ``device_type``. ``replica`` is a
    keyword (it is TensorFlow's second field, but was added last here so that positional
    ``DeviceSpec(job, task, device_type, device_index)`` keeps working). ``str()`` gives
    :meth:`to_string`.
    """

    job: str | None = None
    task: int | None = None
    device_type: str | None = None
    device_index: int | None = None
    replica: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.job is not None:
            check_job_name(self.job, "device spec: job")
        if self.replica is not None:
            _check_int(self.replica, "device spec: replica")
        if self.task is not None:
            _check_int(self.task, "device spec: task")
        if self.device_type is not None:
            object.__setattr__(self, "device_type", _device_type(self.device_type))
        if self.device_index is not None:
            _check_int(self.device_index, "device spec: device index")
            if self.device_type is None:
                raise ClusterConfigError(
                    f"device spec: device index {self.device_index} without a device type; "
                    "give device_type='CPU' or 'GPU' as well"
                )

    @classmethod
    def parse(cls, text: str) -> DeviceSpec:
        """Read a device string; every part is optional and the leading ``/`` too.

        Accepted: ``"/job:worker/replica:0/task:1/device:GPU:0"``, ``"/job:ps/task:0/cpu:0"``,
        ``"/cpu:0"``, ``"/gpu:1"``, ``"/device:CPU:*"``, ``"/job:worker"``, ``"gpu:0"``,
        ``""`` (nothing set). Raises :class:`ClusterConfigError` naming the string and the
        bad part for an unknown part, a bad index, an unknown device type, or a part given
        twice.
        """
        if not isinstance(text, str):
            raise ClusterConfigError(
                f"a device string must be a str such as '/job:worker/task:0/device:GPU:0', "
                f"got {show(text)} of type {type(text).__name__}"
            )
        body = text.strip()
        body = body[1:] if body.startswith("/") else body
        if not body:
            return cls()
        values: dict[str, object] = {}
        seen: set[str] = set()
        for part in body.split("/"):
            pieces = part.split(":")
            key = pieces[0]
            if key in ("job", "replica", "task") and len(pieces) == 2:
                fields: dict[str, object] = {key: _field_value(key, pieces[1], text)}
                name = key
            elif (key == "device" and len(pieces) in (2, 3)) or (
                key.lower() in DEVICE_TYPES.keys() | OTHER_DEVICE_TYPES and len(pieces) in (1, 2)
            ):
                name = "device"
                if key == "device":
                    pieces = pieces[1:]
                fields = {"device_type": _device_type(pieces[0], text)}
                if len(pieces) == 2:
                    fields["device_index"] = _index(pieces[1], text, "device", allow_any=True)
            else:
                raise ClusterConfigError(
                    f"device string {text!r}: unknown part {part!r}; the parts are {_FORMS}"
                )
            if name in seen:
                raise ClusterConfigError(
                    f"device string {text!r} gives the {name} twice; give it once"
                )
            seen.add(name)
            values.update(fields)
        return cls(
            job=values.get("job"),  # type: ignore[arg-type]
            task=values.get("task"),  # type: ignore[arg-type]
            device_type=values.get("device_type"),  # type: ignore[arg-type]
            device_index=values.get("device_index"),  # type: ignore[arg-type]
            replica=values.get("replica"),  # type: ignore[arg-type]
        )

    #: TensorFlow's name for :meth:`parse`.
    from_string = parse

    def to_string(self) -> str:
        """TensorFlow's canonical string, omitting unset parts:
        ``"/job:worker/replica:0/task:1/device:GPU:0"``, ``"/device:CPU:0"``,
        ``"/device:GPU:*"`` (a type without index), ``""`` (nothing set)."""
        out = ""
        if self.job is not None:
            out += f"/job:{self.job}"
        if self.replica is not None:
            out += f"/replica:{self.replica}"
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
        ``DeviceSpec.make_merged_spec``: an inner device scope (``other``) refines an outer
        one (``self``). ``other`` may be a device string."""
        if isinstance(other, str):
            other = DeviceSpec.parse(other)
        if not isinstance(other, DeviceSpec):
            raise ClusterConfigError(
                f"can only merge a DeviceSpec or a device string, got {show(other)} of type "
                f"{type(other).__name__}"
            )
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(other, f.name)
                for f in dataclasses.fields(other)
                if getattr(other, f.name) is not None
            },
        )

    #: TensorFlow's name for :meth:`merge`.
    make_merged_spec = merge

    def replace(self, **changes: object) -> DeviceSpec:
        """A copy with the given fields changed (``None`` unsets one), as TensorFlow's
        ``DeviceSpec.replace``: ``spec.replace(task=None, replica=12)``."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ClusterConfigError(
                f"DeviceSpec has no field(s) {sorted(unknown)}; the fields are job, replica, "
                "task, device_type, device_index"
            )
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def names_task(self) -> bool:
        """Whether the spec names a job or a task (a place in the cluster, not only a device)."""
        return self.job is not None or self.task is not None or self.replica is not None

    def device_only(self) -> DeviceSpec:
        """The device part alone: ``/job:worker/task:1/device:GPU:0`` -> ``/device:GPU:0``."""
        return DeviceSpec(device_type=self.device_type, device_index=self.device_index)

    def torch_device(self) -> str:
        """The device as ``torch.device`` takes it: ``"cpu"`` when no type is set or it is
        CPU; ``"cuda:N"`` for ``GPU:N``, and ``"cuda"`` (torch's current CUDA device) for a
        GPU without an index. Whether the machine has it is checked by
        :func:`tensorfleet.worker.device.torch_device`."""
        if self.device_type != "GPU":
            return "cpu"
        return "cuda" if self.device_index is None else f"cuda:{self.device_index}"


def _check_int(value: object, where: str) -> int:
    """Like :func:`check_task_index` but for Python callers: an ``int``, not a digit string."""
    if isinstance(value, str):
        raise ClusterConfigError(f"{where} must be an int, got the string {value!r}")
    return check_task_index(value, where)


def _field_value(key: str, value: str, text: str) -> object:
    if key == "job":
        return check_job_name(value, f"device string {text!r}: job")
    return _index(value, text, key, allow_any=False)


def _device_type(value: object, text: str | None = None) -> str:
    where = "device spec" if text is None else f"device string {text!r}"
    if not isinstance(value, str) or value.lower() not in DEVICE_TYPES:
        raise ClusterConfigError(
            f"{where}: unknown device type {show(value)}; use 'CPU' or 'GPU' "
            "('cpu', 'gpu' and 'cuda' are accepted too)"
        )
    return DEVICE_TYPES[value.lower()]


def _index(value: str, text: str, what: str, *, allow_any: bool) -> int | None:
    if allow_any and value == "*":
        return None
    if not _DIGITS_RE.fullmatch(value):
        wanted = "a non-negative integer" + (" or '*'" if allow_any else "")
        raise ClusterConfigError(f"device string {text!r}: {what} index {value!r} is not {wanted}")
    return int(value)
