"""Layers whose result depends on the whole batch, in a pipeline.

A pipeline runs each batch as m micro-batches and sums their gradients, so
a layer that normalises by the batch's statistics (BatchNormalization in
training) or adds a loss that is not a mean over the batch (`add_loss` of
a sum) sees micro-batches: one device on the whole batch is not the
oracle for those. What they equal is Keras' own gradient accumulation:
one device with `gradient_accumulation_steps=m` on batches of the
micro-batch's size (checked here, final weights within 1e-4 relative; BN's
moving statistics updated per micro-batch in order). Losses that are means
over the batch (Keras divides activity regularisers by the batch size)
and weight regularisers are in parity with one device on the whole batch
(`tests/test_pipeline.py`).
"""
import keras
import numpy as np
import pytest

import tfpar

import models

M = 2  # micro-batches


class AddsSumOfSquares(keras.layers.Layer):
    """Adds 0.01 × the sum (not the mean) of its input's squares."""

    def call(self, h):
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(h)))
        return h


def build(batch_layer):
    x = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="up")(x)
    h = batch_layer()(h)
    h = keras.layers.Dense(16, activation="tanh", name="mid")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


LAYERS = {"batch-norm": lambda: keras.layers.BatchNormalization(name="bn"),
          "add-loss-of-a-sum": lambda: AddsSumOfSquares(name="adds")}


def _data():
    rng = np.random.RandomState(0)
    return (rng.normal(size=(32, 8)).astype("float32"),
            rng.normal(size=(32, 3)).astype("float32"))


def _trained(model, weights, batch_size, accumulation=None):
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(
        0.1, gradient_accumulation_steps=accumulation), loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False,
              verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_pipeline_trains_as_keras_gradient_accumulation(layer):
    keras.utils.set_random_seed(0)
    weights = build(LAYERS[layer]).get_weights()
    whole = _trained(build(LAYERS[layer]), weights, 16)
    accumulated = _trained(build(LAYERS[layer]), weights, 16 // M,
                           accumulation=M)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        pipe = tfpar.PipelineModel(build(LAYERS[layer]), num_microbatches=M,
                                   stage_boundaries=["mid"])
    got = _trained(pipe, weights, 16)
    for want, value in zip(accumulated, got):
        assert models.relative_error(want, value) < 1e-4
    # ... and the whole batch on one device is not that: the layer does
    # depend on the batch.
    assert max(models.relative_error(a, b)
               for a, b in zip(whole, got)) > 1e-2
