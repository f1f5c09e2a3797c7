"""``Overlap``: how a training step in ``async`` mode overlaps its exchange with the
parameter servers with its own computation.

Without it a step is strictly sequential: the whole backward pass, then one push per shard,
then the wait for the new values. Two settings change that:

* **Buckets** (``bucket_bytes``): the gradients go out during the backward pass, one bucket
  (a range of a shard's variables, the model's last layers first, closed once it holds
  ``bucket_bytes``) as soon as every gradient of the bucket is complete, from a
  post-accumulate-grad hook, beside the buckets still in flight (a shard applies one
  worker's requests in order; until 2026-11-28 the next bucket waited for the reply to the
  one before). The ps applies each bucket at once (:mod:`tensorfleet.ps.partial_push`), so the transfer *and* the update of
  the last layers overlap the backward pass of the first ones. A step pushed in buckets ends
  bit for bit where the whole push ends (each variable is in one bucket; Adam's per-variable
  step counts advance once). ``bucket_bytes=None``: one push per shard after the backward.
* **Prefetch** (``prefetch``): the step returns without waiting for its replies (it waits
  for those of the step before instead); the next step's forward pass uses the values
  already in the model (those of every reply that has arrived by then), and its buckets go
  while the replies of this one are still coming, so the round trips and the ps's update
  overlap the next batch's compute. This adds a *staleness of at most one step*: a step's gradient may be
  computed on parameters that do not yet hold this worker's previous update (as in async
  training another worker's update may not have arrived either), and the global step a
  step reports is the one of the newest reply received, one step behind. The model holds
  the newest values again whenever the session settles the exchange: before
  ``sess.pull()``, a checkpoint, a vetoed step, and at the end.

Where it applies. Only mode ``async`` without ``max_staleness``: ``sync`` averages whole
gradients per step and the staleness gate counts whole steps (their exactness tests compare
with one process bit for bit), so both keep one push per shard after the backward. Buckets
go during the backward only when nothing after the backward may still change or veto the
gradients: not when the worker clips (``clip_grad_norm`` needs the whole gradient's norm),
and not when a hook overrides ``before_update`` (the NaN guard checks every gradient and may
veto the step; a bucket already applied cannot be taken back): then the step pushes after
the hooks, with prefetch still on. Prefetch is off for a model with persistent buffers or
``sparse=True`` embedding weights (their exchanges follow the gradients' outcome each step;
:func:`kept_prefetch` logs a warning naming them when prefetch was asked for). It applies to
``tfl.EmbeddingTable`` s: a step's row pushes stay in flight with its dense replies and are
awaited at the next step's exchange (a shard applies rows as they arrive, and a lookup sent
after them on the same channel reads them updated; since 2026-11-29). The ``sparse=True``
weights are never in a bucket: the ps holds them as rows; the rows of their gradients are
pushed (``push_rows``) when the step's exchange begins, after the backward, and their
changed rows pulled (``pull_changed``) after the dense reply. With a device engine (in-graph
replicas, pipelines) there is no overlap at all, buckets nor prefetch: the engine's own
backward gives no hooks (the session logs it, see :mod:`tensorfleet.session.device_engines`). With ``wire_dtype="bf16"`` each bucket's gradients
are encoded with the error feedback of their own elements, so buckets and whole pushes send
the same bytes (:mod:`tensorfleet.wire.gradient_encoding`).

The choices, the alternatives, the measured reasons (``benchmarks/overlap.py``, 1 ps, the
example's CNN (6.5 MB of gradients) and an MLP with large layers (11.6 MB), interleaved
rounds, medians; the tables are in benchmarks/README.md and docs/timeline.md):

* **Buckets on by default, 1 MiB, closed once full** (as ``DistributedDataParallel`` cuts
  them). Over a 1 Gbit/s link, buckets made the CNN's step 1.23x (one worker) and 1.10x
  (two workers) as fast as the sequential step, and 1.04x on this machine without a link
  limit (a second run: 1.19x, 1.08x, 0.98x): its ``fc`` layers (most of its bytes) are done early and travel during the
  convolutions' backward (most of its compute). They cost the MLP, whose bytes are spread
  over its layers, when the link is saturated by two workers (0.88x): its second request
  waits for the reply to its first (one request in flight per shard); 0.95x locally, 1.04x
  with one worker (second run: 0.94x, 0.91x, 1.06x). They never change the result (bit for bit), help the example, and
  ``bucket_bytes=None`` turns them off for a model they do not suit. The alternative cut,
  closing a bucket *before* it would exceed the size, made the CNN's small last layers a
  bucket of their own that, sent first, held its large ``fc1`` back for a whole round trip;
  the timeline showed it, and adjacent buckets queued behind a request in flight now go as
  one request (the MLP went from 0.77x to 0.95x locally with that).
* **Prefetch off by default.** It was the larger gain over a slow link (1.24x CNN, 1.05x
  MLP with one worker; 1.21x and 1.02x with two) and at least even locally (1.07x, 1.05x),
  but it changes what a step computes on (one step stale) and what a step reports (one step
  behind), so it is asked for, not imposed.
* **Pushed from the hook on the backward thread, not from a sender thread.** The hooks run
  between the autograd engine's nodes on the thread that called ``backward()`` (on CPU),
  which releases the GIL while it computes; a bucket goes within one node of its last
  gradient, and the ZeroMQ sockets stay owned by one thread. The cost, seen in the
  timeline: a reply that arrives during a long node (a convolution's backward) is taken
  only at the next hook, so the bucket queued behind it waits until then; a sender thread
  per shard would send it at once but would share the sockets between threads and contend
  for the GIL with the hooks. With buckets closed once full there are few buckets per
  shard (two for the CNN, three for the MLP), and that wait rarely matters.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from tensorfleet.errors import ConfigError, ConfigTypeError

log = logging.getLogger("tensorfleet.worker")

#: Default bucket size (a bucket is closed once it holds this many bytes): see the module
#: docstring for the measurement.
DEFAULT_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class Overlap:
    """How a step overlaps its exchange with its computation (mode ``async`` without
    ``max_staleness``; see :mod:`tensorfleet.worker.push_overlap`).

    ``bucket_bytes``: push the gradients during the backward pass in buckets, each closed
    once it holds this many bytes (the model's last layers first); None: one push per shard
    after the backward.
    ``prefetch``: do not wait for a step's replies (only for those of the step before); the
    next forward uses the values that have arrived (at most one step stale).
    """

    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.bucket_bytes is not None and (
            isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int)
        ):
            raise ConfigTypeError(
                f"bucket_bytes must be an int (bytes) or None, got {type(self.bucket_bytes).__name__}"
            )
        if self.bucket_bytes is not None and self.bucket_bytes < 1:
            raise ConfigError(
                f"bucket_bytes must be >= 1 byte (or None: no buckets), got {self.bucket_bytes}"
            )
        if not isinstance(self.prefetch, bool):
            raise ConfigTypeError(f"prefetch must be True or False, got {self.prefetch!r}")

    @property
    def active(self) -> bool:
        """Whether anything overlaps (buckets or prefetch)."""
        return self.bucket_bytes is not None or self.prefetch


DEFAULT_OVERLAP = Overlap()
"""The session's default (buckets of :data:`DEFAULT_BUCKET_BYTES`, no prefetch). Unlike an
``Overlap`` a user builds, even an equal one, this default gives way to
:func:`automatic_overlap`'s rule."""


def automatic_overlap(
    overlap: Overlap | None,
    *,
    ps_on_this_host: bool,
    on_cpu: bool,
    threads: int,
    host_cores: int,
    task: str,
) -> Overlap | None:
    """The overlap a step applies: ``overlap`` as given, except the session's default
    (:data:`DEFAULT_OVERLAP`, identity, not equality) when buckets could only slow the step:
    every ps of this worker is on its host (``ps_on_this_host``: the same-host path is in
    use), the model computes on the CPU, and the worker's ``threads`` cover the host's cores.
    Then a bucket's update runs on the cores the backward uses, so it delays the backward
    by as long as it saves; one push after the backward lets each phase use every core
    (:mod:`tensorfleet.cluster.thread_budget`: the launcher gives one worker with its ps
    every core; measured there). One log line says so and how to choose."""
    if overlap is not DEFAULT_OVERLAP or not (ps_on_this_host and on_cpu and threads >= host_cores):
        return overlap
    log.info(
        "%s: buckets off: its ps tasks are on this host and its %d intra-op thread(s) use all "
        "%d core(s), so a bucket's update could only run on the cores of the backward; one "
        "push per shard after the backward. Pass overlap=tfl.Overlap() to keep them",
        task,
        threads,
        host_cores,
    )
    return Overlap(bucket_bytes=None)


def checked_overlap(overlap: object) -> Overlap | None:
    """``overlap`` if it is an :class:`Overlap` or None, else a ConfigTypeError naming it."""
    if overlap is not None and not isinstance(overlap, Overlap):
        raise ConfigTypeError(
            f"overlap must be a tensorfleet.Overlap (or None: a sequential step), got "
            f"{type(overlap).__name__}: e.g. overlap=tfl.Overlap(prefetch=True)"
        )
    return overlap


def kept_prefetch(overlap: Overlap, task: str, blockers: Sequence[str]) -> bool:
    """Whether ``overlap.prefetch`` stays on for a model whose exchanges include
    ``blockers`` (descriptions such as ``"persistent buffers ['bn.running_mean']"``: what
    must follow each step's outcome, so cannot be left in flight). When prefetch was asked
    for and a blocker turns it off, one warning says so, naming them (no silent change)."""
    if not overlap.prefetch:
        return False
    if blockers:
        log.warning(
            "%s: Overlap(prefetch=True) is off for this model: its %s are exchanged after "
            "each step's outcome and cannot be left in flight; the buckets still apply. "
            "Fix: Overlap(prefetch=False) to silence this, or a model without them",
            task,
            " and ".join(blockers),
        )
        return False
    return True
