"""A worker's network link is cut for a few seconds in the middle of training; the cluster
must ride it out.

One ps and two workers, each on its own "host" (a network namespace with its own address on a
shared bridge). Once worker 1 has made progress, its link goes down for about four seconds
(every packet to or from it dropped, as when a cable is pulled), then comes back. Expected:
worker 1 carries on where it was (same process, progress after the link is back), every task
ends by itself with status 0, and the chief's weights are still the closed-form ridge
solution.
"""

from __future__ import annotations

import importlib.util
import json
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import pytest
import torch

from .hosts import Children, free_port, task_env
from .netns import NetworkNamespaces

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(180)]

PROGRAMS = Path(__file__).parent / "programs"
WORKER_PROGRAM = PROGRAMS / "link_worker.py"
#: Where the dataset that link_worker.py trains on, and its closed-form solution, are defined.
RIDGE_PROGRAM = Path(__file__).parents[1] / "cluster" / "programs" / "ridge_worker.py"

#: Global steps of the whole run, and the pause after each local step: about 15-20 s.
STEPS = 2000
STEP_SLEEP_S = 0.01
#: Worker 1's link is cut once it reports at least this global step...
CUT_AFTER_STEP = 100
#: ...for this long.
CUT_SECONDS = 4.0
#: Deadline for worker 1's first progress (includes starting Python and torch everywhere).
FIRST_PROGRESS_DEADLINE_S = 60.0
#: Deadline for every process to exit, from the moment the link is restored. Longer than the
#: worker's step timeout (120 s), so that a step lost to the cut shows as the worker's own
#: error rather than as a process still running.
EXIT_DEADLINE_S = 140.0
#: Worker 1 lines that arrive this soon after the cut may have been printed just before it.
CUT_SLACK_S = 0.5

PROGRESS = re.compile(
    r"^progress worker=(?P<worker>\d+) pid=(?P<pid>\d+) "
    r"global_step=(?P<step>\d+) local_steps=(?P<local>\d+)$"
)
START = re.compile(r"^start worker=(?P<worker>\d+) pid=(?P<pid>\d+)$")

T = TypeVar("T")


def _ridge_program() -> ModuleType:
    """The cluster tests' ridge worker as a module, for the closed form of the dataset that
    ``link_worker.py`` trains on (it imports the dataset from there)."""
    spec = importlib.util.spec_from_file_location("ridge_worker", RIDGE_PROGRAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sockets(net: NetworkNamespaces, ns: int) -> str:
    """The TCP sockets of namespace ``ns`` with their timers and retransmission state."""
    done = subprocess.run(
        net.exec_argv(ns, ["ss", "-tanoi"]), capture_output=True, text=True, timeout=30
    )
    return (done.stdout + done.stderr).strip()


def _progress(lines: list[tuple[float, str]]) -> list[tuple[float, int, int]]:
    """``(arrival time, pid, global step)`` of every progress line."""
    found = []
    for at, text in lines:
        match = PROGRESS.match(text)
        if match:
            found.append((at, int(match["pid"]), int(match["step"])))
    return found


def test_worker_rides_out_a_cut_link(
    network_namespaces: Callable[[int], NetworkNamespaces], tmp_path: Path
) -> None:
    """Cut worker 1's link for CUT_SECONDS mid-training: it must recover, in the same process,
    and the cluster must still finish cleanly with the closed-form weights."""
    net = network_namespaces(3)  # ps:0 on the first, worker:0 and worker:1 on the others
    hosts = {"ps:0": 0, "worker:0": 1, "worker:1": 2}
    ports = {name: free_port(net, ns) for name, ns in hosts.items()}
    address = {name: f"{net.address(ns)}:{ports[name]}" for name, ns in hosts.items()}
    cluster = {"ps": [address["ps:0"]], "worker": [address["worker:0"], address["worker:1"]]}
    secret = secrets.token_hex(32)
    out = tmp_path / "weights.json"

    children = Children()
    diagnostics: list[str] = []

    def report(message: str) -> str:
        return (
            f"{message}\ncluster: {cluster}\noutput (seconds since start):\n"
            + children.transcript()
            + "".join(f"\n{text}" for text in diagnostics)
        )

    try:
        children.start(
            "ps:0",
            net.exec_argv(hosts["ps:0"], [sys.executable, "-m", "tensorfleet", "server"]),
            task_env(cluster, "ps", 0, secret),
        )
        for index in (0, 1):
            name = f"worker:{index}"
            argv = [sys.executable, str(WORKER_PROGRAM), str(out), str(STEPS), str(STEP_SLEEP_S)]
            children.start(
                name, net.exec_argv(hosts[name], argv), task_env(cluster, "worker", index, secret)
            )
        pids = {name: child.process.pid for name, child in children.children.items()}

        def worker1_under_way() -> int | None:
            steps = [step for _, _, step in _progress(children.children["worker:1"].lines)]
            return next((step for step in steps if step >= CUT_AFTER_STEP), None)

        step_at_cut = children.wait_for(worker1_under_way, FIRST_PROGRESS_DEADLINE_S)
        assert step_at_cut is not None, report(
            f"worker:1 reported no global step >= {CUT_AFTER_STEP} within "
            f"{FIRST_PROGRESS_DEADLINE_S:.0f} s"
        )

        net.cut_link(hosts["worker:1"])
        cut_at = children.note(f"cut worker:1's link (it reported global step {step_at_cut})")
        assert not net.link_is_up(hosts["worker:1"]), report("the link did not go down")
        time.sleep(CUT_SECONDS)
        exited = [
            name for name, child in children.children.items() if child.process.poll() is not None
        ]
        net.restore_link(hosts["worker:1"])
        restored_at = children.note(f"restored worker:1's link after {CUT_SECONDS:g} s")
        assert net.link_is_up(hosts["worker:1"]), report("the link did not come back up")
        assert not exited, report(f"{exited} exited while worker:1's link was cut")

        codes = children.wait_all(EXIT_DEADLINE_S)
        if None in codes.values():  # something hangs: say where, before killing it
            diagnostics.extend(
                f"TCP sockets in {name}'s namespace:\n{_sockets(net, ns)}"
                for name, ns in hosts.items()
            )
            children.dump_stacks(["worker:0", "worker:1"])
    finally:
        children.kill_all()

    # Every task ended by itself, successfully.
    failed = {name: code for name, code in codes.items() if code != 0}
    assert not failed, report(
        f"tasks that did not exit 0 within {EXIT_DEADLINE_S:.0f} s of the restore "
        f"(None: still running, killed): {failed}"
    )

    # The same processes throughout: one start each, every line from the pid we started.
    for index in (0, 1):
        name = f"worker:{index}"
        lines = children.lines_of(name)
        starts = [int(m["pid"]) for _, text in lines if (m := START.match(text))]
        seen = {pid for _, pid, _ in _progress(lines)} | set(starts)
        assert starts == [pids[name]] and seen == {pids[name]}, report(
            f"{name} was started as pid {pids[name]} but reported starts {starts} and "
            f"progress from pids {sorted(seen)}: it was restarted"
        )

    # The cut was real: no progress from worker 1 while its link was down...
    progress1 = _progress(children.lines_of("worker:1"))
    during = [step for at, _, step in progress1 if cut_at + CUT_SLACK_S < at < restored_at]
    assert not during, report(
        f"worker:1 reported global steps {during} while its link was cut: the cut had no effect"
    )
    # ...and it recovered: progress after the link came back.
    after = [(at - restored_at, step) for at, _, step in progress1 if at > restored_at]
    assert after, report(
        "worker:1 reported no progress after its link was restored (it did not recover)"
    )

    # The chief's final weights are still the closed-form ridge solution.
    assert out.exists(), report(f"the chief wrote no weights to {out}")
    closed_form = _ridge_program().closed_form()
    trained = torch.tensor(json.loads(out.read_text())["weight"], dtype=torch.float64)
    error = (trained - closed_form).abs().max().item()
    assert error < 1e-3, report(f"max |trained - closed form| = {error:.2e}")
    print(
        f"worker:1 recovered {after[0][0]:.2f} s after the link came back (global step "
        f"{after[0][1]}); max |trained - closed form| = {error:.2e}"
    )
    print(children.transcript())
