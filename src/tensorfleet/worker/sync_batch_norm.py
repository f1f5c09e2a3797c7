"""Synchronized batch norm for all-reduce mode on CPU, and the converter that picks it.

In all-reduce mode each worker sees a slice of the global batch, so a plain ``BatchNorm``
normalizes with its slice's statistics: not what one process training on the whole batch
would do, and noisy for small slices. ``torch.nn.SyncBatchNorm`` fixes that on GPUs but
refuses CPU modules ("SyncBatchNorm layers only work with GPU modules" under DDP, and "expected
input tensor to be on GPU" without it). :class:`CpuSyncBatchNorm` is the CPU counterpart:

* per channel, each worker sums ``x`` and ``x**2`` over its slice and counts its elements;
  one differentiable all-reduce (``torch.distributed.nn.functional.all_reduce``) of
  ``[sum, sumsq, count]`` gives the global mean and (biased) variance, and its backward
  all-reduces the gradients of those sums, so input gradients are those of the whole batch;
* the sums are accumulated in float64: the one-pass formula ``E[x^2] - E[x]^2`` loses digits
  to cancellation when ``|mean| >> std``; in float64 the loss stays far below float32's
  resolution, and it costs one conversion of the input per layer;
* running statistics follow ``BatchNorm`` exactly: ``momentum`` (or the cumulative average
  with ``momentum=None``), unbiased variance ``var * n / (n - 1)`` over the *global* count,
  ``num_batches_tracked``; evaluation uses the running statistics and no communication.

Slices may differ in size (the sums are weighted by construction). Without an initialized
process group (one process) it is a plain batch norm. ``tfl.convert_sync_batchnorm(model)``
replaces every ``BatchNorm*d``: by ``torch.nn.SyncBatchNorm`` where the module's tensors are
on an accelerator, by :class:`CpuSyncBatchNorm` where they are on the CPU.

Synchronized batch norm is for ``allreduce`` mode (the workers form a process group) and
for one process. In the ps modes (``async``, ``sync``) the workers form no process group,
so these layers compute exactly what a plain ``BatchNorm`` computes, each worker with its
own batch's statistics; :func:`warn_unsynchronized` says so once per process and mode
(an :class:`UnsynchronizedBatchNormWarning`), rather than let the conversion seem to work.
"""

from __future__ import annotations

import threading
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
from torch.nn.modules.batchnorm import _BatchNorm

from tensorfleet.errors import ConfigError

# torch 2.13 marks torch.distributed.nn.functional.all_reduce deprecated in favour of the
# private _functional_collectives module; it still is the documented differentiable
# all-reduce (its backward all-reduces the gradient), which is exactly what is needed here.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed\.nn\.functional\.all_reduce is deprecated",
    category=FutureWarning,
)


class UnsynchronizedBatchNormWarning(UserWarning):
    """Synchronized batch norm layers trained where nothing synchronizes them (a ps mode)."""


_warned_modes: set[str] = set()
_warned_lock = threading.Lock()


def synchronized_layers(model: nn.Module) -> list[str]:
    """The places in ``model`` of its synchronized batch norm layers (``nn.SyncBatchNorm``,
    :class:`CpuSyncBatchNorm`); ``""`` for the model itself."""
    kinds = (nn.SyncBatchNorm, CpuSyncBatchNorm)
    return [name for name, module in model.named_modules() if isinstance(module, kinds)]


def warn_unsynchronized(model: nn.Module, mode: str) -> list[str]:
    """Warn (once per process and ``mode``) when ``model``, trained in the ps mode ``mode``,
    holds synchronized batch norm layers: no process group joins the workers there, so they
    behave as plain ``BatchNorm`` (each worker's own batch statistics). Returns the layers'
    places (empty: nothing to say)."""
    layers = synchronized_layers(model)
    if not layers:
        return layers
    with _warned_lock:
        first = mode not in _warned_modes
        _warned_modes.add(mode)
    if first:
        shown = ", ".join(repr(name or "(the model itself)") for name in layers[:5])
        more = f" and {len(layers) - 5} more" if len(layers) > 5 else ""
        warnings.warn(
            f"the model has synchronized batch norm layers ({shown}{more}, from "
            f"tfl.convert_sync_batchnorm or nn.SyncBatchNorm), but mode {mode!r} trains "
            "through ps tasks, where no process group joins the workers: each worker "
            "normalizes with its own batch's statistics, as a plain BatchNorm does. For "
            "statistics over every worker's batch use mode 'allreduce'; in a ps mode, build "
            "the model with plain BatchNorm (leave out convert_sync_batchnorm) to say what "
            "it computes",
            UnsynchronizedBatchNormWarning,
            stacklevel=2,
        )
    return layers


class CpuSyncBatchNorm(_BatchNorm):
    """Batch norm whose batch statistics are those of every process's batch together.

    Arguments as ``torch.nn.SyncBatchNorm`` (``process_group``: None is the default group).
    Input: ``[N, C, *]`` of any number of trailing dims (1d, 2d, 3d alike).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ConfigError(f"expected at least 2D input [N, C, ...], got {input.dim()}D input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ConfigError(
                f"CpuSyncBatchNorm has {self.num_features} features, the input has "
                f"{input.shape[1]} channels (dim 1 of {list(input.shape)})"
            )
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (
                1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            )
        use_batch_stats = self.training or self.running_mean is None
        if not use_batch_stats:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                self.eps,
            )  # fmt: skip
        channels = input.shape[1]
        flat = input.transpose(0, 1).reshape(channels, -1).to(torch.float64)
        count = torch.full((1,), float(flat.shape[1]), dtype=torch.float64)
        stats = torch.cat([flat.sum(1), (flat * flat).sum(1), count])
        if self._world_size() > 1:
            stats = differentiable_all_reduce(stats, group=self._group())
        total, total_sq, n = stats[:channels], stats[channels : 2 * channels], stats[-1]
        n_value = float(n.detach())
        if n_value <= 1:
            raise ConfigError(
                f"expected more than 1 value per channel when training, got {int(n_value)} over "
                f"all processes (input {list(input.shape)})"
            )
        mean = total / n
        var = (total_sq / n - mean * mean).clamp_min(0.0)
        if self.training and self.running_mean is not None:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(
                    mean.to(self.running_mean.dtype), alpha=factor
                )
                unbiased = var * (n_value / (n_value - 1))
                self.running_var.mul_(1 - factor).add_(
                    unbiased.to(self.running_var.dtype), alpha=factor
                )
        shape = (1, channels) + (1,) * (input.dim() - 2)
        invstd = torch.rsqrt(var + self.eps)
        out = (input - mean.to(input.dtype).view(shape)) * invstd.to(input.dtype).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self._group())


def convert_sync_batchnorm(
    module: nn.Module, process_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """``module`` with every ``BatchNorm*d`` replaced by a synchronized one: torch's
    ``SyncBatchNorm`` for modules on an accelerator, :class:`CpuSyncBatchNorm` on the CPU.
    Parameters and running statistics are carried over (the same Parameter objects, as in
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``). Returns the converted module (a new
    object when ``module`` itself is a batch norm). For mode ``allreduce`` and one process:
    in a ps mode nothing synchronizes them, and the session warns
    (:func:`warn_unsynchronized`)."""
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(
        module, (nn.SyncBatchNorm, CpuSyncBatchNorm)
    ):
        tensors = [t for t in (*module.parameters(), *module.buffers())]
        on_accelerator = any(t.device.type != "cpu" for t in tensors)
        if on_accelerator:
            return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
        converted = CpuSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        if module.affine:
            with torch.no_grad():
                converted.weight = module.weight
                converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.training = module.training
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group))
    return converted
