"""A subscriber process: prints the version of every snapshot it receives (its first
argument is the publisher's address, the secret comes from TENSORFLEET_SECRET; it encrypts
when TENSORFLEET_ENCRYPT=1)."""

from __future__ import annotations

import os
import sys

from tensorfleet.environment import encryption_requested
from tensorfleet.patterns.broadcast import WeightSubscriber

with WeightSubscriber(
    sys.argv[1], os.environ["TENSORFLEET_SECRET"].encode(), encrypt=encryption_requested()
) as subscriber:
    while True:
        snapshot = subscriber.newest(wait_s=2.0)
        if snapshot is not None:
            print(f"version {snapshot.version}", flush=True)
