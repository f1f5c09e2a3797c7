"""``ComputeOptions``: faster forward and backward passes that the user turns on, and how a
session applies them to its model and its step.

Three options, each off by default:

* ``channels_last``: the model's 4-D parameters and every 4-D input in channels-last
  (NHWC) memory order. oneDNN's convolutions and PyTorch's max-pool are faster in that order
  on CPUs; the values, names and shapes of the parameters do not change, only their strides.
* ``compile``: the model the step closure calls goes through ``torch.compile`` (``True``, or
  a mapping of its keyword arguments); the variables keep their names (the session
  registered them from the model itself, never from the compiled wrapper).
* ``autocast="bf16"``: the closure (forward and loss) runs under
  ``torch.autocast(device, dtype=torch.bfloat16)``; the parameters, their gradients and
  everything on the wire stay in their own dtype (float32), so it changes the arithmetic of
  the step, not the variables.

Why these are options and not defaults, measured on this project's machine (an AMD EPYC
with AVX-512 and avx512_bf16, no AMX; torch 2.13; the classic CNN of
``examples/mnist_cnn.py``, batch 50, one thread; docs/compute.md has the table and the
command): one-process PyTorch ran the step in 53 ms where TensorFlow took 46 (36-50). The
profile says why: in NCHW order the first max-pool alone costs 9.7 ms (TensorFlow computes
in NHWC) and the second convolution's forward runs at 88 GFLOP/s against 120 in
channels-last; torch's default Adam makes four passes over the 1.6 M weights of ``fc1``
(``tfl.optim.Adam(..., fused=True)`` makes one). Channels-last plus the fused Adam bring the
step to 40.8 ms. Channels-last is not the default because it changes the order of the sums
(losses equal to plain training's to 1e-7, not bit for bit, and the project keeps torch's
default arithmetic bit for bit) and helps only convolutional models. ``torch.compile`` is
not a default because it makes this training step slower here (71.7 ms): inductor's kernel
for a ReLU whose mask is saved for the backward pass (a bool store) takes 12.6 ms for the
first layer's 1.25 M activations where eager PyTorch takes 0.2 ms, and the first step
compiles for 10 to 20 s. bf16 autocast runs the step in 23.8 ms (with channels-last and the
fused Adam) but rounds every convolution's and matmul's inputs to 8 bits of mantissa: an
accuracy cost, reported next to each figure in benchmarks/README.md.

A session applies them with :class:`ComputeSetup`: :meth:`ComputeSetup.prepare` before the
update mode wraps the model (the memory order, an input hook), :meth:`ComputeSetup.wrap`
after it (compile the wrapper, so DDP's hooks stay outside the compiled graph as
``torch.compile`` of a DDP module expects), :meth:`ComputeSetup.autocast` around the
closure, :meth:`ComputeSetup.release` at the end (the input hook is removed).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tensorfleet.errors import ConfigError, ConfigTypeError

_NOTHING: contextlib.AbstractContextManager[None] = contextlib.nullcontext()

log = logging.getLogger("tensorfleet.worker")

#: The autocast precisions by name: what ``ComputeOptions(autocast=...)`` accepts.
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16}


@dataclass(frozen=True)
class ComputeOptions:
    """Faster compute for the step, each option off by default (see the module docstring
    for what each does and costs, and docs/compute.md for the figures)::

        compute = tfl.ComputeOptions(channels_last=True)            # fp32, same accuracy
        compute = tfl.ComputeOptions(channels_last=True, autocast="bf16")  # faster, rounds
        with tfl.TrainingSession(server, model, optimizer, compute=compute) as sess: ...
    """

    channels_last: bool = False
    """4-D parameters and inputs in channels-last memory order (convolutional models)."""
    compile: bool | Mapping[str, Any] = False
    """``torch.compile`` the model the closure calls: True, or its keyword arguments."""
    autocast: str | None = None
    """None (the parameters' dtype) or ``"bf16"``: the closure under bf16 autocast."""

    def __post_init__(self) -> None:
        if not isinstance(self.channels_last, bool):
            raise ConfigTypeError(
                f"ComputeOptions(channels_last=...) takes True or False, got {self.channels_last!r}"
            )
        if not isinstance(self.compile, (bool, Mapping)):
            raise ConfigTypeError(
                "ComputeOptions(compile=...) takes True, False or a mapping of torch.compile's "
                f"keyword arguments such as {{'mode': 'max-autotune'}}, got {self.compile!r}"
            )
        if self.autocast is not None and self.autocast not in AUTOCAST_DTYPES:
            raise ConfigError(
                f"ComputeOptions(autocast=...) takes None or one of {sorted(AUTOCAST_DTYPES)}, "
                f"got {self.autocast!r}"
            )

    @property
    def compile_kwargs(self) -> dict[str, Any] | None:
        """torch.compile's keyword arguments, or None when the model is not compiled."""
        if self.compile is False:
            return None
        return {} if self.compile is True else dict(self.compile)

    def describe(self) -> str:
        """The options that are on, for logs and benchmark tables (``"plain"``: none)."""
        on = [
            name
            for name, value in (
                ("channels_last", self.channels_last),
                ("compile", self.compile is not False),
                (f"autocast={self.autocast}", self.autocast is not None),
            )
            if value
        ]
        return "+".join(on) or "plain"


class ComputeSetup:
    """``options`` applied to one session's model: its memory order, the compiled wrapper,
    the autocast around the closure. ``device_engine``: the name of the device engine the
    session runs (in-graph replicas, pipelines), which runs the model in threads and stages
    of its own, so compile and autocast are refused with it (channels-last works)."""

    def __init__(self, options: ComputeOptions | None, device_engine: str | None = None) -> None:
        if options is not None and not isinstance(options, ComputeOptions):
            raise ConfigTypeError(
                f"compute must be a tensorfleet.ComputeOptions, got {type(options).__name__}"
            )
        self.options = options or ComputeOptions()
        if device_engine is not None and (
            self.options.compile is not False or self.options.autocast is not None
        ):
            raise ConfigError(
                f"ComputeOptions(compile=..., autocast=...) do not combine with the device "
                f"engine {device_engine!r} (replica_devices, stage_devices or a pipeline across "
                "tasks run the model in threads and stages of their own); use channels_last "
                "only, or train without the engine"
            )
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._device_type = "cpu"

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model in the memory order asked for (the same module, its parameters' storage
        changed in place, so every reference to them stays valid), with a hook that brings
        4-D inputs to that order too. Called before the update mode wraps it."""
        first = next(model.parameters(), None)
        self._device_type = first.device.type if first is not None else "cpu"
        if self.options.channels_last:
            with torch.no_grad():
                for tensor in (*model.parameters(), *model.buffers()):
                    if tensor.dim() == 4 and tensor.stride() != channels_last_strides(tensor):
                        copy = torch.empty_like(tensor.data, memory_format=torch.channels_last)
                        tensor.data = copy.copy_(tensor.data)
            self._hook = model.register_forward_pre_hook(_channels_last_inputs, with_kwargs=True)
        if self.options.autocast is not None:
            self._check_autocast()
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        """What the closure calls: ``model`` (the update mode's wrapper) compiled when asked."""
        kwargs = self.options.compile_kwargs
        if kwargs is None:
            return model
        return torch.compile(model, **kwargs)  # type: ignore[return-value]

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Around the closure: bf16 autocast on the model's device when asked, else nothing
        (a shared no-op context: nothing built per step)."""
        if self.options.autocast is None:
            return _NOTHING
        return torch.autocast(self._device_type, dtype=AUTOCAST_DTYPES[self.options.autocast])

    def release(self) -> None:
        """Remove the input hook (the parameters keep their memory order)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _check_autocast(self) -> None:
        if self._device_type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            log.warning(
                "ComputeOptions(autocast='bf16'): this CPU has no bf16 instructions "
                "(avx512_bf16 or AMX); autocast will emulate them and likely be slower than fp32"
            )


def _channels_last_inputs(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A forward pre-hook: every 4-D floating-point tensor argument in channels-last order
    (the convolutions then take and give channels-last; no copy when it is already)."""
    return (
        tuple(_to_channels_last(a) for a in args),
        {k: _to_channels_last(v) for k, v in kwargs.items()},
    )


def _to_channels_last(value: Any) -> Any:
    if not (isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point()):
        return value
    strides = channels_last_strides(value)
    if value.stride() == strides:
        return value
    if value.is_contiguous(memory_format=torch.channels_last):
        # Already in channels-last order in memory, but with a dimension of size 1 (one input
        # channel: MNIST) whose stride says NCHW, and ``contiguous`` leaves it so. oneDNN
        # then takes it for NCHW. A copy with the exact strides (an input of one channel is
        # small; ``as_strided`` would avoid the copy but torch.compile cannot trace it).
        return torch.empty_like(value, memory_format=torch.channels_last).copy_(value)
    return value.contiguous(memory_format=torch.channels_last)


def channels_last_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """The strides of a dense channels-last (NHWC) tensor of ``tensor``'s 4-D shape."""
    _, c, h, w = tensor.shape
    return (h * w * c, 1, w * c, c)
