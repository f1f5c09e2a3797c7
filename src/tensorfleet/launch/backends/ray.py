"""The Ray backend: every task a process started by its own Ray actor on an existing Ray
cluster (``tensorfleet launch --backend ray --ray-address HOST:PORT``).

One actor per task (:class:`~tensorfleet.launch.backends.ray_actor.TaskRunner`), placed
with Ray's ``SPREAD`` strategy and ``cpus_per_task`` CPUs each (and ``gpus_per_task`` GPUs
each worker; ps tasks reserve none).
Before any task starts, each actor reserves its task's address on its node (the node's IP
and a free port), so that ``TF_CONFIG`` names where every task really runs. The actor then
starts the task's command on its node in its own process group; a thread per task here
drains its output lines (prefixed like the local backend's) and learns its exit.

Restarts are the launcher's, not Ray's: every actor is created with ``max_restarts=0``, and
the supervisor applies the same :mod:`~tensorfleet.launch.restart_policy` as for local
processes, restarting the task's command in the same actor, hence on the same node with the
same address (its identity in ``TF_CONFIG``). Ray's actor restarts would restart the actor
process, not the task's command; they cannot tell a preemption (a signal) from a Python
exception (an exit code); and a restarted actor may land on another node, where the
address in every other task's ``TF_CONFIG`` would be wrong. A task whose actor is lost (its
node died) is reported as killed by SIGKILL; its restart then fails, since the actor is
gone, and the run stops with that report.

Trust: Ray moves its calls with its own serialization inside the Ray cluster, which must
be trusted as a whole (anyone who can reach a Ray cluster can run code on it). The cluster
secret goes to each actor as an argument, inside that boundary. Between tasks, tensorfleet
speaks its own authenticated protocol, as with every backend.

Every node needs the same Python environment and paths as the launcher (``sys.executable``
runs the built-in ps; the command's paths are taken relative to the launcher's working
directory), as Ray itself expects of a job's code.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from tensorfleet.errors import LaunchConfigError, LaunchError, ListenError
from tensorfleet.launch.backends.base import Backend, ExitCallback, LineCallback, TaskProcess
from tensorfleet.launch.backends.ray_actor import TaskRunner

#: Seconds to wait for the Ray cluster's address to accept a connection.
CONNECT_TIMEOUT_S = 5.0
#: Seconds to wait for every actor to be placed and answer (resources may be busy).
PLACEMENT_TIMEOUT_S = 60.0
#: Seconds for one call to an actor (start a process, send a signal).
CALL_TIMEOUT_S = 30.0
#: Seconds one output read waits for a line inside the actor.
READ_WAIT_S = 1.0
#: The Ray namespace of the launcher's actors.
NAMESPACE = "tensorfleet"


class RayProcess(TaskProcess):
    """A task's process on a Ray node, through its actor."""

    def __init__(self, actor: Any, pid: int, host: str, ray: Any):
        self._actor = actor
        self._ray = ray
        self.pid = pid
        self.host = host
        self._returncode: int | None = None
        self.pump: threading.Thread | None = None

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def signal_group(self, sig: int) -> bool:
        try:
            return bool(self._ray.get(self._actor.signal.remote(sig), timeout=CALL_TIMEOUT_S))
        except Exception:  # the actor is gone (its node died): so is its process
            return False

    def finish_output(self, timeout: float) -> None:
        if self.pump is not None and self.pump is not threading.current_thread():
            self.pump.join(timeout)


class RayBackend(Backend):
    """Runs every task through a Ray actor on the Ray cluster at ``address``.

    Args:
        address: the Ray cluster's GCS address, ``HOST:PORT`` as ``ray start --head``
            prints it; None: ``$RAY_ADDRESS``, else ``"auto"`` (a cluster started on this
            machine). Never starts a new Ray instance.
        cpus_per_task: CPUs Ray reserves for each task's actor.
        gpus_per_task: GPUs Ray reserves for each worker task's actor (Ray sets
            ``CUDA_VISIBLE_DEVICES`` in it accordingly); ps tasks get none.
        cwd: the tasks' working directory on their nodes (default: the launcher's).

    Raises :class:`~tensorfleet.errors.LaunchConfigError` before anything starts when Ray is
    not installed or the address does not answer.
    """

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        *,
        cpus_per_task: float = 1.0,
        gpus_per_task: float = 0.0,
        cwd: str | None = None,
    ):
        if cpus_per_task < 0 or gpus_per_task < 0:
            raise LaunchConfigError(
                f"resources per task must be >= 0, got cpus={cpus_per_task}, gpus={gpus_per_task}"
            )
        try:
            import ray
        except ImportError as exc:
            raise LaunchConfigError(
                f"the Ray backend needs the ray package ({exc}); install it with "
                "pip install 'tensorfleet[ray]'"
            ) from exc
        self._ray = ray
        self.address = address or os.environ.get("RAY_ADDRESS") or "auto"
        self.cpus_per_task = cpus_per_task
        self.gpus_per_task = gpus_per_task
        self.cwd = os.getcwd() if cwd is None else cwd
        self._actors: dict[str, Any] = {}
        self._hosts: dict[str, str] = {}
        self._closed = False
        _check_answers(self.address)
        try:
            ray.init(
                address=self.address,
                namespace=NAMESPACE,
                log_to_driver=False,
                logging_level="ERROR",
                configure_logging=False,
            )
        except Exception as exc:  # ConnectionError, RuntimeError: Ray's message says why
            defaulted = not address and not os.environ.get("RAY_ADDRESS")
            raise LaunchConfigError(_connect_error(self.address, defaulted, exc)) from exc

    def gpus_for(self, name: str) -> float:
        """GPUs Ray reserves for task ``name``'s actor: ``gpus_per_task`` for a worker, none
        for a ps task (its variables live in host memory: a GPU would sit idle)."""
        return 0.0 if name.partition(":")[0] == "ps" else self.gpus_per_task

    def allocate(self, names: Sequence[str], held: Collection[str] = ()) -> list[str]:
        """Each actor reserves its task's address on its node (``held``: not kept there)."""
        ray = self._ray
        runners: dict[float, Any] = {}
        for name in names:
            gpus = self.gpus_for(name)
            if gpus not in runners:
                runners[gpus] = ray.remote(TaskRunner).options(
                    num_cpus=self.cpus_per_task,
                    num_gpus=gpus,
                    max_restarts=0,
                    max_concurrency=4,  # a read blocks while a signal must get through
                    scheduling_strategy="SPREAD",
                )
            self._actors[name] = runners[gpus].remote()
        refs = [self._actors[name].reserve_address.remote() for name in names]
        try:
            addresses = ray.get(refs, timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            resources = ray.available_resources()
            self.close()
            raise LaunchError(
                f"the Ray cluster at {self.address} did not place {len(names)} task actors "
                f"within {PLACEMENT_TIMEOUT_S:g} s: each asks for {self.cpus_per_task:g} CPU(s) "
                f"and each worker {self.gpus_per_task:g} GPU(s) (--ray-cpus-per-task, "
                "--ray-gpus-per-task) "
                f"and the cluster has available {resources}"
            ) from None
        except Exception as exc:
            self.close()
            raise LaunchError(f"cannot create the task actors on the Ray cluster: {exc}") from exc
        for name, address in zip(names, addresses, strict=True):
            self._hosts[name] = address.rpartition(":")[0].strip("[]")
        return list(addresses)

    def environment(self, variables: Mapping[str, str]) -> dict[str, str]:
        # Each node's own environment, plus these; the launcher cannot see the nodes'.
        return dict(variables)

    def spawn(
        self,
        name: str,
        command: Sequence[str],
        variables: Mapping[str, str],
        cwd: str | None,
        on_line: LineCallback,
        on_exit: ExitCallback,
    ) -> RayProcess:
        ray = self._ray
        actor = self._actors[name]
        try:
            pid = ray.get(
                actor.start.remote(list(command), dict(variables), cwd or self.cwd),
                timeout=CALL_TIMEOUT_S,
            )
        except Exception as exc:  # the command cannot start there, or the actor is gone
            cause = getattr(exc, "cause", None) or exc
            raise ListenError(f"on Ray node {self._hosts.get(name, '?')}: {cause}") from exc
        process = RayProcess(actor, int(pid), self._hosts.get(name, "?"), ray)

        def pump() -> None:
            while True:
                try:
                    lines, returncode = ray.get(
                        actor.read.remote(READ_WAIT_S), timeout=READ_WAIT_S + CALL_TIMEOUT_S
                    )
                except Exception as exc:  # the actor (or its node) is gone
                    on_line(f"(lost this task's Ray actor on {process.host}: {exc})")
                    process._returncode = -signal.SIGKILL
                    break
                for line in lines:
                    on_line(line)
                if returncode is not None:
                    process._returncode = int(returncode)
                    break
            on_exit()

        process.pump = threading.Thread(target=pump, name=f"tensorfleet-ray-{name}", daemon=True)
        process.pump.start()
        return process

    def close(self) -> None:
        """Kill every task actor (their processes die with them) and disconnect."""
        if self._closed:
            return
        self._closed = True
        for actor in self._actors.values():
            try:
                self._ray.get(actor.signal.remote(signal.SIGKILL), timeout=CALL_TIMEOUT_S)
            except Exception:
                pass  # no process, or the actor is already gone
            try:
                self._ray.kill(actor)
            except Exception:
                pass
        self._actors.clear()
        self._ray.shutdown()


def _connect_error(address: str, defaulted: bool, exc: BaseException) -> str:
    """The message for a ``ray.init`` that failed at ``address`` (``defaulted``: neither the
    caller nor ``$RAY_ADDRESS`` gave one, so it is ``"auto"``): Ray's own reason (its
    trailing full stop dropped, as the sentence goes on), then the fix."""
    reason = str(exc).strip().rstrip(".") or type(exc).__name__
    if defaulted:
        where = "'auto' (the default: no --ray-address given and $RAY_ADDRESS not set)"
    else:
        where = repr(address)
    return (
        f"cannot connect to the Ray cluster at {where}: {reason}. Start one with "
        "`ray start --head` and pass the address it prints (--ray-address HOST:PORT)"
    )


def _check_answers(address: str) -> None:
    """Raise :class:`LaunchConfigError` when ``HOST:PORT`` does not accept a connection
    within :data:`CONNECT_TIMEOUT_S` (``"auto"`` is left to Ray)."""
    if address == "auto" or address.startswith("ray://"):
        if address.startswith("ray://"):
            raise LaunchConfigError(
                f"--ray-address {address!r}: Ray Client addresses (ray://) are not supported; "
                "run the launcher on a node of the cluster and pass the GCS address HOST:PORT "
                "that `ray start --head` prints"
            )
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise LaunchConfigError(
            f"--ray-address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379, as "
            "`ray start --head` prints it)"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise LaunchConfigError(
            f"the Ray cluster at {address} does not answer ({exc}); nothing was started. Start "
            "one with `ray start --head --port PORT`, check it with `ray status --address "
            f"{address}`, or pass the right --ray-address"
        ) from exc
