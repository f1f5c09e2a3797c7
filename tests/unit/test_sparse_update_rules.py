"""Row-sparse update rules equal torch's optimizers bit for bit on the same sparse gradient,
on a table held by one shard and on the same table split over three (rows created lazily)."""

from __future__ import annotations

import pytest
import torch

from tensorfleet.ps.row_initializer import RowInitializer
from tensorfleet.ps.row_partition import RowPartition, TableSpec
from tensorfleet.ps.row_store import RowStore
from tensorfleet.ps.sparse_update_rules import SparseRowRule, SparseRuleError
from tensorfleet.worker.sparse_gradient import coalesce_gradient, split_rows

NUM_ROWS = 97
STEPS = 6

RULES = [
    ("sgd", {"lr": 0.3}, lambda p: torch.optim.SGD([p], lr=0.3)),
    (
        "adagrad",
        {"lr": 0.2, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-10},
        lambda p: torch.optim.Adagrad(
            [p], lr=0.2, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-10
        ),
    ),
    (
        "sparse_adam",
        {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-7},
        lambda p: torch.optim.SparseAdam([p], lr=0.05, betas=(0.8, 0.95), eps=1e-7),
    ),
]


def _embedding_gradient(weight: torch.Tensor, ids: torch.Tensor, seed: int) -> torch.Tensor:
    """The sparse COO gradient nn.Embedding(sparse=True) gives ``weight`` for a loss of
    ``sum(emb(ids) * r)`` with random ``r``: duplicates included, not coalesced."""
    emb = torch.nn.Embedding.from_pretrained(weight.detach().clone(), freeze=False, sparse=True)
    r = torch.randn(ids.shape[0], weight.shape[1], generator=torch.Generator().manual_seed(seed))
    (emb(ids) * r).sum().backward()
    grad = emb.weight.grad
    assert grad.is_sparse and not grad.is_coalesced()
    return grad


def _batches(dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(dim)
    # Skewed ids with many duplicates; one step touches few rows (some shards get none).
    batches = [torch.randint(0, NUM_ROWS, (40,), generator=g) for _ in range(STEPS - 1)]
    return [*batches[:3], torch.tensor([5, 5, 5]), *batches[3:]]


@pytest.mark.parametrize("name,hyper,torch_optimizer", RULES, ids=[r[0] for r in RULES])
@pytest.mark.parametrize("dim", [13, 64])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["one shard", "mod over 3", "range over 3"])
def test_rule_is_bit_exact_with_torch(name, hyper, torch_optimizer, dim, dtype, layout) -> None:
    spec = TableSpec("emb", NUM_ROWS, dim, dtype, RowInitializer("normal", 0.5, seed=7))
    initial = spec.initializer.rows(torch.arange(NUM_ROWS), dim, spec.torch_dtype)
    param = torch.nn.Parameter(initial.clone())
    reference = torch_optimizer(param)

    shards = 1 if layout == "one shard" else 3
    partition = RowPartition(NUM_ROWS, shards, "range" if layout.startswith("range") else "mod")
    rule = SparseRowRule(name, hyper)
    stores = [RowStore(spec, partition, k, rule) for k in range(shards)]

    for step, ids in enumerate(_batches(dim)):
        grad = _embedding_gradient(param, ids, seed=step)
        # torch's optimizers coalesce a sparse gradient themselves (Adagrad, SparseAdam); SGD
        # adds an uncoalesced one duplicate by duplicate, so it gets the coalesced gradient the
        # worker sends.
        param.grad = grad.coalesce()
        reference.step()

        rows = coalesce_gradient("emb.weight", grad)
        for store, part in zip(
            stores, split_rows(rows, partition.shard_of(rows.indices), shards), strict=True
        ):
            store.apply(part)

    # Rows nobody touched were never created; the touched ones match bit for bit.
    touched = torch.unique(torch.cat(_batches(dim)))
    held = torch.cat([s.created_rows() for s in stores])
    assert torch.equal(torch.sort(held).values, touched)
    for store in stores:
        ids = store.created_rows()
        assert torch.equal(store.pull(ids), param.detach()[ids]), f"{name} {layout}"
        assert store.step == STEPS
    untouched = torch.ones(NUM_ROWS, dtype=torch.bool)
    untouched[touched] = False
    assert torch.equal(param.detach()[untouched], initial[untouched])


def test_optimizer_state_matches_torch_rows() -> None:
    spec = TableSpec("emb", NUM_ROWS, 8)
    param = torch.nn.Parameter(spec.initializer.rows(torch.arange(NUM_ROWS), 8, torch.float32))
    reference = torch.optim.SparseAdam([param], lr=0.01)
    store = RowStore(spec, RowPartition(NUM_ROWS, 1), 0, SparseRowRule("lazy_adam"))
    for step, ids in enumerate(_batches(8)):
        grad = _embedding_gradient(param, ids, step)
        param.grad = grad
        reference.step()
        store.apply(coalesce_gradient("w", grad))
    state = reference.state[param]
    ids = store.created_rows()
    for slot in ("exp_avg", "exp_avg_sq"):
        positions = store._slot_of[ids]
        assert torch.equal(store._slots[slot][positions], state[slot][ids])
    assert store.step == state["step"]


@pytest.mark.parametrize(
    "name,hyper,words",
    [
        ("sgd", {"momentum": 0.9}, "momentum=0.9"),
        ("sgd", {"weight_decay": 1e-4}, "weight_decay"),
        ("adagrad", {"weight_decay": 0.1}, "weight_decay"),
        ("adam", {"lr": 0.1}, "sparse_adam"),
        ("rmsprop", {}, "unknown row-sparse update rule"),
        ("sparse_adam", {"amsgrad": True}, "unknown hyperparameter"),
        ("sparse_adam", {"betas": (0.9, 1.5)}, "betas"),
        ("adagrad", {"lr": float("nan")}, "finite"),
    ],
)
def test_rules_refuse_what_they_cannot_do_exactly(name, hyper, words) -> None:
    with pytest.raises(SparseRuleError, match=words):
        SparseRowRule(name, hyper)


def test_neutral_dense_options_are_accepted_and_rule_round_trips() -> None:
    rule = SparseRowRule("sgd", {"lr": 0.1, "momentum": 0.0, "weight_decay": 0, "nesterov": False})
    assert rule.hyperparameters == {"lr": 0.1}
    adam = SparseRowRule("sparse_adam", {"betas": [0.5, 0.6]})
    assert SparseRowRule.from_wire(adam.to_wire()) == adam


def test_a_table_under_a_fused_or_foreach_dense_rule_takes_the_rule_without_them() -> None:
    """``fused``/``foreach`` choose torch's implementation of the dense rule; a table's rows
    have their own, so the row-sparse rule drops them (and keeps the arithmetic)."""
    rule = SparseRowRule.from_dense("adagrad", {"lr": 0.1, "fused": True, "foreach": False})
    assert rule.hyperparameters == SparseRowRule("adagrad", {"lr": 0.1}).hyperparameters


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [1, 8, 13, 64, 130])
def test_rows_are_added_with_the_rounding_of_torchs_dense_plus_sparse_kernel(dtype, dim) -> None:
    """``_add_rows`` gathers, adds and copies back (float32, float64: about twice as fast on
    random rows of a large table) where torch's optimizers add a sparse tensor: the same bits,
    over random tables, rows, magnitudes and alphas (1 included: the moments' sums)."""
    from tensorfleet.ps.sparse_update_rules import _add_rows

    generator = torch.Generator().manual_seed(dim)
    for case in range(40):
        scale = float(torch.rand(1, generator=generator)) * 10 ** (case % 7 - 3)
        table = (torch.randn(500, dim, generator=generator) * scale).to(dtype)
        rows = torch.unique(torch.randint(0, 500, (200,), generator=generator))
        rows = rows[torch.randperm(rows.numel(), generator=generator)]  # slots: any order
        update = torch.randn(rows.numel(), dim, generator=generator).to(dtype)
        alpha = 1.0 if case % 4 == 0 else -float(torch.rand(1, generator=generator)) * 3
        expected = table.clone()
        sparse = torch.sparse_coo_tensor(rows.unsqueeze(0), update, expected.shape)
        expected.add_(sparse, alpha=alpha)
        got = table.clone()
        returned = _add_rows(got, rows, update, alpha=alpha)
        assert torch.equal(got, expected), f"case {case}: alpha {alpha}"
        assert torch.equal(returned, expected[rows]), f"case {case}: the rows returned"
        returned.zero_()  # its own memory: the table keeps its rows
        assert torch.equal(got, expected)
