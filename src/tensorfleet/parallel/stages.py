"""Cutting a sequential model into pipeline stages, and cutting a batch into micro-batches.

A stage is a contiguous slice of an ``nn.Sequential`` (``model[a:b]``): it holds the very
same ``Parameter`` objects as the model and keeps their names (``"4.weight"``), so the ps
variables, checkpoints and the placement report see one model whichever stage computes.

Where to cut: explicit ``boundaries`` (the index of each stage's first layer after the
first), or ``num_stages`` with the boundaries that make the largest stage as small as
possible, each layer counting ``1 + its parameters`` (so parameter-free layers still spread
out): with one process per stage, the slowest stage sets the pace. The cut is exact (a
dynamic programme over the contiguous cuts, ``O(num_stages * layers**2)``, instant for any
model written as layers). Among the cuts with that smallest largest stage, the one of
earlier versions (cut once a stage's running count reaches ``1/num_stages`` of the total)
is kept where it is one of them, so boundaries that were already optimal do not move; the
cut is otherwise the optimum whose stages end earliest.

The micro-batch rule: a batch of B samples is cut into ``n`` micro-batches of exactly
``B / n``; a batch that does not divide is refused (no remainder rule). Reasons: the
cross-task schedule fixes its receive buffers' shapes at the first step, and equal
micro-batches are what makes the mean of the micro-batch losses equal the loss of the whole
batch. Use ``drop_last=True`` in the data loader, or an ``n`` that divides the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tensorfleet.parallel.errors import ParallelConfigError


def stage_boundaries(model: nn.Sequential, num_stages: int) -> list[int]:
    """Indices where stages 1..num_stages-1 start: the contiguous cut whose largest stage
    (in ``1 + parameters`` per layer) is smallest (see the module docstring for ties)."""
    layers = _check_sequential(model)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ParallelConfigError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if num_stages > layers:
        raise ParallelConfigError(
            f"cannot cut a model of {layers} layer(s) into {num_stages} stages: each stage needs "
            f"at least one layer. Use at most {layers} stages, or a model with more layers"
        )
    costs = [1 + sum(p.numel() for p in layer.parameters()) for layer in model]
    greedy = _greedy_boundaries(costs, num_stages)
    best = _min_max_boundaries(costs, num_stages)
    if _largest_stage(costs, greedy) == _largest_stage(costs, best):
        return greedy  # the earlier versions' cut, where it already was optimal
    return best


def _largest_stage(costs: list[int], bounds: list[int]) -> int:
    edges = [0, *bounds, len(costs)]
    return max(sum(costs[a:b]) for a, b in zip(edges, edges[1:], strict=False))


def _greedy_boundaries(costs: list[int], num_stages: int) -> list[int]:
    """The earlier rule: cut once the running count reaches the stage's share of the total
    (or where every later stage needs the remaining layers)."""
    total, layers = sum(costs), len(costs)
    bounds: list[int] = []
    running = 0
    for index, cost in enumerate(costs[:-1]):
        running += cost
        stage = len(bounds) + 1
        if stage >= num_stages:
            break
        layers_left = layers - (index + 1)
        stages_left = num_stages - stage
        if running >= total * stage / num_stages or layers_left == stages_left:
            bounds.append(index + 1)
    return bounds


def _min_max_boundaries(costs: list[int], num_stages: int) -> list[int]:
    """The contiguous cut into ``num_stages`` non-empty stages whose largest stage is
    smallest (ties: each stage ends as early as it can), by dynamic programming."""
    layers = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[k][i]: the smallest largest stage cutting the last ``layers - i`` layers into k
    # stages; start[k][i]: where the second of those stages starts (``layers`` for k == 1).
    best = [[0] * (layers + 1) for _ in range(num_stages + 1)]
    start = [[layers] * (layers + 1) for _ in range(num_stages + 1)]
    for i in range(layers):
        best[1][i] = prefix[layers] - prefix[i]
    for k in range(2, num_stages + 1):
        for i in range(layers - k + 1):
            choices = (
                (max(prefix[j] - prefix[i], best[k - 1][j]), j)
                for j in range(i + 1, layers - k + 2)
            )
            best[k][i], start[k][i] = min(choices)  # ties: the earliest end of this stage
    bounds, i = [], 0
    for k in range(num_stages, 1, -1):
        i = start[k][i]
        bounds.append(i)
    return bounds


def split_stages(
    model: nn.Sequential,
    num_stages: int | None = None,
    *,
    boundaries: Sequence[int] | None = None,
) -> list[nn.Sequential]:
    """``model`` cut into stages: give ``num_stages`` (the cut whose largest stage, in
    parameters, is smallest: see :func:`stage_boundaries`) or the
    ``boundaries`` (``[4]``: layers 0-3, then 4 to the end). The stages share the model's
    parameters and keep their names."""
    layers = _check_sequential(model)
    if (num_stages is None) == (boundaries is None):
        raise ParallelConfigError("give either num_stages or boundaries (exactly one)")
    if boundaries is None:
        cuts = stage_boundaries(model, num_stages)  # type: ignore[arg-type]
    else:
        cuts = list(boundaries)
        if (
            any(isinstance(b, bool) or not isinstance(b, int) for b in cuts)
            or any(not 0 < b < layers for b in cuts)
            or cuts != sorted(set(cuts))
        ):
            raise ParallelConfigError(
                f"boundaries {list(boundaries)} must be strictly increasing layer indices in "
                f"1..{layers - 1} (the model has {layers} layers); e.g. [{layers // 2}] for two stages"
            )
    edges = [0, *cuts, layers]
    return [model[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def split_microbatches(tensor: torch.Tensor, n_microbatches: int) -> list[torch.Tensor]:
    """``tensor`` cut along its first dimension into ``n_microbatches`` equal parts."""
    check_microbatches(tensor.shape[0], n_microbatches)
    return list(torch.chunk(tensor, n_microbatches))


def check_microbatches(batch_size: int, n_microbatches: int) -> int:
    """The micro-batch size; :class:`ParallelConfigError` unless the batch divides evenly."""
    if (
        isinstance(n_microbatches, bool)
        or not isinstance(n_microbatches, int)
        or n_microbatches < 1
    ):
        raise ParallelConfigError(f"n_microbatches must be an integer >= 1, got {n_microbatches!r}")
    if batch_size % n_microbatches:
        lower = batch_size - batch_size % n_microbatches
        raise ParallelConfigError(
            f"a batch of {batch_size} does not split into {n_microbatches} equal micro-batches: "
            f"use a batch that is a multiple of {n_microbatches} (e.g. {lower or n_microbatches} or "
            f"{lower + n_microbatches}; drop_last=True in the loader), or a micro-batch count "
            f"that divides {batch_size}"
        )
    return batch_size // n_microbatches


def _check_sequential(model: nn.Module) -> int:
    if not isinstance(model, nn.Sequential):
        raise ParallelConfigError(
            f"pipeline stages are cut from an nn.Sequential, got {type(model).__name__}: write "
            "the model as nn.Sequential(...) of its layers (or blocks), in execution order"
        )
    if len(model) == 0:
        raise ParallelConfigError("the nn.Sequential to cut into stages has no layers")
    return len(model)
