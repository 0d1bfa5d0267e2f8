"""Keras' random layers in training draw one device's numbers on every mesh.

DTensor draws a split tensor's random numbers block by block (from the seed
and the device's place in the mesh), so GaussianNoise on a data mesh added
other noise than one device. In a tfpar step Keras' TF `random.normal`,
`uniform`, `truncated_normal` and `randint` draw their numbers laid out
whole on every device, cut to the consumer's blocks where used
(`tfpar._compat._one_device_draw_in_step`, as Dropout's mask,
tests/test_dropout_parity.py): GaussianNoise, GaussianDropout,
AlphaDropout, SpatialDropout1D (Keras' dropout) and a custom layer drawing
with a `SeedGenerator` train as one device, with the batch split over
`data`, the activations over `model` (Megatron's column-parallel output),
fsdp, or a pipeline's micro-batches (as one device with
`gradient_accumulation_steps=m`, one seed per micro-batch in order).
Keras' preprocessing layers draw with `random.uniform` too: RandomFlip
(whose `numpy.flip` a step runs as gathers, DTensor cannot lay out
ReverseV2) and RandomContrast train as one device on data meshes.
"""

import contextlib

import keras
import numpy as np
import pytest

import tfpar

import models
import test_dropout_parity

RTOL = 1e-4
COLUMN = {r"up/kernel": (None, "model"), r"up/bias": ("model",),
          r"down/kernel": ("model", None)}


class Draws(keras.layers.Layer):
    """x * (1 + s * normal) * (randint(0, 2) or 1) + s * uniform +
    s * truncated_normal, every number from one SeedGenerator in training
    (the mask `randint` keeps a half of the elements where s > 0)."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, x, training=False):
        if not training:
            return x
        shape, s, seed = keras.ops.shape(x), self.scale, self.seed_generator
        kept = keras.random.randint(shape, 0, 2, seed=seed) if s else 1
        return (x * (1 + s * keras.random.normal(shape, seed=seed))
                * keras.ops.cast(kept, x.dtype)
                + s * keras.random.uniform(shape, -1, 1, seed=seed)
                + s * keras.random.truncated_normal(shape, seed=seed))


def build(scale=1.0):
    """16 -> up(32, split by `model` under COLUMN) -> GaussianNoise ->
    GaussianDropout -> Draws -> AlphaDropout -> down(16) -> SpatialDropout1D
    over (4, 4) -> out(3); `scale` 0 turns every draw off."""
    x = keras.Input((16,))
    h = keras.layers.Dense(32, activation="tanh", name="up")(x)
    h = keras.layers.GaussianNoise(0.3 * scale, seed=1, name="noise")(h)
    h = keras.layers.GaussianDropout(0.3 * scale, seed=2, name="gdrop")(h)
    h = Draws(0.2 * scale, name="draws")(h)
    h = keras.layers.AlphaDropout(0.2 * scale, seed=3, name="adrop")(h)
    h = keras.layers.Dense(16, activation="tanh", name="down")(h)
    h = keras.layers.Reshape((4, 4))(h)
    h = keras.layers.SpatialDropout1D(0.3 * scale, seed=4, name="sdrop")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def train(strategy, weights, pipeline=None, scale=1.0, accumulate=1):
    return test_dropout_parity.fit_in_order(
        lambda: build(scale), strategy, weights, pipeline, accumulate)


@pytest.mark.parametrize("axes,kwargs,pipeline", [
    ({"data": 2}, {}, None),
    ({"data": 8}, dict(fsdp=True), None),
    ({"data": 2, "model": 4}, dict(rules=COLUMN), None),
    ({"pipe": 2, "data": 4}, {}, dict(num_microbatches=2)),
], ids=["data2", "data8-fsdp", "data2xmodel4", "pipe2xdata4"])
def test_random_layers_in_training_match_one_device(axes, kwargs, pipeline):
    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    accumulate = pipeline["num_microbatches"] if pipeline else 1
    want_losses, want = train(None, weights, accumulate=accumulate)
    devices = [f"CPU:{i}" for i in range(int(np.prod(list(axes.values()))))]
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes, devices=devices),
                                      **kwargs)
    got_losses, got = train(strategy, weights, pipeline)
    # The draws matter: one device without them trains elsewhere.
    plain_losses, _ = train(None, weights, scale=0.0, accumulate=accumulate)
    assert models.relative_error(want_losses, plain_losses) > 1e-2
    assert models.relative_error(want_losses, got_losses) < RTOL, (
        want_losses, got_losses)
    for a, b in zip(want, got):
        assert models.relative_error(a, b) < RTOL


def build_images(seed=1):
    """(8, 8, 2) images -> RandomFlip -> RandomContrast -> Conv2D -> out(3).
    Keras' TF preprocessing layers draw with `random.uniform`; RandomFlip
    flips by `numpy.flip`, which a step runs as gathers (DTensor cannot lay
    out ReverseV2)."""
    x = keras.Input((8, 8, 2))
    h = keras.layers.RandomFlip(seed=seed, name="flip")(x)
    h = keras.layers.RandomContrast(0.5, value_range=(-3, 3), seed=seed + 1,
                                    name="contrast")(h)
    h = keras.layers.Conv2D(4, 3, name="conv")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def train_images(strategy, weights, seed=1):
    """Two epochs of SGD(0.05) in order, batch 16: (losses, weights)."""
    rng = np.random.RandomState(0)
    x = rng.normal(size=(64, 8, 8, 2)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build_images(seed)
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    losses = models.BatchLosses()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[losses])
    return np.array(losses.losses), model.get_weights()


@pytest.mark.parametrize("axes", [{"data": 2}, {"data": 8}],
                         ids=["data2", "data8"])
def test_random_flip_and_contrast_match_one_device(axes):
    keras.utils.set_random_seed(0)
    weights = build_images().get_weights()
    want_losses, want = train_images(None, weights)
    devices = [f"CPU:{i}" for i in range(int(np.prod(list(axes.values()))))]
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes, devices=devices))
    got_losses, got = train_images(strategy, weights)
    # The draws matter: other seeds train elsewhere on one device.
    other_losses, _ = train_images(None, weights, seed=11)
    assert models.relative_error(want_losses, other_losses) > 1e-2
    assert models.relative_error(want_losses, got_losses) < RTOL, (
        want_losses, got_losses)
    for a, b in zip(want, got):
        assert models.relative_error(a, b) < RTOL
