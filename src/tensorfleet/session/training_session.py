"""``TrainingSession``: the training loop's companion (TensorFlow's MonitoredTrainingSession).

It connects the model to the parameter servers (the chief creates the variables, the other
workers wait for that with a deadline), runs each step (forward and backward in the
caller's closure, then one push+pull per ps shard), keeps the global step, runs the hooks,
and says when to stop. Without a server it trains in one process with the same API.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tensorfleet.errors import TensorfleetError
from tensorfleet.ps.placement import PlacementPlan, VariableSpec, plan_placement
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.session.hooks import Hook, StepResult
from tensorfleet.session.server import Server
from tensorfleet.wire.tensors import dtype_name
from tensorfleet.worker.client import ClientTimeouts, ParameterClient
from tensorfleet.worker.local_updater import LocalUpdater

log = logging.getLogger("tensorfleet.session")

MODES = ("async",)

StepClosure = Callable[[], "torch.Tensor | tuple[torch.Tensor, Any]"]


class TrainingSession:
    """Trains ``model`` with ``optimizer`` (an :class:`UpdateRule`, e.g. ``tfl.optim.Adam``)
    on the cluster of ``server`` (or in this process when ``server`` is None).

    Use it as a context manager::

        with TrainingSession(server, model, optimizer=Adam(lr=1e-4), hooks=[StopAtStep(3000)]) as sess:
            while not sess.should_stop():
                sess.step(lambda: F.cross_entropy(model(x), y))
    """

    def __init__(
        self,
        server: Server | None,
        model: nn.Module,
        optimizer: UpdateRule,
        *,
        mode: str = "async",
        hooks: Iterable[Hook] = (),
        placement: str = "greedy",
        partition_threshold_bytes: int | None = None,
        log_placement: bool = False,
        timeouts: ClientTimeouts | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(optimizer, UpdateRule):
            raise TypeError(
                f"optimizer must be a tensorfleet update rule such as tensorfleet.optim.Adam(lr=1e-4), "
                f"got {type(optimizer).__name__}: the parameter servers apply it, so it is described, not instantiated"
            )
        self.server = server
        self.model = model
        self.rule = optimizer
        self.mode = mode
        self.is_chief = server.is_chief if server is not None else True
        self.task_name = str(server.task) if server is not None else "local"
        self.hooks = [h for h in hooks if self.is_chief or not getattr(h, "chief_only", False)]
        self._named_params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not self._named_params:
            raise ValueError("the model has no trainable parameters")
        self.plan: PlacementPlan | None = None
        if server is not None:
            if not server.ps_addresses:
                raise ValueError(
                    "mode 'async' trains through parameter servers, but the cluster has no 'ps' job"
                )
            specs = [
                VariableSpec(name, tuple(p.shape), dtype_name(p.dtype), p.element_size())
                for name, p in self._named_params
            ]
            self.plan = plan_placement(
                specs, len(server.ps_addresses), placement, partition_threshold_bytes
            )
            if log_placement and self.is_chief:
                print(self.plan.report(), flush=True)
            self._updater: ParameterClient | LocalUpdater = ParameterClient(
                server.ps_addresses, server.secret, self.task_name, timeouts
            )
        else:
            self._updater = LocalUpdater()
        self._global_step = 0
        self._stop_requested = False
        self._started = False
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> TrainingSession:
        self.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(failed=exc is not None)

    def start(self) -> None:
        """Connect, initialize (chief) or wait for initialization (others), pull the values,
        run the hooks' ``begin``."""
        if self._started:
            raise RuntimeError("the session has already started")
        self._started = True
        try:
            self._updater.connect()
            self._global_step = self._updater.register(
                self._named_params, self.plan, self.rule, self.is_chief
            )
            progress = self._updater.pull()
            self._global_step = progress.global_step
            self._stop_requested = progress.stop
        except BaseException:
            self._updater.close()
            self._closed = True
            raise
        for hook in self.hooks:
            hook.begin(self)

    def close(self, failed: bool = False) -> None:
        """Run the hooks' ``end`` (unless failed), tell the parameter servers this worker is
        done (the chief declares training over), and release the connections."""
        if self._closed:
            return
        self._closed = True
        try:
            if not failed:
                for hook in self.hooks:
                    hook.end(self)
            self._updater.finish(declare_end=self.is_chief)
        except TensorfleetError as exc:
            if not failed:
                raise
            log.warning(
                "%s: could not tell the parameter servers that this worker stopped: %s",
                self.task_name,
                exc,
            )
        finally:
            self._updater.close()

    # -- training -------------------------------------------------------------------------------

    @property
    def global_step(self) -> int:
        """The global step as of this worker's last exchange with the parameter servers."""
        return self._global_step

    def should_stop(self) -> bool:
        """Whether training should end: a hook asked, or the chief declared it over."""
        return self._stop_requested

    def request_stop(self) -> None:
        """Ask the loop to end after the current step."""
        self._stop_requested = True

    def step(self, closure: StepClosure) -> StepResult:
        """One training step: ``closure()`` computes the loss (or ``(loss, aux)``) on the
        current parameters, the gradients go to the parameter servers, and the updated
        parameters come back into the model."""
        if not self._started or self._closed:
            raise RuntimeError(
                "step() needs a started, open session: use `with TrainingSession(...) as sess:`"
            )
        for hook in self.hooks:
            hook.before_step(self)
        self.model.zero_grad(set_to_none=True)
        out = closure()
        loss, aux = out if isinstance(out, tuple) else (out, None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"the step closure must return a scalar loss tensor (or (loss, aux)), got {type(loss).__name__}"
            )
        loss.backward()
        progress = self._updater.push_pull()
        self._global_step = progress.global_step
        if progress.stop:
            self._stop_requested = True
        result = StepResult(loss=float(loss.detach()), global_step=progress.global_step, aux=aux)
        for hook in self.hooks:
            hook.after_step(self, result)
        return result

    def pull(self) -> int:
        """Fetch the newest parameters into the model (e.g. before evaluating); returns the
        global step they belong to."""
        progress = self._updater.pull()
        self._global_step = progress.global_step
        return progress.global_step
