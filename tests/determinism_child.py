"""Run by tests/test_determinism.py: seeded training with op determinism
on the meshes named in argv; prints one line "<mesh> <sha256 of weights>"
per mesh. Two runs must print the same lines (bit-identical weights)."""

import hashlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tfpar  # noqa: E402

tfpar.use_virtual_cpus(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from models import HOST_RULES, mlp_data  # noqa: E402

tf.config.experimental.enable_op_determinism()

MESHES = {
    "data=2,model=4": ({"data": 2, "model": 4}, HOST_RULES, False),
    "data=8,fsdp": ({"data": 8}, None, True),
    "model=8": ({"model": 8}, HOST_RULES, False),
    "pipe=2,data=2,model=2": ({"pipe": 2, "data": 2, "model": 2},
                              HOST_RULES, False),
}


def mlp():
    """An MLP with Dropout in training (random masks, seeded)."""
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu", name="up0"),
        keras.layers.Dropout(0.2, name="drop"),
        keras.layers.Dense(16, activation="relu", name="down0"),
        keras.layers.Dense(3, name="head")], name="mlp")


def run(name):
    axes, rules, fsdp = MESHES[name]
    keras.utils.set_random_seed(0)   # initial weights and Dropout seeds
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules,
                                      fsdp=fsdp)
    with strategy.scope():
        model = mlp()
        if "pipe" in axes:
            model = tfpar.PipelineModel(model, num_microbatches=2)
        model.compile(optimizer="adam", loss="mse")
    x, y = mlp_data(n=64)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)  # shuffled, seeded
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(np.ascontiguousarray(weight).tobytes())
    print(name, digest.hexdigest(), flush=True)


for mesh_name in sys.argv[1:]:
    run(mesh_name)
