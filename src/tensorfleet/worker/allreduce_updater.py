"""All-reduce training without parameter servers: the worker job forms a torch.distributed
process group from the cluster spec (gloo; the gradients go over NCCL when every worker has
a GPU of its own, over gloo when workers share a GPU or compute on CPUs:
:mod:`tensorfleet.worker.collective_backend`), the model is wrapped in
``DistributedDataParallel`` (which averages gradients during the backward pass, bucket by
bucket), and every worker applies the same update to its own replica. Rank = worker index;
rank 0 is the chief. The rendezvous is the chief's address in the cluster spec.

It implements the :class:`~tensorfleet.worker.updater.Updater` protocol; :meth:`wrap` is
where the model becomes its DDP wrapper, and the loop's end and checkpoints are collective
(``collective = True``): every replica holds the same parameters and optimizer state, so
the chief's replica is the checkpoint; the workers' data positions are gathered to it
(:meth:`gather_data`) at a step all of them agreed on (:meth:`agree`). A restore is
broadcast from the chief (:meth:`restore_collectively`), so the checkpoint directory needs
to exist on the chief's machine only.
"""

from __future__ import annotations

import datetime
import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tensorfleet import task_markers
from tensorfleet.errors import (
    CheckpointError,
    ClusterConfigError,
    ConfigError,
    DeadlineExceeded,
    ProtocolError,
    TensorfleetError,
    UsageError,
)
from tensorfleet.ps.bare_step import bare_step
from tensorfleet.ps.buffer_policies import persistent_buffers
from tensorfleet.ps.shard_checkpoint import MAX_WORKER_DATA_BYTES, check_worker_data
from tensorfleet.ps.update_discipline import UpdateDiscipline
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.wire import shared_memory
from tensorfleet.worker.collective_backend import (
    BackendChoice,
    DeviceIdentity,
    choose_backend,
    decode_identity,
    device_identity,
    encode_identity,
)
from tensorfleet.worker.host_allreduce import (
    BUCKET_CAP_MB,
    HostAllReduce,
    HostPathChoice,
    choose_host_path,
    decode_host,
    encode_host,
)
from tensorfleet.worker.moving_average import MovingAverage
from tensorfleet.worker.progress import Agreement, Progress
from tensorfleet.worker.replica_state import (
    check_buffers,
    decode_replica,
    encode_replica,
    load_buffers,
    optimizer_state_template,
)
from tensorfleet.worker.table_attachment import find_tables
from tensorfleet.worker.timeouts import ClientTimeouts
from tensorfleet.worker.updater import (
    CheckpointSource,
    DataPosition,
    NamedParams,
    Restored,
    SavedState,
    retune_optimizer,
    whole_placement,
    zero_gradients,
)

#: Outcomes of the chief's look at the checkpoint, broadcast before any state is.
_NO_CHECKPOINT, _RESTORING, _UNUSABLE = 0, 1, 2


class AllReduceUpdater:
    """One worker of an all-reduce group. ``task_names``: every worker's task name by rank
    (their data positions are saved under these names; default ``worker:<rank>``)."""

    discipline: UpdateDiscipline | None = None
    collective = True

    def __init__(
        self,
        rendezvous_address: str,
        rank: int,
        world_size: int,
        timeouts: ClientTimeouts | None = None,
        ema_decay: float | None = None,
        task_names: Sequence[str] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(
                f"rank {rank} is outside a group of {world_size} workers: give 0 <= rank < "
                f"{world_size}"
            )
        self.task_names = (
            list(task_names)
            if task_names is not None
            else [f"worker:{r}" for r in range(world_size)]
        )
        if len(self.task_names) != world_size:
            raise ConfigError(
                f"{len(self.task_names)} task names for a group of {world_size} workers"
            )
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
        self._named_params: list[tuple[str, torch.Tensor]] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self._rule: UpdateRule | None = None
        self._device = torch.device("cpu")
        self._identity: DeviceIdentity | None = None
        self._gradient_group: Any = None  # None: the default (gloo) group
        #: The gradients' backend and why (set by :meth:`connect`).
        self.backend_choice: BackendChoice | None = None
        #: Whether the gradients are averaged through shared memory, and why (:meth:`connect`).
        self.host_path_choice: HostPathChoice | None = None
        self._host_allreduce: HostAllReduce | None = None

    def connect(self, device: torch.device | None = None) -> None:
        """Join the process group (waits up to ``connect_s`` for every worker to arrive) over
        gloo, exchange where each worker computes, and choose the gradients' backend
        (:func:`~tensorfleet.worker.collective_backend.choose_backend`): NCCL when every
        worker has a GPU of its own, gloo otherwise (workers sharing a GPU, or CPUs). The
        chief prints the choice and its reason. Workers all on one host and not on NCCL then
        average their gradients through shared memory (:mod:`~tensorfleet.worker.host_allreduce`;
        ``TENSORFLEET_SHARED_MEMORY=0`` keeps them on gloo): the chief says which, and why."""
        self._device = device if device is not None else torch.device("cpu")
        host_path_enabled = shared_memory.enabled()  # a malformed value fails before the group
        if dist.is_initialized():
            raise UsageError(
                "a torch.distributed process group already exists in this process: one "
                "all-reduce session per process"
            )
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{self.rendezvous_address}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=self.timeouts.connect_s),
            )
        except (RuntimeError, dist.DistStoreError) as exc:
            raise DeadlineExceeded(
                f"worker {self.rank} could not join the all-reduce group of {self.world_size} at "
                f"{self.rendezvous_address} within {self.timeouts.connect_s:.0f} s: {exc}. Are all "
                "workers started, and is the chief's address reachable?"
            ) from exc
        self._own_group = True
        self._identity = device_identity(self._device)
        mine = encode_identity(self._identity)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        self.backend_choice = choose_backend([decode_identity(t) for t in gathered])
        if self.rank == 0:
            print(self.backend_choice.describe(self.rank), flush=True)
        if self.backend_choice.backend == "nccl":  # pragma: no cover - needs several GPUs
            self._gradient_group = dist.new_group(backend="nccl")
        mine = encode_host(shared_memory.host_identity(), host_path_enabled)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        hosts = [decode_host(t) for t in gathered]
        self.host_path_choice = choose_host_path(
            [host for host, _ in hosts],
            [enabled for _, enabled in hosts],
            nccl=self.backend_choice.backend == "nccl",
        )
        if self.rank == 0 and self.world_size > 1:
            print(self.host_path_choice.describe(self.rank), flush=True)

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        """The model wrapped in DDP (rank 0's parameters are broadcast to every worker). The
        training closure must call this wrapper, not the inner model. A model holding
        ``tfl.EmbeddingTable`` modules is refused: their rows live on ps shards, and this
        mode has none."""
        tables = find_tables(model)
        if tables:
            places = ", ".join(repr(place or "(the model itself)") for place, _ in tables)
            raise ConfigError(
                f"the model holds tfl.EmbeddingTable modules ({places}), whose rows live on "
                "ps shards (or in this process, without a cluster); mode 'allreduce' has no "
                "ps. Fix: train in mode 'async' or 'sync' with ps tasks, or build the embedding "
                "as nn.Embedding(..., sparse=True), which all-reduce trains as a replicated weight"
            )
        self._buffers = persistent_buffers(model)  # DDP broadcasts rank 0's at each forward
        on_gpu = self._device.type == "cuda"
        try:
            self._wrapped = DistributedDataParallel(
                model,
                device_ids=[self._device.index or 0] if on_gpu else None,
                process_group=self._gradient_group,
                bucket_cap_mb=BUCKET_CAP_MB,
            )
        except RuntimeError as exc:  # NCCL's and gloo's failures (DistBackendError too)
            raise ClusterConfigError(self._collective_failure(exc)) from exc
        if self.host_path_choice is not None and self.host_path_choice.use:
            self._host_allreduce, problem = HostAllReduce.form(
                self.rank, self.world_size, list(model.parameters()), self._device
            )
            if self._host_allreduce is None:
                print(
                    f"worker {self.rank}: gradients averaged over gloo after all: {problem}",
                    flush=True,
                )
            else:
                self._host_allreduce.attach(self._wrapped)
        self._wrapped.register_forward_pre_hook(self._note_forward)
        return self._wrapped

    def _collective_failure(self, exc: BaseException) -> str:
        """What a failed collective says: the worker, its device, the backend, the fix."""
        where = self._identity.label if self._identity is not None else str(self._device)
        backend = self.backend_choice.backend if self.backend_choice is not None else "gloo"
        # NCCL's first line says where, its last what ("Duplicate GPU detected : rank 2 ...")
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = " / ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else repr(exc)
        return (
            f"worker {self.rank} ({self.task_names[self.rank]}, on {where}): the all-reduce "
            f"group over {backend} failed as DDP set up the gradients' exchange: {first}. "
            "Fix: give each worker its own GPU (tensorfleet launch does while there are enough; "
            "check each worker's CUDA_VISIBLE_DEVICES), or compute on the CPU (--device "
            "/cpu:0); the other workers' output may say more"
        )

    def _note_forward(self, module: nn.Module, args: object) -> None:
        self._forward_seen = True

    def register(self, named_params: NamedParams, rule: UpdateRule) -> None:
        if self._wrapped is None:
            raise UsageError("wrap() the model before register()")
        params = [p for _, p in named_params]
        self._named_params, self._rule = list(named_params), rule
        self._optimizer = rule.build(params)
        if self._ema_decay is not None:
            self._moving_average = MovingAverage(named_params, self._ema_decay)

    def restore(self, checkpoints: CheckpointSource | None, resume: bool = True) -> Restored:
        """*Collective*: the chief reads the newest valid checkpoint and every replica takes
        it. Without one (or without ``checkpoints``, or ``resume``), training starts from the
        chief's initial values, which DDP broadcast when it wrapped the model. Every worker
        must pass a source alike (they run the same command)."""
        if checkpoints is None or not resume:
            return Restored(self._global_step)
        checkpoint = checkpoints.newest() if self.rank == 0 else None
        if checkpoint is not None:
            checkpoints.restoring(checkpoint)
        try:
            data = self.restore_collectively(
                None if checkpoint is None else checkpoint.documents[0],
                0 if checkpoint is None else checkpoint.global_step,
                self.task_names[self.rank],
            )
        except TensorfleetError as exc:
            raise CheckpointError(
                f"{exc}. Start fresh (restore=False) or point checkpoint_dir elsewhere"
            ) from None
        return Restored(self._global_step, data)

    def pull(self) -> Progress:
        return Progress(self._global_step, stop=False)

    def push_pull(
        self,
        count_step: bool = True,
        step: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> Progress:
        """Apply the update: DDP has already averaged the gradients during backward. (``data``
        is not kept per step here: the positions are gathered when a checkpoint is taken.)"""
        if not self._forward_seen:
            raise UsageError(
                "mode 'allreduce': this step's forward pass did not go through the DDP wrapper, so "
                "the gradients were not averaged across workers. Compute the loss with "
                "`sess.model(x)`, not with the model you passed to TrainingSession"
            )
        self._forward_seen = False
        bare_step(self._optimizer)
        if self._moving_average is not None:
            self._moving_average.update()
        self._global_step += 1
        return Progress(self._global_step, stop=False, made_step=self.rank == 0)

    def exchange(self, step: int, data: DataPosition | None) -> Progress:
        return self.push_pull(step=step, data=data)

    def retune(self, hyperparameters: dict[str, Any]) -> None:
        """The optimizer's parameter group takes them (checked by the rule first)."""
        retune_optimizer(self._optimizer, self._rule, hyperparameters)

    def skip(self, step: int) -> Progress:
        """Every replica must take part in each step: the gradients are zeroed (the averaged
        gradient is the same on all replicas, so they all skip alike) and no optimizer step
        is taken."""
        zero_gradients(self._named_params)
        return self.pull()

    def agree(self, stop: bool, checkpoint: bool = False, preempted: bool = False) -> Agreement:
        """Whether any worker wants to stop, whether any wants a checkpoint now, and whether
        any was preempted: every worker must leave the loop (and take part in a checkpoint)
        at the same step, or the others would wait in the next collective. One all-reduce of
        three flags per step."""
        flags = torch.tensor([int(stop), int(checkpoint), int(preempted)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return Agreement(bool(flags[0]), bool(flags[1]), bool(flags[2]))

    # -- checkpoints (collective: every worker calls these at the same step) -------------------

    def gather_data(
        self, data: dict[str, Any] | None, task_names: Sequence[str]
    ) -> dict[str, dict[str, Any]]:
        """Every worker's data position, by task name (``task_names[rank]``)."""
        encoded = (
            b"" if data is None else json.dumps(check_worker_data("this worker", data)).encode()
        )
        mine = torch.zeros(8 + MAX_WORKER_DATA_BYTES, dtype=torch.uint8)
        mine[:8] = torch.frombuffer(bytearray(struct.pack("<Q", len(encoded))), dtype=torch.uint8)
        if encoded:
            mine[8 : 8 + len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        positions = {}
        for rank, buffer in enumerate(gathered):
            raw = buffer.numpy().tobytes()
            (length,) = struct.unpack("<Q", raw[:8])
            if 0 < length <= MAX_WORKER_DATA_BYTES:
                positions[task_names[rank]] = json.loads(raw[8 : 8 + length])
        return positions

    def save(
        self, data: DataPosition | None = None, tables_since: Sequence[dict] | None = None
    ) -> SavedState | None:
        """*Collective*: every worker sends its data position to the chief, which returns its
        replica (all replicas are the same) as the checkpoint; the others get None."""
        positions = self.gather_data(data, self.task_names)
        if self.rank != 0:
            return None
        global_step, documents = self.save_replica(positions)
        return SavedState(global_step, documents, whole_placement(self._named_params))

    def save_replica(self, worker_data: dict[str, dict[str, Any]]) -> tuple[int, list[bytearray]]:
        """This replica (every replica is the same) as one checkpoint document, with the
        workers' data positions ``worker_data`` by task name."""
        if self._optimizer is None or self._rule is None:
            raise UsageError("register() the model before saving")
        document = encode_replica(
            self._named_params,
            self._optimizer,
            self._rule,
            self._moving_average,
            self._global_step,
            worker_data,
            self._buffers,
        )
        return self._global_step, [document]

    def restore_collectively(
        self, document: bytes | None, global_step: int, task_name: str
    ) -> dict[str, Any] | None:
        """Bring every replica to the chief's checkpoint. The chief passes the document of
        the newest valid checkpoint (None: there is none), the others None; the chief checks
        it first and broadcasts the outcome, so that an unusable checkpoint fails every
        worker with an error instead of leaving them waiting. Returns this worker's data
        position from the checkpoint (None when none was saved)."""
        if self._optimizer is None or self._rule is None:
            raise UsageError("register() the model before restoring")
        state, problem = None, ""
        outcome = torch.tensor([_NO_CHECKPOINT, 0], dtype=torch.int64)
        if self.rank == 0 and document is not None:
            try:
                state = decode_replica(document, self._named_params)
                check_buffers(state.buffers, self._buffers)
                template = optimizer_state_template(self._rule, self._named_params)
                if state.optimizer and {k: set(v) for k, v in state.optimizer.items()} != {
                    k: set(v) for k, v in template.items()
                }:
                    raise ConfigError(f"its optimizer state does not fit rule {self._rule.name!r}")
                outcome = torch.tensor([_RESTORING, global_step], dtype=torch.int64)
            except (ValueError, ProtocolError) as exc:
                problem = str(exc)
                outcome = torch.tensor([_UNUSABLE, 0], dtype=torch.int64)
        dist.broadcast(outcome, src=0)
        if int(outcome[0]) == _UNUSABLE:
            raise CheckpointError(
                f"the checkpoint cannot be restored: {problem}"
                if self.rank == 0
                else "the chief could not restore its checkpoint (its output says why)"
            )
        if int(outcome[0]) == _NO_CHECKPOINT:
            return None
        with torch.no_grad():
            for name, param in self._named_params:
                if state is not None:
                    param.copy_(state.values[name])
                _broadcast(param.data)
            if state is not None:
                load_buffers(state.buffers, self._buffers)
            for buffer in self._buffers.values():
                _broadcast(buffer)
        template = optimizer_state_template(self._rule, self._named_params)
        has_state = torch.tensor([int(state is not None and bool(state.optimizer))])
        dist.broadcast(has_state, src=0)
        optimizer_state = {}
        if int(has_state[0]):
            for name, tensors in template.items():
                for key in sorted(tensors):
                    if state is not None:
                        tensors[key].copy_(state.optimizer[name][key])
                    _broadcast(tensors[key])
            optimizer_state = template
        optimizer = self._rule.build([p for _, p in self._named_params])
        index = {name: i for i, (name, _) in enumerate(self._named_params)}
        optimizer.load_state_dict(
            {
                "state": {index[name]: tensors for name, tensors in optimizer_state.items()},
                "param_groups": optimizer.state_dict()["param_groups"],
            }
        )
        self._optimizer = optimizer
        if self._moving_average is not None:
            averages = {name: torch.zeros_like(p) for name, p in self._named_params}
            for name, average in averages.items():
                if state is not None:
                    average.copy_((state.ema or state.values)[name])
                _broadcast(average)
            self._moving_average.load(averages)
        positions = json.dumps(state.worker_data if state is not None else {}).encode()
        length = torch.tensor([len(positions)], dtype=torch.int64)
        dist.broadcast(length, src=0)
        payload = torch.zeros(int(length[0]), dtype=torch.uint8)
        if self.rank == 0 and positions:
            payload.copy_(torch.frombuffer(bytearray(positions), dtype=torch.uint8))
        dist.broadcast(payload, src=0)
        self._global_step = int(outcome[1])
        return json.loads(payload.numpy().tobytes() or b"{}").get(task_name)

    def moving_average(self) -> dict[str, torch.Tensor]:
        if self._moving_average is None:
            raise ConfigError("no moving average is kept: pass ema_decay to the TrainingSession")
        return self._moving_average.state()

    def finish(self, before_done: Callable[[], object] | None, failed: bool = False) -> None:
        """*Collective*: the final checkpoint (every worker takes part), then wait for every
        worker at the end, so that none tears the group down early. After a failure: nothing
        (the others would wait in vain; their next collective fails instead)."""
        if failed:
            return
        if before_done is not None:
            before_done()
        if self._own_group and dist.is_initialized():
            dist.barrier()
            # Past the end: a launcher retires this worker if it dies now (task_markers.py).
            task_markers.mark(task_markers.COLLECTIVE_END, self.task_names[self.rank])

    def stats(self) -> list[dict[str, Any]]:
        return []

    def leave(self) -> None:
        """Nothing to tell: the others notice at their next collective (all-reduce mode has
        no partial restart; the run is started again and resumes from the checkpoint)."""

    def close(self) -> None:
        if self._host_allreduce is not None:
            self._host_allreduce.close()
            self._host_allreduce = None
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
        self._own_group = False


def _broadcast(tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` from the chief in place (through a copy when it is not
    contiguous, e.g. a 0-dim optimizer step)."""
    flat = tensor.reshape(-1)
    dist.broadcast(flat, src=0)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view(tensor.shape))
