"""Update rules for the parameter servers, by name: ``tfl.optim.Adam(lr=1e-4)``.

They describe the rule; each ps shard builds the matching ``torch.optim`` optimizer over its
own variables, so the arithmetic is exactly PyTorch's.
"""

from tensorfleet.ps.update_rules import (
    SGD,
    Adagrad,
    Adam,
    Momentum,
    UpdateRule,
    register_update_rule,
)

__all__ = ["SGD", "Adagrad", "Adam", "Momentum", "UpdateRule", "register_update_rule"]
