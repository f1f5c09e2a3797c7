"""Update rules: every built-in rule, applied by a :class:`VariableStore` over a fused layout
of several variables, must give exactly (bit for bit) what ``torch.optim`` gives on separate
parameters; rules travel as msgpack data and are validated on arrival."""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest
import torch

from tensorfleet.ps import update_rules
from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.store import VariableStore
from tensorfleet.ps.update_rules import (
    SGD,
    Adagrad,
    Adam,
    Momentum,
    UpdateRule,
    register_update_rule,
)
from tensorfleet.worker.local_updater import LocalUpdater

STEPS = 5

#: Two dtype groups, a scalar, matrices and vectors, interleaved so offsets are non-trivial.
VARIABLES = (
    StoredVariable("layer1/weight", (3, 4), "float32"),
    StoredVariable("layer1/bias", (4,), "float32"),
    StoredVariable("scale", (), "float32"),
    StoredVariable("layer2/weight", (2, 3), "float64"),
    StoredVariable("layer2/bias", (5,), "float32"),
    StoredVariable("layer2/gain", (3,), "float64"),
)

ReferenceFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

RULES: list[tuple[str, UpdateRule, ReferenceFactory]] = [
    ("sgd", SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    (
        "momentum",
        Momentum(lr=0.1, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ),
    (
        "nesterov",
        Momentum(lr=0.05, momentum=0.8, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
    ),
    (
        "sgd-weight-decay",
        SGD(lr=0.1, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01),
    ),
    (
        "momentum-weight-decay-dampening",
        UpdateRule("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.02}),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.02),
    ),
    # Adam and Adagrad by name: torch's fused kernel on the CPU (update_rules, "Kernels")
    ("adam", Adam(), lambda ps: torch.optim.Adam(ps, fused=True)),
    ("adam-default-kernel", Adam(fused=False), lambda ps: torch.optim.Adam(ps)),
    (
        "adam-weight-decay",
        Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        lambda ps: torch.optim.Adam(
            ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, fused=True
        ),
    ),
    (
        "adam-amsgrad-foreach",
        UpdateRule("adam", {"lr": 0.01, "amsgrad": True, "foreach": True}),
        lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, foreach=True),
    ),
    ("adam-fused", Adam(lr=0.01, fused=True), lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True)),
    (
        "momentum-fused",
        Momentum(lr=0.1, momentum=0.9, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    ),
    ("adagrad", Adagrad(lr=0.1), lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True)),
    (
        "adagrad-default-kernel",
        Adagrad(lr=0.1, fused=False),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    ),
    (
        "adagrad-fused",
        Adagrad(lr=0.1, fused=True),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
    ),
    (
        "adagrad-accumulator",
        Adagrad(lr=0.1, initial_accumulator_value=0.1, eps=1e-6),
        lambda ps: torch.optim.Adagrad(
            ps, lr=0.1, initial_accumulator_value=0.1, eps=1e-6, fused=True
        ),
    ),
    (
        "adagrad-weight-decay",
        UpdateRule("adagrad", {"lr": 0.1, "weight_decay": 0.01, "lr_decay": 0.05}),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=0.01, lr_decay=0.05, fused=True),
    ),
]


def _values(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        v.name: torch.randn(v.shape, generator=generator, dtype=torch.float64).to(
            getattr(torch, v.dtype)
        )
        for v in VARIABLES
    }


def _fuse(layout: FusedLayout, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [
        torch.cat([tensors[var.name].reshape(-1) for var, _ in group.members])
        for group in layout.groups
    ]


def _unfuse(layout: FusedLayout, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        var.name: flat[offset : offset + var.numel].view(var.shape)
        for group, flat in zip(layout.groups, flats, strict=True)
        for var, offset in group.members
    }


@pytest.mark.parametrize(("label", "rule", "reference"), RULES, ids=[r[0] for r in RULES])
def test_store_matches_torch_optim_bit_for_bit(
    label: str, rule: UpdateRule, reference: ReferenceFactory
) -> None:
    layout = FusedLayout.of(VARIABLES)
    initial = _values(seed=0)
    store = VariableStore()
    store.create(layout, rule, _fuse(layout, initial))

    params = {name: torch.nn.Parameter(value.clone()) for name, value in initial.items()}
    optimizer = reference(list(params.values()))

    for step in range(STEPS):
        gradients = _values(seed=100 + step)
        for name, param in params.items():
            param.grad = gradients[name].clone()
        optimizer.step()
        store.apply(_fuse(layout, gradients))

        stored = _unfuse(layout, store.snapshot())
        for name, param in params.items():
            assert stored[name].dtype == param.dtype
            assert torch.equal(stored[name], param.detach()), f"{label}: {name} at step {step}"
    assert store.version == STEPS
    moved = _unfuse(layout, store.snapshot())
    assert not any(torch.equal(moved[name], initial[name]) for name in initial)


def test_local_updater_matches_torch_optim_and_counts_steps() -> None:
    initial = _values(seed=0)
    local = {name: torch.nn.Parameter(value.clone()) for name, value in initial.items()}
    reference = {name: torch.nn.Parameter(value.clone()) for name, value in initial.items()}
    updater = LocalUpdater()
    with pytest.raises(RuntimeError, match="register"):
        updater.push_pull()
    updater.register(list(local.items()), Momentum(0.1, 0.9))
    assert updater.pull().global_step == 0
    optimizer = torch.optim.SGD(list(reference.values()), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        gradients = _values(seed=100 + step)
        for params in (local, reference):
            for name, param in params.items():
                param.grad = gradients[name].clone()
        optimizer.step()
        progress = updater.push_pull(count_step=step % 2 == 0)
        assert progress.stop is False
    assert progress.global_step == 3
    assert updater.pull().global_step == 3
    for name in initial:
        assert torch.equal(local[name], reference[name])


# -- the rule as data ------------------------------------------------------------------------------


@pytest.mark.parametrize(("label", "rule", "_"), RULES, ids=[r[0] for r in RULES])
def test_rules_round_trip_through_msgpack(label: str, rule: UpdateRule, _: object) -> None:
    wire = msgpack.unpackb(msgpack.packb(rule.to_wire()), raw=False)
    assert UpdateRule.from_wire(wire) == rule
    assert UpdateRule.from_wire(rule.to_wire()) == rule


def test_factories_fill_in_torch_defaults() -> None:
    assert SGD().to_wire() == {
        "name": "sgd",
        "hyperparameters": {"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False},
    }
    assert Momentum().hyperparameters["momentum"] == 0.9
    assert Adam(betas=[0.5, 0.6]).hyperparameters["betas"] == (0.5, 0.6)
    assert Adagrad().name == "adagrad"


def test_to_wire_is_a_copy() -> None:
    rule = SGD(lr=0.1)
    wire = rule.to_wire()
    wire["hyperparameters"]["lr"] = 99.0
    assert rule.hyperparameters["lr"] == 0.1


def test_unknown_rule_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"unknown update rule 'rmsprop'; known: \['adagrad'"):
        UpdateRule("rmsprop", {})
    with pytest.raises(ValueError, match="unknown update rule"):
        UpdateRule.from_wire({"name": "lbfgs", "hyperparameters": {}})


@pytest.mark.parametrize(
    ("name", "hyper"),
    [("sgd", {"learning_rate": 0.1}), ("adam", {"momentum": 0.9}), ("adagrad", {"betas": [1]})],
)
def test_unknown_hyperparameter_is_a_value_error(name: str, hyper: dict) -> None:
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        UpdateRule(name, hyper)


@pytest.mark.parametrize(
    ("name", "hyper", "match"),
    [
        ("sgd", {"lr": "0.1"}, "wrong type"),
        ("sgd", {"lr": None}, "wrong type"),
        ("sgd", {"lr": True}, "must be a number"),
        ("sgd", {"nesterov": 1}, "wrong type"),
        ("sgd", {"momentum": [0.9]}, "wrong type"),
        ("adam", {"betas": 0.9}, "wrong type"),
        ("adam", {"betas": (0.9, "0.999")}, "wrong type"),
        ("adam", {"betas": (0.9, True)}, "wrong type"),
        ("adam", {"eps": (1e-8,)}, "wrong type"),
        ("adagrad", {"foreach": "yes"}, "wrong type"),
    ],
)
def test_hyperparameter_of_the_wrong_type_is_a_value_error(
    name: str, hyper: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        UpdateRule(name, hyper)


@pytest.mark.parametrize(
    "data",
    [
        None,
        "sgd",
        ["sgd", {}],
        {"name": "sgd"},
        {"hyperparameters": {}},
        {"name": 3, "hyperparameters": {}},
        {"name": "sgd", "hyperparameters": [["lr", 0.1]]},
    ],
)
def test_malformed_wire_rules_are_value_errors(data: object) -> None:
    with pytest.raises(ValueError, match="an update rule is"):
        UpdateRule.from_wire(data)


def test_wire_lists_become_tuples_for_tuple_hyperparameters() -> None:
    rule = UpdateRule.from_wire({"name": "adam", "hyperparameters": {"betas": [0.8, 0.9]}})
    assert rule.hyperparameters["betas"] == (0.8, 0.9)
    assert rule.build([torch.zeros(2, requires_grad=True)]).defaults["betas"] == (0.8, 0.9)


def test_build_gives_the_torch_optimizer_with_the_hyperparameters() -> None:
    optimizer = Momentum(lr=0.3, momentum=0.7, nesterov=True).build([torch.zeros(3)])
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.defaults["lr"] == 0.3
    assert optimizer.defaults["momentum"] == 0.7
    assert optimizer.defaults["nesterov"] is True
    assert isinstance(Adagrad().build([torch.zeros(1)]), torch.optim.Adagrad)


def test_invalid_values_are_refused_by_torch_when_building() -> None:
    with pytest.raises(ValueError):
        SGD(lr=-1.0).build([torch.zeros(1)])
    with pytest.raises(ValueError):
        SGD(lr=0.1, nesterov=True).build([torch.zeros(1)])  # Nesterov needs momentum

    # A factory that fails with IndexError (as torch does for some bad values) becomes a
    # ValueError that a ps can send back as a refusal instead of dying.
    def failing_factory(params, hyper):
        raise IndexError("tuple index out of range")

    update_rules.register_update_rule("failing", failing_factory, {})
    try:
        with pytest.raises(ValueError, match="update rule 'failing' cannot be built .* IndexError"):
            UpdateRule("failing").build([torch.zeros(1)])
    finally:
        update_rules._RULES.pop("failing")


def test_registered_rules_can_be_used_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(update_rules, "_RULES", dict(update_rules._RULES))
    register_update_rule(
        "rmsprop",
        lambda params, hyper: torch.optim.RMSprop(list(params), **hyper),
        {"lr": (int, float), "alpha": (int, float)},
    )
    rule = UpdateRule.from_wire({"name": "rmsprop", "hyperparameters": {"lr": 0.01, "alpha": 0.9}})
    assert isinstance(rule.build([torch.zeros(2)]), torch.optim.RMSprop)
    with pytest.raises(ValueError, match="unknown hyperparameter 'momentum'"):
        UpdateRule("rmsprop", {"momentum": 0.1})


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 0.99, 0.5), ()])
def test_betas_must_be_a_pair(betas):
    with pytest.raises(ValueError, match="pair of numbers"):
        UpdateRule("adam", {"betas": betas})


@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_hyperparameters_are_refused(lr):
    with pytest.raises(ValueError, match="finite"):
        UpdateRule("sgd", {"lr": lr})


def test_adam_and_adagrad_pick_the_fused_kernel_where_torch_has_it() -> None:
    """By name, Adam and Adagrad step with torch's fused kernel where it exists for the
    variables (Adam: CPU and CUDA, Adagrad: CPU only; floating dtypes); an explicit
    ``fused`` or ``foreach`` is obeyed; SGD keeps torch's default."""
    floats = [torch.float32, torch.bfloat16]
    assert Adam().uses_fused_kernel({"cpu"}, floats)
    assert Adam().uses_fused_kernel({"cuda"}, floats)
    assert Adagrad().uses_fused_kernel({"cpu"}, floats)
    assert not Adagrad().uses_fused_kernel({"cuda"}, floats)  # torch has none there
    assert not Adam().uses_fused_kernel({"cpu", "mps"}, floats)
    assert not Adam().uses_fused_kernel({"cpu"}, [torch.float32, torch.int64])
    assert not Adam(fused=False).uses_fused_kernel({"cpu"}, floats)
    assert not UpdateRule("adam", {"foreach": True}).uses_fused_kernel({"cpu"}, floats)
    assert Momentum(fused=True).uses_fused_kernel({"cpu"}, floats)
    assert not SGD().uses_fused_kernel({"cpu"}, floats)
    param = torch.nn.Parameter(torch.zeros(3))
    assert Adam().build([param]).defaults["fused"] is True
    assert Adam(fused=False).build([param]).defaults["fused"] is False
    assert not SGD().build([param]).defaults.get("fused")


def test_the_documented_kernel_example_prints_what_the_page_says(capsys) -> None:
    """docs/compute.md's example of the kernels, as written, prints its comments' values."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "compute.md").read_text()
    section = text.split("## On the ps: Adam and Adagrad in torch's fused kernel\n", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "docs/compute.md", "exec"), {})  # noqa: S102 - our own document
    assert capsys.readouterr().out.split() == ["True", "True", "False", "False"]
