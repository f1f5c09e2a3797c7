"""A pipeline across tasks: the MLP cut into stages that run on different worker tasks.

With ``--pipeline-stages S`` the launcher makes worker i stage i % S of pipeline i // S.
Each pipeline's stage 0 runs the training loop (its ``sess.model(x)`` sends the micro-batches
down the stages and gets the outputs back); the other stages serve their stage until it ends.
The pipelines are data-parallel replicas sharing the ps. One command, on one machine (two
pipelines of two stages)::

    tensorfleet launch --ps 1 --workers 4 --pipeline-stages 2 -- python examples/pipeline_across_tasks.py --steps 300

Stages exchange activations over torch.distributed (gloo): run it on a trusted network.
"""

from __future__ import annotations

import sys

import torch.nn.functional as F
from devices_common import batches, mlp, parser, run_ps_if_ps, test_accuracy

import tensorfleet as tfl


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=4, help="must divide --batch")
    args = p.parse_args()
    task = tfl.resolve_task(argv=[], allow_none=True)
    if task is None:
        print("run it under `tensorfleet launch --pipeline-stages 2 ...` (see the docstring)",
              file=sys.stderr)  # fmt: skip
        return 2
    if run_ps_if_ps(task):
        return 0
    server = tfl.Server(task.cluster, task.job, task.index)
    model = mlp()
    stage = tfl.pipeline_stage_of(server)
    if stage != 0:
        steps = tfl.serve_pipeline_stage(server, model)
        print(f"{task.job}:{task.index} served stage {stage} for {steps} steps", flush=True)
        return 0
    pipeline = task.index // server.pipeline_stages
    stream = batches(args, pipeline, task.num_workers // server.pipeline_stages)
    with tfl.TrainingSession(
        server, model, optimizer=tfl.optim.Adam(lr=args.lr), mode=args.mode,
        microbatches=args.microbatches, log_placement=True, hooks=[tfl.StopAtStep(args.steps)],
    ) as sess:  # fmt: skip
        while not sess.should_stop():
            x, y = next(stream)
            result = sess.step(lambda x=x, y=y: F.cross_entropy(sess.model(x), y))
        if sess.is_chief:
            print(f"global step {result.global_step}, loss {result.loss:.3f}, "
                  f"test accuracy {test_accuracy(model, args):.3f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
