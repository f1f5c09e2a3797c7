"""A shard steps big variables of an elementwise rule in cache-sized pieces
(:mod:`tensorfleet.ps.optimizer_pieces`): bit for bit the values of stepping them whole, and
the checkpoint, restore, namespace copy, partial push and copy on write see one state per
variable as before.

The stores here cut pieces of 7 elements (the default is 262,144), so that every variable
of more than 7 elements is stepped in pieces, none of which divides it evenly."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tensorfleet.ps.layout import FusedLayout, StoredVariable
from tensorfleet.ps.optimizer_pieces import steps_in_pieces
from tensorfleet.ps.store import VariableStore
from tensorfleet.ps.update_rules import SGD, Adam, UpdateRule, register_update_rule

PIECE = 7
WHOLE = 1 << 30

VARIABLES = [
    StoredVariable("embedding", (13, 5), "float32"),
    StoredVariable("bias", (3,), "float32"),
    StoredVariable("kernel", (4, 4, 3), "float32"),
    StoredVariable("scale", (), "float32"),
    StoredVariable("half", (30,), "bfloat16"),
]

register_update_rule(
    "rmsprop_for_pieces_test",
    lambda params, hyper: torch.optim.RMSprop(list(params), **hyper),
    {"lr": (int, float), "alpha": (int, float), "momentum": (int, float)},
    elementwise=True,
)

RULES = {
    "sgd": SGD(lr=0.05),
    "momentum_nesterov_decay": UpdateRule(
        "sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    ),
    "sgd_dampening_foreach": UpdateRule(
        "sgd", {"lr": 0.05, "momentum": 0.8, "dampening": 0.1, "foreach": True}
    ),
    # torch's default kernel (fused=False): Adam's and Adagrad's default is the fused one,
    # which steps whole variables (steps_in_pieces)
    "adam": Adam(lr=0.01, fused=False),
    "adam_amsgrad_decay": UpdateRule(
        "adam",
        {"lr": 0.01, "amsgrad": True, "weight_decay": 0.02, "betas": (0.8, 0.95), "fused": False},
    ),
    "adam_by_name": Adam(lr=0.01),
    "adam_fused": Adam(lr=0.01, fused=True),
    "registered_rmsprop": UpdateRule(
        "rmsprop_for_pieces_test", {"lr": 0.01, "alpha": 0.9, "momentum": 0.5}
    ),
    "adagrad": UpdateRule(
        "adagrad",
        {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "fused": False},
    ),
}


def _layout() -> FusedLayout:
    return FusedLayout.of(VARIABLES)


def _values(layout: FusedLayout, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(group.numel, generator=generator).to(_dtype(group.dtype))
        for group in layout.groups
    ]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _store(rule: UpdateRule, piece_elements: int) -> VariableStore:
    store = VariableStore(piece_elements=piece_elements)
    layout = _layout()
    store.create(layout, rule, _values(layout, seed=0))
    return store


def _steps(layout: FusedLayout, count: int, seed: int) -> list[list[torch.Tensor]]:
    return [_values(layout, seed=seed + step) for step in range(count)]


def _assert_same_state(a: VariableStore, b: VariableStore) -> None:
    for mine, theirs in zip(a.live_values(), b.live_values(), strict=True):
        assert torch.equal(mine, theirs)
    values_a, _, optimizer_a = a.checkpoint_parts()
    values_b, _, optimizer_b = b.checkpoint_parts()
    assert values_a.keys() == values_b.keys()
    for name in values_a:
        assert torch.equal(values_a[name], values_b[name]), name
    assert optimizer_a.keys() == optimizer_b.keys()
    for name, tensors in optimizer_a.items():
        assert tensors.keys() == optimizer_b[name].keys(), name
        for key, tensor in tensors.items():
            other = optimizer_b[name][key]
            assert tensor.shape == other.shape and tensor.dtype == other.dtype, (name, key)
            assert torch.equal(tensor, other), (name, key)


@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_pieces_step_every_elementwise_rule_bit_for_bit_as_whole_variables(rule_name: str) -> None:
    rule = RULES[rule_name]
    pieces, whole = _store(rule, PIECE), _store(rule, WHOLE)
    layout = _layout()
    for gradients in _steps(layout, count=6, seed=10):
        pieces.apply(gradients)
        whole.apply(gradients)
    _assert_same_state(pieces, whole)
    assert pieces.version == whole.version == 6


def test_a_push_in_parts_steps_pieces_as_it_steps_whole_variables() -> None:
    rule = RULES["adam_amsgrad_decay"]
    pieces, whole = _store(rule, PIECE), _store(rule, WHOLE)
    layout = _layout()
    for gradients in _steps(layout, count=3, seed=20):
        for start, stop in ((0, 2), (2, 5)):
            slices = layout.part_slices(start, stop)
            part = [grad[lo:hi] for grad, (lo, hi) in zip(gradients, slices, strict=True)]
            for store in (pieces, whole):
                store.apply(part, part=(start, stop), counts=stop == 5)
    _assert_same_state(pieces, whole)


def test_a_checkpoint_of_pieces_restores_into_pieces_and_into_whole_variables() -> None:
    rule = RULES["adam"]
    layout = _layout()
    source = _store(rule, PIECE)
    for gradients in _steps(layout, count=3, seed=30):
        source.apply(gradients)
    restored_pieces, restored_whole = _store(rule, PIECE), _store(rule, WHOLE)
    for store in (restored_pieces, restored_whole):
        # A restore takes the checkpoint's tensors as its state: one decoded copy each.
        values, ema, optimizer = source.checkpoint_parts()
        assert optimizer["embedding"]["exp_avg"].shape == (13, 5)
        assert optimizer["embedding"]["step"].dim() == 0
        store.restore(values, ema, optimizer, version=3)
    for gradients in _steps(layout, count=2, seed=40):
        for store in (source, restored_pieces, restored_whole):
            store.apply(gradients)
    _assert_same_state(restored_pieces, source)
    _assert_same_state(restored_whole, source)


def test_a_namespace_copy_between_stores_in_pieces_is_bit_exact() -> None:
    rule = RULES["momentum_nesterov_decay"]
    layout = _layout()
    source, target = _store(rule, PIECE), _store(rule, PIECE)
    for gradients in _steps(layout, count=2, seed=50):
        source.apply(gradients)
    target.take_state_of(source)
    for gradients in _steps(layout, count=2, seed=60):
        source.apply(gradients)
        target.apply(gradients)
    _assert_same_state(target, source)


@dataclass
class _InFlight:
    done: bool = False


def test_copy_on_write_moves_the_pieces_with_the_variables() -> None:
    """A write while a reply carries the values moves every tensor the optimizer steps onto
    new memory: the lent values stay as they were and the update lands in the store."""
    rule = RULES["adam"]
    layout = _layout()
    pieces, whole = _store(rule, PIECE), _store(rule, WHOLE)
    first, second = _steps(layout, count=2, seed=70)
    for store in (pieces, whole):
        store.apply(first)
    lent = [flat.detach() for flat in pieces.live_values()]  # aliases of the memory lent
    before = [flat.clone() for flat in lent]
    tracker = _InFlight()
    pieces.lent(tracker)
    for store in (pieces, whole):
        store.apply(second)
    assert pieces.copies_on_write == 1
    for flat, kept in zip(lent, before, strict=True):
        assert torch.equal(flat, kept)
    _assert_same_state(pieces, whole)


def test_a_rule_not_registered_as_elementwise_steps_whole_variables() -> None:
    """A rule that reads a whole tensor (here: the gradient's norm) would give other values
    over pieces; registered without ``elementwise=True`` it steps whole variables."""

    class NormalizedSGD(torch.optim.Optimizer):
        def __init__(self, params: list[torch.Tensor], lr: float) -> None:
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure: object = None) -> None:
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.add_(param.grad / param.grad.norm(), alpha=-group["lr"])

    register_update_rule(
        "normalized_sgd_for_pieces_test",
        lambda params, hyper: NormalizedSGD(list(params), **hyper),
        {"lr": (int, float)},
    )
    rule = UpdateRule("normalized_sgd_for_pieces_test", {"lr": 0.5})
    assert not rule.elementwise and Adam().elementwise
    variables = [StoredVariable("w", (40,), "float32")]
    layout = FusedLayout.of(variables)
    store = VariableStore(piece_elements=PIECE)
    initial = torch.ones(40)
    store.create(layout, rule, [initial])
    gradient = torch.arange(40, dtype=torch.float32)
    store.apply([gradient])
    expected = initial - 0.5 * gradient / gradient.norm()
    assert torch.equal(store.live_values()[0], expected)


def test_a_checkpoint_of_pieces_holds_each_slot_once_and_stepping_goes_on_exactly() -> None:
    """``checkpoint_parts(copy=False)`` gives views of the live state, as for whole
    variables: the pieces' slots are gathered into one tensor per slot (once) and stay views
    of it, so the optimizer's state is never held twice and later steps write into it."""
    rule = RULES["adam_amsgrad_decay"]
    layout = _layout()
    pieces, whole = _store(rule, PIECE), _store(rule, WHOLE)
    first, second, third = _steps(layout, count=3, seed=80)
    for store in (pieces, whole):
        store.apply(first)
    _, _, live = pieces.checkpoint_parts(copy=False)
    for store in (pieces, whole):
        store.apply(second)
    _, _, again = pieces.checkpoint_parts(copy=False)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        # The view taken before the second step is the live slot: it moved with it.
        assert live["embedding"][key].data_ptr() == again["embedding"][key].data_ptr()
        assert torch.equal(live["embedding"][key], again["embedding"][key])
    for store in (pieces, whole):
        store.apply(third)
    _assert_same_state(pieces, whole)


def test_only_rules_in_torchs_default_kernel_are_stepped_in_pieces() -> None:
    """Adam and Adagrad by name step whole variables with the fused kernel; with
    ``fused=False`` (torch's default kernel) and for SGD, in pieces."""
    floats = [torch.float32]
    assert not steps_in_pieces(Adam(lr=0.01), floats)
    assert not steps_in_pieces(UpdateRule("adagrad", {"lr": 0.1}), floats)
    assert steps_in_pieces(RULES["adam"], floats) and steps_in_pieces(RULES["adagrad"], floats)
    assert steps_in_pieces(RULES["momentum_nesterov_decay"], floats)
