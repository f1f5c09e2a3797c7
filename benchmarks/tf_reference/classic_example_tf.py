"""Reference peer: the classic distributed MNIST CNN example (1 ps + N workers,
between-graph replication, replica_device_setter, MonitoredTrainingSession),
run on TensorFlow's own distributed runtime (tf.compat.v1, TensorFlow 2.x),
on MNIST-format idx.gz files (Fashion-MNIST by default).

It exists to be measured side by side with tensorfleet on the same machine,
same model, same batch size, same optimizer. See run.sh beside it.

One task per process:
  python classic_example_tf.py --job_name ps --task_index 0
  python classic_example_tf.py --job_name worker --task_index 0 --steps 2000
  python classic_example_tf.py --single --steps 600        # no cluster at all

Each worker prints one JSON line at the end; worker 0 adds the test accuracy.
"""

import argparse
import gzip
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1
tf1.disable_eager_execution()

p = argparse.ArgumentParser()
p.add_argument("--job_name", default="")
p.add_argument("--task_index", type=int, default=0)
p.add_argument("--single", action="store_true", help="plain one-process training, no cluster")
p.add_argument("--sync", action="store_true", help="SyncReplicasOptimizer over all workers")
p.add_argument("--steps", type=int, default=2000, help="global steps to train")
p.add_argument("--batch", type=int, default=50)
p.add_argument("--ps", default="localhost:2222")
p.add_argument("--workers", default="localhost:2223,localhost:2224,localhost:2225")
p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
p.add_argument("--threads", type=int, default=1, help="intra- and inter-op threads per task")
a = p.parse_args()


def read_idx(path):
    with gzip.open(path, "rb") as f:
        b = f.read()
    nd = b[3]
    dims = [int.from_bytes(b[4 + 4 * i : 8 + 4 * i], "big") for i in range(nd)]
    return np.frombuffer(b, np.uint8, offset=4 + 4 * nd).reshape(dims)


def weight(name, shape):
    if len(shape) == 1:
        return tf1.get_variable(name, shape, initializer=tf1.zeros_initializer())
    std = np.sqrt(2.0 / np.prod(shape[:-1]))
    return tf1.get_variable(name, shape, initializer=tf1.random_normal_initializer(stddev=std))


def net(x):
    # conv 5x5x32 -> pool -> conv 5x5x64 -> pool -> fc 500 -> fc 10, as in the classic example
    h = tf1.reshape(x, [-1, 28, 28, 1])
    h = tf.nn.relu(
        tf.nn.conv2d(h, weight("conv1/w", [5, 5, 1, 32]), 1, "SAME") + weight("conv1/b", [32])
    )
    h = tf.nn.max_pool2d(h, 2, 2, "VALID")
    h = tf.nn.relu(
        tf.nn.conv2d(h, weight("conv2/w", [5, 5, 32, 64]), 1, "SAME") + weight("conv2/b", [64])
    )
    h = tf.nn.max_pool2d(h, 2, 2, "VALID")
    h = tf.nn.relu(
        tf1.matmul(tf1.reshape(h, [-1, 3136]), weight("fc/w", [3136, 500])) + weight("fc/b", [500])
    )
    return tf1.matmul(h, weight("pred/w", [500, 10])) + weight("pred/b", [10])


def build(n_workers):
    global_step = tf1.train.get_or_create_global_step()
    x = tf1.placeholder(tf.float32, [None, 784])
    y_ = tf1.placeholder(tf.float32, [None, 10])
    y = net(x)
    loss = tf1.reduce_mean(tf1.nn.softmax_cross_entropy_with_logits_v2(labels=y_, logits=y))
    opt = tf1.train.AdamOptimizer(1e-4)
    if a.sync:
        opt = tf1.train.SyncReplicasOptimizer(
            opt, replicas_to_aggregate=n_workers, total_num_replicas=n_workers
        )
    train = opt.minimize(loss, global_step=global_step)
    acc = tf1.reduce_mean(tf1.cast(tf1.equal(tf1.argmax(y, 1), tf1.argmax(y_, 1)), tf.float32))
    return global_step, x, y_, train, acc, opt


cfg = tf1.ConfigProto(
    intra_op_parallelism_threads=a.threads, inter_op_parallelism_threads=a.threads
)
workers = a.workers.split(",")
if not a.single:
    cluster = tf1.train.ClusterSpec({"ps": a.ps.split(","), "worker": workers})
    server = tf1.train.Server(cluster, job_name=a.job_name, task_index=a.task_index, config=cfg)
    if a.job_name == "ps":
        server.join()
        sys.exit(0)

xtr = read_idx(f"{a.data}/train-images-idx3-ubyte.gz").reshape(-1, 784).astype(np.float32) / 255.0
ytr = np.eye(10, dtype=np.float32)[read_idx(f"{a.data}/train-labels-idx1-ubyte.gz")]
xte = read_idx(f"{a.data}/t10k-images-idx3-ubyte.gz").reshape(-1, 784).astype(np.float32) / 255.0
yte = np.eye(10, dtype=np.float32)[read_idx(f"{a.data}/t10k-labels-idx1-ubyte.gz")]
rng = np.random.default_rng(a.task_index)
is_chief = a.single or a.task_index == 0

if a.single:
    global_step, x, y_, train, acc, opt = build(1)
    session = tf1.train.MonitoredTrainingSession(
        hooks=[tf1.train.StopAtStepHook(last_step=a.steps)], config=cfg
    )
else:
    with tf1.device(
        tf1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{a.task_index}", cluster=cluster
        )
    ):
        global_step, x, y_, train, acc, opt = build(len(workers))
    hooks = [tf1.train.StopAtStepHook(last_step=a.steps)]
    if a.sync:
        hooks.append(opt.make_session_run_hook(is_chief))
    session = tf1.train.MonitoredTrainingSession(
        master=server.target, is_chief=is_chief, hooks=hooks, config=cfg
    )

t0 = first_step = None
mine = 0
with session as sess:
    while not sess.should_stop():
        i = rng.integers(0, len(xtr), a.batch)
        _, step = sess.run([train, global_step], {x: xtr[i], y_: ytr[i]})
        mine += 1
        if t0 is None:
            t0, first_step = time.perf_counter(), step
    seconds = time.perf_counter() - t0 if t0 is not None else 0.0
    result = {
        "peer": "tensorflow " + tf.__version__,
        "task": a.task_index,
        "my_steps": mine,
        "seconds": round(seconds, 3),
    }
    if is_chief and mine:
        raw = sess._tf_sess()  # evaluation only; bypasses the stop hook
        result["global_steps"] = int(step - first_step)
        result["global_steps_per_s"] = round((step - first_step) / seconds, 2)
        result["test_accuracy"] = round(
            float(
                np.mean(
                    [
                        raw.run(acc, {x: xte[k : k + 1000], y_: yte[k : k + 1000]})
                        for k in range(0, len(xte), 1000)
                    ]
                )
            ),
            4,
        )
    print(json.dumps(result), flush=True)
