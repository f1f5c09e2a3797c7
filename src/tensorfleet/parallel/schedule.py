"""Pipeline schedules: the order in which one stage runs the forward (F) and backward (B)
passes of the micro-batches.

- ``gpipe`` (Huang et al., 2019): every forward, then every backward. Simple; a stage keeps
  the activations of all ``n`` micro-batches until its backwards start.
- ``1f1b`` (PipeDream-Flush, Narayanan et al., 2021): stage ``s`` of ``p`` runs
  ``min(p - s - 1, n)`` warm-up forwards, then alternates one forward and one backward, then
  drains the remaining backwards. Same bubble as GPipe, ``(p - 1) / (n + p - 1)`` of the
  time, but at most ``p - s`` micro-batches' activations alive at once.

Backwards run in micro-batch order on every stage, so the gradients one stage sends arrive in
the order the previous stage consumes them.
"""

from __future__ import annotations

from tensorfleet.parallel.errors import ParallelConfigError

SCHEDULES = ("1f1b", "gpipe")


def stage_order(
    schedule: str, stage: int, num_stages: int, n_microbatches: int
) -> list[tuple[str, int]]:
    """``[("F", 0), ("F", 1), ("B", 0), ...]`` for ``stage`` (0-based) of ``num_stages``."""
    if schedule not in SCHEDULES:
        raise ParallelConfigError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    n = n_microbatches
    if schedule == "gpipe":
        return [("F", m) for m in range(n)] + [("B", m) for m in range(n)]
    warmup = min(num_stages - stage - 1, n)
    order = [("F", m) for m in range(warmup)]
    for i in range(n - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", m) for m in range(n - warmup, n)]
    return order


def bubble_fraction(num_stages: int, n_microbatches: int) -> float:
    """The idle share of an ideal pipeline with equal stages: ``(p - 1) / (n + p - 1)``."""
    return (num_stages - 1) / (n_microbatches + num_stages - 1)
