"""The launcher's restart policy: signals restarted within a window with back-off, errors not."""

from __future__ import annotations

import argparse
import signal

import pytest

from tensorfleet.errors import LaunchConfigError
from tensorfleet.launch.launch_command import add_launch_command, restart_policy_from
from tensorfleet.launch.restart_policy import (
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
