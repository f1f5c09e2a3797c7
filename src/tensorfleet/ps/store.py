"""The variables of one parameter-server shard, their optimizer state, and updates to them."""

from __future__ import annotations

import torch

from tensorfleet.errors import CheckpointMismatch, ConfigError, UsageError
from tensorfleet.ps.bare_step import bare_step
from tensorfleet.ps.copy_on_write import CopyOnWrite, Ranges, Tracker
from tensorfleet.ps.layout import FusedLayout
from tensorfleet.ps.optimizer_pieces import (
    PIECE_ELEMENTS,
    VariablePieces,
    cut_variable,
    optimizer_params,
    steps_in_pieces,
)
from tensorfleet.ps.update_rules import UpdateRule
from tensorfleet.wire.tensors import DTYPES


class VariableStore:
    """A shard's variables, kept as one flat tensor per dtype (the fused layout), with a
    ``torch.optim`` optimizer over per-variable views of those tensors (big variables of an
    elementwise rule in cache-sized pieces: :mod:`tensorfleet.ps.optimizer_pieces`).

    Keeping the storage flat makes a pull one contiguous copy and a push one buffer per
    dtype; giving the optimizer per-variable views keeps per-variable rules correct. Replies
    send the flats without a copy (:meth:`lent`); a write while one is in flight copies
    first (:mod:`tensorfleet.ps.copy_on_write`).
    """

    def __init__(self, piece_elements: int = PIECE_ELEMENTS) -> None:
        self.layout: FusedLayout | None = None
        self.rule: UpdateRule | None = None
        self.kernel: str | None = None
        """Which of torch's kernels steps the variables: ``"fused"`` or ``"default"`` (in
        pieces), once created (:mod:`tensorfleet.ps.update_rules`, "Kernels")."""
        self.version = 0
        """How many updates have been applied since the variables were created."""
        self._flats: list[torch.Tensor] = []
        self._views: list[list[torch.Tensor]] = []
        self._variables: list[VariablePieces] = []
        """Every variable as the optimizer steps it, in the optimizer's parameter order."""
        self._aliases: list[list[torch.Tensor]] = []
        """Per flat: every tensor viewing its memory (views and pieces), for copy on write."""
        self._piece_elements = piece_elements
        self._optimizer: torch.optim.Optimizer | None = None
        self._ema: list[torch.Tensor] | None = None
        self._ema_decay = 0.0
        self._copy_on_write = CopyOnWrite()

    @property
    def initialized(self) -> bool:
        return self.layout is not None

    def create(self, layout: FusedLayout, rule: UpdateRule, values: list[torch.Tensor]) -> None:
        """Take ownership of the initial values (one flat tensor per group, copied)."""
        if self.initialized:
            raise UsageError("variables already created")
        if len(values) != len(layout.groups):
            raise ConfigError(f"{len(values)} value buffers for {len(layout.groups)} dtype groups")
        flats = []
        for group, value in zip(layout.groups, values, strict=True):
            if value.dtype != DTYPES[group.dtype] or value.numel() != group.numel:
                raise ConfigError(
                    f"initial values for the {group.dtype} group have {value.numel()} {value.dtype} elements, expected {group.numel}"
                )
            flats.append(value.detach().clone().reshape(-1))
        _check_applicable(rule, [DTYPES[group.dtype] for group in layout.groups])
        views, variables, aliases = [], [], []
        dtypes = [DTYPES[group.dtype] for group in layout.groups]
        in_pieces = steps_in_pieces(rule, dtypes)
        for flat, group in zip(flats, layout.groups, strict=True):
            group_views, group_aliases = [], []
            for var, offset in group.members:
                flat_view = flat[offset : offset + var.numel]
                view = flat_view.view(var.shape)
                cut = cut_variable(view, flat_view, in_pieces, self._piece_elements)
                group_views.append(view)
                group_aliases.append(view)
                if not cut.whole:
                    group_aliases.extend(cut.pieces)
                variables.append(cut)
            views.append(group_views)
            aliases.append(group_aliases)
        self._optimizer = _build(rule, optimizer_params(variables))
        self.layout, self.rule, self._flats, self._views = layout, rule, flats, views
        self._variables, self._aliases = variables, aliases
        self.kernel = "fused" if rule.uses_fused_kernel({"cpu"}, dtypes) else "default"

    def keep_moving_average(self, decay: float) -> None:
        """From now on, keep ``ema = decay * ema + (1 - decay) * value`` after every update,
        starting from the current values."""
        self._ema = [flat.clone() for flat in self._flats]
        self._ema_decay = decay

    @property
    def has_moving_average(self) -> bool:
        return self._ema is not None

    def moving_average_snapshot(self) -> list[torch.Tensor]:
        """A copy of the moving average, one flat tensor per group."""
        if self._ema is None:
            raise ConfigError("this shard keeps no moving average (ema_decay was not set)")
        return [flat.clone() for flat in self._ema]

    def snapshot(self) -> list[torch.Tensor]:
        """A copy of the current values, one flat tensor per group (safe to send while the
        store keeps changing)."""
        return [flat.clone() for flat in self._flats]

    def live_values(self) -> list[torch.Tensor]:
        """The current values themselves, one flat tensor per group: to be read at once
        (the next update changes them), or sent in a reply followed by :meth:`lent`; never
        kept across a write (a write may move the store onto other memory)."""
        return list(self._flats)

    def lent(self, tracker: Tracker | None, ranges: Ranges = None) -> None:
        """The values of :meth:`live_values` (``ranges`` of each group: slices of them; None:
        all) went out in a reply that ``tracker`` follows: until it is done, a write leaves
        that memory unchanged."""
        self._copy_on_write.lent(tracker, ranges)

    @property
    def copies_on_write(self) -> int:
        """How many writes came while a reply was sending the values, and copied them."""
        return self._copy_on_write.copies

    def checkpoint_parts(
        self, copy: bool = True
    ) -> tuple[
        dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict[str, dict[str, torch.Tensor]]
    ]:
        """The values, the moving average and the optimizer's tensors, by variable name (what
        a checkpoint of this shard holds): copies, or with ``copy=False`` views of the live
        state, to be copied before the store changes (the ps encodes them at once)."""
        take = (lambda t: t.clone()) if copy else (lambda t: t)
        if self._optimizer is None:
            raise UsageError("variables not created yet")
        values, ema = {}, None if self._ema is None else {}
        for index, (group, views) in enumerate(zip(self.layout.groups, self._views, strict=True)):
            for (var, offset), view in zip(group.members, views, strict=True):
                values[var.name] = take(view)
                if ema is not None:
                    ema[var.name] = take(
                        self._ema[index][offset : offset + var.numel].view(var.shape)
                    )
        optimizer: dict[str, dict[str, torch.Tensor]] = {}
        for var, cut in zip(self._ordered_variables(), self._variables, strict=True):
            tensors = {
                key: value.contiguous()
                for key, value in cut.joined_state(self._optimizer, take).items()
            }
            if tensors:
                optimizer[var.name] = tensors
        return values, ema, optimizer

    def restore(
        self,
        values: dict[str, torch.Tensor],
        ema: dict[str, torch.Tensor] | None,
        optimizer: dict[str, dict[str, torch.Tensor]],
        version: int,
    ) -> None:
        """Replace the values, moving average and optimizer state with a checkpoint's (already
        checked against this layout by :func:`~tensorfleet.ps.shard_checkpoint.decode_shard`).

        The optimizer state is loaded through ``load_state_dict`` of a fresh optimizer, so a
        state torch refuses leaves this store unchanged (ValueError)."""
        if self._optimizer is None:
            raise UsageError("variables not created yet")
        check_optimizer_state(self.rule, self._ordered_variables(), self._params(), optimizer)
        fresh = _build(self.rule, optimizer_params(self._variables))
        state: dict[int, dict[str, torch.Tensor]] = {}
        index = 0
        for var, cut in zip(self._ordered_variables(), self._variables, strict=True):
            if var.name in optimizer:
                for offset, piece_state in enumerate(cut.split_state(optimizer[var.name])):
                    state[index + offset] = piece_state
            index += len(cut.pieces)
        self._copy_on_write.before_write(self._flats, self._aliases)
        try:
            fresh.load_state_dict(
                {"state": state, "param_groups": fresh.state_dict()["param_groups"]}
            )
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"the checkpoint's optimizer state does not fit rule {self.rule.name!r}: {exc}"
            ) from None
        with torch.no_grad():
            for index, (group, views) in enumerate(
                zip(self.layout.groups, self._views, strict=True)
            ):
                for (var, offset), view in zip(group.members, views, strict=True):
                    view.copy_(values[var.name])
                    if self._ema is not None:
                        source = ema[var.name] if ema is not None else values[var.name]
                        self._ema[index][offset : offset + var.numel].copy_(source.reshape(-1))
        self._optimizer = fresh
        self.version = version

    def take_state_of(self, source: VariableStore) -> None:
        """Make this store's values, moving average and optimizer state a copy of
        ``source``'s, bit for bit (its hyperparameters and ``version`` stay its own).

        Both stores must hold the same layout under the same rule (the caller checked it:
        :func:`~tensorfleet.ps.namespace_copy.copy_model`): the flats are copied as they
        are, and each variable's optimizer state (Adam's moments and step count, momentum
        buffers) is cloned into this store's optimizer, which is what ``load_state_dict``
        ends in, without rebuilding or checking a reference optimizer (a copy of a 1 M-
        parameter Adam model is three memory copies)."""
        if self._optimizer is None or source._optimizer is None:
            raise UsageError("variables not created yet")
        self._copy_on_write.before_write(self._flats, self._aliases)
        with torch.no_grad():
            for mine, theirs in zip(self._flats, source._flats, strict=True):
                mine.copy_(theirs)
            if self._ema is not None and source._ema is not None:
                for mine, theirs in zip(self._ema, source._ema, strict=True):
                    mine.copy_(theirs)
        state = self._optimizer.state
        mine_params = optimizer_params(self._variables)
        theirs_params = optimizer_params(source._variables)
        for mine, theirs in zip(mine_params, theirs_params, strict=True):
            copied = source._optimizer.state.get(theirs)
            if copied:
                state[mine] = {
                    key: value.detach().clone() if isinstance(value, torch.Tensor) else value
                    for key, value in copied.items()
                }
            else:
                state.pop(mine, None)

    def retune(self, rule: UpdateRule) -> None:
        """Take ``rule``'s hyperparameters (the same rule by name, other numbers: a learning
        rate, a weight decay) from the next update on, keeping the optimizer's state: each
        is written into the optimizer's parameter group, which is where torch reads them at
        every step. The caller checked ``rule`` (:func:`~tensorfleet.ps.namespace_copy.retuned_rule`)."""
        if self._optimizer is None or self.rule is None:
            raise UsageError("variables not created yet")
        if rule.name != self.rule.name:
            raise ConfigError(
                f"retune keeps the update rule: this shard's is {self.rule.name!r}, got "
                f"{rule.name!r}"
            )
        for group in self._optimizer.param_groups:
            group.update(rule.hyperparameters)
        self.rule = rule

    def _params(self) -> list[torch.Tensor]:
        """The per-variable views, in the optimizer's parameter order."""
        return [view for views in self._views for view in views]

    def _ordered_variables(self) -> list:
        """The variables in the optimizer's parameter order (group by group)."""
        return [var for group in self.layout.groups for var, _ in group.members]

    def apply(
        self,
        gradients: list[torch.Tensor],
        part: tuple[int, int] | None = None,
        counts: bool = True,
    ) -> None:
        """Apply one update from flat gradients (one per group, already validated in size).

        ``part``: the gradients of the variables ``[start, stop)`` only (a bucket of a push:
        each group's slice, :meth:`FusedLayout.part_slices`). Only those variables get a
        gradient, and ``torch.optim`` steps only parameters that have one, so each
        variable's own state (Adam's step count, momentum) advances once per part that holds
        it, and its moving average once: a step pushed in parts, each variable in exactly
        one, ends bit for bit where the whole push ends (every built-in rule is
        per-variable). ``counts``: this update ends a worker's step (``version`` + 1)."""
        if self._optimizer is None:
            raise UsageError("variables not created yet")
        start, stop = part if part is not None else (0, len(self.layout.variables))
        slices = (
            self.layout.part_slices(start, stop)
            if part is not None
            else [(0, group.numel) for group in self.layout.groups]
        )
        self._copy_on_write.before_write(self._flats, self._aliases, slices)
        stepped = []
        cuts = iter(self._variables)
        for group, indices, grad, (lo, _) in zip(
            self.layout.groups, self.layout.member_indices, gradients, slices, strict=True
        ):
            for (var, offset), index in zip(group.members, indices, strict=True):
                cut = next(cuts)
                if start <= index < stop:
                    cut.give_gradient(grad[offset - lo : offset - lo + var.numel])
                    stepped.append(cut)
        bare_step(self._optimizer)
        for cut in stepped:
            cut.drop_gradient()
        if self._ema is not None:
            for average, flat, (lo, hi) in zip(self._ema, self._flats, slices, strict=True):
                average[lo:hi].lerp_(flat[lo:hi], 1.0 - self._ema_decay)
        if counts:
            self.version += 1


class _NoVariables(torch.optim.Optimizer):
    """The optimizer of a shard that holds no dense variable (its part of the model is only
    embedding-table rows): torch refuses an empty parameter list; there is nothing to step."""

    def __init__(self) -> None:
        self.state: dict = {}
        self.param_groups: list = []
        self.defaults: dict = {}

    def step(self, closure: object = None) -> None:
        return None

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("state"):
            raise CheckpointMismatch(
                f"optimizer state for {len(state_dict['state'])} variable(s) given to a shard "
                "that holds no dense variable (only embedding-table rows): the checkpoint was "
                "written for another placement; restore it with the placement it was saved with"
            )


def _build(rule: UpdateRule, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``rule``'s optimizer over ``params``; for none, :class:`_NoVariables`."""
    return rule.build(params) if params else _NoVariables()


def _check_applicable(rule: UpdateRule, dtypes: list[torch.dtype]) -> None:
    """ValueError unless ``rule`` can update variables of these dtypes.

    torch builds some optimizers whose every step then fails: a learning rate (or weight
    decay, dampening, ...) beyond the range of float16 or bfloat16 ("value cannot be converted
    to type c10::Half without overflow"), an int beyond int64 (OverflowError), an Adagrad
    initial_accumulator_value that overflows float32 (RuntimeError already when building).
    These depend on the hyperparameters and dtypes only, not on the values, so two steps of
    the rule on two elements per dtype find them: the create is refused, instead of every push
    failing (and the first one ending the service loop). Two elements, not one: torch fills a
    one-element tensor without the overflow check."""
    params = [torch.zeros(2, dtype=dtype) for dtype in dtypes]
    if not params:  # a shard without variables: nothing to update
        return
    try:
        optimizer = rule.build(params)
        for _ in range(2):  # the second step reaches the momentum terms
            for param in params:
                param.grad = torch.ones_like(param)
            optimizer.step()
    except (RuntimeError, OverflowError) as exc:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ConfigError(
            f"update rule {rule.name!r} with {rule.hyperparameters} cannot update {names} "
            f"variables: {type(exc).__name__}: {exc}"
        ) from None


def reference_optimizer_state(
    rule: UpdateRule, params: list[torch.Tensor]
) -> list[dict[str, torch.Tensor]]:
    """The optimizer state ``rule`` keeps for each of ``params`` after a step: its keys and
    shapes (values of a zero step on zero tensors, not of the real parameters)."""
    reference_params = [torch.zeros_like(p) for p in params]
    reference = _build(rule, reference_params)
    for p in reference_params:
        p.grad = torch.zeros_like(p)
    reference.step()
    return [
        {
            key: value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            for key, value in reference.state.get(p, {}).items()
        }
        for p in reference_params
    ]


def check_optimizer_state(
    rule: UpdateRule,
    variables: list,
    params: list[torch.Tensor],
    optimizer: dict[str, dict[str, torch.Tensor]],
) -> None:
    """ValueError unless every tensor of a checkpoint's optimizer state is one the rule keeps,
    shaped as the rule keeps it. torch's ``load_state_dict`` takes any shape, and a wrong
    one would only fail at the next update, in the middle of training."""
    for var, expected in zip(variables, reference_optimizer_state(rule, params), strict=True):
        for key, tensor in optimizer.get(var.name, {}).items():
            want = expected.get(key)
            if want is None:
                raise ConfigError(
                    f"the checkpoint has optimizer state {key!r} for {var.name!r}, which rule "
                    f"{rule.name!r} does not keep (it keeps {sorted(expected) or 'nothing'})"
                )
            if tuple(tensor.shape) != tuple(want.shape):
                raise ConfigError(
                    f"optimizer state {key!r} of {var.name!r} is {list(tensor.shape)} in the "
                    f"checkpoint, rule {rule.name!r} keeps it as {list(want.shape)}"
                )
