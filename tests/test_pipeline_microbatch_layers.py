"""Layers whose result depends on the whole batch, and Keras masks, in a
pipeline.

A pipeline runs each batch as m micro-batches and sums their gradients, so
a layer that normalises by the batch's statistics (BatchNormalization in
training), a loss a layer adds that is not a mean over the batch
(`add_loss` of a sum), a loss over the whole batch (Keras' Dice and
Tversky: ratios of sums over every sample) and random draws (Dropout
draws each micro-batch's mask) see micro-batches: one device on the whole
batch is not the oracle for those. What they equal is Keras' own gradient accumulation:
one device with `gradient_accumulation_steps=m` on batches of the
micro-batch's size (checked here, final weights within 1e-4 relative; BN's
moving statistics updated per micro-batch in order). Losses that are means
over the batch (Keras divides activity regularisers by the batch size)
and weight regularisers are in parity with one device on the whole batch
(`tests/test_pipeline.py`).

Keras masks (`Embedding(mask_zero=True)`) cross a stage cut with their
tensors: MultiHeadAttention reads its inputs' masks from the values
themselves, and attended to padding on the stage after the cut (losses 2%
and predictions 48% off one device's, found 2026-12-07).
"""
import keras
import numpy as np
import pytest

import tfpar

import fuzzing
import hub_models
import models

M = 2  # micro-batches


class AddsSumOfSquares(keras.layers.Layer):
    """Adds 0.01 × the sum (not the mean) of its input's squares."""

    def call(self, h):
        self.add_loss(0.01 * keras.ops.sum(keras.ops.square(h)))
        return h


def build(batch_layer=None):
    """x -> up -> [batch_layer] -> mid -> out (sigmoid: Dice's range)."""
    x = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="up")(x)
    if batch_layer is not None:
        h = batch_layer()(h)
    h = keras.layers.Dense(16, activation="tanh", name="mid")(h)
    return keras.Model(x, keras.layers.Dense(3, activation="sigmoid",
                                             name="out")(h))


# (the layer after `up`, the loss): BatchNormalization's statistics, a
# sum added in call(), Dice, a ratio of sums over the whole batch, and
# Dropout, whose draws are made per micro-batch.
CASES = {
    "batch-norm": (lambda: keras.layers.BatchNormalization(name="bn"), "mse"),
    "add-loss-of-a-sum": (lambda: AddsSumOfSquares(name="adds"), "mse"),
    "dice-loss": (None, "dice"),
    "dropout": (lambda: keras.layers.Dropout(0.3, name="drop"), "mse"),
}


def _data():
    rng = np.random.RandomState(0)
    return (rng.normal(size=(32, 8)).astype("float32"),
            (rng.uniform(size=(32, 3)) > 0.5).astype("float32"))


def _trained(model, weights, batch_size, loss, accumulation=None):
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(
        0.1, gradient_accumulation_steps=accumulation), loss=loss)
    x, y = _data()
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False,
              verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_pipeline_trains_as_keras_gradient_accumulation(case):
    layer, loss = CASES[case]
    keras.utils.set_random_seed(0)
    weights = build(layer).get_weights()
    keras.utils.set_random_seed(1)  # each model: the same dropout seeds
    whole = _trained(build(layer), weights, 16, loss)
    keras.utils.set_random_seed(1)
    accumulated = _trained(build(layer), weights, 16 // M, loss,
                           accumulation=M)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    keras.utils.set_random_seed(1)
    with strategy.scope():
        pipe = tfpar.PipelineModel(build(layer), num_microbatches=M,
                                   stage_boundaries=["mid"])
    got = _trained(pipe, weights, 16, loss)
    for want, value in zip(accumulated, got):
        assert models.relative_error(want, value) < 1e-4
    # ... and the whole batch on one device is not that: the layer or the
    # loss does depend on the batch.
    assert max(models.relative_error(a, b)
               for a, b in zip(whole, got)) > 1e-3


def test_a_loss_added_before_the_last_stage_is_loss_scaled():
    """Under a LossScaleOptimizer the loss an earlier stage adds is scaled
    as the last stage's loss is (its gradient was divided by the loss
    scale: stage 0's weights 3% and its bias 35% off one device's after
    one step, found 2026-12-07). One micro-batch: the batch is the
    micro-batch, and one device on it is the oracle."""
    layer = CASES["add-loss-of-a-sum"][0]
    keras.utils.set_random_seed(0)
    weights = build(layer).get_weights()

    def loss_scaled():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))

    x, y = _data()
    single = build(layer)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        pipe = tfpar.PipelineModel(build(layer), num_microbatches=1,
                                   stage_boundaries=["mid"])
    for model in (single, pipe):
        model.set_weights(weights)
        model.compile(optimizer=loss_scaled(), loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for want, got in zip(single.get_weights(), pipe.get_weights()):
        assert models.relative_error(want, got) < 1e-4


def test_a_keras_mask_crosses_the_stage_cut():
    """One epoch of SGD, as one device (attention's key bias, whose true
    gradient is zero, to float32's own noise: `fuzzing.assert_parity`
    against float64); then the predictions. (Across hosts:
    tests/test_hosts_pipeline.py.)"""
    keras.utils.set_random_seed(0)
    weights = models.masked_attention().get_weights()
    x, y = models.padded_tokens()
    single = models.masked_attention()
    want = fuzzing.train(single, x, y, weights, models.BatchLosses(),
                         keras.optimizers.SGD(0.1))
    exact = fuzzing.train_in_float64(models.masked_attention, x, y, weights,
                                     keras.optimizers.SGD(0.1))
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        pipe = tfpar.PipelineModel(models.masked_attention(), num_microbatches=M,
                                   stage_boundaries=["attend"])
    got = fuzzing.train(pipe, x, y, weights, models.BatchLosses(),
                        keras.optimizers.SGD(0.1))
    fuzzing.assert_parity(want[0], got[0], want[1], got[1], exact=exact)
    assert models.relative_error(
        single.predict(x, batch_size=16, verbose=0),
        pipe.predict(x, batch_size=16, verbose=0)) < 1e-4


def test_a_router_loss_on_the_stage_reading_a_tied_table():
    """keras-hub Mixtral (8 experts, router loss 0.02) cut before its
    second block: the last stage reads the token embedding's table again
    (its ReversibleEmbedding's reverse call), which tfpar reads through a
    `keras.StatelessScope`; that scope dropped the router loss the second
    block adds, so the pipeline trained without it (weights 1% off,
    found 2026-12-07). Weights and loss as Keras' gradient accumulation
    over the M micro-batches on one device (the router loss is each
    micro-batch's), SGD, two steps of batch 16."""
    weights = hub_models.build("mixtral").get_weights()
    x, y = hub_models.data("mixtral", batch=32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = hub_models.build("mixtral")
    reference.set_weights(weights)
    reference.compile(optimizer=keras.optimizers.SGD(
        gradient_accumulation_steps=M), loss=loss)
    expected = reference.fit(x, y, batch_size=16 // M, shuffle=False,
                             verbose=0).history["loss"]
    with tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4})).scope():
        pipe = tfpar.PipelineModel(hub_models.build("mixtral"), M,
                                   stage_boundaries=["transformer_layer_1"])
        pipe.set_weights(weights)
        pipe.compile(optimizer="sgd", loss=loss)
    got = pipe.fit(x, y, batch_size=16, shuffle=False,
                   verbose=0).history["loss"]
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    for variable, want, have in zip(reference.weights,
                                    reference.get_weights(),
                                    pipe.get_weights()):
        assert models.relative_error(want, have) < 1e-4, variable.path
