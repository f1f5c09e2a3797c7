"""A shard's variables: the fused layout (one flat buffer per dtype, offsets derived from the
ordered variable list), its validation of peer input, and :class:`VariableStore`."""

from __future__ import annotations

import pytest
import torch

from tensorfleet.errors import ProtocolError
from tensorfleet.ps.layout import MAX_NAME_LENGTH, FusedLayout, StoredVariable
from tensorfleet.ps.store import VariableStore
from tensorfleet.ps.update_rules import SGD

W = StoredVariable("w", (2, 3), "float32")
B = StoredVariable("b", (3,), "float32")
D = StoredVariable("d", (4,), "float64")
S = StoredVariable("s", (), "float32")


# -- layout -----------------------------------------------------------------------------------------


def test_layout_groups_by_dtype_in_order_of_first_use_with_offsets() -> None:
    layout = FusedLayout.of([W, D, B, S])
    assert [g.dtype for g in layout.groups] == ["float32", "float64"]
    float32, float64 = layout.groups
    assert float32.members == ((W, 0), (B, 6), (S, 9))
    assert float32.numel == 10 and float32.itemsize == 4
    assert float64.members == ((D, 0),) and float64.numel == 4 and float64.itemsize == 8
    assert layout.group_bytes() == [40, 32]
    assert layout.variables == (W, D, B, S)


def test_layout_of_is_deterministic() -> None:
    assert FusedLayout.of([W, D, B]) == FusedLayout.of((W, D, B))
    assert FusedLayout.of([W, D, B]) != FusedLayout.of([D, W, B])


def test_duplicate_names_in_a_layout_are_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match=r"duplicate variable names: \['w'\]"):
        FusedLayout.of([W, B, StoredVariable("w", (1,), "float64")])


def test_describe_difference_names_the_first_difference() -> None:
    mine = FusedLayout.of([W, B])
    assert mine.describe_difference(FusedLayout.of([W, B])) is None
    assert "variable 'b' is not on this shard" == mine.describe_difference(FusedLayout.of([W]))
    assert "this shard holds 'd'" in mine.describe_difference(FusedLayout.of([W, B, D]))
    resized = FusedLayout.of([W, StoredVariable("b", (4,), "float32")])
    assert mine.describe_difference(resized) == (
        "variable 'b' is [4] float32 on the ps, [3] float32 in the model"
    )
    retyped = FusedLayout.of([W, StoredVariable("b", (3,), "float64")])
    assert "float64 on the ps" in mine.describe_difference(retyped)
    assert "different order" in mine.describe_difference(FusedLayout.of([B, W]))


def test_stored_variable_wire_round_trip() -> None:
    for variable in (W, B, D, S):
        assert StoredVariable.from_wire(variable.to_wire()) == variable
    assert S.to_wire() == {"name": "s", "shape": [], "dtype": "float32"}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ([("name", "w")], "a variable is a map"),
        ({"shape": [1], "dtype": "float32"}, "variable name must be"),
        ({"name": "", "shape": [1], "dtype": "float32"}, "variable name must be"),
        ({"name": "x" * (MAX_NAME_LENGTH + 1), "shape": [1], "dtype": "float32"}, "name must"),
        ({"name": b"w", "shape": [1], "dtype": "float32"}, "variable name must be"),
        ({"name": "w", "shape": [1], "dtype": "int64"}, "trainable dtypes"),
        ({"name": "w", "shape": [1], "dtype": "complex64"}, "trainable dtypes"),
        ({"name": "w", "shape": [1]}, "trainable dtypes"),
        ({"name": "w", "shape": [-1], "dtype": "float32"}, "shape must"),
        ({"name": "w", "shape": "3", "dtype": "float32"}, "shape must"),
        ({"name": "w", "dtype": "float32"}, "shape must"),
    ],
)
def test_invalid_variables_from_peers_are_protocol_errors(data: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        StoredVariable.from_wire(data)


def test_longest_allowed_name_is_accepted() -> None:
    name = "x" * MAX_NAME_LENGTH
    assert StoredVariable.from_wire({"name": name, "shape": [1], "dtype": "bfloat16"}).name == name


# -- store -----------------------------------------------------------------------------------------


@pytest.fixture
def layout() -> FusedLayout:
    return FusedLayout.of([W, D, B, S])


def _initial() -> list[torch.Tensor]:
    return [torch.arange(10, dtype=torch.float32), torch.arange(4, dtype=torch.float64) / 8]


def test_create_copies_the_initial_values(layout: FusedLayout) -> None:
    values = _initial()
    store = VariableStore()
    assert not store.initialized
    store.create(layout, SGD(lr=0.5), values)
    assert store.initialized and store.layout is layout and store.rule == SGD(lr=0.5)
    values[0].fill_(-1.0)
    assert [t.tolist() for t in store.snapshot()] == [t.tolist() for t in _initial()]
    assert store.version == 0


def test_snapshot_is_a_copy(layout: FusedLayout) -> None:
    store = VariableStore()
    store.create(layout, SGD(lr=0.5), _initial())
    before = store.snapshot()
    before[0].zero_()
    store.apply([torch.ones(10), torch.ones(4, dtype=torch.float64)])
    assert torch.equal(before[0], torch.zeros(10))
    assert torch.equal(store.snapshot()[0], torch.arange(10, dtype=torch.float32) - 0.5)


def test_apply_updates_each_variable_from_its_slice_of_the_gradient(layout: FusedLayout) -> None:
    store = VariableStore()
    store.create(layout, SGD(lr=1.0), _initial())
    gradients = [
        torch.arange(10, dtype=torch.float32),
        torch.full((4,), 0.125, dtype=torch.float64),
    ]
    store.apply(gradients)
    float32, float64 = store.snapshot()
    assert torch.equal(float32, torch.zeros(10))
    assert torch.equal(float64, torch.arange(4, dtype=torch.float64) / 8 - 0.125)
    assert store.version == 1
    store.apply(gradients)
    assert store.version == 2
    # Gradients are not kept (or modified) after the step.
    assert torch.equal(gradients[0], torch.arange(10, dtype=torch.float32))


def test_apply_before_create_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="not created yet"):
        VariableStore().apply([torch.zeros(1)])


def test_create_twice_is_an_error(layout: FusedLayout) -> None:
    store = VariableStore()
    store.create(layout, SGD(), _initial())
    with pytest.raises(RuntimeError, match="already created"):
        store.create(layout, SGD(), _initial())


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ([torch.zeros(10)], "1 value buffers for 2 dtype groups"),
        ([torch.zeros(10), torch.zeros(4), torch.zeros(1)], "3 value buffers"),
        ([torch.zeros(9), torch.zeros(4, dtype=torch.float64)], "9 torch.float32 elements"),
        ([torch.zeros(10), torch.zeros(4)], "float64 group have 4 torch.float32"),
        ([torch.zeros(10, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)], "float32"),
    ],
)
def test_create_refuses_values_that_do_not_fit_the_layout(
    layout: FusedLayout, values: list[torch.Tensor], match: str
) -> None:
    store = VariableStore()
    with pytest.raises(ValueError, match=match):
        store.create(layout, SGD(), values)
    assert not store.initialized


def test_failed_rule_build_leaves_the_store_uncreated(layout: FusedLayout) -> None:
    store = VariableStore()
    with pytest.raises(ValueError):
        store.create(layout, SGD(lr=-1.0), _initial())
    assert not store.initialized
    store.create(layout, SGD(lr=1.0), _initial())
    assert store.initialized


def test_a_store_without_variables_updates_checkpoints_and_restores() -> None:
    """A shard whose part of the model is only embedding-table rows holds no variable: torch
    refuses an optimizer over no parameters, the store does not."""
    from tensorfleet.ps.shard_checkpoint import decode_shard, encode_shard
    from tensorfleet.ps.update_rules import UpdateRule

    store = VariableStore()
    layout = FusedLayout.of([])
    store.create(layout, UpdateRule("adagrad", {"lr": 0.1}), [])
    assert store.initialized and layout.groups == ()
    store.apply([])
    assert store.version == 1 and store.snapshot() == []
    values, ema, optimizer = store.checkpoint_parts()
    assert values == {} and ema is None and optimizer == {}
    document = encode_shard(
        shard=2, global_step=7, version=1, rule={"name": "adagrad"}, layout=layout,
        values=values, ema=ema, optimizer=optimizer, worker_data={},
    )  # fmt: skip
    state = decode_shard(document)
    assert state.variables == [] and state.values == {} and state.global_step == 7
    store.restore(state.values, state.ema, state.optimizer, state.version)
    assert store.version == 1
