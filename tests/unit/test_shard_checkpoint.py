"""One ps shard's checkpoint document (:mod:`tensorfleet.ps.shard_checkpoint`) and
:meth:`VariableStore.checkpoint_parts` / :meth:`VariableStore.restore`.

Covered: a store with two dtype groups and a stateful rule (momentum SGD, Adam) survives
encode -> decode -> restore into a fresh store so exactly that the next update gives the same
bits (and without the optimizer state it would not); the moving average travels too; the
metadata (shard, step, version, rule, variables, workers' data positions) is kept;
:func:`decode_shard` refuses, with a :class:`ProtocolError` naming the problem, every kind of
malformed document (wrong shape or dtype, unexpected or missing tensors, bad optimizer state,
garbage, a header beyond the document, bad workers' data); and a property: a mutated document
raises ProtocolError or decodes to a state that fits its own variables, never anything else.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as safetensors_save

from tensorfleet.errors import ProtocolError
from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.shard_checkpoint import (
    MAX_WORKER_DATA_BYTES,
    METADATA_KEY,
    SHARD_FORMAT,
    ShardState,
    check_worker_data,
    decode_shard,
    encode_shard,
    encode_shard_pieces,
    read_metadata,
)
from tensorfleet.ps.store import VariableStore
from tensorfleet.ps.update_rules import SGD, Adam, Momentum, UpdateRule
from tensorfleet.wire.tensors import as_buffer

pytestmark = pytest.mark.timeout(60)

W = StoredVariable("w", (2, 3), "float32")
D = StoredVariable("d", (4,), "float64")
B = StoredVariable("b", (3,), "float32")
#: Two dtype groups: float32 [w, b] and float64 [d] (d comes second in layout order).
LAYOUT = FusedLayout.of([W, D, B])
RULES = {"momentum": Momentum(lr=0.1, momentum=0.9), "adam": Adam(lr=0.05)}
WORKER_DATA = {"worker:0": {"epoch": 1, "offset": 64}, "worker:1": {"epoch": 0, "seed": 7}}


def _initial() -> list[torch.Tensor]:
    return [
        torch.tensor([0.5, -1.25, 3.0, 1e-3, -0.0, 7.5, 2.0, -4.0, 0.125]),
        torch.tensor([1.0, -2.5, 1e-3, 12345.678], dtype=torch.float64),
    ]


def _gradients(step: int) -> list[torch.Tensor]:
    """Gradients of update ``step``: not multiples of each other, so the optimizer state
    (momentum, Adam's moments) matters."""
    scale = 1.0 + 0.37 * step
    sign = -1.0 if step % 2 else 1.0
    return [
        torch.tensor([0.1, 0.2, -0.3, 0.4, 0.5, -0.6, 0.7, 0.8, -0.9]) * scale * sign + 0.01 * step,
        torch.tensor([0.3, -0.1, 2.0, 0.05], dtype=torch.float64) * scale - 0.02 * step,
    ]


def _store(rule: UpdateRule, updates: int, ema_decay: float | None = None) -> VariableStore:
    store = VariableStore()
    store.create(LAYOUT, rule, _initial())
    if ema_decay is not None:
        store.keep_moving_average(ema_decay)
    for step in range(updates):
        store.apply(_gradients(step))
    return store


def _fresh(rule: UpdateRule, ema_decay: float | None = None) -> VariableStore:
    """A store like a restarted ps has before its restore: other values, no optimizer state."""
    store = VariableStore()
    store.create(LAYOUT, rule, [torch.zeros(9), torch.zeros(4, dtype=torch.float64)])
    if ema_decay is not None:
        store.keep_moving_average(ema_decay)
    return store


def _document(
    store: VariableStore,
    *,
    shard: int = 0,
    global_step: int = 7,
    worker_data: dict[str, dict[str, Any]] | None = None,
) -> bytes:
    values, ema, optimizer = store.checkpoint_parts()
    return encode_shard(
        shard=shard,
        global_step=global_step,
        version=store.version,
        rule=store.rule.to_wire(),
        layout=store.layout,
        values=values,
        ema=ema,
        optimizer=optimizer,
        worker_data=WORKER_DATA if worker_data is None else worker_data,
    )


def _bits(tensor: torch.Tensor) -> bytes:
    return bytes(as_buffer(tensor.contiguous()))


def _all_bits(tensors: list[torch.Tensor]) -> list[bytes]:
    return [_bits(t) for t in tensors]


def _metadata(**changes: Any) -> dict[str, Any]:
    """The metadata of a valid document of LAYOUT (no moving average), with changes."""
    metadata = {
        "format": SHARD_FORMAT,
        "shard": 0,
        "global_step": 3,
        "version": 3,
        "rule": SGD(lr=0.1).to_wire(),
        "variables": [v.to_wire() for v in LAYOUT.variables],
        "has_ema": False,
        "worker_data": {},
    }
    return {**metadata, **changes}


def _tensors() -> dict[str, torch.Tensor]:
    """The tensors of a valid document of LAYOUT (values only)."""
    return {
        "value/w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "value/d": torch.arange(4, dtype=torch.float64),
        "value/b": torch.ones(3),
    }


def _craft(tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> bytes:
    return safetensors_save(tensors, metadata={METADATA_KEY: json.dumps(metadata)})


def _raw(header: bytes, data: bytes = b"") -> bytes:
    """A document with this exact header (safetensors framing: 8-byte length, JSON, data)."""
    return struct.pack("<Q", len(header)) + header + data


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ema_decay", [None, 0.9])
def test_the_pieces_of_a_snapshot_are_the_document_written_at_once(ema_decay: float | None) -> None:
    """The update log writes a snapshot as pieces, uncopied: one after the other they must be
    the very document ``encode_shard`` makes (decoded by safetensors' own parser)."""
    store = _store(Adam(lr=0.01), updates=2, ema_decay=ema_decay)
    values, ema, optimizer = store.checkpoint_parts(copy=False)
    fields = dict(shard=1, global_step=5, version=store.version, rule=store.rule.to_wire(),
                  layout=store.layout, values=values, ema=ema, optimizer=optimizer,
                  worker_data={"worker:0": {"epoch": 1}})  # fmt: skip
    pieces = encode_shard_pieces(**fields)
    assert b"".join(bytes(piece) for piece in pieces) == bytes(encode_shard(**fields))


@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_restored_store_makes_the_same_next_update_bit_for_bit(rule_name: str) -> None:
    rule = RULES[rule_name]
    original = _store(rule, updates=3)
    state = decode_shard(_document(original))

    restored = _fresh(rule)
    restored.restore(state.values, state.ema, state.optimizer, state.version)

    assert restored.version == original.version == 3
    assert _all_bits(restored.snapshot()) == _all_bits(original.snapshot())
    for step in (3, 4):
        original.apply(_gradients(step))
        restored.apply(_gradients(step))
        assert _all_bits(restored.snapshot()) == _all_bits(original.snapshot()), step
    assert restored.version == 5


@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_without_the_optimizer_state_the_next_update_would_differ(rule_name: str) -> None:
    """Guard for the test above: the optimizer state is what makes the bits match."""
    rule = RULES[rule_name]
    original = _store(rule, updates=3)
    state = decode_shard(_document(original))
    assert set(state.optimizer) == {"w", "d", "b"}

    forgetful = _fresh(rule)
    forgetful.restore(state.values, state.ema, {}, state.version)
    assert _all_bits(forgetful.snapshot()) == _all_bits(original.snapshot())
    original.apply(_gradients(3))
    forgetful.apply(_gradients(3))
    for mine, theirs in zip(forgetful.snapshot(), original.snapshot(), strict=True):
        assert _bits(mine) != _bits(theirs)


def test_the_decoded_optimizer_state_is_the_stores_bit_for_bit() -> None:
    original = _store(Adam(lr=0.05), updates=2)
    _, _, optimizer = original.checkpoint_parts()
    state = decode_shard(_document(original))
    assert set(optimizer["w"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert state.optimizer.keys() == optimizer.keys()
    for name, tensors in optimizer.items():
        assert state.optimizer[name].keys() == tensors.keys()
        for key, tensor in tensors.items():
            decoded = state.optimizer[name][key]
            assert (decoded.shape, decoded.dtype) == (tensor.shape, tensor.dtype), (name, key)
            assert _bits(decoded) == _bits(tensor), (name, key)
    assert state.optimizer["d"]["exp_avg"].dtype == torch.float64


def test_a_store_without_updates_has_no_optimizer_state_and_round_trips() -> None:
    original = _store(Adam(lr=0.05), updates=0)
    state = decode_shard(_document(original))
    assert state.optimizer == {}
    restored = _fresh(Adam(lr=0.05))
    restored.restore(state.values, state.ema, state.optimizer, state.version)
    original.apply(_gradients(0))
    restored.apply(_gradients(0))
    assert _all_bits(restored.snapshot()) == _all_bits(original.snapshot())


def test_the_metadata_travels() -> None:
    original = _store(Momentum(lr=0.1, momentum=0.9), updates=2)
    document = _document(original, shard=3, global_step=41)
    state = decode_shard(document)
    assert (state.shard, state.global_step, state.version) == (3, 41, 2)
    assert state.rule == Momentum(lr=0.1, momentum=0.9).to_wire()
    assert state.variables == [W, D, B]
    assert state.layout == LAYOUT
    assert state.worker_data == WORKER_DATA
    assert state.ema is None
    values, _, _ = original.checkpoint_parts()
    assert {k: _bits(v) for k, v in state.values.items()} == {
        k: _bits(v) for k, v in values.items()
    }
    assert read_metadata(document)["global_step"] == 41
    assert read_metadata(memoryview(document))["shard"] == 3


def test_the_moving_average_round_trips() -> None:
    rule = Momentum(lr=0.1, momentum=0.9)
    original = _store(rule, updates=3, ema_decay=0.75)
    average = original.moving_average_snapshot()
    assert _all_bits(average) != _all_bits(original.snapshot())  # it really is an average
    state = decode_shard(_document(original))
    assert state.ema is not None and set(state.ema) == {"w", "d", "b"}
    assert _bits(state.ema["d"]) == _bits(average[1])
    assert _bits(state.ema["w"].reshape(-1)) == _bits(average[0][:6])
    assert _bits(state.ema["b"]) == _bits(average[0][6:])

    restored = _fresh(rule, ema_decay=0.75)
    restored.restore(state.values, state.ema, state.optimizer, state.version)
    assert _all_bits(restored.moving_average_snapshot()) == _all_bits(average)
    original.apply(_gradients(3))
    restored.apply(_gradients(3))
    assert _all_bits(restored.moving_average_snapshot()) == _all_bits(
        original.moving_average_snapshot()
    )


def test_a_store_keeping_an_average_restored_without_one_starts_it_at_the_values() -> None:
    rule = SGD(lr=0.5)
    state = decode_shard(_document(_store(rule, updates=2)))
    assert state.ema is None
    restored = _fresh(rule, ema_decay=0.5)
    restored.restore(state.values, state.ema, state.optimizer, state.version)
    assert _all_bits(restored.moving_average_snapshot()) == _all_bits(restored.snapshot())


def test_restore_refuses_optimizer_state_torch_rejects_and_changes_nothing() -> None:
    """Adam's state without its step counter: torch's load_state_dict fails (KeyError)."""
    rule = Adam(lr=0.05)
    original = _store(rule, updates=2)
    values, _, optimizer = original.checkpoint_parts()
    broken = {name: {"exp_avg": tensors["exp_avg"]} for name, tensors in optimizer.items()}
    target = _store(rule, updates=1)
    before = _all_bits(target.snapshot())
    with pytest.raises(ValueError, match="does not fit rule 'adam'"):
        target.restore(values, None, broken, 2)
    assert _all_bits(target.snapshot()) == before
    assert target.version == 1


# -- refusals --------------------------------------------------------------------------------------


def _replace(name: str, tensor: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensor

    return change


def _delete(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    return change


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            _replace("value/w", torch.zeros(3, 2)),
            r"tensor 'value/w' is \[3, 2\] torch.float32 in the shard document, the variable is \[2, 3\] float32",
        ),
        (
            _replace("value/w", torch.zeros(6)),
            r"tensor 'value/w' is \[6\] .* the variable is \[2, 3\] float32",
        ),
        (
            _replace("value/d", torch.zeros(4, dtype=torch.float32)),
            r"tensor 'value/d' is \[4\] torch.float32 .* the variable is \[4\] float64",
        ),
        (
            _replace("value/b", torch.zeros(3, dtype=torch.float16)),
            r"tensor 'value/b' is \[3\] torch.float16",
        ),
        (_replace("value/zzz", torch.zeros(3)), r"unexpected tensor 'value/zzz'"),
        (_replace("junk", torch.zeros(3)), r"unexpected tensor 'junk'"),
        (_replace("weights/w", torch.zeros(2, 3)), r"unexpected tensor 'weights/w'"),
        (_replace("ema/w", torch.zeros(2, 3)), r"unexpected tensor 'ema/w'"),  # has_ema false
        (_replace("optim/zzz/exp_avg", torch.zeros(3)), r"unexpected tensor 'optim/zzz/exp_avg'"),
        (_replace("optim/w/bad-key", torch.zeros(2, 3)), r"unexpected tensor 'optim/w/bad-key'"),
        (_replace("optim/w", torch.zeros(2, 3)), r"unexpected tensor 'optim/w'"),
        (_delete("value/b"), r"the shard document has no values for 'b'"),
        (_delete("value/d"), r"the shard document has no values for 'd'"),
        (
            _replace("optim/w/exp_avg", torch.zeros(5)),
            r"optimizer state 'optim/w/exp_avg' is \[5\] torch.float32; it must be a float "
            r"scalar or shaped like 'w' \[2, 3\]",
        ),
        (
            _replace("optim/w/exp_avg", torch.zeros(2, 4)),
            r"optimizer state 'optim/w/exp_avg' is \[2, 4\]",
        ),
        (
            _replace("optim/b/step", torch.tensor(3, dtype=torch.int64)),
            r"optimizer state 'optim/b/step' is \[\] torch.int64",
        ),
    ],
)
def test_decode_refuses_bad_tensors_naming_them(
    change: Callable[[dict[str, torch.Tensor]], None], match: str
) -> None:
    tensors = _tensors()
    decode_shard(_craft(tensors, _metadata()))  # the unchanged document is fine
    change(tensors)
    with pytest.raises(ProtocolError, match=match):
        decode_shard(_craft(tensors, _metadata()))


@pytest.mark.parametrize("shape", [(3, 2), (6,)])
def test_decode_refuses_optimizer_state_with_the_variables_size_but_not_its_shape(
    shape: tuple[int, ...],
) -> None:
    tensors = {**_tensors(), "optim/w/momentum_buffer": torch.zeros(shape)}
    with pytest.raises(ProtocolError, match=r"optimizer state 'optim/w/momentum_buffer'"):
        decode_shard(_craft(tensors, _metadata()))


@pytest.mark.parametrize("shape", [(), (3, 2), (6,)])
def test_a_misshaped_optimizer_state_is_refused_before_it_breaks_an_update(
    shape: tuple[int, ...],
) -> None:
    rule = Adam(lr=0.05)
    values, _, optimizer = _store(rule, updates=1).checkpoint_parts()
    optimizer["w"]["exp_avg"] = torch.full(shape, 0.5)
    document = encode_shard(
        shard=0,
        global_step=1,
        version=1,
        rule=rule.to_wire(),
        layout=LAYOUT,
        values=values,
        ema=None,
        optimizer=optimizer,
        worker_data={},
    )
    store = _fresh(rule)
    try:
        state = decode_shard(document)
        store.restore(state.values, state.ema, state.optimizer, state.version)
    except (ProtocolError, ValueError):
        return  # refused: what must happen
    store.apply(_gradients(1))  # raises RuntimeError today


def test_decode_refuses_a_missing_moving_average() -> None:
    tensors = {**_tensors(), "ema/w": torch.zeros(2, 3), "ema/d": torch.zeros(4).double()}
    with pytest.raises(ProtocolError, match=r"no moving average for 'b'"):
        decode_shard(_craft(tensors, _metadata(has_ema=True)))
    tensors["ema/b"] = torch.zeros(3)
    assert decode_shard(_craft(tensors, _metadata(has_ema=True))).ema is not None
    tensors["ema/b"] = torch.zeros(4)
    with pytest.raises(ProtocolError, match=r"tensor 'ema/b' is \[4\]"):
        decode_shard(_craft(tensors, _metadata(has_ema=True)))


def test_decode_refuses_too_many_optimizer_state_tensors() -> None:
    tensors = _tensors()
    for k in range(9):
        tensors[f"optim/b/key{k}"] = torch.zeros(3)
    with pytest.raises(ProtocolError, match=r"too many optimizer state tensors for 'b'"):
        decode_shard(_craft(tensors, _metadata()))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"format": 2}, r"shard document format 2, this tensorfleet reads format 1"),
        ({"format": None}, r"shard document format None"),
        ({"variables": []}, r"unexpected tensor '(value|optim)/"),  # tensors of none listed
        ({"variables": "w"}, r"the shard document's 'variables' must be a list, got 'w'"),
        ({"variables": [{"name": "w", "shape": [2, 3], "dtype": "int64"}]}, r"trainable dtypes"),
        (
            {"variables": [W.to_wire(), D.to_wire(), B.to_wire(), W.to_wire()]},
            r"duplicate variable names: \['w'\]",
        ),
        ({"shard": -1}, r"field 'shard' must be an int >= 0, got -1"),
        ({"shard": True}, r"field 'shard' must be an int >= 0, got True"),
        ({"global_step": "3"}, r"field 'global_step' must be an int >= 0, got '3'"),
        ({"version": 1.5}, r"field 'version' must be an int >= 0, got 1.5"),
        ({"rule": "sgd"}, r"field 'rule' must be a map, got 'sgd'"),
        ({"worker_data": [1, 2]}, r"worker_data must be a map of task -> map"),
        (
            {"worker_data": {"worker:0": [1, 2]}},
            r"worker:0: a data position must be a map, got list",
        ),
        ({"worker_data": {"worker:0": 5}}, r"worker:0: a data position must be a map, got int"),
        (
            {"worker_data": {"worker:0": {"blob": "x" * MAX_WORKER_DATA_BYTES}}},
            r"worker:0: the data position has 4108 bytes as JSON, at most 4096 are kept",
        ),
        (
            {"worker_data": {"worker:1": {"loss": float("nan")}}},
            r"worker:1: the data position is not plain JSON data",
        ),
    ],
)
def test_decode_refuses_bad_metadata_naming_it(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_shard(_craft(_tensors(), _metadata(**changes)))


def test_decode_refuses_a_tensor_of_a_variable_the_metadata_does_not_list() -> None:
    metadata = _metadata(variables=[W.to_wire(), D.to_wire()])
    with pytest.raises(ProtocolError, match=r"unexpected tensor 'value/b'"):
        decode_shard(_craft(_tensors(), metadata))


@pytest.mark.parametrize(
    ("document", "match"),
    [
        (b"", r"a shard document of 0 bytes is too short"),
        (b"garbage", r"a shard document of 7 bytes is too short"),
        (b"this is not a safetensors document at all", r"declares a \d+-byte header in 41 bytes"),
        (_raw(b"{}")[:8] + b"{", r"declares a 2-byte header in 9 bytes"),
        (struct.pack("<Q", 1 << 40) + b"{}", r"declares a 1099511627776-byte header in 10 bytes"),
        (struct.pack("<Q", 1000) + b'{"__metadata__": {}}', r"declares a 1000-byte header"),
        (_raw(b"\xff\xfe not json"), r"not a tensorfleet shard document"),
        (_raw(b"[1, 2, 3]"), r"not a tensorfleet shard document"),
        (_raw(b"{}"), r"not a tensorfleet shard document"),
        (_raw(b'{"__metadata__": {"other": "x"}}'), r"not a tensorfleet shard document"),
        (_raw(b'{"__metadata__": {"tensorfleet_shard": "{"}}'), r"not a tensorfleet shard"),
        (_raw(b'{"__metadata__": {"tensorfleet_shard": 5}}'), r"not a tensorfleet shard"),
        (_raw(b'{"__metadata__": {"tensorfleet_shard": "[1]"}}'), r"shard document format None"),
    ],
)
def test_decode_refuses_garbage(document: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_shard(document)
    with pytest.raises(ProtocolError, match=match):
        read_metadata(document)


def test_decode_refuses_a_document_whose_tensor_data_is_cut_short_or_extended() -> None:
    document = _craft(_tensors(), _metadata())
    with pytest.raises(ProtocolError, match=r"the shard document's tensors cannot be read"):
        decode_shard(document[:-1])
    with pytest.raises(ProtocolError, match=r"the shard document's tensors cannot be read"):
        decode_shard(document + b"\0")


def test_decode_refuses_tensors_whose_offsets_do_not_fit_the_data() -> None:
    header = json.dumps(
        {
            "__metadata__": {METADATA_KEY: json.dumps(_metadata(variables=[B.to_wire()]))},
            "value/b": {"dtype": "F32", "shape": [3], "data_offsets": [0, 400]},
        }
    ).encode()
    with pytest.raises(ProtocolError, match=r"the shard document's tensors cannot be read"):
        decode_shard(_raw(header, bytes(12)))


@pytest.mark.parametrize("where", ["header", "metadata"])
def test_decode_refuses_deeply_nested_json(where: str) -> None:
    nested = "[" * 100_000
    if where == "header":
        document = _raw(nested.encode())
    else:
        document = _raw(json.dumps({"__metadata__": {METADATA_KEY: nested}}).encode())
    with pytest.raises(ProtocolError, match=r"not a tensorfleet shard document"):
        decode_shard(document)


# -- check_worker_data -------------------------------------------------------------------------------


def test_check_worker_data_returns_a_valid_position_unchanged() -> None:
    position = {"epoch": 3, "offset": 1024, "seed": [1, 2], "name": "train", "frac": 0.5}
    assert check_worker_data("worker:2", position) is position


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ([1, 2], r"worker:2: a data position must be a map, got list"),
        ("epoch=1", r"worker:2: a data position must be a map, got str"),
        (None, r"worker:2: a data position must be a map, got NoneType"),
        ({"seed": {1, 2}}, r"worker:2: the data position is not plain JSON data"),
        ({"t": torch.zeros(1)}, r"worker:2: the data position is not plain JSON data"),
        ({"x": float("inf")}, r"worker:2: the data position is not plain JSON data"),
        ({"blob": "y" * 5000}, r"worker:2: the data position has 5012 bytes as JSON, at most 4096"),
    ],
)
def test_check_worker_data_refuses(data: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        check_worker_data("worker:2", data)


# -- property: mutated documents -----------------------------------------------------------------


def _conforms(state: ShardState) -> None:
    """A decoded state fits its own variables (what decode_shard promises its callers)."""
    by_name = {v.name: v for v in state.variables}
    assert set(state.values) == set(by_name)
    for source in (state.values, state.ema or {}):
        for name, tensor in source.items():
            var = by_name[name]
            assert tuple(tensor.shape) == var.shape
            assert str(tensor.dtype).removeprefix("torch.") == var.dtype
    if state.ema is not None:
        assert set(state.ema) == set(by_name)
    for name, tensors in state.optimizer.items():
        for tensor in tensors.values():
            assert tensor.dtype.is_floating_point
            assert tensor.numel() in (1, by_name[name].numel)
    for data in state.worker_data.values():
        json.dumps(data, allow_nan=False)


def _tensor_bits(state: ShardState) -> dict[str, bytes]:
    tensors = {f"value/{k}": v for k, v in state.values.items()}
    tensors.update({f"ema/{k}": v for k, v in (state.ema or {}).items()})
    for name, state_tensors in state.optimizer.items():
        tensors.update({f"optim/{name}/{k}": v for k, v in state_tensors.items()})
    return {k: _bits(v) for k, v in tensors.items()}


def _same_metadata(state: ShardState, original: ShardState) -> bool:
    return (
        state.shard,
        state.global_step,
        state.version,
        state.rule,
        state.variables,
        state.worker_data,
        state.ema is None,
    ) == (
        original.shard,
        original.global_step,
        original.version,
        original.rule,
        original.variables,
        original.worker_data,
        original.ema is None,
    )


_VALID = _document(_store(Adam(lr=0.05), updates=2, ema_decay=0.5), global_step=2)
_VALID_STATE = decode_shard(_VALID)
_DATA_START = 8 + struct.unpack("<Q", _VALID[:8])[0]

_mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, len(_VALID) - 1), st.integers(0, 255)),
    st.tuples(st.just("set"), st.integers(0, _DATA_START + 16), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, len(_VALID) - 1), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, len(_VALID)), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, len(_VALID) - 1), st.just(0)),
)


def _mutate(document: bytes, mutations: list[tuple[str, int, int]]) -> tuple[bytes, bool]:
    """The mutated document, and whether every change stayed inside the tensor data."""
    data = bytearray(document)
    only_data = True
    for kind, position, byte in mutations:
        position = min(position, len(data) - 1 if kind != "insert" else len(data))
        if kind == "set" and data:
            data[position] = byte
            only_data &= position >= _DATA_START
        elif kind == "truncate":
            del data[position:]
            only_data = False
        elif kind == "insert":
            data[position:position] = bytes([byte])
            only_data = False
        elif kind == "delete" and data:
            del data[position]
            only_data = False
    return bytes(data), only_data


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_mutation, min_size=1, max_size=4))
def test_a_mutated_document_is_refused_or_decodes_to_a_state_that_fits(
    mutations: list[tuple[str, int, int]],
) -> None:
    """The document carries no checksum (the manifest's SHA-256 guards the files), so a flipped
    data byte decodes to other values; what must hold: a ProtocolError or a state that fits its
    variables, never another exception; with only data bytes changed, the metadata is intact,
    and an unchanged document decodes to exactly the original."""
    mutated, only_data = _mutate(_VALID, mutations)
    try:
        state = decode_shard(mutated)
    except ProtocolError:
        return
    _conforms(state)
    if only_data:
        assert _same_metadata(state, _VALID_STATE)
    if mutated == _VALID:
        assert _same_metadata(state, _VALID_STATE)
        assert _tensor_bits(state) == _tensor_bits(_VALID_STATE)


def test_the_mutation_property_sees_the_valid_document_decode() -> None:
    """Guard for the property: the unmutated document decodes, with EMA and Adam state."""
    assert _VALID_STATE.ema is not None
    assert set(_VALID_STATE.optimizer["w"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert _mutate(_VALID, [("set", 3, _VALID[3])]) == (_VALID, False)
    flipped, only_data = _mutate(_VALID, [("set", len(_VALID) - 1, _VALID[-1] ^ 0x40)])
    assert only_data
    state = decode_shard(flipped)
    assert _same_metadata(state, _VALID_STATE)
    assert _tensor_bits(state) != _tensor_bits(_VALID_STATE)  # no checksum: other values
