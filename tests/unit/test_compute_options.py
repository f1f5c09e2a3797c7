"""``ComputeOptions`` in one process: each option trains a small CNN (finite, decreasing loss,
the same parameter names and shapes), the fp32 options give the loss of plain training
within a tolerance derived below, a checkpoint written with the options on loads strictly
into a plain model, bf16 autocast really runs the forward pass in bf16 and leaves the
gradients in float32, and misuse is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.errors import ConfigError, ConfigTypeError
from tensorfleet.worker.compute_options import (
    ComputeOptions,
    ComputeSetup,
    channels_last_strides,
)

STEPS = 6
#: Relative tolerance between plain fp32 training and channels-last (or compiled) fp32
#: training, loss by loss over STEPS Adam steps. The options change only the order of the
#: sums inside the convolutions (oneDNN's blocked kernels in another memory order, or the
#: compiler's fusions), so each forward differs by a few float32 roundings (relative 1e-7
#: each, over sums of at most 5 * 5 * 8 = 200 terms: ~1e-6 at the worst); Adam's update
#: divides the gradient by its own running magnitude, so a relative difference of the
#: gradients moves the parameters by lr times that difference, far below the loss's own
#: changes. 1e-4 leaves two orders of magnitude above the differences measured (2e-7 at
#: most) and is still 100 times smaller than the loss decrease of one step (~1e-2).
FP32_RTOL = 1e-4


class SmallCNN(nn.Module):
    """Two convolutions, a max-pool and a linear layer: what the options act on."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, kernel_size=5, padding=2)
        self.fc = nn.Linear(8 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(16, 1, 8, 8, generator=generator), torch.randint(
        0, 3, (16,), generator=generator
    )


def _train(
    compute: ComputeOptions | None, **session: object
) -> tuple[list[float], nn.Module, list[tuple[str, tuple[int, ...]]]]:
    """STEPS steps of Adam on one fixed batch; the losses, the model and its parameter names
    and shapes as the session left them."""
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = _data()
    losses = []
    with tfl.TrainingSession(
        None,
        model,
        optimizer=tfl.optim.Adam(lr=1e-2),
        hooks=[tfl.StopAtStep(STEPS)],
        progress_secs=None,
        compute=compute,
        **session,
    ) as sess:
        while not sess.should_stop():
            losses.append(sess.step(lambda: F.cross_entropy(sess.model(x), y)).loss)
    return losses, model, [(n, tuple(p.shape)) for n, p in model.named_parameters()]


PLAIN_NAMES = [(n, tuple(p.shape)) for n, p in SmallCNN().named_parameters()]


def _assert_trains(losses: list[float], names: list[tuple[str, tuple[int, ...]]]) -> None:
    assert len(losses) == STEPS
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.05, f"the loss did not decrease: {losses}"
    assert names == PLAIN_NAMES  # no "_orig_mod." prefix, no other shape


@pytest.mark.parametrize(
    "options",
    [ComputeOptions(channels_last=True), ComputeOptions(autocast="bf16")],
    ids=["channels_last", "autocast_bf16"],
)
def test_each_option_trains_with_the_same_parameter_names(options: ComputeOptions) -> None:
    losses, model, names = _train(options)
    _assert_trains(losses, names)
    if options.channels_last:
        assert model.conv2.weight.is_contiguous(memory_format=torch.channels_last)


def test_channels_last_reaches_the_first_convolution_of_a_one_channel_input() -> None:
    """A [N, 1, H, W] input and a [C, 1, k, k] weight are channels-last in memory but carry
    NCHW strides (the size-1 dimension's stride is free); unless both get the exact
    channels-last strides, oneDNN computes the first layer, and all after it, in NCHW."""
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = _data()
    outputs: list[torch.Tensor] = []
    model.conv1.register_forward_hook(lambda module, args, out: outputs.append(out))
    with tfl.TrainingSession(
        None,
        model,
        optimizer=tfl.optim.SGD(lr=0.1),
        progress_secs=None,
        compute=ComputeOptions(channels_last=True),
    ) as sess:
        assert model.conv1.weight.stride() == channels_last_strides(model.conv1.weight)
        sess.step(lambda: F.cross_entropy(sess.model(x), y))
    assert outputs[0].stride() == channels_last_strides(outputs[0]), outputs[0].stride()
    assert x.stride() == (64, 64, 8, 1)  # the caller's tensor is left as it was


def test_channels_last_gives_plain_training_losses() -> None:
    plain, _, _ = _train(None)
    channels_last, _, _ = _train(ComputeOptions(channels_last=True))
    assert channels_last == pytest.approx(plain, rel=FP32_RTOL)


@pytest.mark.timeout(240)
def test_compile_trains_the_same_losses_as_plain_and_saves_plain_names(tmp_path) -> None:
    """torch.compile (inductor, a C++ compiler on the CPU): 10-20 s on a 2-core machine, so
    one test covers it: the losses, the names, and a checkpoint a plain model loads strictly."""
    plain, _, _ = _train(None)
    options = ComputeOptions(channels_last=True, compile=True)
    compiled, model, names = _train(options, checkpoint_dir=tmp_path)
    _assert_trains(compiled, names)
    assert compiled == pytest.approx(plain, rel=FP32_RTOL)
    fresh = SmallCNN()
    state = tfl.load_checkpoint(tmp_path, fresh, strict=True)
    assert sorted(state) == sorted(SmallCNN().state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_checkpoint_written_with_channels_last_and_autocast_loads_into_a_plain_model(
    tmp_path,
) -> None:
    _, model, _ = _train(
        ComputeOptions(channels_last=True, autocast="bf16"), checkpoint_dir=tmp_path
    )
    fresh = SmallCNN()
    tfl.load_checkpoint(tmp_path, fresh, strict=True)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
        assert fresh.state_dict()[name].dtype == torch.float32


def test_autocast_runs_the_forward_in_bf16_and_keeps_float32_gradients() -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    x, y = _data()
    seen: list[torch.dtype] = []
    model.conv2.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with tfl.TrainingSession(
        None,
        model,
        optimizer=tfl.optim.SGD(lr=0.1),
        progress_secs=None,
        compute=ComputeOptions(autocast="bf16"),
    ) as sess:
        sess.step(lambda: F.cross_entropy(sess.model(x), y))
        assert seen == [torch.bfloat16]
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
        assert all(p.dtype == torch.float32 for p in model.parameters())
    model(x)  # outside the session's step: no autocast
    assert seen[-1] == torch.float32


def test_the_channels_last_input_hook_is_removed_when_the_session_closes() -> None:
    losses, model, _ = _train(ComputeOptions(channels_last=True))
    assert not model._forward_pre_hooks
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)  # stays


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"channels_last": 1}, ConfigTypeError, "channels_last=...) takes True or False, got 1"),
        ({"compile": "yes"}, ConfigTypeError, "compile=...) takes True, False or a mapping"),
        ({"autocast": "fp16"}, ConfigError, "takes None or one of ['bf16'], got 'fp16'"),
    ],
)
def test_invalid_options_are_refused_by_name(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error) as raised:
        ComputeOptions(**kwargs)
    assert message in str(raised.value)


def test_compile_and_autocast_are_refused_with_a_device_engine() -> None:
    with pytest.raises(ConfigError, match="do not combine with the device engine 'replicas'"):
        ComputeSetup(ComputeOptions(autocast="bf16"), "replicas")
    ComputeSetup(ComputeOptions(channels_last=True), "replicas")  # this one works
    with pytest.raises(ConfigTypeError, match="compute must be a tensorfleet.ComputeOptions"):
        ComputeSetup({"channels_last": True})  # type: ignore[arg-type]


def test_a_session_with_replica_devices_refuses_compile_before_training() -> None:
    with pytest.raises(ConfigError, match="do not combine with the device engine"):
        tfl.TrainingSession(
            None,
            SmallCNN(),
            optimizer=tfl.optim.SGD(lr=0.1),
            replica_devices=["/cpu:0", "/cpu:0"],
            compute=ComputeOptions(compile=True),
        )


def test_describe_names_the_options_that_are_on() -> None:
    assert ComputeOptions().describe() == "plain"
    assert (
        ComputeOptions(channels_last=True, compile={"mode": "default"}, autocast="bf16").describe()
        == "channels_last+compile+autocast=bf16"
    )
