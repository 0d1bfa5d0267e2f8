"""Trains a `PipelineModel(record_timeline=True)` one step and marks on
stderr where TF's profiler ran (tests/test_profiler_groups.py reads which
collective groups formed inside and outside that window, from TF's own
log lines with TF_CPP_VMODULE=collective_param_resolver_local=1).

    python profiler_groups_child.py [--no-form]

--no-form: without `tfpar.pipeline.profiler.form_collective_groups` (the
step then forms its groups under the profiler, as before the fix).
"""

import os
import sys

import tfpar

tfpar.use_virtual_cpus(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfpar.pipeline import profiler  # noqa: E402

if "--no-form" in sys.argv:
    profiler.form_collective_groups = lambda meshes: None


def marked(function, marker, before):
    def wrapper(*args, **kwargs):
        if not before:
            result = function(*args, **kwargs)
        os.write(2, marker)
        if before:
            result = function(*args, **kwargs)
        return result
    return wrapper


tf.profiler.experimental.start = marked(
    tf.profiler.experimental.start, b"TFPAR-PROFILER-STARTED\n", before=False)
tf.profiler.experimental.stop = marked(
    tf.profiler.experimental.stop, b"TFPAR-PROFILER-STOPPING\n", before=True)
strategy = tfpar.ParallelStrategy(
    tfpar.Mesh({"pipe": 2, "data": 2, "model": 2}),
    rules={r".*up\d/kernel": (None, "model"), r".*down\d/kernel": ("model", None)})
x = np.random.RandomState(0).rand(16, 16).astype("float32")
with strategy.scope():
    model = keras.Sequential([keras.Input((16,))] + [
        keras.layers.Dense(32, name=f"{kind}{i}", activation=activation)
        if kind == "up" else keras.layers.Dense(16, name=f"{kind}{i}")
        for i in range(2) for kind, activation in (("up", "relu"),
                                                   ("down", None))])
    pipe = tfpar.PipelineModel(model, num_microbatches=2, record_timeline=True)
    pipe.compile(optimizer="sgd", loss="mse")
pipe.fit(x, x, batch_size=16, verbose=0)
print("TIMELINE", len(pipe.last_timeline), flush=True)
