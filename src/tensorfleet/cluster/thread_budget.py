"""The thread budget: how many intra-op threads each task on one host gets.

The rule: **tasks that compute at the same time share the host's cores; tasks that take
turns each get all of them.** Co-located tasks that each use every core oversubscribe the
host (four tasks on two cores with torch's default of one intra-op thread per core run 8
busy threads on 2 cores: a 2-process pipeline was 2.3x slower here), so by default the cores
are divided, ``cores // tasks`` each, at least 1, the remainder to the workers first (worker
0 first): :func:`thread_budget`.

One layout takes turns instead of sharing: **one worker with its ps tasks** (``--ps N
--workers 1``). The worker computes its forward and backward while its ps tasks wait for the
push, then the ps tasks apply the update while the worker waits for the reply; they never
both compute. Dividing the cores there halves the speed of each phase for nothing: the
worker gets every core, and the ps tasks, which apply their shards of one push at the same
time as each other, divide the cores among themselves. Measured with the BERT-base-sized
encoder of ``benchmarks/big_model.py`` (108 M parameters, Adam; this project's 2-core
machine, interleaved runs, one process with torch's 2 threads as the baseline): 1 ps + 1
worker with one thread each (the division) ran at 0.58-0.60x the one-process loop, with two
threads each and one push after the backward at 1.02x (2 ps: 0.71x -> 0.98x). The push must
then not overlap the backward: a bucket applied by the ps during the backward runs on the
cores the backward uses (two threads each *with* buckets: 0.58x), so the session leaves its
buckets off by default when its ps tasks are on its host and its threads cover the host's
cores (:func:`tensorfleet.worker.push_overlap.automatic_overlap`).

With two or more workers on the host the workers compute at the same time, and a ps applies
one worker's push while the others compute: every task shares, as before.

Explicit ``--intra-op-threads N`` gives every task N; ``--no-thread-budget`` leaves torch's
defaults alone. This module imports no torch, so the launcher stays light.

A ps started by itself (``tensorfleet server`` on a machine of its own, outside the launcher)
plans its threads by the same rule over the tasks the cluster spec puts on its host
(:func:`co_located_threads`): alone there, it takes every core; beside workers named on the
same host, its share. Before, it took one thread whatever it was given, so a ps on a
machine of its own applied every update on one of its cores.
"""

from __future__ import annotations

import ipaddress

from tensorfleet.cluster.spec import ClusterSpec, TaskId, parse_address
from tensorfleet.errors import ClusterConfigError

#: Jobs whose tasks apply updates rather than compute them (every other job computes).
PS_JOBS = ("ps",)


def thread_budget(host_cores: int, co_located_tasks: int) -> list[int]:
    """Threads per task when ``co_located_tasks`` share ``host_cores``: ``cores // tasks``
    each, at least 1, the remainder one each to the first tasks. ``thread_budget(2, 4)`` ->
    ``[1, 1, 1, 1]``; ``thread_budget(16, 3)`` -> ``[6, 5, 5]``."""
    if host_cores < 1 or co_located_tasks < 1:
        raise ClusterConfigError(
            f"a thread budget needs at least one core and one task, got {host_cores} core(s) "
            f"and {co_located_tasks} task(s)"
        )
    share, extra = divmod(host_cores, co_located_tasks)
    return [max(1, share + (1 if i < extra else 0)) for i in range(co_located_tasks)]


def takes_turns(num_ps: int, num_workers: int) -> bool:
    """Whether the tasks of a host take turns rather than compute at the same time: one
    worker and its ps tasks (see the module docstring)."""
    return num_workers == 1 and num_ps >= 1


def planned_threads(num_ps: int, num_workers: int, host_cores: int) -> dict[str, int]:
    """Each task's intra-op threads by task name (``"worker:0"``, ``"ps:1"``) when
    ``num_workers`` workers and ``num_ps`` ps tasks share a host of ``host_cores`` cores.

    ``planned_threads(1, 3, 2)`` -> every task 1 (they share); ``planned_threads(2, 1, 2)``
    -> ``worker:0`` 2 and each ps 1 (they take turns: the worker gets every core, the ps
    tasks divide them)."""
    workers = [f"worker:{i}" for i in range(num_workers)]
    ps = [f"ps:{i}" for i in range(num_ps)]
    if takes_turns(num_ps, num_workers):
        # thread_budget checks host_cores >= 1 for the ps tasks; the worker takes them all.
        return {
            workers[0]: host_cores,
            **dict(zip(ps, thread_budget(host_cores, num_ps), strict=True)),
        }
    names = workers + ps
    return dict(zip(names, thread_budget(host_cores, len(names)), strict=True))


def host_key(address: str) -> str:
    """The host part of ``address`` in a form two spellings of one host share: lower case, an
    IP address in its compressed form, and every loopback name or address (``localhost``,
    ``127.0.0.1``, ``::1``) as one."""
    host = parse_address(address).host.lower()
    if host == "localhost":
        return "loopback"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a name, not an address
        return host
    return "loopback" if ip.is_loopback else ip.compressed


def co_located_threads(cluster: ClusterSpec, task: TaskId, host_cores: int) -> tuple[int, int]:
    """``(threads, tasks)``: the intra-op threads :func:`planned_threads` gives ``task`` among
    the tasks of ``cluster`` whose address names its host (:func:`host_key`), and how many
    such tasks there are (``task`` included). ps tasks are planned as ps, every other job
    (worker, chief, an evaluator) as a worker. Tasks named on the same machine under
    different host names (an address and a name) are not seen as co-located."""

    def host_of(t: TaskId) -> str:
        return host_key(cluster.task_address(t.job, t.index))

    here = host_of(task)
    co_located = [t for t in cluster.tasks() if host_of(t) == here]
    ps = [t for t in co_located if t.job in PS_JOBS]
    computing = [t for t in co_located if t.job not in PS_JOBS]
    plan = planned_threads(len(ps), len(computing), host_cores)
    if task.job in PS_JOBS:
        name = f"ps:{ps.index(task)}"
    else:
        name = f"worker:{computing.index(task)}"
    return plan[name], len(co_located)
