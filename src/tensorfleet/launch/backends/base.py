"""The interface between the supervisor and a backend that runs the tasks' processes.

A backend does three things: it gives each task an address to listen on
(:meth:`Backend.allocate`, before any task starts, so that the cluster spec in every task's
``TF_CONFIG`` is known), it starts a task's command as a new process group with the
variables the launcher sets (:meth:`Backend.spawn`), and it hands back a :class:`TaskProcess`
through which the supervisor signals that process group and learns how it ended. Output
lines and the exit are reported through callbacks, from the backend's own threads; the
supervisor turns them into events on its queue, so a backend never decides anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence


class TaskProcess(ABC):
    """One running (or ended) process of a task, and its process group."""

    #: The process id on its host; also its process group id.
    pid: int
    #: Where it runs: ``"local"``, or the node's address for a remote backend.
    host: str

    @property
    @abstractmethod
    def returncode(self) -> int | None:
        """``Popen.returncode`` once the process has ended and was reaped (negative: killed
        by that signal), else None."""

    @abstractmethod
    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the process group; False when the group no longer exists (or,
        for ``sig`` 0, has no member left)."""

    @abstractmethod
    def finish_output(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the last output lines to be delivered."""


#: Called with one output line (without its ending), from a backend thread.
LineCallback = Callable[[str], None]
#: Called once the process has ended (its ``returncode`` is set), from a backend thread.
ExitCallback = Callable[[], None]


class Backend(ABC):
    """Runs the tasks' processes for a :class:`~tensorfleet.launch.supervisor.ClusterSupervisor`."""

    #: A short name for messages: ``"local"``, ``"ray"``.
    name: str

    @abstractmethod
    def allocate(self, names: Sequence[str], held: Collection[str] = ()) -> list[str]:
        """One ``host:port`` address per task name (``"worker:1"``), in order, each free on
        the host where that task will run. ``held``: the tasks whose program binds its port
        with ``SO_REUSEADDR`` (tensorfleet's own server): a backend that can keeps their
        ports bound for the run, so that no other process takes one before the task binds
        it or while it restarts (:class:`~tensorfleet.launch.ports.PortReservation`); the
        others' ports are only free when chosen. Raises
        :class:`~tensorfleet.errors.LaunchError` when the addresses cannot be found."""

    @abstractmethod
    def spawn(
        self,
        name: str,
        command: Sequence[str],
        variables: Mapping[str, str],
        cwd: str | None,
        on_line: LineCallback,
        on_exit: ExitCallback,
    ) -> TaskProcess:
        """Start ``command`` for task ``name`` in a new process group, with ``variables``
        added to the environment of the host. Raises ``OSError`` when it cannot be started."""

    @abstractmethod
    def environment(self, variables: Mapping[str, str]) -> dict[str, str]:
        """The complete environment a task started with ``variables`` gets (as far as this
        process can know it)."""

    def close(self) -> None:
        """Release what the backend holds (connections, actors). Idempotent."""
        return None
