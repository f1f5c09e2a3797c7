"""The end of a process's output in a failure message (patterns/output_tail.py): whole lines
only, the error line kept, within the limit."""

from __future__ import annotations

from tensorfleet.patterns.output_tail import LIMIT, output_tail

TRACEBACK = "\n".join(
    [
        "Traceback (most recent call last):",
        '  File "/home/user/sweeps/ridge/train_ridge_with_a_rather_long_name.py", line 41, in <module>',
        "    main(learning_rate=params['learning_rate'], weight_decay=params['weight_decay'])",
        '  File "/home/user/sweeps/ridge/train_ridge_with_a_rather_long_name.py", line 12, in main',
        "    raise ValueError(f'the learning rate must be below 1, got {learning_rate}: ' + 'x' * 200)",
        "ValueError: the learning rate must be below 1, got 3.5: " + "x" * 200,
    ]
)


def test_whole_lines_only_and_the_error_line_last_within_the_limit() -> None:
    tail = output_tail(TRACEBACK)
    assert len(tail) <= LIMIT
    lines = [line.strip() for line in TRACEBACK.splitlines()]
    assert all(part in lines for part in tail.split(" | ")), tail  # none cut in the middle
    assert tail.endswith("x" * 200) and "ValueError: the learning rate" in tail


def test_an_error_followed_by_other_output_is_shown_first() -> None:
    text = TRACEBACK + "\nwarning: leaked semaphore\nThread 0x1 (most recent call first):\n  idle"
    tail = output_tail(text)
    assert tail.startswith("ValueError: the learning rate"), tail
    assert tail.endswith("idle") and len(tail) <= LIMIT


def test_one_line_longer_than_the_limit_keeps_its_end() -> None:
    tail = output_tail("RuntimeError: " + "y" * 1000 + " the end")
    assert len(tail) == LIMIT and tail.startswith("...") and tail.endswith("the end")


def test_nothing_printed_is_nothing_shown() -> None:
    assert output_tail("") == "" and output_tail("\n  \n") == ""
