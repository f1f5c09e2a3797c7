"""What every test process shares.

``make test`` runs the tests in two pytest processes at once (pytest-xdist); each then gets
one intra-op thread for the torch work it does itself, one core each on a 2-core machine.
With torch's default (a thread per core in each process), the two processes' OpenMP threads
spin on each other's cores between parallel ops: a one-process training test took 37 s
beside another test where it takes 3.5 s alone. The processes the tests start choose their
own threads as before (the launcher's thread budget, or the program's own setting).
"""

from __future__ import annotations

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
