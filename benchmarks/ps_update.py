"""The ps's update of a big model: a shard's ``VariableStore.apply`` with big variables
stepped whole against stepped in cache-sized pieces (``tensorfleet.ps.optimizer_pieces``),
and one process's own ``optimizer.step()`` over the model's parameters, in one run.

The shard holds every variable of the BERT-base-sized encoder of ``big_model.py``
(108,523,010 float32 parameters, the biggest the 23.4 M-element token embedding), as one
ps of ``big_model.py``'s ``ps1`` run holds them. Each row applies the same seeded gradients:

* ``torch``: ``torch.optim.<rule>`` over the model's own parameters (separate tensors, as a
  one-process loop steps them): **the baseline**;
* ``whole``: ``VariableStore(piece_elements=<more than any variable>)``, every variable one
  tensor of the optimizer (the ps before pieces);
* ``pieces``: ``VariableStore()`` with the rule in torch's default kernel (``fused=False``):
  variables of more than 262,144 elements in pieces of at most that many;
* ``fused``: ``VariableStore()`` with the rule by name, for Adam and Adagrad: torch's fused
  kernel over whole variables, their default (``tensorfleet.ps.update_rules``, "Kernels").

Rows are interleaved over ``--rounds`` rounds of ``--updates`` updates (the first update of
each store allocates the optimizer's state and is not timed), ms per update median. After the
last round, ``pieces`` and ``whole`` are compared bit for bit (values and every optimizer
state tensor): the table says whether they are equal. Threads: torch's default (all cores),
as a ps that takes turns with its worker has them (``--threads`` to choose).

    .venv/bin/python benchmarks/ps_update.py [--rules adam momentum adagrad] [--rounds 3]
    .venv/bin/python benchmarks/ps_update.py --quick     # a small model: a smoke test

Writes benchmarks/results/ps_update.json and .md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "programs"))

from big_model_worker import Encoder  # noqa: E402
from results_writer import OUT_ENV, add_out_dir_option, write_results  # noqa: E402

from tensorfleet.ps.layout import FusedLayout, StoredVariable  # noqa: E402
from tensorfleet.ps.optimizer_pieces import PIECE_ELEMENTS  # noqa: E402
from tensorfleet.ps.store import VariableStore  # noqa: E402
from tensorfleet.ps.update_rules import SGD, Adagrad, Adam, UpdateRule  # noqa: E402

#: The rules in torch's default kernel: the baseline's arithmetic, and what pieces step.
RULES: dict[str, UpdateRule] = {
    "adam": Adam(lr=1e-4, fused=False),
    "momentum": SGD(lr=0.01, momentum=0.9),
    "adagrad": Adagrad(lr=0.01, fused=False),
}
#: The same rules by name where that means the fused kernel (their default).
BY_NAME: dict[str, UpdateRule] = {"adam": Adam(lr=1e-4), "adagrad": Adagrad(lr=0.01)}
WHOLE = 1 << 62


def model_variables(quick: bool) -> list[tuple[str, torch.Tensor]]:
    """The encoder's parameters (BERT-base's shape; ``quick``: 2 layers, hidden 128)."""
    torch.manual_seed(0)
    if quick:
        model = Encoder(30522, 128, 2, 2, 512, 32, "cls")
    else:
        model = Encoder(30522, 768, 12, 12, 3072, 32, "cls")
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


def torch_optimizer(rule: UpdateRule, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """What a one-process loop builds for the same rule (the same hyperparameters)."""
    return rule.build(params)


def measure_rule(
    rule: UpdateRule,
    named: list[tuple[str, torch.Tensor]],
    layout: FusedLayout,
    initial: torch.Tensor,
    gradients: list[torch.Tensor],
    args: argparse.Namespace,
    by_name: UpdateRule | None = None,
) -> dict:
    """The rows of one rule (and of ``by_name``, the same rule by name when that means the
    fused kernel, in a store of its own), interleaved over the rounds, and whether pieces and
    whole ended bit for bit equal."""
    stores = {"whole": VariableStore(piece_elements=WHOLE), "pieces": VariableStore()}
    rules = {"whole": rule, "pieces": rule}
    if by_name is not None:
        stores["fused"], rules["fused"] = VariableStore(), by_name
    for name, store in stores.items():
        store.create(layout, rules[name], [initial])
        store.apply([gradients[0]])  # allocates the optimizer's state: not timed
    params = [t.clone() for _, t in named]
    optimizer = torch_optimizer(rule, params)
    splits = [t.numel() for t in params]
    per_param = [list(g.split(splits)) for g in gradients]

    def step_torch(index: int) -> None:
        for param, grad in zip(params, per_param[index % 2], strict=True):
            param.grad = grad.view(param.shape)
        optimizer.step()

    step_torch(0)  # allocates the optimizer's state: not timed
    runs = {
        "torch": step_torch,
        "whole": lambda index: stores["whole"].apply([gradients[index % 2]]),
        "pieces": lambda index: stores["pieces"].apply([gradients[index % 2]]),
    }
    if "fused" in stores:
        runs["fused"] = lambda index: stores["fused"].apply([gradients[index % 2]])
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(args.rounds):
        print(f"{rule.name}: round {round_index + 1} of {args.rounds}", flush=True)
        for name, run in runs.items():
            start = time.perf_counter()
            for index in range(args.updates):
                run(index)
            times[name].append(1e3 * (time.perf_counter() - start) / args.updates)
    whole_values, _, whole_state = stores["whole"].checkpoint_parts()
    piece_values, _, piece_state = stores["pieces"].checkpoint_parts()
    equal = all(torch.equal(whole_values[k], piece_values[k]) for k in whole_values) and all(
        torch.equal(tensor, piece_state[name][key])
        for name, tensors in whole_state.items()
        for key, tensor in tensors.items()
    )
    baseline = statistics.median(times["torch"])
    row: dict = {
        name: {
            "ms_per_update": statistics.median(measured),
            "rounds": measured,
            "vs_torch": baseline / statistics.median(measured),
        }
        for name, measured in times.items()
    }
    row["pieces_equal_whole_bit_for_bit"] = equal
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rules", nargs="+", choices=tuple(RULES), default=list(RULES))
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--updates", type=int, default=4, help="timed updates per row a round")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's own")
    parser.add_argument("--quick", action="store_true", help="a small model: a smoke test")
    add_out_dir_option(parser)
    args = parser.parse_args()
    if args.quick and not os.environ.get(OUT_ENV):
        os.environ[OUT_ENV] = tempfile.mkdtemp(prefix="ps_update-")
    if args.threads:
        torch.set_num_threads(args.threads)
    named = model_variables(args.quick)
    layout = FusedLayout.of([StoredVariable(name, tuple(t.shape), "float32") for name, t in named])
    (group,) = layout.groups
    initial = torch.cat([t.reshape(-1) for _, t in named])
    generator = torch.Generator().manual_seed(1)
    gradients = [torch.randn(group.numel, generator=generator) * 1e-2 for _ in range(2)]
    rows = {
        rule_name: measure_rule(
            RULES[rule_name], named, layout, initial, gradients, args, BY_NAME.get(rule_name)
        )
        for rule_name in args.rules
    }
    table = [
        "| rule | one process: torch.optim (baseline) ms | ps, whole variables ms (vs torch) "
        "| ps, pieces ms (vs torch) | pieces vs whole | pieces = whole bit for bit "
        "| ps, by name: fused kernel ms (vs torch) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rule_name, row in rows.items():
        table.append(
            f"| {rule_name} | {row['torch']['ms_per_update']:.0f} "
            f"| {row['whole']['ms_per_update']:.0f} ({row['whole']['vs_torch']:.2f}x) "
            f"| {row['pieces']['ms_per_update']:.0f} ({row['pieces']['vs_torch']:.2f}x) "
            f"| {row['whole']['ms_per_update'] / row['pieces']['ms_per_update']:.2f}x "
            f"| {'yes' if row['pieces_equal_whole_bit_for_bit'] else 'NO'} "
            + (
                f"| {row['fused']['ms_per_update']:.0f} ({row['fused']['vs_torch']:.2f}x) |"
                if "fused" in row
                else "| (torch's default kernel by name) |"
            )
        )
    result = {
        "benchmark": "the ps's update of a big model: whole variables vs pieces vs the fused "
        "kernel vs one process",
        "parameters": group.numel,
        "variables": len(named),
        "piece_elements": PIECE_ELEMENTS,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "updates_per_round": args.updates,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_average_at_start": os.getloadavg(),
        },
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
    }
    heading = (
        f"The ps's update of {group.numel:,} float32 parameters in {len(named)} variables "
        f"(BERT-base-sized{' (quick: small)' if args.quick else ''}), {torch.get_num_threads()} "
        f"thread(s), pieces of {PIECE_ELEMENTS:,} elements, median of {args.rounds} rounds of "
        f"{args.updates} updates; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end; {result['date']}"
    )
    write_results("ps_update", result, heading, table)
    return 0 if all(row["pieces_equal_whole_bit_for_bit"] for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
