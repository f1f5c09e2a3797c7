"""The silence clock (``silence_clock.py``): silence counts only over time the observer ran."""

from __future__ import annotations

from tensorfleet.silence_clock import SilenceClock


def test_silence_counts_from_the_observers_resumption_after_a_stall() -> None:
    now = [100.0]
    silence = SilenceClock(5.0, lambda: now[0])
    assert not silence.stalled()  # it has not run yet: nothing to say
    silence.ran()
    now[0] += 4.0
    assert not silence.stalled() and silence.silent_for(heard=90.0) == 14.0  # ran throughout
    silence.ran()
    now[0] += 30.0  # the observer was stopped
    assert silence.stalled()
    silence.ran()
    assert silence.silent_for(heard=90.0) == 0.0  # counted from its resumption
    now[0] += 3.0
    assert silence.silent_for(heard=90.0) == 3.0 and silence.silent_for(heard=135.5) == 1.5
