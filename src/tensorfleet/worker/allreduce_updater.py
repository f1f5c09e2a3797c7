"""All-reduce training without parameter servers: the worker job forms a torch.distributed
process group (gloo on CPU, NCCL on GPU) from the cluster spec, the model is wrapped in
``DistributedDataParallel`` (which averages gradients during the backward pass, bucket by
bucket), and every worker applies the same update to its own replica. Rank = worker index;
rank 0 is the chief. The rendezvous is the chief's address in the cluster spec.

Same interface as :class:`~tensorfleet.worker.client.ParameterClient`, plus :meth:`wrap`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tensorfleet.errors import TensorfleetError
from tensorfleet.ps.placement import PlacementPlan
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.worker.client import ClientTimeouts, Progress
from tensorfleet.worker.moving_average import MovingAverage


class AllReduceUpdater:
    """One worker of an all-reduce group."""

    def __init__(
        self,
        rendezvous_address: str,
        rank: int,
        world_size: int,
        timeouts: ClientTimeouts | None = None,
        ema_decay: float | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size} workers")
        self.rendezvous_address = rendezvous_address
        self.rank = rank
        self.world_size = world_size
        self.timeouts = timeouts or ClientTimeouts()
        self._ema_decay = ema_decay
        self._moving_average: MovingAverage | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._wrapped: DistributedDataParallel | None = None
        self._forward_seen = False
        self._global_step = 0
        self._own_group = False

    def connect(self, device_type: str = "cpu") -> None:
        """Join the process group (waits up to ``connect_s`` for every worker to arrive)."""
        if dist.is_initialized():
            raise TensorfleetError(
                "a torch.distributed process group already exists in this process"
            )
        backend = "nccl" if device_type == "cuda" else "gloo"
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{self.rendezvous_address}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=self.timeouts.connect_s),
            )
        except (RuntimeError, dist.DistStoreError) as exc:
            raise TensorfleetError(
                f"worker {self.rank} could not join the all-reduce group of {self.world_size} at "
                f"{self.rendezvous_address} within {self.timeouts.connect_s:.0f} s: {exc}. Are all "
                "workers started, and is the chief's address reachable?"
            ) from exc
        self._own_group = True

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        """The model wrapped in DDP (rank 0's parameters are broadcast to every worker). The
        training closure must call this wrapper, not the inner model."""
        self._wrapped = DistributedDataParallel(model)
        self._wrapped.register_forward_pre_hook(self._note_forward)
        return self._wrapped

    def _note_forward(self, module: nn.Module, args: object) -> None:
        self._forward_seen = True

    def register(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        plan: PlacementPlan | None,
        rule: UpdateRule,
        is_chief: bool,
    ) -> int:
        if self._wrapped is None:
            raise RuntimeError("wrap() the model before register()")
        params = [p for _, p in named_params]
        self._optimizer = rule.build(params)
        if self._ema_decay is not None:
            self._moving_average = MovingAverage(named_params, self._ema_decay)
        return self._global_step

    def pull(self) -> Progress:
        return Progress(self._global_step, stop=False)

    def push_pull(self, count_step: bool = True, step: int | None = None) -> Progress:
        """Apply the update: DDP has already averaged the gradients during backward."""
        if not self._forward_seen:
            raise TensorfleetError(
                "mode 'allreduce': this step's forward pass did not go through the DDP wrapper, so "
                "the gradients were not averaged across workers. Compute the loss with "
                "`sess.model(x)`, not with the model you passed to TrainingSession"
            )
        self._forward_seen = False
        self._optimizer.step()
        if self._moving_average is not None:
            self._moving_average.update()
        self._global_step += 1
        return Progress(self._global_step, stop=False, made_step=self.rank == 0)

    def agree_to_stop(self, local_wish: bool) -> bool:
        """Whether any worker wants to stop: every worker must leave the loop at the same step,
        or the others would wait in the next all-reduce."""
        flag = torch.tensor([1 if local_wish else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def moving_average(self) -> dict[str, torch.Tensor]:
        if self._moving_average is None:
            raise ValueError("no moving average is kept: pass ema_decay to the TrainingSession")
        return self._moving_average.state()

    def finish(self, declare_end: bool) -> None:
        """Wait for every worker at the end, so that none tears the group down early."""
        if self._own_group and dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
        self._own_group = False
