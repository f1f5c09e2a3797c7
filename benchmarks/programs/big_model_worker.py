"""The program of ``benchmarks/big_model.py``: a BERT-base-sized encoder trained with Adam on
synthetic tokens, in one of three ways, writing what it measured to ``--report``.

    big_model_worker.py --mode torch|local|cluster --report PATH [--layers 12 --hidden 768
        --heads 12 --ffn 3072 --vocab 30522 --seq 32 --batch 4 --head cls|lm --steps 12
        --warmup 3 --lr 1e-4 --torch-fused --device cpu|cuda --timeline FILE --cprofile FILE]

* ``torch``: the plain PyTorch loop (``torch.optim.Adam``; with ``--torch-fused``, its fused
  kernel, which ``tfl.optim.Adam`` uses by default): the baseline;
* ``local``: ``tfl.TrainingSession(None, model, tfl.optim.Adam(...))``, one process;
* ``cluster``: a worker of a cluster started by ``tensorfleet launch`` (async, every
  session setting at its default: buckets on, prefetch off); its ps tasks run the built-in
  ``tensorfleet server``.

The model (:class:`Encoder`): token and position embeddings, ``--layers``
``nn.TransformerEncoderLayer`` (post-norm, GELU, dropout 0.1, batch first), a final
LayerNorm and a head: ``cls`` (default) a linear classifier of the mean of the sequence into
2 classes, ``lm`` a linear layer to the vocabulary at every position (an untied LM head:
+``vocab x hidden`` parameters and that many more FLOPs). The defaults are BERT-base's shape:
108.9 M parameters with ``cls``, 132.4 M with ``lm``. The data: a pool of 8 batches of
uniform random tokens (and labels) from a generator seeded with ``--seed``, the same in every
mode: no data loading is measured. ``--device cuda`` puts the model and the batches on the
GPU (in a cluster, the worker's: the ps keeps the variables in host memory), so each step's
``loss.item()`` waits for the GPU and the step times are the GPU's.

The report (JSON): every step's end on ``time.perf_counter`` (``step_ends_s``), the seconds
per step over the steps after ``--warmup`` (the first ``--warmup`` steps are not timed), the
first and last loss, the parameter count and bytes, the torch threads, and this process's
``/proc/self/status`` memory figures read after training (``VmHWM``: the kernel's high-water
mark of the resident set, exact; ``VmRSS`` and its parts) and right after the model was built.
``--timeline FILE``: the session's timeline (the modes with a session; per-phase spans);
``--cprofile FILE``: the training loop under ``cProfile`` (its stats written to FILE, the
top functions by cumulative and by own time to FILE.txt).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl

#: Batches in the synthetic pool (cycled): enough that no two neighbouring steps repeat.
POOL = 8
#: Classes of the ``cls`` head.
CLASSES = 2
#: The ``/proc/<pid>/status`` fields a report keeps (kB).
MEMORY_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")


class Encoder(nn.Module):
    """A BERT-style encoder: embeddings, ``layers`` transformer layers, LayerNorm, a head."""

    def __init__(
        self, vocab: int, hidden: int, layers: int, heads: int, ffn: int, seq: int, head: str
    ) -> None:
        super().__init__()
        self.head_kind = head
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)
        layer = nn.TransformerEncoderLayer(
            hidden, heads, ffn, dropout=0.1, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, CLASSES if head == "cls" else vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.norm(self.encoder(self.tokens(tokens) + self.positions(positions)))
        if self.head_kind == "cls":
            return self.head(hidden.mean(dim=1))
        return self.head(hidden)


def build_model(args: argparse.Namespace) -> Encoder:
    """The encoder of the command line, its initial values from ``--seed``."""
    torch.manual_seed(args.seed)
    return Encoder(args.vocab, args.hidden, args.layers, args.heads, args.ffn, args.seq, args.head)


def make_batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The synthetic pool: (tokens [batch, seq], targets) from a generator seeded ``--seed``."""
    generator = torch.Generator().manual_seed(args.seed)
    pool = []
    for _ in range(POOL):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        if args.head == "cls":
            targets = torch.randint(0, CLASSES, (args.batch,), generator=generator)
        else:
            targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        pool.append((tokens, targets))
    return pool


def loss_of(model: Encoder, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def memory_kib() -> dict[str, int]:
    """This process's :data:`MEMORY_FIELDS` from ``/proc/self/status``, in KiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in MEMORY_FIELDS:
            fields[key] = int(value.split()[0])
    return fields


def say_step(ends: list[float]) -> None:
    """One line per step with its seconds (a run of minutes shows it is moving)."""
    if len(ends) > 1:
        print(f"big_model_worker: step {len(ends)}: {ends[-1] - ends[-2]:.2f} s", flush=True)


def train_torch(
    args: argparse.Namespace, model: Encoder, batches, ends: list[float], cpu: list[float]
) -> list:
    """The baseline: the plain loop, ``torch.optim.Adam`` (torch's default kernel, or with
    ``--torch-fused`` its fused one)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=args.torch_fused or None)
    losses = []
    for step in range(args.steps):
        tokens, targets = batches[step % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, tokens, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
        say_step(ends)
    return losses


def train_session(
    args: argparse.Namespace, model: Encoder, batches, ends: list[float], cpu: list[float]
) -> list:
    """One process (``server`` None) or a cluster's worker: ``tfl.TrainingSession``."""
    server = None
    if args.mode == "cluster":
        task = tfl.resolve_task()
        if task.job != "worker":
            raise tfl.ConfigError(
                f"big_model_worker.py runs the worker tasks only, but this task is "
                f"{task.job}:{task.index}; let the launcher start the built-in ps (leave out "
                "--ps-command / --ps-runs-script)"
            )
        server = tfl.Server(task.cluster, task.job, task.index)
    losses = []
    with tfl.TrainingSession(
        server,
        model,
        tfl.optim.Adam(lr=args.lr),
        hooks=[tfl.StopAtStep(last_step=args.steps)],
        timeline=args.timeline,
        progress_secs=None,
        **({} if args.bucket_bytes is None else {"overlap": tfl.Overlap(args.bucket_bytes)}),
    ) as sess:
        step = 0
        while not sess.should_stop() and step < args.steps:
            tokens, targets = batches[step % len(batches)]
            result = sess.step(lambda t=tokens, y=targets: loss_of(model, t, y))
            losses.append(float(result.loss))
            ends.append(time.perf_counter())
            cpu.append(time.process_time())
            say_step(ends)
            step += 1
    return losses


def profiled(path: Path | None, run: Callable[[], list]) -> list:
    """``run()``, under ``cProfile`` when ``path`` is given (stats to ``path``, the top 40
    by cumulative and by own time to ``path``.txt)."""
    if path is None:
        return run()
    profile = cProfile.Profile()
    try:
        return profile.runcall(run)
    finally:
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.dump_stats(path)
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(40)
        path.with_name(path.name + ".txt").write_text(text.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("torch", "local", "cluster"), required=True)
    parser.add_argument("--report", type=Path, required=True, help="where the JSON report goes")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=None, help="default: hidden / 64")
    parser.add_argument("--ffn", type=int, default=None, help="default: 4 x hidden")
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--head", choices=("cls", "lm"), default="cls")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--torch-fused", action="store_true",
                        help="mode torch: torch.optim.Adam(fused=True)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeline", type=Path, default=None)
    parser.add_argument(
        "--bucket-bytes",
        type=int,
        default=None,
        help="pass overlap=tfl.Overlap(bucket_bytes=B) to the session (default: the "
        "session's own default overlap)",
    )
    parser.add_argument("--cprofile", type=Path, default=None)
    parser.add_argument(
        "--device", default="cpu", help="where the model computes: cpu (default) or cuda"
    )
    args = parser.parse_args()
    args.heads = args.heads or max(1, args.hidden // 64)
    args.ffn = args.ffn or 4 * args.hidden
    if args.steps <= args.warmup:
        parser.error(
            f"--steps {args.steps} is not more than --warmup {args.warmup}: no step would be "
            f"timed; pass --steps {args.warmup + 1} or more"
        )
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    device = torch.device(args.device)
    model = build_model(args).to(device)
    batches = [(tokens.to(device), targets.to(device)) for tokens, targets in make_batches(args)]
    parameters = sum(p.numel() for p in model.parameters())
    built = memory_kib()
    ends: list[float] = []  # time.perf_counter() (CLOCK_MONOTONIC: one clock for every process)
    cpu: list[float] = []  # time.process_time(): this process's CPU seconds, every thread
    started, started_cpu = time.perf_counter(), time.process_time()
    train = train_torch if args.mode == "torch" else train_session
    losses = profiled(args.cprofile, lambda: train(args, model, batches, ends, cpu))
    timed = len(ends) - args.warmup
    if timed < 1:
        raise tfl.ConfigError(
            f"{len(ends)} steps ran, not more than the {args.warmup} warm-up steps: nothing "
            f"to time; pass --steps {args.warmup + 1} or more"
        )
    report = {
        "mode": args.mode,
        "shape": {
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "ffn": args.ffn,
            "vocab": args.vocab,
            "seq": args.seq,
            "batch": args.batch,
            "head": args.head,
        },
        "parameters": parameters,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "threads": torch.get_num_threads(),
        "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "steps": len(ends),
        "warmup": args.warmup,
        "started_perf_counter_s": started,
        "step_ends_s": [t - started for t in ends],
        "timed_from_perf_counter_s": ends[args.warmup - 1] if args.warmup else started,
        "s_per_step": (ends[-1] - (ends[args.warmup - 1] if args.warmup else started)) / timed,
        "cpu_s_per_step": (cpu[-1] - (cpu[args.warmup - 1] if args.warmup else started_cpu))
        / timed,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "memory_kib_after_build": built,
        "memory_kib": memory_kib(),
    }
    args.report.write_text(json.dumps(report, indent=1))
    print(
        f"big_model_worker: {args.mode}: {parameters:,} parameters, "
        f"{report['s_per_step']:.3f} s/step over {timed} steps, "
        f"VmHWM {report['memory_kib']['VmHWM'] / 2**20:.2f} GiB",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except tfl.TensorfleetError as error:  # a misconfiguration: one clear line, no traceback
        print(f"big_model_worker.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
