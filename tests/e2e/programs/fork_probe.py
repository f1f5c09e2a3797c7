"""A task that says how it was started, then does what its arguments ask: for the task fork
tests (tests/e2e/test_task_forks.py).

``PROBE {...}``: whether torch was imported before this script's first line (only in a task
forked from the fork server), ``__name__``, ``sys.argv``, ``sys.path[0]``, the working
directory, ``PROBE_VALUE`` from the environment, a draw of Python's generator, the process
group. Then, by argument: ``exit N``, ``raise``, ``thread`` (a non-daemon thread that prints
after the main code ended), ``atexit`` (an exit handler that prints), ``unflushed`` (a line
on stdout and one on stderr, neither flushed), ``sleep S``.
"""

import atexit
import json
import os
import random
import sys
import threading
import time

torch_before = "torch" in sys.modules
print(
    "PROBE "
    + json.dumps(
        {
            "torch_before": torch_before,
            "name": __name__,
            "argv": sys.argv,
            "path0": sys.path[0],
            "cwd": os.getcwd(),
            "value": os.environ.get("PROBE_VALUE"),
            "draw": random.random(),
            "pgid_is_pid": os.getpgid(0) == os.getpid(),
            "task": json.loads(os.environ.get("TF_CONFIG", "{}")).get("task"),
        }
    ),
    flush=True,
)
args = sys.argv[1:]
while args:
    what = args.pop(0)
    if what == "exit":
        raise SystemExit(int(args.pop(0)))
    if what == "raise":
        raise ValueError("the probe raised on purpose")
    if what == "thread":

        def late() -> None:
            time.sleep(0.3)
            print("THREAD done after the main code", flush=True)

        threading.Thread(target=late).start()
    if what == "atexit":
        atexit.register(lambda: print("ATEXIT ran", flush=True))
    if what == "unflushed":
        print("UNFLUSHED stdout line")
        print("UNFLUSHED stderr line", file=sys.stderr)
    if what == "sleep":
        time.sleep(float(args.pop(0)))
print("PROBE main code ended", flush=True)
