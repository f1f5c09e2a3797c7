"""How a ps process's heap hands out memory: the update's temporaries reused, not faulted in
anew for every update.

**What.** When a task starts its parameter service, it sets two of glibc's malloc
parameters for its process (``mallopt``): blocks below 64 MiB come from the heap
(``M_MMAP_THRESHOLD``), and up to 128 MiB of free memory at the top of the heap stays
mapped (``M_TRIM_THRESHOLD``). ``TENSORFLEET_PS_HEAP=default`` leaves glibc's own settings;
on a C library without ``mallopt`` (musl, macOS) nothing is set.

**Why.** torch's default update rules allocate temporaries at every update: Adam two per
variable, the size of the variable, or of a piece of it (1 MiB,
:mod:`tensorfleet.ps.optimizer_pieces`). With glibc's default, dynamic thresholds (the mmap
threshold rises to the largest block freed so far, the trim threshold is twice that), the
2 MiB freed at the top of the heap after each piece goes back to the operating system and
comes back at the next piece as fresh pages, each one a page fault and a page of zeros.
Measured on this project's 2-vCPU machine for the shard of the BERT-base-sized model
(108.5 M float32 parameters, Adam in pieces, 2 threads). In a fresh process, 4 updates each
way under load 2-3: 70,000-118,000 minor faults and 700-1,060 ms of CPU per update with the
defaults, 0-500 faults and 430-480 ms with these settings. In the ps of a real 1 ps + 1
worker run, where earlier big frees have already raised glibc's thresholds part of the way
(``benchmarks/big_model.py --runs ps1 --steps 8 --warmup 2 --profile DIR`` with
``TENSORFLEET_PS_HEAP=default`` and ``tuned`` alternated, two runs each, quiet machine,
2026-11-27 03:17): the ps's apply 341 / 406 ms a step with the defaults, 302 / 278 ms with
these settings; its CPU 0.69 / 0.83 s against 0.67 / 0.61 s a step; its minor faults
28,000-36,000 against 0-1,000 a step; its peak RSS 2.75 GiB either way.

**The cost.** Up to 128 MiB of freed memory stays resident in the ps process; blocks of
1-64 MiB (messages of that size, a variable's temporaries) are carved from the heap, where
freeing one in the middle keeps its pages until blocks around it are freed too.

**The alternatives.** glibc's ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
environment variables do the same but only when set before the process starts, so a ps
started by hand, by Slurm or by a Kubernetes manifest would not get them; ``mallopt`` here
reaches every way a ps starts, and only ps processes (a worker's allocations are another
pattern: not measured, not changed). A caching allocator for CPU tensors (what the CUDA side
of torch has) does not exist in torch for CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Mapping

from tensorfleet import environment
from tensorfleet.errors import ConfigError

log = logging.getLogger(__name__)

#: glibc's ``mallopt`` parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Blocks below this many bytes come from the heap.
MMAP_THRESHOLD_BYTES = 64 << 20
#: Free memory at the top of the heap kept mapped, in bytes.
TRIM_THRESHOLD_BYTES = 128 << 20

_applied: dict[str, int] | None = None


def requested(environ_: Mapping[str, str] | None = None) -> bool:
    """Whether the settings are wanted: ``TENSORFLEET_PS_HEAP`` unset or ``tuned``;
    ``default`` keeps glibc's. Any other value is a ConfigError naming both choices."""
    value = (environment.environ() if environ_ is None else environ_).get(
        environment.PS_HEAP_VAR, "tuned"
    )
    choice = value.strip().lower()
    if choice in ("", "tuned"):
        return True
    if choice == "default":
        return False
    raise ConfigError(
        f"{environment.PS_HEAP_VAR}={value!r} is not a choice: set it to 'tuned' (the ps's "
        "update temporaries stay on the heap, the default) or 'default' (glibc's own settings)"
    )


def apply_ps_heap_settings(environ_: Mapping[str, str] | None = None) -> dict[str, int]:
    """Set this process's malloc parameters for a ps (once; later calls return the same).
    Returns what was set (``{"M_MMAP_THRESHOLD": bytes, "M_TRIM_THRESHOLD": bytes}``), or
    ``{}`` when not requested or where the C library has no ``mallopt``."""
    global _applied
    if _applied is not None:
        return dict(_applied)
    if not requested(environ_):
        _applied = {}
        return {}
    mallopt = _mallopt()
    if mallopt is None:
        log.debug("no mallopt in this C library: the ps keeps its heap settings")
        _applied = {}
        return {}
    settings = {"M_MMAP_THRESHOLD": MMAP_THRESHOLD_BYTES, "M_TRIM_THRESHOLD": TRIM_THRESHOLD_BYTES}
    numbers = {"M_MMAP_THRESHOLD": M_MMAP_THRESHOLD, "M_TRIM_THRESHOLD": M_TRIM_THRESHOLD}
    applied = {}
    for name, value in settings.items():
        if mallopt(numbers[name], value) == 1:  # mallopt returns 1 on success
            applied[name] = value
        else:
            log.debug("mallopt(%s, %d) refused: left as it was", name, value)
    _applied = applied
    return dict(applied)


def _mallopt():  # -> ctypes function or None
    """glibc's ``mallopt(int, int) -> int``, or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallopt
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int)
    function.restype = ctypes.c_int
    return function
