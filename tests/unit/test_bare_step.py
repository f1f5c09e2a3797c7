"""A ps shard steps its optimizer without torch's per-call wrappers
(:mod:`tensorfleet.ps.bare_step`): bit for bit where ``step()`` puts the parameters and the
state, for every built-in rule and option; an optimizer that is not torch's own, or that is
differentiable, keeps its wrapped step (its hooks run)."""

from __future__ import annotations

import pytest
import torch

from tensorfleet.ps.bare_step import bare_step
from tensorfleet.ps.update_rules import SGD, Adam, UpdateRule

RULES = {
    "sgd": SGD(lr=0.05),
    "momentum_nesterov_decay": UpdateRule(
        "sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    ),
    "sgd_foreach": UpdateRule("sgd", {"lr": 0.05, "momentum": 0.8, "foreach": True}),
    "adam_fused_default": Adam(lr=0.01),
    "adam_unfused_amsgrad": UpdateRule(
        "adam", {"lr": 0.01, "amsgrad": True, "weight_decay": 0.02, "fused": False}
    ),
    "adagrad_fused_default": UpdateRule("adagrad", {"lr": 0.1}),
    "adagrad_unfused": UpdateRule("adagrad", {"lr": 0.1, "lr_decay": 0.01, "fused": False}),
}


def _params(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, generator=generator).requires_grad_() for shape in ((37,), (5, 3), ())
    ]


@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_the_bare_step_ends_where_step_ends_bit_for_bit(rule_name: str) -> None:
    rule = RULES[rule_name]
    wrapped_params, bare_params = _params(0), _params(0)
    wrapped, bare = rule.build(wrapped_params), rule.build(bare_params)
    for step in range(3):
        gradients = [torch.randn_like(p) for p in _params(step + 1)]
        for params in (wrapped_params, bare_params):
            for param, gradient in zip(params, gradients, strict=True):
                param.grad = gradient.clone()
        wrapped.step()
        bare_step(bare)
        for mine, theirs in zip(bare_params, wrapped_params, strict=True):
            assert torch.equal(mine, theirs), (rule_name, step)
            assert not mine.grad_fn, "a bare step must not record autograd history"
    for mine, theirs in zip(bare_params, wrapped_params, strict=True):
        state, expected = bare.state[mine], wrapped.state[theirs]
        assert state.keys() == expected.keys()
        for key in expected:
            assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(expected[key])), key


class _CountingSGD(torch.optim.Optimizer):
    """An optimizer of the user's, outside ``torch.optim``."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {"lr": 0.5})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.add_(param.grad, alpha=-group["lr"])


def test_an_optimizer_not_of_torch_keeps_its_hooks() -> None:
    param = torch.ones(4, requires_grad=True)
    optimizer = _CountingSGD([param])
    calls = []
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    param.grad = torch.ones(4)
    bare_step(optimizer)
    assert calls == ["post"] and torch.equal(param.detach(), torch.full((4,), 0.5))


def test_torchs_own_optimizer_steps_without_its_hooks_and_a_differentiable_one_with_them() -> None:
    """What the bare step skips, shown: torch's step hooks (the ps registers none); an
    optimizer built with ``differentiable=True`` needs the wrapper's gradient mode and keeps
    it, hooks included."""
    for differentiable, expected in ((False, []), (True, ["post"])):
        param = torch.ones(4)  # not a leaf that needs a gradient: a differentiable step may
        param.grad = torch.ones(4)  # update it in place with gradients on
        optimizer = torch.optim.SGD([param], lr=0.5, differentiable=differentiable)
        calls: list[str] = []
        optimizer.register_step_post_hook(lambda *_, seen=calls: seen.append("post"))
        bare_step(optimizer)
        assert calls == expected
        assert torch.equal(param, torch.full((4,), 0.5))
