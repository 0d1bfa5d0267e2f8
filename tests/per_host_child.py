"""One host of two feeding only its share of each batch (tests/test_launch.py).

    python -m tfpar.launch --hosts 2 --virtual-cpus 4 per_host_child.py MODE WORKDIR

Global batch k (32 rows) is x[32k : 32k+32]; host h holds and feeds only
rows x[32k + 16h : 32k + 16h + 16] of it (`per_host_input=True`, data=8:
host h's devices hold data blocks 4h..4h+3). MODE: "arrays" and "dataset"
train `models.host_mlp` for 2 epochs (plain SGD) from numpy arrays or a
tf.data.Dataset of those rows, writing the per-batch losses ("arrays"
then also evaluates and predicts on this host's rows, writing the loss
and the predictions predict returns: every host's, in order); "files" the
same from files sharded by host (WORKDIR/rows-NNN.npz, file 2k+h holding
host h's rows of batch k, read by a tf.data pipeline of every other file); "function"
iterates `strategy.distribute_datasets_from_function` (each host shards a
dataset of 16-row batches by its InputContext) and writes the global
batches it assembles; "uneven" gives host 1 one batch fewer.
"""

import glob
import json
import os
import sys

import tfpar

tfpar.connect_hosts(heartbeat_timeout=120)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import models  # noqa: E402
from tfpar import placement  # noqa: E402

mode, workdir = sys.argv[1], sys.argv[2]
host = tfpar.hosts.host_id()
given = np.load(os.path.join(workdir, "given.npz"))
x, y = given["x"], given["y"]
mine = np.concatenate([np.arange(32 * k + 16 * host, 32 * k + 16 * host + 16)
                       for k in range(len(x) // 32)])
if mode == "uneven" and host == 1:
    mine = mine[:-16]
strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), per_host_input=True)


def write(name, value):
    with open(os.path.join(workdir, f"{name}-host{host}.json"), "w") as f:
        json.dump(value, f)


def files_of_this_host():
    """WORKDIR/rows-NNN.npz, file 2k+h holding host h's 16 rows of global
    batch k: this host's tf.data pipeline reads every other file."""
    names = sorted(glob.glob(os.path.join(workdir, "rows-*.npz")))

    def load(name):
        rows = np.load(name.decode())
        return rows["x"], rows["y"]

    files = tf.data.Dataset.from_tensor_slices(names).shard(2, host)
    return files.map(lambda name: tuple(
        tf.ensure_shape(t, s) for t, s in zip(
            tf.numpy_function(load, [name], [tf.float32, tf.float32]),
            [(16, x.shape[1]), (16, y.shape[1])])))


if mode == "function":
    def dataset_fn(context):
        rows = tf.data.Dataset.from_tensor_slices(x).batch(16)
        return rows.shard(context.num_input_pipelines, context.input_pipeline_id)

    batches = strategy.distribute_datasets_from_function(dataset_fn)
    write("batches", [placement.fetch(b).tolist() for b in batches])
else:
    with strategy.scope():
        model = models.host_mlp()
        model.set_weights([given[f"w{i}"] for i in range(6)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    recorder = models.BatchLosses()
    if mode == "files":
        data = (files_of_this_host(),)
    else:
        data = ((x[mine], y[mine]) if mode != "dataset" else
                (tf.data.Dataset.from_tensor_slices(
                    (x[mine], y[mine])).batch(16),))
    model.fit(*data, batch_size=None if mode in ("dataset", "files") else 16,
              epochs=2, shuffle=False, verbose=0, callbacks=[recorder])
    write("losses", recorder.losses)
    if mode == "arrays":
        write("evaluate", model.evaluate(x[mine], y[mine], batch_size=16,
                                         verbose=0))
        write("predict", model.predict(x[mine], batch_size=16,
                                       verbose=0).tolist())
print(f"host {host} done", flush=True)
