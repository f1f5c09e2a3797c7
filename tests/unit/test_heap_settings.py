"""A ps process's malloc settings (:mod:`tensorfleet.ps.heap_settings`): set once per
process when its parameter service starts, turned off by ``TENSORFLEET_PS_HEAP=default``,
a typo refused. Each case runs in a fresh interpreter: the settings are process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from tensorfleet.errors import ConfigError
from tensorfleet.ps.heap_settings import (
    MMAP_THRESHOLD_BYTES,
    TRIM_THRESHOLD_BYTES,
    requested,
)

PROGRAM = """
import json
from tensorfleet.ps.heap_settings import apply_ps_heap_settings
first = apply_ps_heap_settings()
print(json.dumps({"first": first, "again": apply_ps_heap_settings()}))
"""


def _run(heap: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TENSORFLEET_PS_HEAP"}
    if heap is not None:
        env["TENSORFLEET_PS_HEAP"] = heap
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's; elsewhere nothing is set (the ps keeps its C library's heap)",
)
def test_a_ps_process_sets_both_thresholds_once() -> None:
    result = _run(None)
    expected = {"M_MMAP_THRESHOLD": MMAP_THRESHOLD_BYTES, "M_TRIM_THRESHOLD": TRIM_THRESHOLD_BYTES}
    assert result == {"first": expected, "again": expected}
    assert _run("tuned")["first"] == expected


def test_default_keeps_the_c_librarys_own_settings() -> None:
    assert _run("default") == {"first": {}, "again": {}}


def test_a_value_that_is_no_choice_is_refused_naming_both() -> None:
    assert requested({}) and requested({"TENSORFLEET_PS_HEAP": " Tuned "})
    assert not requested({"TENSORFLEET_PS_HEAP": "default"})
    with pytest.raises(
        ConfigError, match=r"TENSORFLEET_PS_HEAP='off' is not a choice.*'tuned'.*'default'"
    ):
        requested({"TENSORFLEET_PS_HEAP": "off"})
