"""Update rules for the parameter servers, by name: ``tfl.optim.Adam(lr=1e-4)``.

They describe the rule; each ps shard builds the matching ``torch.optim`` optimizer over its
own variables, so the arithmetic is exactly PyTorch's. Embedding tables take a row-sparse
rule (:class:`SparseRowRule`: ``sgd``, ``adagrad``, ``sparse_adam``), bit for bit what the
torch optimizer does with the same sparse gradient; ``SparseAdam(...)`` names the lazy Adam.
"""

from __future__ import annotations

from tensorfleet.ps.sparse_update_rules import SparseRowRule
from tensorfleet.ps.update_rules import (
    SGD,
    Adagrad,
    Adam,
    Momentum,
    UpdateRule,
    register_update_rule,
)


def SparseAdam(
    lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
) -> SparseRowRule:
    """Lazy Adam for embedding tables (``torch.optim.SparseAdam``): only touched rows' moments."""
    return SparseRowRule("sparse_adam", {"lr": lr, "betas": tuple(betas), "eps": eps})


__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "Momentum",
    "SparseAdam",
    "SparseRowRule",
    "UpdateRule",
    "register_update_rule",
]
