"""Keras mixed precision (bfloat16 compute, float32 weights) under
ParallelStrategy: tensor parallelism and fsdp train like one device.

bfloat16 keeps 8 bits of mantissa (relative spacing 2**-8 = 0.4%), and the
sharded step sums in another order than one device, so results agree to
bfloat16 precision, not to the 1e-4 of the fp32 parity tests.
"""

import contextlib

import keras
import numpy as np
import pytest

import tfpar

import models

# The oracle: sharding may change the result by about as much as bfloat16
# itself does, no more. One device in mixed precision differs from one
# device in float32 by some amount per weight; the sharded mixed-precision
# run must stay within twice that amount of the one-device mixed-precision
# run (both round to bfloat16, summing in another order on the mesh).
# SGD with momentum: Adam's step is about lr * sign(gradient) wherever a
# gradient is tiny, which would turn a rounding difference into a whole step.
SLACK = 2.0


def build(policy="mixed_bfloat16"):
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="up", dtype=policy),
        keras.layers.Dense(32, name="down", dtype=policy),
        keras.layers.Dense(3, name="out")], name="mp")


def train(strategy, weights, policy="mixed_bfloat16"):
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build(policy)
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss="mse")
    history = models.fit_mlp(model, epochs=2)
    return model, history.history["loss"]


@pytest.fixture(scope="module")
def reference():
    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    model, losses = train(None, weights)
    fp32_model, fp32_losses = train(None, weights, policy="float32")
    bfloat16_error = {
        "losses": np.abs(np.subtract(losses, fp32_losses)).max(),
        **{a.path: np.abs(a.numpy() - b.numpy()).max()
           for a, b in zip(model.weights, fp32_model.weights)}}
    return weights, model, losses, bfloat16_error


@pytest.mark.parametrize("axes,rules,fsdp", [
    ({"data": 2, "model": 4}, {r".*up/kernel": (None, "model"),
                               r".*up/bias": ("model",),
                               r".*down/kernel": ("model", None)}, False),
    ({"data": 8}, None, True),
], ids=["tensor-parallel", "fsdp"])
def test_mixed_bfloat16_trains_like_one_device(reference, axes, rules, fsdp):
    weights, single, single_losses, bfloat16_error = reference
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules,
                                      fsdp=fsdp)
    model, losses = train(strategy, weights)
    assert np.abs(np.subtract(losses, single_losses)).max() <= \
        SLACK * bfloat16_error["losses"]
    for want, got in zip(single.weights, model.weights):
        assert got.dtype == "float32"  # weights stay float32
        error = np.abs(want.numpy() - got.numpy()).max()
        assert 0 < bfloat16_error[want.path]
        assert error <= SLACK * bfloat16_error[want.path], (want.path, error)
    assert all(v.dtype == "float32" for v in model.optimizer.variables
               if v.shape.rank)
    x, _ = models.mlp_data(n=16)
    hidden = keras.Model(model.inputs, model.get_layer("up").output)
    assert hidden.predict(x, batch_size=16, verbose=0).dtype == np.dtype(
        keras.backend.standardize_dtype("bfloat16"))
