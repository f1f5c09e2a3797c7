"""The cluster description: which jobs exist, which tasks each job has, and their addresses.

:class:`ClusterSpec` mirrors TensorFlow's ``tf.train.ClusterSpec`` (same constructor forms, same
``as_dict`` / ``jobs`` / ``num_tasks`` / ``task_indices`` / ``task_address`` / ``job_tasks``
semantics) so that programs and launch scripts written for Distributed TensorFlow move over
unchanged. Unlike TensorFlow it checks everything up front: a malformed spec fails where it is
built, with a :class:`~tensorfleet.errors.ClusterConfigError` that names the bad value and the
fix, instead of as a connection timeout on some other machine minutes later.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from tensorfleet.errors import ClusterConfigError

#: Job names as TensorFlow accepts them in device strings ("/job:worker"): a letter, then
#: letters, digits or underscores. Anything else (":", "/") would make task ids and device
#: strings ambiguous.
JOB_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_HOSTNAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_DIGITS_RE = re.compile(r"[0-9]+")

#: The job whose task 0 leads training when the cluster has it (else ``worker:0`` does).
CHIEF_JOB = "chief"
#: The job of the tasks that train.
WORKER_JOB = "worker"

_EXAMPLE = '{"ps": ["ps0:2222"], "worker": ["worker0:2222", "worker1:2222"]}'


def show(value: object, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about user input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_job_name(job: object, where: str = "job name") -> str:
    """Return ``job`` if it is a valid job name, else raise :class:`ClusterConfigError`."""
    if not isinstance(job, str):
        raise ClusterConfigError(
            f"{where} must be a string such as 'worker' or 'ps', got {show(job)} "
            f"of type {type(job).__name__}"
        )
    if not job:
        raise ClusterConfigError(f"{where} is empty; name the job, e.g. 'worker' or 'ps'")
    if not JOB_NAME_RE.fullmatch(job):
        raise ClusterConfigError(
            f"{where} {show(job)} is not valid: use a letter followed by letters, digits or "
            "underscores (as TensorFlow does), e.g. 'worker', 'ps', 'chief'"
        )
    return job


def check_task_index(index: object, where: str = "task index") -> int:
    """Return ``index`` as an ``int`` if it is a non-negative integer (or a string of digits,
    as JSON object keys are), else raise :class:`ClusterConfigError`."""
    if isinstance(index, str) and _DIGITS_RE.fullmatch(index):
        return int(index)
    if isinstance(index, bool) or not isinstance(index, int):
        raise ClusterConfigError(
            f"{where} must be a non-negative integer, got {show(index)} of type "
            f"{type(index).__name__}"
        )
    if index < 0:
        raise ClusterConfigError(f"{where} must be a non-negative integer, got {index}")
    return index


class TaskId(NamedTuple):
    """One task of the cluster: a job name and an index within that job.

    ``str(TaskId("worker", 1)) == "worker:1"``, and :meth:`parse` reads that form back.
    """

    job: str
    index: int

    def __str__(self) -> str:
        return f"{self.job}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> TaskId:
        """Read ``"job:index"`` (e.g. ``"worker:1"``); raise :class:`ClusterConfigError` if
        it is not that form."""
        if not isinstance(text, str) or ":" not in text:
            raise ClusterConfigError(
                f"a task id is written 'job:index', e.g. 'worker:1'; got {show(text)}"
            )
        job, _, index = text.rpartition(":")
        where = f"task id {show(text)}:"
        return cls(check_job_name(job, f"{where} job name"), _parse_index(index, where))


def _parse_index(text: str, where: str) -> int:
    if not _DIGITS_RE.fullmatch(text):
        raise ClusterConfigError(
            f"{where} task index must be a non-negative integer, got {show(text)}"
        )
    return int(text)


class Address(NamedTuple):
    """A task's network address. ``host`` is as written, without the brackets of an IPv6
    literal; ``str()`` puts them back (``"[::1]:2222"``)."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_address(address: object, where: str = "address") -> Address:
    """Split ``"host:port"`` into an :class:`Address`, checking both parts.

    Hosts may be names (``"worker0"``, ``"node1.example.org"``), IPv4 addresses or bracketed
    IPv6 addresses (``"[::1]:2222"``). Ports must be integers in 1..65535.
    """
    if not isinstance(address, str):
        raise ClusterConfigError(
            f"{where} must be a 'host:port' string, got {show(address)} of type "
            f"{type(address).__name__}"
        )
    if "://" in address:
        raise ClusterConfigError(
            f"{where} {show(address)} has a URL scheme; write just 'host:port', e.g. 'worker0:2222'"
        )
    if address.startswith("["):
        close = address.find("]")
        if close < 0 or not address[close + 1 :].startswith(":"):
            raise ClusterConfigError(
                f"{where} {show(address)} is not '[ipv6]:port'; write e.g. '[::1]:2222'"
            )
        host, port_text = address[1:close], address[close + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ClusterConfigError(
                f"{where} {show(address)}: {show(host)} inside the brackets is not an IPv6 "
                "address; brackets are only for IPv6 literals such as '[::1]:2222'"
            ) from None
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise ClusterConfigError(
                f"{where} {show(address)} has no port; write 'host:port', e.g. "
                f"'{address or 'worker0'}:2222'"
            )
        if ":" in host:
            raise ClusterConfigError(
                f"{where} {show(address)}: IPv6 addresses must be in brackets, e.g. '[::1]:2222'"
            )
        if not host:
            raise ClusterConfigError(
                f"{where} {show(address)} has an empty host; write 'host:port', "
                f"e.g. 'localhost{address}'"
            )
        if not _HOSTNAME_RE.fullmatch(host):
            raise ClusterConfigError(
                f"{where} {show(address)}: host {show(host)} may only hold letters, digits, "
                "'.', '-' and '_' (or be a bracketed IPv6 address)"
            )
    if not _DIGITS_RE.fullmatch(port_text):
        raise ClusterConfigError(
            f"{where} {show(address)}: port {show(port_text)} is not an integer; "
            "write 'host:port' with a port in 1..65535"
        )
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ClusterConfigError(
            f"{where} {show(address)}: port {port} is out of range; use 1..65535"
        )
    return Address(host, port)


def _address_key(address: Address) -> tuple[str, int]:
    """A form in which two spellings of the same address compare equal."""
    host = address.host.lower()
    if ":" in host:
        host = str(ipaddress.IPv6Address(host))
    return host, address.port


def _json_object_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for :func:`json.loads` that refuses repeated keys, which
    ``json`` would otherwise resolve silently by keeping the last one."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ClusterConfigError(f"key {show(key)} appears twice in the same JSON object")
        out[key] = value
    return out


def loads_json(text: object, what: str) -> Any:
    """Parse JSON text, turning every failure into a :class:`ClusterConfigError` that
    names ``what`` was being read."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise ClusterConfigError(f"{what} must be JSON text, got {type(text).__name__}")
    try:
        return json.loads(text, object_pairs_hook=_json_object_no_duplicates)
    except ClusterConfigError as e:
        raise ClusterConfigError(f"{what}: {e}") from None
    except ValueError as e:
        raise ClusterConfigError(f"{what} is not valid JSON ({e}); got {show(text)}") from None


class ClusterSpec:
    """The set of jobs of a cluster and the address of each of their tasks.

    Built from, like ``tf.train.ClusterSpec``:

    - a dict mapping job name to a list of ``"host:port"`` (task ``i`` is the ``i``-th entry):
      ``ClusterSpec({"ps": ["ps0:2222"], "worker": ["w0:2222", "w1:2222"]})``;
    - a dict mapping job name to ``{index: "host:port"}`` for *sparse* jobs, where only some
      tasks are known to this process (indices may be ints or digit strings, as JSON keys are):
      ``ClusterSpec({"worker": {1: "w1:2222"}})``;
    - another ``ClusterSpec`` (copied), or JSON text through :meth:`from_json`.

    Everything is validated here; :class:`ClusterConfigError` names the bad value. A spec is
    immutable, hashable, and compares equal to another spec (or dict) with the same tasks.
    """

    __slots__ = ("_jobs",)

    def __init__(self, cluster: ClusterSpec | Mapping[str, Any]) -> None:
        if isinstance(cluster, ClusterSpec):
            self._jobs: dict[str, dict[int, str]] = {
                job: dict(tasks) for job, tasks in cluster._jobs.items()
            }
            return
        if not isinstance(cluster, Mapping):
            raise ClusterConfigError(
                "a cluster spec must be a dict mapping job names to lists of 'host:port' "
                f"addresses, e.g. {_EXAMPLE}; got {show(cluster)} of type "
                f"{type(cluster).__name__}"
            )
        for job in cluster:
            check_job_name(job, "cluster spec: job name")
        self._jobs = {job: _parse_job_tasks(job, cluster[job]) for job in sorted(cluster)}
        _check_addresses(self._jobs)

    @classmethod
    def from_json(cls, text: str | bytes) -> ClusterSpec:
        """Build a spec from JSON text holding the dict form (as :meth:`to_json` writes)."""
        return cls(loads_json(text, "cluster spec JSON"))

    def to_json(self, indent: int | None = None) -> str:
        """The :meth:`as_dict` form as JSON (sparse indices become string keys);
        :meth:`from_json` reads it back to an equal spec."""
        return json.dumps(self.as_dict(), indent=indent, sort_keys=True)

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """A dict job -> tasks, exactly as TensorFlow returns it: a list of addresses for a
        job whose indices are 0..n-1, a dict ``{index: address}`` for a sparse job, and an
        empty dict for a job without tasks."""
        out: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            if not tasks:
                out[job] = {}
            elif max(tasks) + 1 == len(tasks):
                out[job] = [tasks[i] for i in range(len(tasks))]
            else:
                out[job] = dict(tasks)
        return out

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return list(self._jobs)

    def num_tasks(self, job_name: str) -> int:
        """How many tasks ``job_name`` has (for a sparse job: how many are listed)."""
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The indices of the tasks of ``job_name``, sorted."""
        return list(self._job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The ``"host:port"`` address of one task."""
        tasks = self._job(job_name)
        index = check_task_index(task_index, f"task index of job {job_name!r}")
        if index not in tasks:
            raise ClusterConfigError(
                f"job {job_name!r} has no task {index}; its task indices are {list(tasks)}"
            )
        return tasks[index]

    def job_tasks(self, job_name: str) -> list[str | None]:
        """The addresses of ``job_name``'s tasks as a list indexed by task index, with
        ``None`` for indices a sparse job does not list (as TensorFlow returns it)."""
        tasks = self._job(job_name)
        if not tasks:
            return []
        out: list[str | None] = [None] * (max(tasks) + 1)
        for index, address in tasks.items():
            out[index] = address
        return out

    def tasks(self) -> Iterator[TaskId]:
        """Every task of the cluster, jobs in sorted order, indices ascending."""
        for job, tasks in self._jobs.items():
            for index in tasks:
                yield TaskId(job, index)

    def chief_task(self) -> TaskId:
        """The chief, the one rule every layer uses: task 0 of job ``"chief"`` when the
        cluster has that job (TensorFlow's and Kubeflow's convention), otherwise ``worker:0``.
        The chief creates (or restores) the variables, saves checkpoints and declares the end
        of training; in all-reduce mode it is rank 0 and the rendezvous."""
        return TaskId(CHIEF_JOB, 0) if CHIEF_JOB in self._jobs else TaskId(WORKER_JOB, 0)

    def training_tasks(self) -> list[TaskId]:
        """Every task that trains, in rank order: the chief job's (if any), then the workers."""
        return [
            TaskId(job, index)
            for job in (CHIEF_JOB, WORKER_JOB)
            if job in self._jobs
            for index in self.task_indices(job)
        ]

    def _job(self, job_name: str) -> dict[int, str]:
        try:
            return self._jobs[job_name]
        except (KeyError, TypeError):
            raise ClusterConfigError(
                f"no job {show(job_name)} in the cluster; its jobs are {self.jobs}"
            ) from None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClusterSpec):
            return self._jobs == other._jobs
        if isinstance(other, Mapping):
            try:
                return self._jobs == ClusterSpec(other)._jobs
            except ClusterConfigError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple((job, tuple(tasks.items())) for job, tasks in self._jobs.items()))

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def _parse_job_tasks(job: str, tasks: object) -> dict[int, str]:
    """One job's tasks (list or sparse dict) as ``{index: address}`` sorted by index; checks
    the indices and the container, :func:`_check_addresses` checks the addresses."""
    if isinstance(tasks, Mapping):
        out: dict[int, Any] = {}
        for key, address in tasks.items():
            index = check_task_index(key, f"cluster spec: job {job!r}: task index")
            if index in out:
                raise ClusterConfigError(
                    f"cluster spec: job {job!r} lists task {index} twice "
                    f"(keys {show(list(tasks))}); give each index once"
                )
            out[index] = address
        return dict(sorted(out.items()))
    if isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence):
        raise ClusterConfigError(
            f"cluster spec: job {job!r} must map to a list of 'host:port' addresses "
            f"(or a dict {{index: 'host:port'}} for a sparse job), got {show(tasks)}; "
            f"e.g. {{{job!r}: ['host0:2222', 'host1:2222']}}"
        )
    for index, address in enumerate(tasks):
        if address is None:
            raise ClusterConfigError(
                f"cluster spec: task {job}:{index} has no address (None); for a sparse job, "
                "give a dict {index: 'host:port'} of the tasks that exist instead of a list"
            )
    return dict(enumerate(tasks))


def _check_addresses(jobs: Mapping[str, Mapping[int, str]]) -> None:
    """Every address must be a valid 'host:port', and no two tasks may share one: they could
    not both listen on it, so catch it here rather than as a bind error on some machine."""
    seen: dict[tuple[str, int], TaskId] = {}
    for job, tasks in jobs.items():
        for index, address in tasks.items():
            key = _address_key(
                parse_address(address, f"cluster spec: address of task {job}:{index}")
            )
            if key in seen:
                raise ClusterConfigError(
                    f"cluster spec: tasks {seen[key]} and {job}:{index} both have address "
                    f"{address!r}; every task needs its own host:port"
                )
            seen[key] = TaskId(job, index)
