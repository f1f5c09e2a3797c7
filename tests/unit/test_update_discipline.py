"""UpdateDiscipline: which combinations are valid, and the wire form the chief sends in
``create`` (parsed strictly: a ps refuses what it does not understand)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorfleet.errors import ConfigTypeError, ProtocolError
from tensorfleet.ps.update_discipline import UpdateDiscipline


def test_the_default_is_plain_async() -> None:
    assert UpdateDiscipline().to_wire() == {
        "mode": "async",
        "replicas_to_aggregate": None,
        "max_staleness": None,
        "clip_norm": None,
        "ema_decay": None,
        "lost_worker": "shrink",
        "max_gradient_age": "auto",
    }


def test_it_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        UpdateDiscipline().mode = "sync"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "allreduce"}, "mode must be one of ('async', 'sync'), got 'allreduce'"),
        ({"mode": "SYNC"}, "got 'SYNC'"),
        ({"replicas_to_aggregate": 2}, "replicas_to_aggregate=2 needs mode 'sync'"),
        ({"mode": "sync", "replicas_to_aggregate": 0}, "and a value >= 1"),
        ({"mode": "sync", "max_staleness": 1}, "max_staleness=1 needs mode 'async'"),
        ({"max_staleness": -1}, "max_staleness=-1 needs mode 'async' and a value >= 0"),
        ({"clip_norm": 0.0}, "clip_norm must be > 0, got 0.0"),
        ({"clip_norm": -1.0}, "clip_norm must be > 0, got -1.0"),
        ({"clip_norm": float("nan")}, "clip_norm must be > 0, got nan"),
        ({"ema_decay": 0.0}, "ema_decay must be in (0, 1), got 0.0"),
        ({"ema_decay": 1.0}, "ema_decay must be in (0, 1), got 1.0"),
        ({"ema_decay": float("nan")}, "got nan"),
        ({"mode": "sync", "max_gradient_age": 5}, "max_gradient_age=5 needs mode 'async'"),
        ({"max_gradient_age": 0}, "max_gradient_age must be 'auto', 'off' or a whole number"),
        ({"max_gradient_age": "never"}, "got 'never'"),
    ],
)
def test_invalid_combinations_are_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        UpdateDiscipline(**kwargs)


@pytest.mark.parametrize(
    ("field", "value", "wanted"),
    [
        ("max_staleness", 1.5, "int"),
        ("max_staleness", True, "int"),
        ("replicas_to_aggregate", 2.0, "int"),
        ("replicas_to_aggregate", "2", "int"),
        ("clip_norm", True, "int or float"),
        ("clip_norm", "1", "int or float"),
        ("ema_decay", "0.9", "float"),
        ("mode", 1, "str"),
        ("lost_worker", 0, "str"),
        ("max_gradient_age", 2.5, "int or str"),
        ("max_gradient_age", True, "int or str"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_when_built_naming_it(
    field: str, value: object, wanted: str
) -> None:
    """What from_wire would refuse as a protocol error never gets built, so never sent."""
    kwargs = {"mode": "sync" if field == "replicas_to_aggregate" else "async", field: value}
    with pytest.raises(ConfigTypeError) as excinfo:
        UpdateDiscipline(**kwargs)
    assert str(excinfo.value) == (
        f"discipline field {field}={value!r} is a {type(value).__name__}, not {wanted}: "
        f"give {field} as {wanted}"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "sync"},
        {"mode": "sync", "replicas_to_aggregate": 1, "clip_norm": 0.5, "ema_decay": 0.99},
        {"mode": "async", "max_staleness": 0},
        {"mode": "async", "max_staleness": 3, "clip_norm": 2, "ema_decay": 0.5},
        {"mode": "async", "max_gradient_age": "off"},
        {"mode": "async", "max_gradient_age": 1},
    ],
)
def test_valid_combinations_are_accepted(kwargs: dict) -> None:
    assert UpdateDiscipline(**kwargs).to_wire() == {
        **UpdateDiscipline().to_wire(),
        **kwargs,
    }


disciplines = st.one_of(
    st.builds(
        UpdateDiscipline,
        mode=st.just("sync"),
        replicas_to_aggregate=st.none() | st.integers(1, 1000),
        clip_norm=st.none() | st.floats(1e-6, 1e6) | st.integers(1, 100),
        ema_decay=st.none() | st.floats(1e-6, 1 - 1e-6),
    ),
    st.builds(
        UpdateDiscipline,
        mode=st.just("async"),
        max_staleness=st.none() | st.integers(0, 1000),
        max_gradient_age=st.sampled_from(["auto", "off"]) | st.integers(1, 10**6),
        clip_norm=st.none() | st.floats(1e-6, 1e6),
        ema_decay=st.none() | st.floats(1e-6, 1 - 1e-6),
    ),
)


@given(disciplines)
def test_to_wire_from_wire_round_trips(discipline: UpdateDiscipline) -> None:
    assert UpdateDiscipline.from_wire(discipline.to_wire()) == discipline


def test_from_wire_none_or_partial_fills_in_defaults() -> None:
    assert UpdateDiscipline.from_wire(None) == UpdateDiscipline()
    assert UpdateDiscipline.from_wire({}) == UpdateDiscipline()
    assert UpdateDiscipline.from_wire({"mode": "sync"}) == UpdateDiscipline(mode="sync")


@pytest.mark.parametrize("data", [["sync"], "sync", 3])
def test_from_wire_refuses_what_is_not_a_map(data: object) -> None:
    with pytest.raises(
        ProtocolError, match=f"'discipline' must be a map, got {type(data).__name__}"
    ):
        UpdateDiscipline.from_wire(data)


def test_from_wire_refuses_unknown_fields() -> None:
    with pytest.raises(ProtocolError, match="unknown discipline field 'lr'"):
        UpdateDiscipline.from_wire({"mode": "async", "lr": 0.1})


@pytest.mark.parametrize(
    "data",
    [
        {"mode": 1},
        {"mode": "sync", "replicas_to_aggregate": True},
        {"mode": "sync", "replicas_to_aggregate": 2.0},
        {"mode": "sync", "replicas_to_aggregate": "2"},
        {"max_staleness": False},
        {"max_staleness": 1.5},
        {"clip_norm": "1"},
        {"clip_norm": True},
        {"ema_decay": "0.9"},
        {"ema_decay": True},
    ],
)
def test_from_wire_refuses_wrong_types(data: dict) -> None:
    with pytest.raises(ProtocolError, match="has the wrong type"):
        UpdateDiscipline.from_wire(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"mode": "allreduce"}, "mode must be one of"),
        ({"mode": "async", "replicas_to_aggregate": 2}, "needs mode 'sync'"),
        ({"mode": "sync", "max_staleness": 2}, "needs mode 'async'"),
        ({"clip_norm": -3}, "clip_norm must be > 0"),
        ({"ema_decay": 1.5}, "ema_decay must be in"),
    ],
)
def test_from_wire_validates_values_like_the_constructor(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        UpdateDiscipline.from_wire(data)
