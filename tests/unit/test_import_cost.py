"""What a task imports before it trains: every task (and every restarted one) imports the
session's modules, so a heavy import there is paid at every start, pipeline or not."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

#: Modules that take seconds to import and that a task without that feature never needs.
HEAVY = ("torch.distributed.pipelining",)


def test_a_session_and_a_server_do_not_import_the_pipelining_package() -> None:
    """torch.distributed.pipelining took 3-7 s to import on this project's 2-core machine:
    it is imported when a pipeline stage is built, not when the session's modules load."""
    program = (
        "import sys, tensorfleet as tfl\n"
        "import tensorfleet.session.training_session, tensorfleet.session.device_engines\n"
        "tfl.TrainingSession, tfl.Server\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_the_launcher_does_not_import_torch() -> None:
    """``tensorfleet launch`` only starts and watches processes: importing torch there (2 s
    idle, 5-10 s on a loaded 2-core machine, and hundreds of MB) was paid by every launch, a
    ``--help`` and a refused flag included, before the arguments were even read."""
    program = (
        "import sys\n"
        "import tensorfleet.launch.cli, tensorfleet.launch.local_cluster\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", (
        "the launcher's modules import torch (find the importer with "
        "`python -X importtime -m tensorfleet launch --help`)\n" + result.stdout + result.stderr
    )
