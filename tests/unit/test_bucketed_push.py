"""Overlapped pushes in a training session (tensorfleet.worker.bucketed_push): buckets pushed
during the backward pass end bit for bit where the sequential step ends; the hooks push only
during the session's own backward (not for gradients accumulated in the closure, nor for an
evaluation's backward); nothing goes during the backward when a hook may veto or the worker
clips; prefetch leaves the last reply in flight, settles before a pull and at the end, and
recovers from a ps restart.

Real parameter services in threads (``service_harness``), one worker session in the test."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tensorfleet import environment
from tensorfleet.optim import Adam, SparseAdam
from tensorfleet.ps.service import ServiceConfig
from tensorfleet.ps.store import VariableStore
from tensorfleet.session.hooks import NanGuard
from tensorfleet.session.server import Server
from tensorfleet.session.training_session import TrainingSession
from tensorfleet.wire.secret import load_secret
from tensorfleet.wire.shared_memory import MAX_REQUEST_SEGMENTS
from tensorfleet.worker import bucketed_push
from tensorfleet.worker.bucketed_push import BucketedPush
from tensorfleet.worker.push_overlap import DEFAULT_OVERLAP, Overlap, automatic_overlap
from tensorfleet.worker.timeouts import ClientTimeouts

from .service_harness import RunningService, bits, serve_in_thread, stop_services

pytestmark = pytest.mark.timeout(120)

SECRET = "bucketed-push-unit-test-secret-000000001"
WORKERS = ("worker:0",)
#: Small buckets: the MLP below makes several per shard.
SMALL = Overlap(bucket_bytes=600)


class _Model(nn.Module):
    """An MLP (optionally after a sparse embedding of its first input column)."""

    def __init__(self, sparse_embedding: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 4, sparse=True) if sparse_embedding else None
        width = 8 + (4 if sparse_embedding else 0)
        self.layers = nn.Sequential(
            nn.Linear(width, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = torch.cat([x, self.embedding(x[:, 0].abs().long() % 10)], dim=1)
        return self.layers(x)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=generator) * 3, torch.randint(
        0, 3, (16,), generator=generator
    )


@dataclass
class Trained:
    params: list[torch.Tensor]
    moving_average: dict[str, torch.Tensor]
    results: list[Any]
    stats: list[dict]
    stores: list[list[torch.Tensor]]


@pytest.fixture
def cluster() -> Iterator[Callable[..., list[RunningService]]]:
    started: list[list[RunningService]] = []

    def start(shards: int = 1) -> list[RunningService]:
        services = [
            serve_in_thread(ServiceConfig(shard_index=i, worker_tasks=WORKERS), load_secret(SECRET))
            for i in range(shards)
        ]
        started.append(services)
        return services

    yield start
    for services in started:
        stop_services(services)


def _slow_down(
    monkeypatch: pytest.MonkeyPatch, last_bucket_s: float = 0.0, every_bucket_s: float = 0.0
) -> None:
    """Make every ps of the test answer late: ``every_bucket_s`` after applying any push,
    ``last_bucket_s`` more after a step's last bucket (the one that counts the step)."""
    apply = VariableStore.apply

    def slow_apply(
        store: VariableStore,
        gradients: list[torch.Tensor],
        part: tuple[int, int] | None = None,
        counts: bool = True,
    ) -> None:
        apply(store, gradients, part, counts)
        time.sleep(every_bucket_s + (last_bucket_s if counts else 0.0))

    monkeypatch.setattr(VariableStore, "apply", slow_apply)


def _train(
    services: list[RunningService],
    overlap: Overlap | None,
    steps: int = 4,
    closure: Callable[[nn.Module, int], torch.Tensor] | None = None,
    sparse_embedding: bool = False,
    after: Callable[[TrainingSession, nn.Module], None] | None = None,
    **session: Any,
) -> Trained:
    server = Server(
        {"ps": [s.address for s in services], "worker": ["127.0.0.1:1"]}, "worker", 0, secret=SECRET
    )
    model = _Model(sparse_embedding)

    def loss_of(step: int) -> torch.Tensor:
        x, y = _batch(step)
        return nn.functional.cross_entropy(model(x), y)

    options = {"ema_decay": 0.9, "progress_secs": None, **session}
    if len(services) > 1:
        options.setdefault("partition_threshold_bytes", 256)  # a weight over both shards
    with TrainingSession(server, model, Adam(lr=0.05), overlap=overlap, **options) as sess:
        results = [
            sess.step(
                (lambda step=step: closure(model, step))
                if closure
                else (lambda step=step: loss_of(step))
            )
            for step in range(steps)
        ]
        if after is not None:
            after(sess, model)
        stats = sess.cluster_stats()
        average = sess.moving_average() if options["ema_decay"] is not None else {}
    stores = [[flat.clone() for flat in s.service.store.live_values()] for s in services]
    return Trained(
        [p.detach().clone() for p in model.parameters()], average, results, stats, stores
    )


def _same(a: Trained, b: Trained) -> None:
    assert [bits(p) for p in a.params] == [bits(p) for p in b.params]
    assert sorted(a.moving_average) == sorted(b.moving_average)
    for name, value in a.moving_average.items():
        assert bits(value) == bits(b.moving_average[name]), name
    assert [[bits(f) for f in s] for s in a.stores] == [[bits(f) for f in s] for s in b.stores]


@pytest.mark.parametrize("shards", [1, 2])
def test_buckets_pushed_during_the_backward_end_bit_for_bit_where_the_whole_push_ends(
    cluster: Callable[..., list[RunningService]], shards: int
) -> None:
    sequential = _train(cluster(shards), None)
    bucketed = _train(cluster(shards), SMALL)
    _same(sequential, bucketed)
    assert [r.global_step for r in bucketed.results] == [1, 2, 3, 4]
    assert all(r.made_step for r in bucketed.results)
    assert sum(s["buckets"] for s in bucketed.stats) > sum(s["pushes"] for s in bucketed.stats)
    assert bucketed.stats[0]["pushes"] == 4  # the global step and its push count once a step
    # Every push and every bucket named the version of the values it was computed on: with
    # one worker and no prefetch, the newest (tensorfleet.ps.gradient_age).
    for trained, requests in ((sequential, "pushes"), (bucketed, "buckets")):
        for shard in trained.stats:
            ages = shard["gradient_age"]
            assert ages["unknown"] == 0 and ages["dropped"] == 0
            assert ages["bins"] == {"0": shard[requests]}


#: A sparse=True weight is updated by a row-sparse rule (lazy Adam beside the dense Adam).
ROWS: dict[str, Any] = {"ema_decay": None, "sparse_optimizer": SparseAdam(lr=0.05)}


def test_a_model_with_sparse_embedding_weights_ends_as_with_the_whole_push(
    cluster: Callable[..., list[RunningService]],
) -> None:
    """The sparse=True embedding weight travels as rows (worker/mirrored_embeddings.py, after
    the backward), the other variables in buckets during it: the same end, bit for bit. (The
    ps keeps no moving average of row-held weights, hence no ema_decay.)"""
    _same(
        _train(cluster(), None, sparse_embedding=True, **ROWS),
        _train(cluster(), SMALL, sparse_embedding=True, **ROWS),
    )


def test_gradients_accumulated_in_the_closure_or_a_backward_outside_the_step_push_nothing_early(
    cluster: Callable[..., list[RunningService]],
) -> None:
    def accumulate(model: nn.Module, step: int) -> torch.Tensor:
        x, y = _batch(step)
        nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()  # its hooks are not armed
        return nn.functional.cross_entropy(model(x[8:]), y[8:])

    counted: dict[str, int] = {}

    def evaluate_with_gradients(sess: TrainingSession, model: nn.Module) -> None:
        counted["before"] = sess.cluster_stats()[0]["buckets"]
        x, y = _batch(99)
        nn.functional.cross_entropy(model(x), y).backward()  # outside sess.step
        counted["after"] = sess.cluster_stats()[0]["buckets"]
        model.zero_grad(set_to_none=True)

    sequential = _train(cluster(), None, closure=accumulate)
    bucketed = _train(cluster(), SMALL, closure=accumulate, after=evaluate_with_gradients)
    _same(sequential, bucketed)
    assert counted["before"] == counted["after"] > 4


def _nan_at_step_2(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    loss = nn.functional.cross_entropy(model(x), y)
    return loss * math.nan if step == 2 else loss


@pytest.mark.parametrize(
    "session",
    [
        {"hooks": [NanGuard(action="skip")], "closure": _nan_at_step_2},
        {"clip_grad_norm": 0.5},
    ],
    ids=["vetoing-hook", "clipping-on-the-worker"],
)
def test_with_a_vetoing_hook_or_worker_clipping_the_step_pushes_after_the_backward(
    cluster: Callable[..., list[RunningService]], session: dict
) -> None:
    sequential = _train(cluster(), None, **session)
    overlapped = _train(cluster(), SMALL, **session)
    _same(sequential, overlapped)
    assert overlapped.stats[0]["buckets"] == 0  # whole pushes only
    vetoed = "hooks" in session
    assert overlapped.stats[0]["pushes"] == (3 if vetoed else 4)


def test_prefetch_leaves_the_last_reply_in_flight_and_the_model_ends_on_the_ps_values(
    cluster: Callable[..., list[RunningService]],
) -> None:
    services = cluster()
    pulled: dict[str, Any] = {}

    def pull_midway(sess: TrainingSession, model: nn.Module) -> None:
        pulled["step"] = sess.pull()  # settles the prefetched reply first
        pulled["values"] = [p.detach().clone() for p in model.parameters()]
        pulled["store"] = services[0].service.store.live_values()[0].clone()

    def one_batch(model: nn.Module, step: int) -> torch.Tensor:  # the loss must go down
        x, y = _batch(0)
        return nn.functional.cross_entropy(model(x), y)

    trained = _train(
        services,
        Overlap(bucket_bytes=600, prefetch=True),
        steps=12,
        closure=one_batch,
        after=pull_midway,
    )
    steps = [r.global_step for r in trained.results]
    assert steps[0] == 0 and not trained.results[0].made_step  # its count was still in flight
    assert steps == sorted(steps) and steps[-1] >= 10  # one step behind at most
    assert pulled["step"] == 12
    assert bits(torch.cat([v.flatten() for v in pulled["values"]])) == bits(pulled["store"])
    assert trained.results[-1].loss < trained.results[0].loss  # it trains
    ages = trained.stats[0]["gradient_age"]  # prefetch: at most one step stale
    assert ages["unknown"] == 0 and set(ages["bins"]) <= {"0", "1"} and ages["dropped"] == 0
    # The session's end settled the exchange: the model holds the ps's values.
    assert bits(torch.cat([p.flatten() for p in trained.params])) == bits(trained.stores[0][0])


class _RecoveryStarted(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().endswith("; recovering"):
            self.event.set()


def test_a_ps_restart_during_a_prefetched_step_is_recovered_from_the_checkpoint(
    cluster: Callable[..., list[RunningService]], tmp_path: Path
) -> None:
    services = cluster()
    handler = _RecoveryStarted()
    logger = logging.getLogger("tensorfleet.worker")
    logger.addHandler(handler)
    restarted: list[RunningService] = []
    restarter: list[threading.Thread] = []

    def restart_the_ps(sess: TrainingSession, model: nn.Module) -> None:
        old = services[0]
        stop_services([old])  # with the last push of the step in flight, or just answered

        def start_again() -> None:
            if handler.event.wait(30.0):
                restarted.append(
                    serve_in_thread(old.service.config, load_secret(SECRET), old.address)
                )

        restarter.append(threading.Thread(target=start_again, daemon=True))
        restarter[0].start()
        results = [sess.step(lambda step=step: _loss(model, step)) for step in range(20, 26)]
        assert any(r.dropped for r in results) or handler.event.is_set()
        assert results[-1].global_step >= sess.last_checkpoint_step  # never behind the checkpoint

    def _loss(model: nn.Module, step: int) -> torch.Tensor:
        x, y = _batch(step)
        return nn.functional.cross_entropy(model(x), y)

    try:
        with TrainingSession(
            Server(
                {"ps": [services[0].address], "worker": ["127.0.0.1:1"]}, "worker", 0, secret=SECRET
            ),
            model := _Model(),
            Adam(lr=0.05),
            overlap=Overlap(bucket_bytes=600, prefetch=True),
            checkpoint_dir=tmp_path,
            progress_secs=None,
            timeouts=ClientTimeouts(step_s=10.0, recover_s=40.0, heartbeat_s=0.5, ps_silence_s=3.0),
        ) as sess:
            for step in range(6):
                sess.step(lambda step=step: _loss(model, step))
            saved = sess.save_checkpoint()
            sess.last_checkpoint_step = int(saved.name.split("-")[-1])  # type: ignore[attr-defined]
            restart_the_ps(sess, model)
            final = sess.pull()
            values = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert restarted, "the worker never recovered from the restart"
        assert final >= sess.last_checkpoint_step  # type: ignore[attr-defined]
        assert bits(values) == bits(restarted[0].service.store.live_values()[0])
    finally:
        logger.removeHandler(handler)
        handler.event.set()
        for thread in restarter:
            thread.join(35.0)
        stop_services(restarted)


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_steps_buckets_are_in_flight_together_and_a_step_ends_owing_only_its_own(
    cluster: Callable[..., list[RunningService]],
    monkeypatch: pytest.MonkeyPatch,
    prefetch: bool,
) -> None:
    """Every bucket goes as soon as it is complete, beside the requests still in flight;
    a step returns having taken every reply of its own (no prefetch) or of the step before
    (prefetch: at most one step stale). The step's last bucket is answered late, so the
    next step's first buckets find it unanswered; the training still ends bit for bit where
    the sequential one does when nothing is prefetched."""
    sends: list[tuple[int, list[int]]] = []
    settled: list[tuple[int, list[int]]] = []
    send, exchange = BucketedPush._send, BucketedPush.exchange

    def recorded_send(push: BucketedPush, shard: int, bucket: Any) -> None:
        sends.append((push._step_serial, [f.step for f in push._shards[shard].flights]))
        send(push, shard, bucket)

    def recorded_exchange(push: BucketedPush, *args: Any) -> Any:
        progress = exchange(push, *args)
        exchanged = push._step_serial - 1  # the exchange ended the step
        settled.append((exchanged, [f.step for s in push._shards for f in s.flights]))
        return progress

    monkeypatch.setattr(BucketedPush, "_send", recorded_send)
    monkeypatch.setattr(BucketedPush, "exchange", recorded_exchange)
    sequential = _train(cluster(), None, steps=5)
    _slow_down(monkeypatch, last_bucket_s=0.1)
    trained = _train(cluster(), Overlap(bucket_bytes=600, prefetch=prefetch), steps=5)
    assert any(serial in in_flight for serial, in_flight in sends)  # several of one step
    # Whatever is left in flight when a step returns is that step's own (prefetch), or
    # nothing: the next forward is at most one step behind.
    assert all(set(left) <= ({step} if prefetch else set()) for step, left in settled)
    ages = trained.stats[0]["gradient_age"]
    assert ages["unknown"] == 0 and ages["dropped"] == 0
    assert set(ages["bins"]) <= ({"0", "1"} if prefetch else {"0"})
    if not prefetch:
        _same(sequential, trained)


@pytest.mark.parametrize("prefetch", [False, True])
def test_at_most_max_in_flight_requests_per_shard_and_the_rest_go_merged(
    cluster: Callable[..., list[RunningService]],
    monkeypatch: pytest.MonkeyPatch,
    prefetch: bool,
) -> None:
    """A bucket per variable (six a step): at most MAX_IN_FLIGHT requests in flight to the
    shard, as many as a same-host channel has request segments; what queues behind them goes
    as one request with its adjacent buckets. The training ends where the sequential one
    does (without prefetch)."""
    in_flight_at_send: list[int] = []
    sizes: list[int] = []
    send = BucketedPush._send

    def recorded_send(push: BucketedPush, shard: int, bucket: Any) -> None:
        in_flight_at_send.append(len(push._shards[shard].flights))
        sizes.append(bucket.stop - bucket.start)
        send(push, shard, bucket)

    monkeypatch.setattr(BucketedPush, "_send", recorded_send)
    sequential = _train(cluster(), None, steps=4)
    in_flight_at_send.clear()
    sizes.clear()
    _slow_down(monkeypatch, every_bucket_s=0.05)  # far slower than this model's backward
    trained = _train(cluster(), Overlap(bucket_bytes=1, prefetch=prefetch), steps=4)
    assert max(in_flight_at_send) == bucketed_push.MAX_IN_FLIGHT - 1
    assert bucketed_push.MAX_IN_FLIGHT == MAX_REQUEST_SEGMENTS
    assert max(sizes) > 1  # queued behind the full shard, adjacent buckets went as one
    if not prefetch:
        _same(sequential, trained)


def _span(buffer: Any) -> tuple[int, int]:
    start = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr() if len(buffer) else 0
    return start, start + memoryview(buffer).nbytes


def test_no_payload_is_packed_into_memory_a_request_in_flight_still_holds(
    cluster: Callable[..., list[RunningService]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With prefetch the next step's buckets go while the step before is in flight. Over
    ZeroMQ a payload is sent from the worker's own memory, later, on ZeroMQ's thread: a
    bucket packed into the memory of a request still in flight would change that request's
    bytes. Each payload's memory is checked against every request in flight when it is
    sent. (Through shared memory a request segment is never offered while a request holds
    it: tests/unit/test_shared_memory.py.)"""
    monkeypatch.setenv(environment.SHARED_MEMORY_VAR, "0")
    _slow_down(monkeypatch, last_bucket_s=0.05)
    spans: dict[int, list[tuple[int, int]]] = {}
    kept: list[list[memoryview]] = []  # so that no address is reused while it is compared
    clashes: list[tuple[int, int]] = []
    beside_the_step_before = []
    pack, send = BucketedPush._pack, BucketedPush._send

    def recorded_pack(push: BucketedPush, *args: Any) -> list[memoryview]:
        buffers = pack(push, *args)
        kept.append(buffers)
        push._packed = [_span(b) for b in buffers if memoryview(b).nbytes]  # type: ignore[attr-defined]
        return buffers

    def recorded_send(push: BucketedPush, shard: int, bucket: Any) -> None:
        in_flight = list(push._shards[shard].flights)
        send(push, shard, bucket)
        new = push._shards[shard].flights[-1]
        spans[new.request_id] = push._packed  # type: ignore[attr-defined]
        beside_the_step_before.append(any(f.step != new.step for f in in_flight))
        for flight in in_flight:
            for lo, hi in spans[flight.request_id]:
                for other_lo, other_hi in spans[new.request_id]:
                    if lo < other_hi and other_lo < hi:
                        clashes.append((flight.request_id, new.request_id))

    monkeypatch.setattr(BucketedPush, "_pack", recorded_pack)
    monkeypatch.setattr(BucketedPush, "_send", recorded_send)
    trained = _train(cluster(), Overlap(bucket_bytes=600, prefetch=True), steps=6)
    assert any(beside_the_step_before)  # the case in question happened
    assert clashes == []
    ages = trained.stats[0]["gradient_age"]
    assert ages["unknown"] == 0 and ages["dropped"] == 0 and set(ages["bins"]) <= {"0", "1"}


def test_a_prefetched_reply_taken_during_the_next_backward_still_reaches_the_model(
    cluster: Callable[..., list[RunningService]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last request of a prefetched step answers late: after the next forward started.
    Its values wait for the next safe point instead of being lost, or the first layer (the
    last bucket) would keep its old values for as long as that kept happening."""
    services = cluster()
    _slow_down(monkeypatch, last_bucket_s=0.3)  # the step's last reply leaves 0.3 s later
    server = Server(
        {"ps": [services[0].address], "worker": ["127.0.0.1:1"]}, "worker", 0, secret=SECRET
    )
    model = _Model()
    x, y = _batch(0)

    def slow_forward() -> torch.Tensor:
        time.sleep(1.0)  # the late reply arrives now, and the backward's first hook takes it
        return nn.functional.cross_entropy(model(x), y)

    with TrainingSession(
        server,
        model,
        Adam(lr=0.05),
        overlap=Overlap(bucket_bytes=600, prefetch=True),
        progress_secs=None,
    ) as sess:
        first_layer = model.layers[0].weight.detach().clone()
        sess.step(lambda: nn.functional.cross_entropy(model(x), y))  # its last reply: late
        assert torch.equal(model.layers[0].weight, first_layer)  # still in flight
        sess.step(slow_forward)
        assert not torch.equal(model.layers[0].weight, first_layer)  # step 1's values arrived


def test_a_preempted_shards_request_for_a_checkpoint_reaches_the_chief_through_the_buckets(
    cluster: Callable[..., list[RunningService]], tmp_path: Path
) -> None:
    """A preempted ps asks for a checkpoint in every reply (ps/preemption_drain.py); with the
    gradients pushed in buckets those replies are the buckets', and the chief still saves at
    the end of the step that received one."""
    services = cluster()
    server = Server(
        {"ps": [s.address for s in services], "worker": ["127.0.0.1:1"]}, "worker", 0, secret=SECRET
    )
    model = _Model()

    def loss_of(step: int) -> torch.Tensor:
        x, y = _batch(step)
        return nn.functional.cross_entropy(model(x), y)

    with TrainingSession(
        server, model, Adam(lr=0.05), overlap=SMALL, checkpoint_dir=tmp_path, progress_secs=None
    ) as sess:
        sess.step(lambda: loss_of(0))
        assert not list(tmp_path.glob("step-*"))
        services[0].service.checkpoint_wanted = True  # what a SIGTERM to the ps sets
        sess.step(lambda: loss_of(1))
        assert [p.name for p in tmp_path.glob("step-*")] == ["step-00000002"]


def test_kept_prefetch_says_why_it_turns_prefetch_off(caplog):
    from tensorfleet.worker.push_overlap import kept_prefetch

    with caplog.at_level(logging.INFO, logger="tensorfleet.worker"):
        assert kept_prefetch(Overlap(prefetch=True), "worker:0", []) is True
        assert kept_prefetch(Overlap(), "worker:0", ["persistent buffers ['bn.x']"]) is False
        assert not caplog.records  # prefetch not asked for: nothing changed, nothing said
        blockers = ["sparse=True embedding weights ['embedding.weight']"]
        assert kept_prefetch(Overlap(prefetch=True), "worker:0", blockers) is False
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "worker:0: Overlap(prefetch=True) is off for this model: its sparse=True embedding" in (
        record.getMessage()
    )


def test_prefetch_asked_for_with_sparse_embedding_weights_is_turned_off_and_said(cluster, caplog):
    """The sparse=True weights' rows follow each step's outcome: prefetch is off for such a
    model, and a warning names them (it was silent before); the buckets still go."""
    with caplog.at_level(logging.INFO, logger="tensorfleet.worker"):
        trained = _train(
            cluster(),
            Overlap(bucket_bytes=600, prefetch=True),
            steps=2,
            sparse_embedding=True,
            **ROWS,
        )
    assert [r.global_step for r in trained.results] == [1, 2]  # not one step behind
    said = [r for r in caplog.records if "Overlap(prefetch=True) is off" in r.getMessage()]
    assert len(said) == 1 and "['embedding.weight']" in said[0].getMessage()


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """Set this process's torch intra-op threads for a test; restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_the_default_overlap_gives_way_when_the_ps_is_here_and_the_worker_uses_every_core(
    cluster: Callable[..., list[RunningService]],
    threads: Callable[[int], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """automatic_overlap: the session's default buckets are off (one push per step, and one
    line saying so) when the ps answers through shared memory and the worker's threads cover
    the host's cores; a user's own Overlap(), equal to the default, keeps its buckets."""
    threads(environment.host_cpu_count())
    with caplog.at_level(logging.INFO, logger="tensorfleet.worker"):
        default = _train(cluster(), DEFAULT_OVERLAP, steps=3)
    assert [s["buckets"] for s in default.stats] == [0]
    assert default.stats[0]["pushes"] == 3
    assert "buckets off: its ps tasks are on this host" in caplog.text
    chosen = _train(cluster(), Overlap(bucket_bytes=600), steps=3)
    assert sum(s["buckets"] for s in chosen.stats) > 3
    _same(default, chosen)  # buckets or not, the same end bit for bit


def test_the_default_overlap_keeps_its_buckets_when_cores_are_left_for_the_ps(
    cluster: Callable[..., list[RunningService]],
    threads: Callable[[int], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    if environment.host_cpu_count() < 2:
        pytest.skip("one core: a worker's one thread covers it (the other test's case)")
    threads(1)
    applied: list[Overlap | None] = []
    with caplog.at_level(logging.INFO, logger="tensorfleet.worker"):
        _train(  # the ps here, as in the test above
            cluster(),
            DEFAULT_OVERLAP,
            steps=3,
            after=lambda s, _: applied.append(s._updater.overlap),
        )
    assert applied == [DEFAULT_OVERLAP]
    assert "buckets off" not in caplog.text


def test_automatic_overlap_changes_only_the_default_and_only_when_every_condition_holds() -> None:
    here = {"ps_on_this_host": True, "on_cpu": True, "threads": 2, "host_cores": 2, "task": "w"}
    assert automatic_overlap(DEFAULT_OVERLAP, **here) == Overlap(bucket_bytes=None)
    assert automatic_overlap(DEFAULT_OVERLAP, **{**here, "threads": 4}) == Overlap(None)
    mine = Overlap()
    assert mine == DEFAULT_OVERLAP and automatic_overlap(mine, **here) is mine
    assert automatic_overlap(None, **here) is None
    for condition in ({"ps_on_this_host": False}, {"on_cpu": False}, {"threads": 1}):
        assert automatic_overlap(DEFAULT_OVERLAP, **{**here, **condition}) is DEFAULT_OVERLAP
