"""The benchmarks' training driver: ``examples/mnist_cnn.py`` plus what a measurement needs
and an example should not show.

* ``--straggler INDEX`` / ``--straggler-slowdown X``: that worker computes X times slower
  (it sleeps ``X - 1`` times each step's own duration), as if its hardware were slower;
* steady-state clocks: the chief's throughput is measured from its ``WARMUP_STEPS``-th local
  step on (connection set-up, first allocations and the other workers' start are not in it);
* ``--metrics-json PATH``: the chief writes its figures there (global steps and steps/s,
  steady-state steps/s, local steps, test accuracy, workers, mode and, in the ps modes, the
  bytes its transport sent per steady-state step).

Every other flag is the example's; the training itself is the example's ``train``. Run it as
the example is run, e.g. ``tensorfleet launch --ps 1 --workers 3 -- .venv/bin/python
benchmarks/cnn_training.py --steps 600 --metrics-json m.json``. With ``--metrics-json`` the
chief must make more than ``WARMUP_STEPS`` local steps: a shorter run is an error (no
steady state to time), not a figure.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import mnist_cnn  # noqa: E402

import tensorfleet as tfl  # noqa: E402

#: Local steps after which the chief starts its steady-state throughput clock.
WARMUP_STEPS = 20


class BenchmarkClocks(tfl.Hook):
    """Times the loop (overall and after the warm-up) and slows a straggler down."""

    def __init__(self, slowdown: float | None) -> None:
        self.slowdown = slowdown
        self.local_steps = 0
        self.started = self.step_started = self.last_step_at = 0.0
        self.first_step = 0
        self.steady_from: tuple[float, int] | None = None  # (time, global step)
        self.client = None  # the ps modes' ParameterClient, for its byte counters
        self.sent_from = self.sent_to = 0

    def begin(self, session: tfl.TrainingSession) -> None:
        self.started = time.perf_counter()
        self.first_step = session.global_step
        self.client = getattr(session._updater, "client", None)  # the benchmark reads counters

    def before_step(self, session: tfl.TrainingSession) -> None:
        self.step_started = time.perf_counter()

    def after_step(self, session: tfl.TrainingSession, result: tfl.StepResult) -> None:
        if self.slowdown is not None:  # as if this worker's hardware were that many times slower
            time.sleep((self.slowdown - 1) * (time.perf_counter() - self.step_started))
        self.local_steps += 1
        self.last_step_at = time.perf_counter()
        if self.local_steps == WARMUP_STEPS:
            self.steady_from = (self.last_step_at, result.global_step)
        if self.client is not None:
            sent = self.client.wire_bytes()[0]
            self.sent_from = sent if self.local_steps == WARMUP_STEPS else self.sent_from
            self.sent_to = sent

    def figures(
        self, result: mnist_cnn.Result, mode: str, steps: int
    ) -> dict[str, float | int | str]:
        """The chief's figures; ``steps`` is the ``--steps`` asked for (named in the error).

        Raises ConfigError when the chief's local steps did not pass the warm-up: there is no
        steady state to time, and figures of the whole run would pass for per-step ones.
        """
        if self.local_steps <= WARMUP_STEPS:
            needed = math.ceil(steps * (WARMUP_STEPS + 1) / max(1, self.local_steps))
            raise tfl.ConfigError(
                f"--steps {steps} gave the chief {self.local_steps} local steps ({mode} mode, "
                f"{result.workers} worker(s)), not more than the {WARMUP_STEPS} warm-up steps "
                f"its steady-state clock skips: no figure can be measured; pass at least "
                f"{WARMUP_STEPS + 1} local steps to the chief (about --steps {needed} here)"
            )
        elapsed = self.last_step_at - self.started
        steady_s, steady_step = self.steady_from or (self.started, self.first_step)
        steps = result.global_step - self.first_step
        return {
            "global_steps": steps,
            "seconds": elapsed,
            "global_steps_per_s": steps / elapsed,
            "steady_global_steps_per_s": (result.global_step - steady_step)
            / (self.last_step_at - steady_s),
            "chief_local_steps": self.local_steps,
            "steady_local_ms_per_step": 1e3
            * (self.last_step_at - steady_s)
            / (self.local_steps - WARMUP_STEPS),
            "test_accuracy": result.test_accuracy,
            "workers": result.workers,
            "mode": mode,
            "sent_bytes_per_step": (self.sent_to - self.sent_from)
            / (self.local_steps - WARMUP_STEPS)
            if self.client is not None
            else None,
        }


def main(argv: list[str] | None = None) -> int:
    parser = mnist_cnn.build_parser()
    parser.description = __doc__
    parser.add_argument("--straggler", type=int, default=None, metavar="INDEX")
    parser.add_argument("--straggler-slowdown", type=float, default=4.0)
    parser.add_argument("--metrics-json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.metrics_json is not None and args.steps <= WARMUP_STEPS:
        parser.error(
            f"--steps {args.steps} cannot pass the chief's {WARMUP_STEPS} warm-up steps, after "
            f"which --metrics-json's figures are timed: pass --steps {WARMUP_STEPS + 1} or more "
            "(more with several workers in async mode: the chief makes only its share)"
        )
    task = tfl.resolve_task(
        argv=[
            f"--{k}={getattr(args, k)}"
            for k in ("job_name", "task_index", "cluster")
            if getattr(args, k)
        ],
        allow_none=True,
    )
    slow = args.straggler is not None and args.straggler == (task.index if task else 0)
    clocks = BenchmarkClocks(args.straggler_slowdown if slow else None)
    result = mnist_cnn.train(args, extra_hooks=[clocks])
    if result is not None and args.metrics_json is not None:
        args.metrics_json.write_text(json.dumps(clocks.figures(result, args.mode, args.steps)))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except tfl.TensorfleetError as error:  # a misconfiguration: one clear line, no traceback
        print(f"cnn_training.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
