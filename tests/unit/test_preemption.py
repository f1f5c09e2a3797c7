"""A SIGTERM is a preemption (``session/preemption.py``, ``ps/preemption_drain.py``): the
notice itself, a ps that waits for the chief's checkpoint before it ends (and what it waits
for), a worker that leaves (lost at once, its identity free), and a one-process session
that saves and exits with status 143 at the end of the step it is in, then resumes there.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import tensorfleet as tfl
from tensorfleet import task_markers
from tensorfleet.errors import PREEMPTED_EXIT_STATUS, ConfigError, Preempted
from tensorfleet.launch.ports import free_port
from tensorfleet.preemption_event import preempted
from tensorfleet.ps.placement import VariableSpec, plan_placement
from tensorfleet.ps.preemption_drain import PreemptionDrain
from tensorfleet.ps.service_settings import ServiceSettings
from tensorfleet.ps.update_rules import SGD
from tensorfleet.ps.worker_roster import WorkerRoster
from tensorfleet.session.preemption import PreemptionNotice
from tensorfleet.session.server import Server, ServerConfig
from tensorfleet.wire.tensors import dtype_name
from tensorfleet.worker.client import ParameterClient
from tensorfleet.worker.timeouts import ClientTimeouts

pytestmark = pytest.mark.timeout(60)

SECRET = b"preemption-unit-test-secret-0000000000"
TIMEOUTS = ClientTimeouts(connect_s=10.0, initialize_s=10.0, step_s=10.0, recover_s=5.0)


# -- the notice ------------------------------------------------------------------------------


def test_sigterm_inside_the_notice_is_a_notice_and_the_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    called = threading.Event()
    with PreemptionNotice(called.set) as notice:
        assert notice.installed
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (the main) thread
        assert notice.received.wait(5.0) and called.is_set()
    assert signal.getsignal(signal.SIGTERM) is before


def test_outside_the_main_thread_nothing_is_installed() -> None:
    seen: list[bool] = []

    def enter() -> None:
        with PreemptionNotice() as notice:
            seen.append(notice.installed)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join(5.0)
    assert seen == [False]


def test_a_second_sigterm_ends_the_process_at_once() -> None:
    """In a child process: the first SIGTERM is a notice, the second kills it by SIGTERM."""
    import subprocess
    import sys

    program = (
        "import os, signal, time\n"
        "from tensorfleet.session.preemption import PreemptionNotice\n"
        "with PreemptionNotice() as n:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    assert n.received.wait(5)\n"
        "    print('noticed', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(10)\n"
        "print('not reached', flush=True)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=30
    )
    assert run.stdout == "noticed\n", run.stdout + run.stderr
    assert run.returncode == -signal.SIGTERM, run.stderr


def test_preempted_is_a_system_exit_with_status_143() -> None:
    error = Preempted("worker:0: preempted at global step 7")
    assert isinstance(error, SystemExit) and not isinstance(error, Exception)
    assert error.code == PREEMPTED_EXIT_STATUS == 143
    assert str(error) == "worker:0: preempted at global step 7"


def test_a_negative_preempt_grace_is_refused() -> None:
    with pytest.raises(ConfigError, match="preempt_grace_s"):
        ServiceSettings(preempt_grace_s=-1.0)


# -- the drain's rule ----------------------------------------------------------------------


class FakeService:
    def __init__(self, answer: bool | None) -> None:
        self.answer = answer
        self.checkpoint_wanted = False

    def chief_saved_since(self, when: float) -> bool | None:
        return self.answer


def test_the_drain_waits_only_for_models_whose_chief_will_save() -> None:
    drain = PreemptionDrain(time.monotonic(), grace_s=60.0)
    services = {"": FakeService(False), "b": FakeService(None), "c": FakeService(True)}
    drain.start(services)
    assert all(s.checkpoint_wanted for s in services.values())
    assert not drain.drained(services)  # the default model's chief has not saved yet
    services[""].answer = True
    assert drain.drained(services)


def test_the_drain_says_what_status_143_means_without_promising_a_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The ps cannot tell a preemption from the launcher stopping the cluster after an error
    (or a user's kill), where nothing restarts it: its line must be true in both cases."""
    drain = PreemptionDrain(time.monotonic(), grace_s=30.0, task="ps:1")
    with caplog.at_level(logging.WARNING, logger="tensorfleet.ps"):
        drain.start({"": FakeService(False)})
    assert caplog.messages == [
        "ps:1: SIGTERM: asking the chief for a checkpoint, then exiting with status 143 "
        "(within 30 s), which a launcher or cluster manager that restarts tasks treats as a "
        "preemption (it restarts this task; when the cluster is being stopped, nothing "
        "restarts it)"
    ]
    assert "to be restarted" not in caplog.text


def test_the_drain_ends_at_its_grace_period(caplog: pytest.LogCaptureFixture) -> None:
    drain = PreemptionDrain(time.monotonic() - 2.0, grace_s=1.0, task="ps:3")
    with caplog.at_level(logging.WARNING, logger="tensorfleet.ps"):
        assert drain.drained({"m": FakeService(False)})
    assert "ps:3: no checkpoint from the chief of 'm' within 1 s" in caplog.text


# -- a worker that leaves ------------------------------------------------------------------


def test_a_worker_that_left_is_lost_at_once_and_its_identity_is_free() -> None:
    now = [100.0]
    roster = WorkerRoster(("worker:0", "worker:1"), 15.0, clock=lambda: now[0])
    roster.claim("worker:1", "old-process", b"s1")
    roster.heard_from("worker:1")
    roster.mark_left("worker:1")
    change = roster.check_liveness()
    assert change.newly_lost == ("worker:1",) and roster.left == {"worker:1"}
    roster.claim("worker:1", "new-process", b"s2")  # no takeover flag needed
    assert roster.holders["worker:1"] == "new-process"
    assert "worker:1" not in roster.lost and not roster.left


# -- a ps task: waits for the chief's checkpoint, then Preempted -----------------------------


def _ps_and_chief(
    grace_s: float, saves_checkpoints: bool, timeouts: ClientTimeouts = TIMEOUTS
) -> tuple[Server, ParameterClient, dict[str, nn.Parameter]]:
    address = f"127.0.0.1:{free_port()}"
    cluster = {"ps": [address], "worker": ["127.0.0.1:1"]}  # the worker's address is unused
    server = Server(cluster, "ps", 0, secret=SECRET, config=ServerConfig(preempt_grace_s=grace_s))
    params = {"w": nn.Parameter(torch.ones(3, 2)), "b": nn.Parameter(torch.zeros(2))}
    specs = [VariableSpec(n, tuple(p.shape), dtype_name(p.dtype), 4) for n, p in params.items()]
    client = ParameterClient([address], SECRET, "worker:0", timeouts)
    client.connect()
    client.saves_checkpoints = saves_checkpoints
    client.register(list(params.items()), plan_placement(specs, 1), SGD(lr=0.5), is_chief=True)
    return server, client, params


def _join_in_thread(server: Server) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def join() -> None:
        try:
            server.join(30.0)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            raised.append(exc)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread, raised


def test_a_preempted_ps_asks_the_chief_and_ends_right_after_its_checkpoint() -> None:
    server, client, params = _ps_and_chief(grace_s=30.0, saves_checkpoints=True)
    thread, raised = _join_in_thread(server)
    try:
        for param in params.values():
            param.grad = torch.ones_like(param)
        assert not client.push_pull().checkpoint_requested
        server.preempt()  # what SIGTERM does during join(); the loop sees it between requests
        pushes = 1
        while not (progress := client.push_pull()).checkpoint_requested and pushes < 50:
            pushes += 1
        pushes += 1
        assert progress.checkpoint_requested and progress.global_step == pushes
        assert thread.is_alive(), "the ps must wait for the chief's checkpoint"
        global_step, documents = client.save()
        thread.join(10.0)
        assert not thread.is_alive(), "the ps must end right after the checkpoint"
        started = time.monotonic()
        client.leave()  # the ps said it ends: no 'leave' that would wait for its silence
        assert time.monotonic() - started < 1.0
    finally:
        client.close()
    assert global_step == pushes and len(documents) == 1
    assert len(raised) == 1 and isinstance(raised[0], Preempted), raised
    assert raised[0].code == 143 and str(raised[0]) == (
        f"ps:0: SIGTERM at global step {pushes}; exiting with status 143, which a launcher or "
        "cluster manager that restarts tasks treats as a preemption"
    )
    assert server.outcome is not None and server.outcome.reason == "preempted"


def test_a_ps_whose_chief_keeps_no_checkpoints_ends_at_once() -> None:
    server, client, _ = _ps_and_chief(grace_s=30.0, saves_checkpoints=False)
    thread, raised = _join_in_thread(server)
    try:
        started = time.monotonic()
        server.preempt()
        thread.join(10.0)
        assert not thread.is_alive() and time.monotonic() - started < 5.0
    finally:
        client.close()
    assert [type(e) for e in raised] == [Preempted]


def test_a_ps_gives_up_on_the_checkpoint_after_its_grace_period() -> None:
    server, client, _ = _ps_and_chief(grace_s=0.5, saves_checkpoints=True)
    thread, raised = _join_in_thread(server)
    try:
        server.preempt()  # the chief never saves
        thread.join(10.0)
        assert not thread.is_alive()
    finally:
        client.close()
    assert [type(e) for e in raised] == [Preempted]


# -- a one-process session: saves at the end of the step, exits 143, resumes there ----------


def test_a_session_saves_at_the_end_of_the_step_and_exits_with_143(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def loss() -> torch.Tensor:
        if sess.global_step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while step 5 computes
        return nn.functional.mse_loss(model(x), y)

    # Should the session not take SIGTERM, this handler does (instead of ending pytest).
    leaked: list[int] = []

    def fallback(signum: int, frame: object) -> None:
        leaked.append(signum)

    before = signal.signal(signal.SIGTERM, fallback)
    try:
        with pytest.raises(Preempted) as preempted:
            with tfl.TrainingSession(
                None, model, optimizer=tfl.optim.SGD(lr=0.1), checkpoint_dir=tmp_path / "ckpt"
            ) as sess:
                while not sess.should_stop() and sess.global_step < 20:
                    sess.step(loss)
        assert signal.getsignal(signal.SIGTERM) is fallback  # the session restored it
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not leaked, "the session did not take the SIGTERM"
    assert preempted.value.code == 143
    assert "preempted at global step 5" in str(preempted.value)
    saved = dict(model.state_dict())

    resumed = nn.Linear(4, 1)
    with tfl.TrainingSession(
        None, resumed, optimizer=tfl.optim.SGD(lr=0.1), checkpoint_dir=tmp_path / "ckpt"
    ) as again:
        assert again.global_step == 5
        for name, value in resumed.state_dict().items():
            assert torch.equal(value, saved[name]), name
        again.request_stop()


def test_a_preempted_session_leaves_the_left_marker_once_its_checkpoint_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a launcher (its marker directory in the environment), a preempted session leaves
    ``task_markers.LEFT`` with its pid, after its checkpoint (the launcher hands the task's
    identity to a restart as soon as it sees it: launch/preempted_handover.py)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv(task_markers.MARKERS_VAR, str(markers))
    checkpoints = tmp_path / "ckpt"
    saved_at_mark: list[list[str]] = []
    mark_left = task_markers.mark_left

    def recording(task_name: str) -> None:
        saved_at_mark.append(sorted(p.name for p in checkpoints.glob("step-*")))
        mark_left(task_name)

    monkeypatch.setattr(task_markers, "mark_left", recording)
    model = nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def loss() -> torch.Tensor:
        if sess.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return nn.functional.mse_loss(model(x), y)

    leaked: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: leaked.append(signum))
    try:
        with pytest.raises(Preempted):
            with tfl.TrainingSession(
                None, model, optimizer=tfl.optim.SGD(lr=0.1), checkpoint_dir=checkpoints
            ) as sess:
                while not sess.should_stop() and sess.global_step < 20:
                    sess.step(loss)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not leaked, "the session did not take the SIGTERM"
    assert saved_at_mark == [["step-00000003"]], "the marker came before the checkpoint"
    assert (markers / "local.left").read_text() == str(os.getpid())


# -- a worker preempted while the parameter servers are unreachable ------------------------


def test_a_worker_preempted_while_recovering_exits_at_once_instead_of_retrying() -> None:
    """A recovery retries for ``recover_s`` (minutes by default) while no ps answers; a SIGTERM
    then has nothing left to save, so the recovery ends at once with Preempted (status 143)
    instead of outlasting the grace period and being killed.

    The recovery's hello waits for the stopped ps (up to 10 s, not given up for the
    heartbeat's silence: it is how the recovery learns that the ps is back) when the signal
    comes, and that wait ends on it."""
    patient = ClientTimeouts(
        connect_s=10.0,
        initialize_s=10.0,
        step_s=10.0,
        recover_s=60.0,
        heartbeat_s=0.1,
        ps_silence_s=0.5,
    )
    server, client, _ = _ps_and_chief(grace_s=5.0, saves_checkpoints=False, timeouts=patient)
    server.stop()
    server.join(10.0)  # its loop has ended: nothing answers any more
    with PreemptionNotice() as notice:
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        try:
            with pytest.raises(Preempted, match="unreachable") as raised:
                client.recover(ConnectionError("test: the ps went away"))
        finally:
            timer.cancel()
            client.close()
        assert notice.received.is_set()
    # Not DeadlineExceeded after the 60 s: the recovery gave up on the signal.
    assert raised.value.code == PREEMPTED_EXIT_STATUS
    assert not preempted()  # cleared with the handler: the next session starts clear


def test_a_worker_preempted_while_saying_hello_exits_at_once_instead_of_waiting() -> None:
    """A worker whose parameter servers are not up yet waits for their hello answer for
    ``connect_s`` (a minute by default); a SIGTERM meanwhile has nothing to save, so the
    wait ends at once with Preempted (status 143) instead of outlasting the cluster
    manager's grace period and being killed (a launcher stopping a cluster whose ps never
    started had to SIGKILL every worker after 15 s)."""
    nobody = f"127.0.0.1:{free_port()}"
    patient = ClientTimeouts(connect_s=60.0, initialize_s=10.0, step_s=10.0)
    client = ParameterClient([nobody], SECRET, "worker:0", patient)
    with PreemptionNotice() as notice:
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        try:
            with pytest.raises(Preempted, match="waiting for ps:0 to answer 'hello'") as raised:
                client.connect()
        finally:
            timer.cancel()
            client.close()
        assert notice.received.is_set()
    # Not DeadlineExceeded after 60 s: the hello gave up on the signal.
    assert raised.value.code == PREEMPTED_EXIT_STATUS
    assert not preempted()


def test_a_chief_lost_by_silence_is_waited_for_and_one_that_left_or_finished_is_not() -> None:
    """The drain's question to one model's service: a chief silent past the liveness timeout
    may come back within the grace (its SIGSTOP ends, its spare takes over) and then saves,
    so the drain keeps waiting (False); a chief that finished or left (preempted, its own
    checkpoint written) will not save again (None); a save after the notice drains (True)."""
    from tensorfleet.ps.save_restore import SaveRestoreHandling

    roster = WorkerRoster(("worker:0", "worker:1"), liveness_timeout_s=15.0)
    service = type(
        "Shard", (), {"checkpointing_chief": "worker:0", "roster": roster, "last_save_at": None}
    )()
    ask = SaveRestoreHandling.chief_saved_since
    roster.lost = {"worker:0"}  # silent for the liveness timeout
    assert ask(service, 100.0) is False  # wait: it may come back
    service.last_save_at = 101.0
    assert ask(service, 100.0) is True
    service.last_save_at = None
    roster.left = {"worker:0"}
    assert ask(service, 100.0) is None
    roster.left, roster.done = set(), {"worker:0"}
    assert ask(service, 100.0) is None


def test_a_draining_shard_is_known_by_its_process_and_a_restart_is_not() -> None:
    """A worker's ``leave`` skips the shards whose current process asked for a checkpoint
    (preempted: it ends once the chief wrote one), not a restarted process in its place."""
    from tensorfleet.wire.channel import Reply
    from tensorfleet.worker.shard_fanout import ShardFanout

    class Answering:
        def __init__(self, body: dict) -> None:
            self.body, self.server_session = body, b"first"

        def send(self, *args: object) -> int:
            return 1

        def pending_op(self, request_id: int) -> str:
            return "push"

        def wait(self, request_id: int, timeout_s: float, abort: object = None) -> Reply:
            return Reply(dict(self.body))

    draining, serving = Answering({"checkpoint": True}), Answering({})
    fanout = ShardFanout([draining, serving], heartbeat=None)  # type: ignore[list-item, arg-type]
    fanout.call("push", {}, 1.0, abort_when_silent=False)
    assert fanout.draining() == {0}
    draining.server_session = b"restarted"  # the client recovered to a new process there
    assert fanout.draining() == set()


def test_a_childs_death_is_never_raised_into_a_preemptions_exit() -> None:
    """torch's SIGCHLD handler raises when a loader's worker died: after the notice, once
    the session is leaving (its exit, a preempted worker's leave: what the suite saw cut
    short, the chief's checkpoint never written) and after the notice's own exit (the
    marker, the teardown), it is logged, not raised."""

    def torch_like(signum: int, frame: object) -> None:
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")

    before = signal.signal(signal.SIGCHLD, torch_like)
    try:
        notice = PreemptionNotice(busy=lambda: False)
        with notice:
            os.kill(os.getpid(), signal.SIGTERM)
            assert notice.received.wait(5.0)
            with pytest.raises(RuntimeError, match="DataLoader worker"):  # a loop's wait
                signal.raise_signal(signal.SIGCHLD)
            notice.leaving()
            signal.raise_signal(signal.SIGCHLD)  # logged, kept
        signal.raise_signal(signal.SIGCHLD)  # after the exit too
        assert len(notice.deferred) == 2
    finally:
        signal.signal(signal.SIGCHLD, before)
