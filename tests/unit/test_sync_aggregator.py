"""SyncAggregator: the mean of k gradients per step, in a fixed worker order; stale gradients
dropped and counted; backup workers; fewer needed when workers have finished."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tensorfleet.ps.sync_aggregator import Contribution, SyncAggregator

WORKERS = ("worker:0", "worker:1", "worker:2")


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _contribution(task: str, *values: float, request: object = None) -> Contribution:
    float32 = torch.tensor(values, dtype=torch.float32)
    float64 = torch.tensor([v * 2 for v in values], dtype=torch.float64)
    return Contribution(task, [float32, float64], request if request is not None else task)


#: Gradients whose float32 sum depends on the order: (1e8 + -1e8) + 1 == 1, but
#: (1 + 1e8) + -1e8 == 0. A mean summed in arrival order would differ from worker order.
ORDER_SENSITIVE = {"worker:0": 1e8, "worker:1": -1e8, "worker:2": 1.0}


@pytest.mark.parametrize("k", [0, -1, 4])
def test_replicas_to_aggregate_outside_1_to_workers_is_refused(k: int) -> None:
    with pytest.raises(ValueError, match=rf"between 1 and the number of workers \(3\), got {k}"):
        SyncAggregator(k, WORKERS)


def test_a_step_is_complete_after_k_contributions_and_take_mean_moves_on() -> None:
    aggregator = SyncAggregator(2, WORKERS)
    assert not aggregator.is_complete(set())
    aggregator.add(_contribution("worker:2", 1.0, 3.0))
    assert not aggregator.is_complete(set())
    aggregator.add(_contribution("worker:0", 2.0, -5.0))
    assert aggregator.is_complete(set())
    assert aggregator.missing() == ["worker:1"]

    mean, contributions = aggregator.take_mean()

    assert [c.task for c in contributions] == ["worker:0", "worker:2"]  # worker order
    assert [c.request for c in contributions] == ["worker:0", "worker:2"]
    assert mean[0].tolist() == [1.5, -1.0]
    assert mean[1].dtype == torch.float64 and mean[1].tolist() == [3.0, -2.0]
    assert aggregator.step == 1
    assert aggregator.waiting == []
    assert aggregator.missing() == list(WORKERS)
    assert not aggregator.is_complete(set())


def test_take_mean_does_not_change_the_contributed_gradients() -> None:
    aggregator = SyncAggregator(2, WORKERS)
    first, second = _contribution("worker:0", 1.0), _contribution("worker:1", 3.0)
    aggregator.add(first)
    aggregator.add(second)
    mean, _ = aggregator.take_mean()
    assert mean[0].tolist() == [2.0]
    assert first.gradients[0].tolist() == [1.0] and second.gradients[0].tolist() == [3.0]


def test_the_order_sensitive_gradients_really_depend_on_the_order() -> None:
    """Guard for the next test: it only proves something if the order changes the bits."""
    a, b, c = (torch.tensor([ORDER_SENSITIVE[t]]) for t in WORKERS)
    assert not torch.equal((a + b) + c, (c + a) + b)


@pytest.mark.parametrize("arrival", list(itertools.permutations(WORKERS)))
def test_the_mean_is_summed_in_worker_order_whatever_the_arrival_order(
    arrival: tuple[str, ...],
) -> None:
    aggregator = SyncAggregator(3, WORKERS)
    for task in arrival:
        aggregator.add(_contribution(task, ORDER_SENSITIVE[task], 0.5))
    mean, contributions = aggregator.take_mean()
    expected = torch.tensor([ORDER_SENSITIVE[t] for t in WORKERS[:1]] + [0.5])
    for task in WORKERS[1:]:
        expected.add_(torch.tensor([ORDER_SENSITIVE[task], 0.5]))
    expected.div_(3)
    assert _bits(mean[0]) == _bits(expected)
    assert mean[0][0].item() == pytest.approx(1 / 3)
    assert [c.task for c in contributions] == list(WORKERS)


def test_stale_means_computed_on_an_older_step() -> None:
    aggregator = SyncAggregator(1, WORKERS)
    assert not aggregator.is_stale(0)
    aggregator.add(_contribution("worker:0", 1.0))
    aggregator.take_mean()
    assert aggregator.is_stale(0)
    assert not aggregator.is_stale(1)
    assert not aggregator.is_stale(2)  # the future is not stale (the service refuses it)


def test_drops_are_counted_per_worker() -> None:
    aggregator = SyncAggregator(2, WORKERS)
    aggregator.drop("worker:1")
    aggregator.drop("worker:1")
    aggregator.drop("worker:2")
    assert dict(aggregator.dropped) == {"worker:1": 2, "worker:2": 1}


def test_a_second_push_of_the_same_worker_replaces_the_first() -> None:
    aggregator = SyncAggregator(2, WORKERS)
    aggregator.add(_contribution("worker:0", 1.0, request="first"))
    aggregator.add(_contribution("worker:0", 5.0, request="second"))
    assert not aggregator.is_complete(set())
    assert [c.request for c in aggregator.waiting] == ["second"]
    aggregator.add(_contribution("worker:1", 3.0))
    mean, _ = aggregator.take_mean()
    assert mean[0].tolist() == [4.0]


@pytest.mark.parametrize(
    ("k", "finished", "needed"),
    [
        (3, set(), 3),
        (2, set(), 2),
        (3, {"worker:1"}, 2),
        (2, {"worker:1"}, 2),
        (2, {"worker:0", "worker:1"}, 1),
        (3, set(WORKERS), 1),  # never 0: a last push still makes a step
        (1, {"unknown"}, 1),
    ],
)
def test_needed_is_k_or_the_workers_still_training(k: int, finished: set, needed: int) -> None:
    assert SyncAggregator(k, WORKERS).needed(finished) == needed


def test_finished_workers_complete_a_step_that_waits_for_them() -> None:
    aggregator = SyncAggregator(3, WORKERS)
    aggregator.add(_contribution("worker:0", 1.0))
    aggregator.add(_contribution("worker:1", 2.0))
    assert not aggregator.is_complete(set())
    assert aggregator.is_complete({"worker:2"})


def test_withdraw_removes_a_contribution_once() -> None:
    aggregator = SyncAggregator(2, WORKERS)
    contribution = _contribution("worker:1", 1.0)
    aggregator.add(contribution)
    assert aggregator.withdraw("worker:1") is contribution
    assert aggregator.withdraw("worker:1") is None
    assert aggregator.waiting == []
    assert aggregator.missing() == list(WORKERS)


@given(
    st.lists(
        st.tuples(st.sampled_from(WORKERS), st.floats(-1e6, 1e6, width=32)),
        min_size=1,
        max_size=12,
    )
)
def test_the_mean_is_of_the_last_push_of_each_worker_in_worker_order(pushes: list) -> None:
    aggregator = SyncAggregator(1, WORKERS)
    latest: dict[str, float] = {}
    for task, value in pushes:
        aggregator.add(_contribution(task, value))
        latest[task] = value
    mean, contributions = aggregator.take_mean()
    ordered = [t for t in WORKERS if t in latest]
    expected = torch.tensor([latest[ordered[0]]])
    for task in ordered[1:]:
        expected.add_(torch.tensor([latest[task]]))
    expected.div_(len(ordered))
    assert [c.task for c in contributions] == ordered
    assert _bits(mean[0]) == _bits(expected)
