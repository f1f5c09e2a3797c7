"""A stand-in for a tensorfleet task, driven by flags, for the launcher's tests.

It needs nothing of tensorfleet: it reads TF_CONFIG like a real task, prints what the
launcher gave it, and behaves as told. A SPEC names tasks: ``worker:1``, ``worker:*``,
``ps:*`` or ``*``.

- ``--serve`` (ps): listen on this task's address from TF_CONFIG, wait until every worker
  has connected, send each ``go``, then wait until every worker has hung up (they do when
  they exit) and exit 0, like a ps that learns that training is over.
- ``--connect`` (worker): connect to every ps, wait for its ``go`` (so every task is up before
  any worker goes on), keep the connection open until exiting.
- ``--exit SPEC=CODE``: exit with CODE (default 0). ``--hang SPEC``: never exit by itself.
  ``--ignore-sigterm SPEC``: ignore SIGTERM. ``--grandchild SPEC``: leave a ``sleep``
  process behind in the task's process group.

Output: ``TASK_INFO {json}`` first (TF_CONFIG, secret, launcher variables, pid), a line on
stderr, ``--lines`` numbered lines, ``READY job:index``, and ``last words of job:index`` just
before exiting.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

CONNECT_DEADLINE = 20.0


def matches(spec: str, job: str, index: int) -> bool:
    want_job, _, want_index = spec.partition(":")
    return want_job in ("*", job) and want_index in ("", "*", str(index))


def serve(address: str, num_workers: int) -> None:
    host, _, port = address.rpartition(":")
    with socket.socket() as listener:
        listener.bind((host, int(port)))
        listener.listen(num_workers)
        listener.settimeout(CONNECT_DEADLINE)
        peers = [listener.accept()[0] for _ in range(num_workers)]
    for peer in peers:
        peer.sendall(b"go")
    print(f"all {num_workers} workers connected", flush=True)
    for peer in peers:
        peer.settimeout(None)
        while peer.recv(1024):
            pass
        peer.close()
    print("training over", flush=True)


def connect(addresses: list[str]) -> list[socket.socket]:
    sockets = []
    deadline = time.monotonic() + CONNECT_DEADLINE
    for address in addresses:
        host, _, port = address.rpartition(":")
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=1.0)
                break
            except OSError:
                # The ps may not listen yet; retrying is what real clients do too.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        sock.settimeout(CONNECT_DEADLINE)
        if sock.recv(2) != b"go":
            raise SystemExit(f"no go from {address}")
        sockets.append(sock)
    print(f"connected to {len(addresses)} ps task(s)", flush=True)
    return sockets


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=2)
    parser.add_argument("--exit", action="append", default=[], metavar="SPEC=CODE")
    parser.add_argument("--hang", action="append", default=[], metavar="SPEC")
    parser.add_argument("--ignore-sigterm", action="append", default=[], metavar="SPEC")
    parser.add_argument("--grandchild", action="append", default=[], metavar="SPEC")
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--connect", action="store_true")
    args = parser.parse_args()

    config = json.loads(os.environ["TF_CONFIG"])
    job, index = config["task"]["type"], config["task"]["index"]
    name = f"{job}:{index}"
    if any(matches(spec, job, index) for spec in args.ignore_sigterm):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    info = {
        "tf_config": config,
        "secret": os.environ.get("TENSORFLEET_SECRET"),
        "launcher": os.environ.get("TENSORFLEET_LAUNCHER"),
        "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
        "pid": os.getpid(),
    }
    print("TASK_INFO " + json.dumps(info))
    print(f"stderr line of {name}", file=sys.stderr)
    for i in range(args.lines):
        print(f"line {i} of {name}")
    if any(matches(spec, job, index) for spec in args.grandchild):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(f"GRANDCHILD {child.pid}")

    held = []
    if args.serve and job == "ps":
        serve(config["cluster"]["ps"][index], len(config["cluster"]["worker"]))
    if args.connect and job == "worker":
        held = connect(config["cluster"].get("ps", []))
    print(f"READY {name}")
    if any(matches(spec, job, index) for spec in args.hang):
        while True:
            time.sleep(3600)
    code = 0
    for spec in args.exit:
        target, _, value = spec.rpartition("=")
        if matches(target, job, index):
            code = int(value)
    print(f"last words of {name}")
    del held
    return code


if __name__ == "__main__":
    sys.exit(main())
