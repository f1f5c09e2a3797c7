"""The pieces a shard's optimizer steps: big variables cut into cache-sized slices.

**What.** A shard's optimizer does not step each variable as one tensor: every variable of
more than :data:`PIECE_ELEMENTS` elements is given to it as consecutive 1-D slices of at most
that many elements (a *piece*, 1 MiB of float32), smaller variables as themselves. Only for
rules registered as *elementwise* (SGD with or without momentum, Adam, Adagrad: each
element's new value and state depend on that element's value, gradient and state alone, and
on the step count); any other rule steps whole variables.

**Why.** torch's default (single-tensor) update rules on CPU make one pass over memory per
operation: Adam's step is ``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, ``div_``, ``add_`` and
``addcdiv_``, each reading and writing whole tensors, about 19 bytes of memory traffic per
4-byte parameter. For a variable far bigger than the caches (a 23 M-element embedding) every
pass goes to main memory; cut into pieces of 1 MiB, the seven passes of a piece find it in
the caches, and main memory is crossed about once. Measured on this project's 2-vCPU machine
(2 threads, 1 MiB L2 per core, 32 MiB L3) for a BERT-base-sized shard (108.9 M float32
elements): Adam 0.35 s a step over whole variables, 0.20-0.22 s over pieces of 262,144
elements (65,536: 0.22-0.27 s; 1,048,576: 0.22 s), parameters bit-identical after every
step. That is the ps's update, which a worker of a big model waits for every step.

**Exactness.** An elementwise rule computes the same operations on every element whichever
tensor holds it, so stepping the pieces gives bit for bit the values of stepping the whole
variable (``tests/unit/test_optimizer_pieces.py`` checks every built-in rule and option,
piece sizes that do not divide the variable, float32 and bfloat16). Every piece of a
variable gets its gradient in the same update, so their step counts stay equal. The pieces
are a multiple of every vector width, so a vectorised kernel treats each element of a
piece as it treats it in the whole variable, tail included; the test's pieces of 7 elements
(every element on another path) show that torch's default kernels do not depend on it
either. Its fused kernels do (they step whole variables: :func:`steps_in_pieces`).

**The alternative**, torch's fused kernels (one pass, different rounding), is now Adam's and
Adagrad's default where torch has it (:mod:`tensorfleet.ps.update_rules`, "Kernels": 3-6x
faster than these pieces); pieces serve the rules and options that keep torch's default
arithmetic (SGD, momentum, ``fused=False``), bit for bit.

Only on the ps: a shard owns its variables' memory (flat, contiguous, on CPU) for the life
of the store. A one-process or all-reduce replica steps the model's own parameters, whose
memory the model may replace after the session started (``model.to(memory_format=...)``
gives a parameter new, channels-last storage), so pieces there would have to follow every
such move; they are not used there.

A checkpoint and a namespace copy still see one state tensor per variable:
:meth:`VariablePieces.joined_state` gives the pieces' state as one tensor per slot, of which
the pieces' slots are views (made so at the first checkpoint: no second copy of the state),
:meth:`VariablePieces.split_state` cuts a variable's state into its pieces' (views).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tensorfleet.errors import ConfigError
from tensorfleet.ps.update_rules import UpdateRule

#: The most elements of one piece: 262,144 (1 MiB of float32), the fastest of the sizes
#: measured (module docstring).
PIECE_ELEMENTS = 1 << 18
#: What a caller applies to each state tensor it is given (e.g. ``Tensor.clone``).
Take = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class VariablePieces:
    """One variable as the optimizer steps it: its shaped view of the shard's flat tensor,
    the pieces (the view itself, or 1-D slices of it) and each piece's element range within
    the variable (in the flat order)."""

    view: torch.Tensor
    pieces: tuple[torch.Tensor, ...]
    bounds: tuple[tuple[int, int], ...]

    @property
    def whole(self) -> bool:
        """Whether the optimizer steps the variable as one tensor (its own view)."""
        return len(self.pieces) == 1 and self.pieces[0] is self.view

    def give_gradient(self, gradient: torch.Tensor) -> None:
        """Give each piece its part of ``gradient`` (the variable's flat gradient)."""
        if self.whole:
            self.view.grad = gradient.view(self.view.shape)
            return
        for piece, (lo, hi) in zip(self.pieces, self.bounds, strict=True):
            piece.grad = gradient[lo:hi]

    def drop_gradient(self) -> None:
        for piece in self.pieces:
            piece.grad = None

    def joined_state(
        self, optimizer: torch.optim.Optimizer, take: Take | None = None
    ) -> dict[str, torch.Tensor]:
        """The optimizer's state of this variable, one tensor per key: an elementwise slot
        (Adam's moments, a momentum buffer) shaped as the variable, of which every piece's
        slot is a view (:meth:`_slot`); a per-step number (the step count), the first
        piece's, which all pieces share. ``take`` (e.g. ``clone``) is applied to each, as
        to a whole variable's tensors. Empty before the first update."""
        if self.whole:
            state = optimizer.state.get(self.view, {})
            return {key: _tensor(value, take) for key, value in state.items()}
        states = [optimizer.state.get(piece, {}) for piece in self.pieces]
        if not states[0]:
            return {}
        joined: dict[str, torch.Tensor] = {}
        for key, first in states[0].items():
            if isinstance(first, torch.Tensor) and first.shape == self.pieces[0].shape:
                joined[key] = _tensor(self._slot(states, key), take)
            else:
                joined[key] = _tensor(first, take)
        return joined

    def _slot(self, states: list[dict], key: str) -> torch.Tensor:
        """Slot ``key`` of the variable as one tensor shaped as the variable, every piece's
        slot a view of it. Found as it is when the pieces' slots already lie in one tensor,
        in order (after a restore, which gives the pieces views of the checkpoint's
        tensor, or after an earlier call); otherwise made now: the pieces' slots are copied
        into one tensor once and replaced by views of it, so that their own memory is freed
        and a checkpoint never holds the optimizer's state twice (torch allocates one
        tensor per piece at the first update)."""
        first = states[0][key].detach()
        storage, base = first.untyped_storage(), first.storage_offset()
        if all(
            state[key].untyped_storage().data_ptr() == storage.data_ptr()
            and state[key].storage_offset() == base + lo
            and state[key].is_contiguous()
            for state, (lo, _) in zip(states, self.bounds, strict=True)
        ):
            whole = first.new_empty(0).set_(storage, base, (self.bounds[-1][1],), (1,))
            return whole.view(self.view.shape)
        whole = first.new_empty(self.bounds[-1][1])
        with torch.no_grad():
            for state, (lo, hi) in zip(states, self.bounds, strict=True):
                whole[lo:hi].copy_(state[key])
                state[key] = whole[lo:hi]
        return whole.view(self.view.shape)

    def split_state(self, state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Each piece's state from the variable's (``state`` as :meth:`joined_state` gives
        it): slots shaped as the variable are cut as the pieces are (views, not copies);
        anything else (a 0-d step count) is given to every piece as its own clone.
        ConfigError for a slot of any other shape."""
        if self.whole:
            return [dict(state)]
        pieces: list[dict[str, torch.Tensor]] = [{} for _ in self.pieces]
        for key, value in state.items():
            if tuple(value.shape) == tuple(self.view.shape):
                flat = value.reshape(-1)
                for piece_state, (lo, hi) in zip(pieces, self.bounds, strict=True):
                    piece_state[key] = flat[lo:hi]
            elif value.dim() == 0:
                for piece_state in pieces:
                    piece_state[key] = value.clone()
            else:
                raise ConfigError(
                    f"optimizer state {key!r} is {list(value.shape)} for a variable of shape "
                    f"{list(self.view.shape)}: an elementwise rule keeps slots shaped as the "
                    "variable or single numbers"
                )
        return pieces


def steps_in_pieces(rule: UpdateRule, dtypes: Sequence[torch.dtype]) -> bool:
    """Whether a shard steps ``rule``'s big variables (CPU tensors of ``dtypes``) in pieces:
    for an elementwise rule in torch's default arithmetic. Not with the fused kernel (Adam's
    and Adagrad's default, :meth:`~tensorfleet.ps.update_rules.UpdateRule.uses_fused_kernel`):
    it is one pass over memory already, and its results depend on where a tensor starts
    (measured: pieces of 7 elements differ from whole variables in the last bit)."""
    return rule.elementwise and not rule.uses_fused_kernel({"cpu"}, dtypes)


def cut_variable(
    view: torch.Tensor, flat_view: torch.Tensor, cut: bool, piece_elements: int
) -> VariablePieces:
    """``view`` (shaped) and ``flat_view`` (the same memory, 1-D) as the optimizer steps
    them: in pieces of at most ``piece_elements`` when ``cut`` (:func:`steps_in_pieces`)
    and the variable is bigger than one piece, else whole."""
    numel = flat_view.numel()
    if not cut or numel <= piece_elements:
        return VariablePieces(view, (view,), ((0, numel),))
    bounds = tuple((lo, min(lo + piece_elements, numel)) for lo in range(0, numel, piece_elements))
    return VariablePieces(view, tuple(flat_view[lo:hi] for lo, hi in bounds), bounds)


def optimizer_params(variables: Sequence[VariablePieces]) -> list[torch.Tensor]:
    """What the optimizer steps, variable by variable, piece by piece."""
    return [piece for variable in variables for piece in variable.pieces]


def _tensor(value: object, take: Take | None) -> torch.Tensor:
    """A state value as a tensor (a plain-number step counter becomes a 0-d tensor),
    passed through ``take`` when given."""
    if not isinstance(value, torch.Tensor):
        return torch.tensor(float(value))
    value = value.detach()
    return value if take is None else take(value)
