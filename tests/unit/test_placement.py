"""Placement of variables on ps shards: round robin and greedy assignments, partitioning of
large variables into contiguous row ranges, argument errors, the report, determinism."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorfleet.ps.placement import PlacementPlan, Slice, VariableSpec, plan_placement


def _f32(name: str, *shape: int) -> VariableSpec:
    return VariableSpec(name, tuple(shape), "float32", 4)


#: a 40 B, b 400 B, c 100 B, d 200 B, e 4 B (a scalar).
MODEL = [_f32("a", 10), _f32("b", 100), _f32("c", 5, 5), _f32("d", 50), _f32("e")]


def _names(plan: PlacementPlan) -> list[list[str]]:
    return [[piece.stored_name for piece in shard] for shard in plan.shards]


def _rows(piece: Slice) -> tuple[int, int]:
    return piece.row_start, piece.row_stop


# -- strategies ---------------------------------------------------------------------------------


def test_round_robin_places_variable_i_on_shard_i_mod_n() -> None:
    plan = plan_placement(MODEL, 2, "round_robin")
    assert plan.strategy == "round_robin" and plan.num_shards == 2
    assert _names(plan) == [["a", "c", "e"], ["b", "d"]]
    assert plan.shard_bytes() == [144, 600]
    assert _names(plan_placement(MODEL, 3, "round_robin")) == [["a", "d"], ["b", "e"], ["c"]]


def test_greedy_places_largest_first_on_the_lightest_shard() -> None:
    # b(400) -> 0; d(200) -> 1; c(100) -> 1 (200 < 400); a(40) -> 1; e(4) -> 1.
    plan = plan_placement(MODEL, 2, "greedy")
    assert _names(plan) == [["b"], ["a", "c", "d", "e"]]
    assert plan.shard_bytes() == [400, 344]
    # b -> 0; d -> 1; c -> 2; a -> 2 (100 < 200); e -> 2 (140 < 200).
    plan = plan_placement(MODEL, 3)
    assert plan.strategy == "greedy"
    assert _names(plan) == [["b"], ["d"], ["a", "c", "e"]]
    assert plan.shard_bytes() == [400, 200, 144]


def test_greedy_breaks_ties_by_model_order_and_lowest_shard() -> None:
    same = [_f32(name, 8) for name in "pqrst"]
    assert _names(plan_placement(same, 2)) == [["p", "r", "t"], ["q", "s"]]


def test_more_shards_than_variables_leaves_shards_empty() -> None:
    plan = plan_placement(MODEL[:2], 4)
    assert _names(plan) == [["b"], ["a"], [], []]
    assert plan.shard_bytes() == [400, 40, 0, 0]
    assert _names(plan_placement(MODEL[:2], 4, "round_robin")) == [["a"], ["b"], [], []]


def test_one_shard_holds_everything_in_model_order() -> None:
    for strategy in ("greedy", "round_robin"):
        assert _names(plan_placement(MODEL, 1, strategy)) == [["a", "b", "c", "d", "e"]]


def test_each_shard_lists_its_slices_in_model_order() -> None:
    plan = plan_placement(MODEL, 2)
    order = {v.name: i for i, v in enumerate(MODEL)}
    for index, shard in enumerate(plan.shards):
        assert [order[p.variable.name] for p in shard] == sorted(
            order[p.variable.name] for p in shard
        )
        assert all(p.shard == index for p in shard)


def test_greedy_balances_bytes_better_than_round_robin_on_skewed_sizes() -> None:
    skewed = [_f32(f"v{i}", size) for i, size in enumerate([1000, 10, 1000, 10, 1000, 10])]
    greedy = plan_placement(skewed, 2).shard_bytes()
    round_robin = plan_placement(skewed, 2, "round_robin").shard_bytes()
    assert round_robin == [12000, 120]
    # 4000 B: v0 -> 0, v2 -> 1, v4 -> 0; then every 40 B variable goes to the lighter shard 1.
    assert greedy == [8000, 4120]


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=30),
    num_shards=st.integers(1, 6),
)
def test_greedy_load_spread_never_exceeds_the_largest_variable(
    sizes: list[int], num_shards: int
) -> None:
    variables = [_f32(f"v{i}", size) for i, size in enumerate(sizes)]
    loads = plan_placement(variables, num_shards).shard_bytes()
    assert sum(loads) == 4 * sum(sizes)
    assert max(loads) - min(loads) <= 4 * max(sizes)


# -- partitioning -------------------------------------------------------------------------------


def test_large_variable_is_cut_into_contiguous_row_ranges_one_per_shard() -> None:
    embedding = _f32("emb", 10, 3)  # 120 B
    plan = plan_placement([embedding, _f32("bias", 3)], 3, partition_threshold_bytes=100)
    pieces = {p.stored_name: p for shard in plan.shards for p in shard}
    assert set(pieces) == {"emb/part_0", "emb/part_1", "emb/part_2", "bias"}
    assert [_rows(pieces[f"emb/part_{k}"]) for k in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [pieces[f"emb/part_{k}"].shape for k in range(3)] == [(3, 3), (3, 3), (4, 3)]
    assert [pieces[f"emb/part_{k}"].nbytes for k in range(3)] == [36, 36, 48]
    assert not any(pieces[f"emb/part_{k}"].is_whole for k in range(3))
    assert pieces["bias"].is_whole and _rows(pieces["bias"]) == (0, 3)
    # Greedy: part_2 (48) -> 0, part_0 (36) -> 1, part_1 (36) -> 2, then bias (12) -> 1: shards
    # 1 and 2 tie at 36 bytes and ties go to the lowest shard index.
    assert _names(plan) == [["emb/part_2"], ["emb/part_0", "bias"], ["emb/part_1"]]


def test_round_robin_places_partitions_like_variables() -> None:
    plan = plan_placement(
        [_f32("emb", 4, 2), _f32("w", 2)], 2, "round_robin", partition_threshold_bytes=16
    )
    assert _names(plan) == [["emb/part_0", "w"], ["emb/part_1"]]


def test_a_variable_is_never_cut_into_more_parts_than_it_has_rows() -> None:
    plan = plan_placement([_f32("w", 2, 100)], 4, partition_threshold_bytes=1)
    pieces = sorted((p for shard in plan.shards for p in shard), key=lambda p: p.stored_name)
    assert [(p.stored_name, _rows(p)) for p in pieces] == [
        ("w/part_0", (0, 1)),
        ("w/part_1", (1, 2)),
    ]


def test_threshold_edge_equal_size_is_not_partitioned_one_byte_less_is() -> None:
    variable = _f32("w", 8, 4)  # 128 B
    at_threshold = plan_placement([variable], 2, partition_threshold_bytes=128)
    assert _names(at_threshold) == [["w"], []]
    below = plan_placement([variable], 2, partition_threshold_bytes=127)
    assert _names(below) == [["w/part_0"], ["w/part_1"]]


def test_scalars_and_single_row_tensors_are_never_partitioned() -> None:
    variables = [_f32("scalar"), _f32("row", 1, 1000), VariableSpec("big", (), "float64", 8)]
    plan = plan_placement(variables, 3, partition_threshold_bytes=1)
    assert sorted(p.stored_name for shard in plan.shards for p in shard) == ["big", "row", "scalar"]
    for piece in (p for shard in plan.shards for p in shard):
        assert piece.is_whole
        assert piece.shape == piece.variable.shape
        assert piece.nbytes == piece.variable.nbytes


def test_scalar_slices_have_an_empty_shape_and_one_element() -> None:
    plan = plan_placement([_f32("s")], 1)
    (piece,) = plan.shards[0]
    assert piece.shape == () and piece.numel == 1 and piece.nbytes == 4 and piece.is_whole


def test_no_threshold_means_no_partitioning() -> None:
    plan = plan_placement([_f32("huge", 1_000_000, 10)], 4)
    assert _names(plan) == [["huge"], [], [], []]


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 40),
    columns=st.integers(1, 5),
    num_shards=st.integers(1, 8),
    strategy=st.sampled_from(["greedy", "round_robin"]),
)
def test_partitions_cover_every_row_exactly_once_in_order(
    rows: int, columns: int, num_shards: int, strategy: str
) -> None:
    variable = _f32("v", rows, columns)
    plan = plan_placement([variable], num_shards, strategy, partition_threshold_bytes=1)
    pieces = [p for shard in plan.shards for p in shard]
    parts = min(num_shards, rows)
    assert len(pieces) == parts
    by_name = {p.stored_name: p for p in pieces}
    expected_names = ["v"] if parts == 1 else [f"v/part_{k}" for k in range(parts)]
    assert sorted(by_name) == sorted(expected_names)
    ordered = [by_name[name] for name in expected_names]
    assert ordered[0].row_start == 0 and ordered[-1].row_stop == rows
    for before, after in zip(ordered, ordered[1:], strict=False):
        assert before.row_stop == after.row_start
    assert all(p.row_stop > p.row_start for p in ordered)
    sizes = [p.row_stop - p.row_start for p in ordered]
    assert max(sizes) - min(sizes) <= 1  # as even as rows allow
    assert sum(p.nbytes for p in pieces) == variable.nbytes
    assert len({p.shard for p in pieces}) == parts  # one part per shard


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [0, -1])
def test_at_least_one_shard_is_needed(num_shards: int) -> None:
    with pytest.raises(ValueError, match=f"at least one ps shard.*got {num_shards}"):
        plan_placement(MODEL, num_shards)


@pytest.mark.parametrize("strategy", ["random", "Greedy", "", "round-robin"])
def test_unknown_strategy_is_refused(strategy: str) -> None:
    with pytest.raises(ValueError, match="placement strategy must be one of"):
        plan_placement(MODEL, 2, strategy)


@pytest.mark.parametrize("threshold", [0, -5])
def test_non_positive_partition_threshold_is_refused(threshold: int) -> None:
    with pytest.raises(ValueError, match="partition_threshold_bytes must be positive"):
        plan_placement(MODEL, 2, partition_threshold_bytes=threshold)


def test_duplicate_variable_names_are_refused() -> None:
    with pytest.raises(ValueError, match="variable names must be unique"):
        plan_placement([_f32("w", 2), _f32("b", 2), _f32("w", 3)], 2)


# -- report and determinism ------------------------------------------------------------------------


def test_report_mentions_every_stored_name_and_every_shard_total() -> None:
    variables = [*MODEL, _f32("emb", 1000, 8)]
    plan = plan_placement(variables, 3, partition_threshold_bytes=1000)
    report = plan.report()
    assert report.splitlines()[0] == "placement (greedy, 3 ps shard(s)):"
    for shard_index, shard in enumerate(plan.shards):
        for piece in shard:
            line = next(li for li in report.splitlines() if f" {piece.stored_name} " in li)
            assert line.strip().startswith(f"ps:{shard_index}")
            assert re.search(rf"{piece.nbytes:,d} B$", line)
    for shard_index, total in enumerate(plan.shard_bytes()):
        assert f"ps:{shard_index}  total {total:,d} bytes" in report
    assert "emb/part_2" in report and "32,000 B" not in report


def test_plans_are_deterministic() -> None:
    variables = [*MODEL, _f32("emb", 1000, 8), _f32("w2", 64, 64)]
    for strategy in ("greedy", "round_robin"):
        first = plan_placement(variables, 3, strategy, 1000)
        second = plan_placement(list(variables), 3, strategy, 1000)
        assert first == second
        assert first.report() == second.report()
