"""The launcher's restart policy: signals restarted within a window with back-off, errors not."""

from __future__ import annotations

import argparse
import signal

import pytest

from tensorfleet.errors import LaunchConfigError
from tensorfleet.launch.launch_command import add_launch_command, restart_policy_from
from tensorfleet.launch.restart_policy import (
    AT_WORK,
    DEFAULT_POLICY,
    ERROR,
    SIGNAL,
    RestartPolicy,
    failure_kind,
)


@pytest.mark.parametrize(
    ("returncode", "kind"),
    [
        (-signal.SIGKILL, SIGNAL),
        (-signal.SIGTERM, SIGNAL),
        (137, SIGNAL),  # a shell reporting SIGKILL
        (143, SIGNAL),
        (1, ERROR),  # a Python exception
        (2, ERROR),  # a bad flag
        (127, ERROR),
        (0, None),
    ],
)
def test_failure_kind(returncode: int, kind: str | None) -> None:
    assert failure_kind(returncode) == kind


def test_default_restarts_signals_with_back_off_and_not_errors() -> None:
    policy = DEFAULT_POLICY
    first = policy.decide(-signal.SIGKILL, [], now=100.0)
    assert first.restart and first.kind == SIGNAL and first.delay_s == 1.0
    assert (first.used, first.limit) == (0, 10)
    history = [(100.0 + i, SIGNAL) for i in range(4)]
    fifth = policy.decide(-signal.SIGTERM, history, now=110.0)
    assert fifth.restart and fifth.used == 4 and fifth.delay_s == 10.0  # 16 s, capped
    error = policy.decide(1, [], now=100.0)
    assert not error.restart and error.kind == ERROR and error.limit == 0


def test_limit_counts_within_the_window_only() -> None:
    policy = RestartPolicy(signal_restarts=2, window_s=60.0)
    history = [(0.0, SIGNAL), (10.0, SIGNAL)]
    assert not policy.decide(-9, history, now=50.0).restart
    later = policy.decide(-9, history, now=65.0)  # the first restart left the window
    assert later.restart and later.used == 1 and later.delay_s == 2.0
    whole_run = RestartPolicy(signal_restarts=2, window_s=None)
    assert not whole_run.decide(-9, history, now=10_000.0).restart


def test_errors_and_signals_have_their_own_limits() -> None:
    policy = RestartPolicy(signal_restarts=1, error_restarts=1)
    assert policy.decide(3, [(0.0, SIGNAL)], now=1.0).restart
    assert not policy.decide(-9, [(0.0, SIGNAL)], now=1.0).restart


def test_a_used_up_limit_names_the_option_that_sets_it() -> None:
    policy = RestartPolicy(signal_restarts=1, error_restarts=1)
    error = policy.decide(2, [(0.0, ERROR)], now=1.0)
    assert error.describe_used() == (
        "restarts used: 1 of 1, all that --error-restarts / --max-restarts allow"
    )
    kill = policy.decide(-9, [(0.0, SIGNAL)], now=1.0)
    assert kill.describe_used().endswith("all that --signal-restarts / --max-restarts allow")
    # Not used up (a restart refused because the run is stopping): no option to raise.
    assert policy.decide(-9, [], now=1.0).describe_used() == "restarts used: 0 of 1"


def test_uniform_is_what_max_restarts_always_meant() -> None:
    policy = RestartPolicy.uniform(2)
    assert (policy.signal_restarts, policy.error_restarts, policy.window_s) == (2, 2, None)
    assert RestartPolicy.never().decide(-9, [], 0.0).restart is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"signal_restarts": -1}, "signal_restarts must be an integer >= 0, got -1"),
        ({"error_restarts": -2}, "error_restarts must be an integer >= 0, got -2"),
        ({"window_s": 0.0}, "restart window must be > 0 seconds"),
        ({"backoff_s": 0.0}, "0 < backoff_s <= max_backoff_s"),
    ],
)
def test_invalid_policies_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(LaunchConfigError, match=message) as info:
        RestartPolicy(**kwargs)
    assert isinstance(info.value, ValueError)
    with pytest.raises(LaunchConfigError, match="max_restarts must be >= 0, got -1"):
        RestartPolicy.uniform(-1)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_launch_command(parser.add_subparsers())
    return parser.parse_args(["launch", *argv, "--", "python", "x.py"])


def test_flags_make_the_policy() -> None:
    assert restart_policy_from(_parse()) == DEFAULT_POLICY
    policy = restart_policy_from(_parse("--signal-restarts", "3", "--restart-window", "0"))
    assert (policy.signal_restarts, policy.error_restarts, policy.window_s) == (3, 0, None)
    policy = restart_policy_from(_parse("--restart-on-error"))
    assert policy.error_restarts == DEFAULT_POLICY.signal_restarts
    policy = restart_policy_from(_parse("--max-restarts", "4", "--error-restarts", "0"))
    assert (policy.signal_restarts, policy.error_restarts, policy.window_s) == (4, 0, None)
    with pytest.raises(LaunchConfigError, match="--signal-restarts"):
        restart_policy_from(_parse("--signal-restarts", "-1"))
    with pytest.raises(LaunchConfigError, match="--restart-window must be >= 0"):
        restart_policy_from(_parse("--restart-window", "-5"))


def test_a_task_that_ran_past_the_threshold_is_restarted_at_once() -> None:
    policy = DEFAULT_POLICY
    assert policy.crash_loop_s == 30.0
    history = [(100.0 + i, SIGNAL) for i in range(4)]  # four earlier restarts in the window
    long_run = policy.decide(-signal.SIGKILL, history, now=200.0, ran_s=84.2, streak=0)
    assert long_run.restart and long_run.delay_s == 0.0 and not long_run.crash_loop
    assert (long_run.used, long_run.limit) == (4, 10)  # it still counts toward the limit
    assert long_run.describe_wait() == (
        "at once (it ran 84.2 s, at least the crash-loop threshold of 30 s)"
    )
    quick = policy.decide(-signal.SIGKILL, history, now=200.0, ran_s=3.1, streak=0)
    assert quick.restart and quick.crash_loop and quick.delay_s == 1.0
    assert quick.describe_wait() == "in 1 s (crash-loop back-off: it ran 3.1 s, under 30 s)"
    just_under = policy.decide(-9, [], now=0.0, ran_s=29.97, streak=0)
    assert just_under.describe_wait().endswith("it ran 29.9 s, under 30 s)")


def test_a_task_that_got_to_work_is_no_crash_loop_however_short_its_run() -> None:
    """A process that left the serving marker (a ps serving its variables, a worker past its
    first step) and was then killed is restarted at once, even in a crash streak; the
    restart still counts toward the limit."""
    history = [(100.0 + i, SIGNAL) for i in range(3)]
    served = DEFAULT_POLICY.decide(-9, history, now=200.0, ran_s=12.3, streak=3, served=True)
    assert served.restart and served.delay_s == 0.0 and not served.crash_loop
    assert (served.used, served.limit) == (3, 10)
    assert served.describe_wait() == (
        "at once (it ran 12.3 s, under the crash-loop threshold of 30 s, but got to work "
        "first: no crash loop)"
    )
    not_served = DEFAULT_POLICY.decide(-9, history, now=200.0, ran_s=12.3, streak=3)
    assert not_served.crash_loop and not_served.delay_s == 8.0
    limited = RestartPolicy(signal_restarts=3).decide(-9, history, 200.0, 1.0, 0, served=True)
    assert not limited.restart


def test_the_back_off_doubles_with_quick_deaths_in_a_row_only() -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=10.0, crash_loop_s=30.0)
    delays = [policy.decide(-9, [], now=0.0, ran_s=2.0, streak=n).delay_s for n in range(6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    # exactly the threshold is no crash loop; 0 never backs off
    assert policy.decide(-9, [], now=0.0, ran_s=30.0, streak=3).delay_s == 0.0
    never = RestartPolicy(crash_loop_s=0.0)
    assert never.decide(-9, [], now=0.0, ran_s=0.0, streak=5).delay_s == 0.0


def test_a_flapping_task_still_uses_up_its_limit_however_long_it_ran() -> None:
    policy = RestartPolicy(signal_restarts=2, crash_loop_s=30.0)
    history = [(0.0, SIGNAL), (100.0, SIGNAL)]
    decision = policy.decide(-9, history, now=200.0, ran_s=99.0, streak=0)
    assert not decision.restart and decision.used == 2
    assert "all that --signal-restarts / --max-restarts allow" in decision.describe_used()


def test_the_crash_loop_threshold_flag() -> None:
    assert restart_policy_from(_parse("--crash-loop-seconds", "5")).crash_loop_s == 5.0
    assert restart_policy_from(_parse("--crash-loop-seconds", "0")).crash_loop_s == 0.0
    with pytest.raises(LaunchConfigError, match="--crash-loop-seconds"):
        restart_policy_from(_parse("--crash-loop-seconds", "-1"))


def test_a_task_killed_while_it_worked_is_restarted_whatever_the_count_and_not_counted() -> None:
    """A signal death after the process got to work and ran at least the crash-loop
    threshold is a preemption or a lost machine, not a crash loop: restarted even with the
    limit used up, recorded as AT_WORK, and AT_WORK entries do not count. A death before work,
    or sooner than the threshold, still counts; --max-restarts (uniform) counts everything."""
    policy = RestartPolicy(signal_restarts=2, crash_loop_s=30.0)
    history = [(0.0, SIGNAL), (50.0, SIGNAL)]  # the limit is used up
    worked = policy.decide(-9, history, now=100.0, ran_s=41.3, streak=0, served=True)
    assert worked.restart and not worked.counted and worked.delay_s == 0.0
    assert worked.history_kind == AT_WORK
    assert worked.describe_count() == "not counted: it worked 41.3 s; 2 of 2 used"
    storm = [(float(t), AT_WORK) for t in range(0, 600, 40)]  # 15 deaths at work in 10 min
    assert policy.decide(-9, storm, now=600.0, ran_s=1.0, streak=0).restart  # still 0 used
    assert policy.decide(-9, storm, now=600.0, ran_s=1.0, streak=0).used == 0
    short = policy.decide(-9, history, now=100.0, ran_s=12.0, streak=0, served=True)
    assert not short.restart and short.counted  # worked, but died 12 s into its run
    unserved = policy.decide(-9, history, now=100.0, ran_s=99.0, streak=0)
    assert not unserved.restart and unserved.counted  # never got to work
    error = RestartPolicy(error_restarts=1).decide(1, [(0.0, ERROR)], 100.0, 99.0, 0, served=True)
    assert not error.restart and error.counted  # an error exit is never a preemption
    uniform = RestartPolicy.uniform(2).decide(-9, history, 100.0, 41.3, 0, served=True)
    assert not uniform.restart and uniform.counted
    first = policy.decide(-9, [], now=100.0, ran_s=5.0, streak=0, served=True)
    assert first.counted and first.describe_count() == "restart 1 of 2"


def test_a_ps_the_launcher_replaced_after_it_worked_is_not_counted() -> None:
    """A process the launcher killed because it stayed stopped (launch/stopped_ps.py) did not
    crash: once it had got to work it is restarted at once with the limit used up and not
    counted, however short its run (a storm stopping the ps every half minute used up its 10
    restarts in 5 minutes before). One stopped before it got to work counts, so a process
    stopped at every start ends at the limit; --max-restarts counts everything."""
    policy = RestartPolicy(signal_restarts=2, crash_loop_s=30.0)
    history = [(0.0, SIGNAL), (50.0, SIGNAL)]  # the limit is used up
    replaced = policy.decide(-9, history, 100.0, 12.1, 3, served=True, replaced=True)
    assert replaced.restart and not replaced.counted and replaced.delay_s == 0.0
    assert replaced.history_kind == AT_WORK
    assert replaced.describe_count() == (
        "not counted: the launcher replaced it, stopped after it got to work; 2 of 2 used"
    )
    before_work = policy.decide(-9, history, 100.0, 12.1, 3, replaced=True)
    assert not before_work.restart and before_work.counted and not before_work.replaced
    uniform = RestartPolicy.uniform(2).decide(-9, history, 100.0, 12.1, 0, True, replaced=True)
    assert not uniform.restart and uniform.counted


def test_a_worker_preempted_that_left_cleanly_is_restarted_at_once_and_not_counted() -> None:
    """A process that handled its SIGTERM and left (task_markers.LEFT: push applied,
    checkpoint written, shards told) was preempted, not crash-looping, however short its
    run: restarted at once with the limit used up and not counted. Without the clean leave
    the same short death counts; an error exit is never a preemption; --max-restarts counts
    everything."""
    policy = RestartPolicy(signal_restarts=2, crash_loop_s=30.0)
    history = [(0.0, SIGNAL), (50.0, SIGNAL)]  # the limit is used up
    left = policy.decide(143, history, now=100.0, ran_s=12.5, streak=3, served=True, left=True)
    assert left.restart and not left.counted and left.delay_s == 0.0 and not left.crash_loop
    assert left.history_kind == AT_WORK
    assert (
        left.describe_count() == "not counted: preempted, it left cleanly after 12.5 s; 2 of 2 used"
    )
    assert left.describe_wait() == "at once (preempted: no crash loop)"
    killed = policy.decide(143, history, now=100.0, ran_s=12.5, streak=3, served=True)
    assert not killed.restart and killed.counted  # no clean leave: a short death counts
    error = RestartPolicy(error_restarts=1).decide(1, [(0.0, ERROR)], 100.0, 5.0, 0, left=True)
    assert not error.restart and error.counted and not error.left
    uniform = RestartPolicy.uniform(2).decide(143, history, 100.0, 12.5, 0, left=True)
    assert not uniform.restart and uniform.counted
