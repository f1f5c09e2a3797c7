"""In-graph replication: each worker task drives several local devices.

The model is replicated on ``--devices`` (two CPU "devices" by default: two threads), each
step's batch is split among the replicas, their gradients are combined in the task and pushed
to the ps once. One command, on one machine::

    tensorfleet launch --ps 1 --workers 2 -- python examples/ingraph_replicas.py --steps 300

(or ``python examples/ingraph_replicas.py`` alone: one process, no ps). On a GPU machine:
``--devices /gpu:0 /gpu:1``.
"""

from __future__ import annotations

import torch.nn.functional as F
from devices_common import batches, mlp, parser, run_ps_if_ps, test_accuracy

import tensorfleet as tfl


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--devices", nargs="+", default=["/cpu:0", "/cpu:1"], help="one per replica")
    args = p.parse_args()
    task = tfl.resolve_task(argv=[], allow_none=True)
    if run_ps_if_ps(task):
        return 0
    server = tfl.Server(task.cluster, task.job, task.index) if task else None
    stream = batches(args, task.index if task else 0, task.num_workers if task else 1)
    model = mlp()
    with tfl.TrainingSession(
        server, model, optimizer=tfl.optim.Adam(lr=args.lr), mode=args.mode if server else "async",
        replica_devices=args.devices, log_placement=True, hooks=[tfl.StopAtStep(args.steps)],
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
