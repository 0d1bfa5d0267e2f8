"""Dropout in training gives one device's masks on every mesh.

DTensor draws a split tensor's random numbers block by block (from the seed
and the device's place in the mesh), so Dropout on a data mesh kept other
elements than one device and trained elsewhere (found by the fuzzing). In a
tfpar step Keras' `random.dropout` draws its uniform numbers laid out whole
on every device and cuts the mask to the input's blocks
(`tfpar.spmd_patches._one_device_dropout_in_step`): the masks, the losses and
the weights are one device's, with the batch split over `data`, the
activations over `model` (Megatron's column-parallel output), or fsdp. A
pipeline's micro-batches draw their masks as one device with gradient
accumulation over as many micro-batches does.
"""

import contextlib

import keras
import numpy as np
import pytest

import tfpar

import models

RTOL = 1e-4
COLUMN = {r"up/kernel": (None, "model"), r"up/bias": ("model",),
          r"down/kernel": ("model", None)}


def build(noise_shape=None, rates=(0.5, 0.3)):
    """16 -> up(32, split by `model` under COLUMN) -> Dropout -> down(16)
    -> Dropout (noise_shape) -> out(3)."""
    x = keras.Input((16,))
    h = keras.layers.Dense(32, activation="tanh", name="up")(x)
    h = keras.layers.Dropout(rates[0], seed=1, name="drop_up")(h)
    h = keras.layers.Dense(16, activation="tanh", name="down")(h)
    h = keras.layers.Reshape((4, 4))(h)
    h = keras.layers.Dropout(rates[1], noise_shape=noise_shape, seed=2,
                             name="drop_down")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def fit_in_order(make_model, strategy, weights, pipeline=None,
                 accumulate=1):
    """`make_model()` (under `strategy`, a PipelineModel of it with
    `pipeline`) trained two epochs of SGD(0.1) in order from `weights`,
    batch 16 (16 / `accumulate` with `gradient_accumulation_steps=
    accumulate`): (losses, weights)."""
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = make_model()
        model.set_weights(weights)
        if pipeline:
            model = tfpar.PipelineModel(model, **pipeline)
        model.compile(optimizer=keras.optimizers.SGD(
            0.1, gradient_accumulation_steps=accumulate if accumulate > 1
            else None), loss="mse")
    losses = models.BatchLosses()
    x, y = models.mlp_data()
    model.fit(x, y, batch_size=16 // accumulate, epochs=2, shuffle=False,
              verbose=0, callbacks=[losses])
    # Keras logs the epoch's running mean: at every accumulated step.
    return np.array(losses.losses)[accumulate - 1::accumulate], \
        model.get_weights()


def train(strategy, weights, noise_shape=None, pipeline=None,
          rates=(0.5, 0.3), accumulate=1):
    return fit_in_order(lambda: build(noise_shape, rates), strategy, weights,
                        pipeline, accumulate)


@pytest.mark.parametrize("axes,kwargs,pipeline,noise_shape", [
    ({"data": 2}, {}, None, None),
    ({"data": 8}, dict(fsdp=True), None, (None, 1, 4)),
    ({"data": 2, "model": 4}, dict(rules=COLUMN), None, None),
    ({"pipe": 2, "data": 4}, {}, dict(num_microbatches=2), None),
], ids=["data2", "data8-fsdp-noise-shape", "data2xmodel4", "pipe2xdata4"])
def test_dropout_in_training_matches_one_device(axes, kwargs, pipeline,
                                                noise_shape):
    """A pipeline of m micro-batches draws one mask per micro-batch, as one
    device with `gradient_accumulation_steps=m` does (one seed per
    micro-batch, in order), and updates as it does: that is its oracle."""
    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    accumulate = pipeline["num_microbatches"] if pipeline else 1
    want_losses, want = train(None, weights, noise_shape,
                              accumulate=accumulate)
    devices = [f"CPU:{i}" for i in range(int(np.prod(list(axes.values()))))]
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes, devices=devices),
                                      **kwargs)
    got_losses, got = train(strategy, weights, noise_shape, pipeline)
    # The masks matter: one device without Dropout trains elsewhere.
    plain_losses, _ = train(None, weights, noise_shape, rates=(0.0, 0.0),
                            accumulate=accumulate)
    assert models.relative_error(want_losses, plain_losses) > 1e-2
    assert models.relative_error(want_losses, got_losses) < RTOL, (
        want_losses, got_losses)
    for a, b in zip(want, got):
        assert models.relative_error(a, b) < RTOL

