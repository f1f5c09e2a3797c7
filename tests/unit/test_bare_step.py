"""An optimizer steps without torch's per-call wrappers when nothing would see them
(:mod:`tensorfleet.ps.bare_step`): bit for bit where ``step()`` puts the parameters and the
state, for every built-in rule and option; with a step hook registered (the optimizer's or
torch's global one), a profiler recording, a differentiable optimizer or an optimizer class
that is not torch's, the wrapped step runs, and what it does is seen."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

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


def _sgd(**options: object) -> tuple[torch.Tensor, torch.optim.SGD]:
    param = torch.ones(4, requires_grad=not options.get("differentiable", False))
    param.grad = torch.ones(4)
    return param, torch.optim.SGD([param], lr=0.5, **options)


def test_the_optimizers_own_hooks_run() -> None:
    param, optimizer = _sgd()
    calls: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    bare_step(optimizer)
    assert calls == ["pre", "post"]
    assert torch.equal(param.detach(), torch.full((4,), 0.5))


def test_torchs_global_hooks_run() -> None:
    param, optimizer = _sgd()
    calls: list[str] = []
    handle = register_optimizer_step_post_hook(lambda *_: calls.append("global post"))
    try:
        bare_step(optimizer)
    finally:
        handle.remove()
    assert calls == ["global post"]
    assert torch.equal(param.detach(), torch.full((4,), 0.5))


def test_a_profiler_sees_the_steps_range() -> None:
    param, optimizer = _sgd()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        bare_step(optimizer)
    names = {event.name for event in profiler.events()}
    assert any(name.startswith("Optimizer.step#SGD.step") for name in names), sorted(names)
    assert torch.equal(param.detach(), torch.full((4,), 0.5))


def _watch_step(optimizer: torch.optim.Optimizer) -> list[str]:
    """Record calls of ``optimizer.step()`` (the wrapped step) made through the instance."""
    calls: list[str] = []
    wrapped = optimizer.step

    def step(*args: object, **kwargs: object) -> object:
        calls.append("step()")
        return wrapped(*args, **kwargs)

    optimizer.step = step  # type: ignore[method-assign]
    return calls


def test_torchs_own_optimizer_unobserved_steps_bare() -> None:
    param, optimizer = _sgd()
    calls = _watch_step(optimizer)
    bare_step(optimizer)
    assert calls == []  # the class's own step ran, not the wrapped one
    assert torch.equal(param.detach(), torch.full((4,), 0.5))


def test_a_differentiable_optimizer_steps_wrapped() -> None:
    param, optimizer = _sgd(differentiable=True)  # not a leaf that needs a gradient
    calls = _watch_step(optimizer)
    bare_step(optimizer)
    assert calls == ["step()"]
    assert torch.equal(param, torch.full((4,), 0.5))


class _PlainSGD(torch.optim.Optimizer):
    """An optimizer of the user's, outside ``torch.optim``."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {"lr": 0.5})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.add_(param.grad, alpha=-group["lr"])


def test_an_optimizer_not_of_torch_steps_wrapped() -> None:
    param = torch.ones(4, requires_grad=True)
    param.grad = torch.ones(4)
    optimizer = _PlainSGD([param])
    calls = _watch_step(optimizer)
    bare_step(optimizer)
    assert calls == ["step()"]
    assert torch.equal(param.detach(), torch.full((4,), 0.5))
