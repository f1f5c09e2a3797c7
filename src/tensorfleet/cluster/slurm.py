"""Slurm's compressed notations, expanded: node lists and tasks-per-node counts.

Slurm describes an allocation with strings such as ``SLURM_JOB_NODELIST="node[01-03,07],gpu5"``
and ``SLURM_TASKS_PER_NODE="2(x3),1"``. These functions turn them into plain lists, and
:func:`block_layout` places ranks on nodes the way Slurm's default (block) distribution does,
which is what :mod:`tensorfleet.cluster.resolver` needs to build a cluster from a Slurm job.
:func:`check_allocation` compares the tasks of a step with the cluster shape a job script
asked for, so that a too small allocation fails in every task before anything listens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tensorfleet.cluster.spec import show
from tensorfleet.errors import ClusterConfigError

#: Refuse to expand more than this many hosts or tasks: a typo such as ``n[0-99999999]``
#: should fail at once, not eat the memory of every task.
MAX_EXPANSION = 1_000_000

_HOST_RE = re.compile(r"[A-Za-z0-9._-]+")
_RANGE_RE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_COUNT_RE = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list into host names, in order.

    ``expand_hostlist("node[01-03,07],gpu5,n[1-2]-ib")`` is
    ``["node01", "node02", "node03", "node07", "gpu5", "n1-ib", "n2-ib"]``.

    Items are separated by commas outside brackets. A bracket group holds comma-separated
    numbers and ranges ``lo-hi``; numbers keep the zero padding of ``lo`` (``[08-10]`` gives
    ``08, 09, 10``). Text after the group is a suffix; an item with several groups expands to
    every combination, the first group varying slowest, as Slurm does. An empty string is an
    empty list. Raises :class:`ClusterConfigError` for unbalanced or nested brackets, bad
    ranges, empty items and characters that cannot be in a host name.
    """
    if not isinstance(hostlist, str):
        raise ClusterConfigError(f"a Slurm host list must be a str, got {show(hostlist)}")
    if not hostlist.strip():
        return []
    hosts: list[str] = []
    for item in _split_items(hostlist):
        hosts.extend(_expand_item(item, hostlist))
        if len(hosts) > MAX_EXPANSION:
            raise ClusterConfigError(
                f"Slurm host list {show(hostlist)} expands to more than {MAX_EXPANSION} hosts"
            )
    return hosts


def _split_items(hostlist: str) -> list[str]:
    """Split at the commas that are outside brackets, checking the brackets balance."""
    items: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(hostlist):
        if char == "[":
            if depth:
                raise ClusterConfigError(
                    f"Slurm host list {show(hostlist)} has nested brackets at position {i}"
                )
            depth = 1
        elif char == "]":
            if not depth:
                raise ClusterConfigError(
                    f"Slurm host list {show(hostlist)} has a ']' without '[' at position {i}"
                )
            depth = 0
        elif char == "," and not depth:
            items.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise ClusterConfigError(f"Slurm host list {show(hostlist)} has a '[' without ']'")
    items.append(hostlist[start:])
    for item in items:
        if not item.strip():
            raise ClusterConfigError(
                f"Slurm host list {show(hostlist)} has an empty item (two commas in a row, "
                "or a comma at an end)"
            )
    return [item.strip() for item in items]


def _expand_item(item: str, hostlist: str) -> list[str]:
    """Expand one comma-free item such as ``"n[1-2]-ib"`` (brackets already balanced)."""
    open_at = item.find("[")
    if open_at < 0:
        if not _HOST_RE.fullmatch(item):
            raise ClusterConfigError(
                f"Slurm host list {show(hostlist)}: {item!r} is not a host name "
                "(letters, digits, '.', '-', '_')"
            )
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE_RE.fullmatch(part.strip())
        if not match:
            raise ClusterConfigError(
                f"Slurm host list {show(hostlist)}: {part!r} in [{body}] is not a number "
                "or a range 'lo-hi'"
            )
        lo_text, hi_text = match.group(1), match.group(2)
        if hi_text is None:
            numbers.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ClusterConfigError(
                f"Slurm host list {show(hostlist)}: range {part!r} runs backwards"
            )
        if hi - lo + len(numbers) > MAX_EXPANSION:
            raise ClusterConfigError(
                f"Slurm host list {show(hostlist)} expands to more than {MAX_EXPANSION} hosts"
            )
        numbers.extend(str(n).zfill(len(lo_text)) for n in range(lo, hi + 1))
    if prefix and not _HOST_RE.fullmatch(prefix):
        raise ClusterConfigError(
            f"Slurm host list {show(hostlist)}: {prefix!r} is not part of a host name "
            "(letters, digits, '.', '-', '_')"
        )
    suffixes = _expand_item(rest, hostlist) if rest else [""]
    if len(numbers) * len(suffixes) > MAX_EXPANSION:
        raise ClusterConfigError(
            f"Slurm host list {show(hostlist)} expands to more than {MAX_EXPANSION} hosts"
        )
    return [f"{prefix}{number}{suffix}" for number in numbers for suffix in suffixes]


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expand Slurm's tasks-per-node notation: ``"2(x3),1"`` is ``[2, 2, 2, 1]``.

    Each comma-separated item is a count ``N`` or ``N(xM)`` (``N`` on each of ``M`` nodes).
    An empty string is an empty list. Raises :class:`ClusterConfigError` for anything else.
    """
    if not isinstance(tasks_per_node, str):
        raise ClusterConfigError(f"Slurm tasks-per-node must be a str, got {show(tasks_per_node)}")
    if not tasks_per_node.strip():
        return []
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = _COUNT_RE.fullmatch(item.strip())
        if not match:
            raise ClusterConfigError(
                f"Slurm tasks-per-node {show(tasks_per_node)}: {item!r} is not 'N' or "
                "'N(xM)', e.g. '2(x3),1'"
            )
        repeat = 1 if match.group(2) is None else int(match.group(2))
        if len(counts) + repeat > MAX_EXPANSION:
            raise ClusterConfigError(
                f"Slurm tasks-per-node {show(tasks_per_node)} describes more than "
                f"{MAX_EXPANSION} nodes"
            )
        counts.extend([int(match.group(1))] * repeat)
    return counts


def block_layout(nodes: Sequence[str], tasks_per_node: Sequence[int]) -> list[tuple[str, int]]:
    """Where each rank runs under Slurm's default block distribution, as
    ``(node, local rank)`` indexed by global rank: node 0 takes the first
    ``tasks_per_node[0]`` ranks, node 1 the next, and so on.
    """
    if len(nodes) != len(tasks_per_node):
        raise ClusterConfigError(
            f"Slurm's node list names {len(nodes)} nodes ({show(list(nodes))}) but its "
            f"tasks-per-node gives counts for {len(tasks_per_node)} ({list(tasks_per_node)}); "
            "they must describe the same nodes"
        )
    return [
        (node, local)
        for node, count in zip(nodes, tasks_per_node, strict=True)
        for local in range(count)
    ]


def check_allocation(ntasks: int, num_ps: int, num_workers: int, where: str) -> None:
    """Raise :class:`ClusterConfigError` unless a Slurm step of ``ntasks`` tasks holds exactly
    the cluster shape ``num_ps`` ps + ``num_workers`` workers.

    ``where`` names the variable that gave ``ntasks`` (e.g. ``"SLURM_NTASKS"``). Too few
    tasks would leave a worker or a ps missing (the others would wait for it until their
    deadlines); too many would train with workers the job script did not ask for.
    """
    wanted = num_ps + num_workers
    if ntasks == wanted:
        return
    shape = f"{num_ps} ps + {num_workers} workers = {wanted} tasks"
    if ntasks < wanted:
        raise ClusterConfigError(
            f"slurm: the allocation is smaller than the cluster shape: {where}={ntasks} but "
            f"the shape is {shape}. Ask Slurm for {wanted} tasks (sbatch --ntasks={wanted}, "
            f"srun -n {wanted}) or make the shape smaller"
        )
    raise ClusterConfigError(
        f"slurm: the step has more tasks than the cluster shape: {where}={ntasks} but the "
        f"shape is {shape}. Run srun -n {wanted}, or make the shape larger"
    )
