"""Keras' random layers in training draw one device's numbers on every mesh.

DTensor draws a split tensor's random numbers block by block (from the seed
and the device's place in the mesh), so GaussianNoise on a data mesh added
other noise than one device. In a tfpar step Keras' TF `random.normal`,
`uniform`, `truncated_normal` and `randint` draw their numbers laid out
whole on every device, cut to the consumer's blocks where used
(`tfpar.spmd_patches._one_device_draw_in_step`, as Dropout's mask,
tests/test_dropout_parity.py): GaussianNoise, GaussianDropout,
AlphaDropout, SpatialDropout1D (Keras' dropout) and a custom layer drawing
with a `SeedGenerator` train as one device, with the batch split over
`data`, the activations over `model` (Megatron's column-parallel output),
fsdp, or a pipeline's micro-batches (as one device with
`gradient_accumulation_steps=m`, one seed per micro-batch in order).
Keras' preprocessing layers draw with `random.uniform` too: RandomFlip
(whose `numpy.flip` a step runs as gathers, DTensor cannot lay out
ReverseV2) and RandomContrast train as one device on data meshes;
RandomCrop too, also on data x model (Keras 3.15 does not crop at
inference, keras-team/keras#21868, which failed every strategy's build:
under tfpar the inference crop is the centred one Keras documents, and a
step cuts the drawn window by gathers). `keras.random.shuffle` draws one
device's permutation (also recomputed). RandomRotation, RandomZoom,
RandomTranslation and RandomShear transform by TF's
ImageProjectiveTransformV3, which DTensor cannot lay out: a step gathers
(`spmd_image_ops.affine_transform_by_gather`, equal to TF's op here) and they
train as one device on data=8; RandomHue and RandomSaturation too (TF's
RGBToHSV and HSVToRGB as elementwise ops). `gamma`, `beta` and `binomial`
are refused in a step with a ValueError (DTensor 2.21 cannot lay out
their TF ops at all, tests/dtensor_random_gamma_repro.py).
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import spmd_image_ops

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


def build_geometric(seed=1):
    """(8, 8, 2) images -> RandomRotation (reflect, bilinear) ->
    RandomZoom (wrap) -> RandomTranslation (constant fill) -> RandomShear
    (nearest fill and interpolation) -> Conv2D -> out(3): each transforms
    by Keras' `image.affine_transform` (TF's ImageProjectiveTransformV3,
    which DTensor 2.21 cannot lay out; a step gathers)."""
    x = keras.Input((8, 8, 2))
    h = keras.layers.RandomRotation(0.2, seed=seed, name="rotation")(x)
    h = keras.layers.RandomZoom(0.3, fill_mode="wrap", seed=seed + 1,
                                name="zoom")(h)
    h = keras.layers.RandomTranslation(0.2, 0.2, fill_mode="constant",
                                       fill_value=0.5, seed=seed + 2,
                                       name="translation")(h)
    h = keras.layers.RandomShear(0.3, 0.3, fill_mode="nearest",
                                 interpolation="nearest", seed=seed + 3,
                                 name="shear")(h)
    h = keras.layers.RandomPerspective(0.8, 0.5, seed=seed + 4,
                                       name="perspective")(h)
    h = keras.layers.Conv2D(4, 3, name="conv")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def build_channels_first(seed=1):
    """(3, 8, 8) channels-first images in [0, 1] -> RandomPerspective ->
    RandomRotation -> RandomHue -> Conv2D -> AveragePooling2D (its
    gradient: AvgPoolGrad) -> out(3), every layer channels first: the
    stand-ins move channels last and back."""
    first = dict(data_format="channels_first")
    x = keras.Input((3, 8, 8))
    h = keras.layers.Rescaling(0.25, 0.5)(x)
    h = keras.layers.RandomPerspective(0.8, 0.5, seed=seed, **first)(h)
    h = keras.layers.RandomRotation(0.2, seed=seed + 1, **first)(h)
    h = keras.layers.RandomHue(0.5, value_range=(0, 1), seed=seed + 2,
                               **first)(h)
    h = keras.layers.Conv2D(4, 3, name="conv", **first)(h)
    h = keras.layers.AveragePooling2D(2, padding="same", **first)(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def build_colour(seed=1):
    """(8, 8, 3) images in [0, 1] -> RandomHue -> RandomSaturation ->
    Conv2D -> out(3): both convert to HSV and back (TF's RGBToHSV, which
    DTensor 2.21 cannot lay out; a step computes it in elementwise ops)."""
    x = keras.Input((8, 8, 3))
    h = keras.layers.Rescaling(0.25, 0.5)(x)
    h = keras.layers.RandomHue(0.5, value_range=(0, 1), seed=seed,
                               name="hue")(h)
    h = keras.layers.RandomSaturation(0.8, value_range=(0, 1),
                                      seed=seed + 1, name="saturation")(h)
    h = keras.layers.Conv2D(4, 3, name="conv")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def train_images(strategy, weights, seed=1, build=build_images):
    """Two epochs of SGD(0.05) in order, batch 16: (losses, weights)."""
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build(seed)
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.RandomState(0)
    x = rng.normal(size=(64, *model.input_shape[1:])).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    losses = models.BatchLosses()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[losses])
    return np.array(losses.losses), model.get_weights()


@pytest.mark.parametrize("axes,build", [
    ({"data": 2}, build_images), ({"data": 8}, build_images),
    ({"data": 8}, build_geometric), ({"data": 8}, build_colour),
    ({"data": 8}, build_channels_first)],
    ids=["data2", "data8", "geometric-data8", "colour-data8",
         "channels-first-data8"])
def test_random_image_layers_match_one_device(axes, build):
    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    want_losses, want = train_images(None, weights, build=build)
    devices = [f"CPU:{i}" for i in range(int(np.prod(list(axes.values()))))]
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes, devices=devices))
    got_losses, got = train_images(strategy, weights, build=build)
    # The draws matter: other seeds train elsewhere on one device.
    other_losses, _ = train_images(None, weights, seed=11, build=build)
    assert models.relative_error(want_losses, other_losses) > 1e-2
    assert models.relative_error(want_losses, got_losses) < RTOL, (
        want_losses, got_losses)
    for a, b in zip(want, got):
        assert models.relative_error(a, b) < RTOL


class Shuffled(keras.layers.Layer):
    """x shuffled along `axis` by `keras.random.shuffle` in training."""

    def __init__(self, axis, **kwargs):
        super().__init__(**kwargs)
        self.axis = axis
        self.seed_generator = keras.random.SeedGenerator(5)

    def call(self, x, training=False):
        if not training:
            return x
        return keras.random.shuffle(x, axis=self.axis,
                                    seed=self.seed_generator)


@pytest.mark.parametrize("axes,kwargs", [
    pytest.param({"data": 2}, {}, marks=pytest.mark.slow),
    ({"data": 2, "model": 4}, dict(rules=COLUMN))],
    ids=["data2", "data2xmodel4"])
def test_shuffle_matches_one_device(axes, kwargs):
    """keras.random.shuffle of the batch (split over data) and of the
    features (split over model under COLUMN) in one model: one device's
    permutations (its uniform numbers drawn whole in a step,
    `spmd_patches._one_device_shuffle_in_step`; here DTensor laid Keras' own
    draw out whole too, and it matched before: what the patch changes is
    recomputation, tests/test_recompute.py)."""
    def build(axis=0):
        x = keras.Input((16,))
        h = keras.layers.Dense(32, activation="tanh", name="up")(x)
        if axis is not None:
            h = Shuffled(1, name="features")(Shuffled(0, name="batch")(h))
        h = keras.layers.Dense(16, activation="tanh", name="down")(h)
        return keras.Model(x, keras.layers.Dense(3, name="out")(h))

    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    fit = test_dropout_parity.fit_in_order
    want_losses, want = fit(build, None, weights)
    devices = [f"CPU:{i}" for i in range(int(np.prod(list(axes.values()))))]
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes, devices=devices),
                                      **kwargs)
    got_losses, got = fit(build, strategy, weights)
    plain_losses, _ = fit(lambda: build(None), None, weights)
    assert models.relative_error(want_losses, plain_losses) > 1e-2
    assert models.relative_error(want_losses, got_losses) < RTOL, (
        want_losses, got_losses)
    for a, b in zip(want, got):
        assert models.relative_error(a, b) < RTOL


class Refused(keras.layers.Layer):
    """x + keras.random.<name>(...) in training."""

    DRAWS = {"gamma": lambda shape, seed: keras.random.gamma(
                 shape, 2.0, seed=seed),
             "beta": lambda shape, seed: keras.random.beta(
                 shape, 2.0, 3.0, seed=seed),
             "binomial": lambda shape, seed: keras.random.binomial(
                 shape, 3.0, 0.5, seed=seed)}

    def __init__(self, draw, **kwargs):
        super().__init__(**kwargs)
        self.draw = draw
        self.seed_generator = keras.random.SeedGenerator(5)

    def call(self, x, training=False):
        if not training:
            return x
        return x + self.DRAWS[self.draw](keras.ops.shape(x),
                                         self.seed_generator)


@pytest.mark.parametrize("draw", sorted(Refused.DRAWS))
def test_gamma_beta_binomial_are_refused_before_the_first_step(draw):
    """DTensor 2.21 cannot lay out TF's gamma and binomial draws, not even
    replicated (tests/dtensor_random_gamma_repro.py): refused with a
    ValueError naming Keras' op, the layer and what to do, before any
    weight changes (it was DTensor's compile error, advising to change
    the weights' layouts)."""
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2}, devices=["CPU:0", "CPU:1"]))
    with strategy.scope():
        x = keras.Input((16,))
        h = Refused(draw, name="drawing")(keras.layers.Dense(8)(x))
        model = keras.Model(x, keras.layers.Dense(3)(h))
        model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    with pytest.raises(ValueError, match=(
            rf"keras.random.{draw} cannot run in a tfpar step(?s:.*)input "
            rf"pipeline(?s:.*)Received: keras.random.{draw} called under "
            r"'.*drawing")):
        models.fit_mlp(model)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Outside a step Keras' op runs (here: eagerly, on one device).
    assert keras.ops.shape(Refused.DRAWS[draw]((2, 3), 1)) == (2, 3)


def build_cropped(crop=True, seed=1):
    """(8, 8, 2) images -> RandomCrop(6, 6) -> Conv2D -> up(8) -> out(3);
    `crop` False: (6, 6, 2) images in, no crop layer."""
    x = keras.Input((8, 8, 2) if crop else (6, 6, 2))
    h = keras.layers.RandomCrop(6, 6, seed=seed, name="crop")(x) if crop else x
    h = keras.layers.Conv2D(4, 3, name="conv")(h)
    h = keras.layers.Dense(8, activation="tanh", name="up")(
        keras.layers.Flatten()(h))
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


@pytest.mark.parametrize("axes,rules", [
    ({"data": 2}, None), ({"data": 2, "model": 4}, COLUMN)],
    ids=["data2", "data2xmodel4"])
def test_random_crop_matches_one_device(axes, rules):
    """RandomCrop failed before training under tfpar (and under
    MirroredStrategy): Keras 3.15 does not crop at inference
    (keras-team/keras#21868) and builds the model under a strategy with an
    inference call. Under tfpar it trains as one device (its drawn windows
    cut by gathers in a step) and predicts with the centred crop Keras
    documents (one device's `predict` fails there)."""
    rules = rules and {r"up/kernel": (None, "model"), r"up/bias": ("model",),
                       r"out/kernel": ("model", None)}
    rng = np.random.RandomState(0)
    x = rng.normal(size=(64, 8, 8, 2)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")

    def fit(strategy, weights, seed=1):
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = build_cropped(seed=seed)
            model.set_weights(weights)
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        losses = models.BatchLosses()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[losses])
        return np.array(losses.losses), model

    keras.utils.set_random_seed(0)
    weights = build_cropped().get_weights()
    want_losses, single = fit(None, weights)
    devices = [f"CPU:{i}" for i in range(int(np.prod(list(axes.values()))))]
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes, devices=devices),
                                      rules=rules)
    got_losses, model = fit(strategy, weights)
    other_losses, _ = fit(None, weights, seed=11)  # the windows matter
    assert models.relative_error(want_losses, other_losses) > 1e-3
    assert models.relative_error(want_losses, got_losses) < RTOL, (
        want_losses, got_losses)
    for a, b in zip(single.get_weights(), model.get_weights()):
        assert models.relative_error(a, b) < RTOL
    # Inference: the whole 8x8 image (its 1:1 window) resized to 6x6.
    uncropped = build_cropped(crop=False)
    uncropped.set_weights(model.get_weights())
    resized = keras.ops.image.resize(x[:8], (6, 6))
    np.testing.assert_allclose(model.predict(x[:8], verbose=0),
                               uncropped.predict(resized, verbose=0),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
@pytest.mark.parametrize("fill_mode", ["constant", "nearest", "wrap",
                                       "reflect"])
def test_affine_transform_by_gather_is_tf_op(interpolation, fill_mode):
    """`spmd_image_ops.affine_transform_by_gather` equals TF's
    ImageProjectiveTransformV3 on 30 random images (sizes 1-9, so the
    1-pixel edge cases too) and projective transforms (some with k = 0
    somewhere, some one transform for the whole batch)."""
    rng = np.random.default_rng(0)
    for trial in range(30):
        height, width = (int(n) for n in rng.integers(1, 10, 2))
        images = rng.normal(size=(3, height, width, 2)).astype("float32")
        scale = np.array([1, 1, 4, 1, 1, 4, 0.2, 0.2], "float32")
        transforms = (rng.normal(size=(3 if trial % 2 else 1, 8))
                      * scale).astype("float32")
        if trial % 5 == 0:
            transforms[:, 6:] = 0.0
        if trial % 7 == 0:  # k = c0·x + c1·y + 1 = 0 at (x, y) = (1, 0)
            transforms[:, 6:] = [-1.0, 0.0]
        want = tf.raw_ops.ImageProjectiveTransformV3(
            images=images, transforms=transforms,
            output_shape=[height, width], fill_value=0.5,
            interpolation=interpolation.upper(), fill_mode=fill_mode.upper())
        got = spmd_image_ops.affine_transform_by_gather(
            images, transforms, interpolation, fill_mode, 0.5)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                   err_msg=f"trial {trial}")


def test_colour_conversions_by_ops_are_tf_ops():
    """`spmd_image_ops.rgb_to_hsv_by_ops` and `hsv_to_rgb_by_ops` equal TF's
    RGBToHSV and HSVToRGB on random colours, greys (range 0: hue 0),
    black (value 0) and ties between channels."""
    rng = np.random.default_rng(0)
    rgb = rng.uniform(size=(200, 3)).astype("float32")
    rgb[:10] = rgb[:10, :1]  # greys
    rgb[10:12] = 0.0  # black
    rgb[12:20, 1] = rgb[12:20, 0]  # red == green
    rgb[20:28, 2] = rgb[20:28, 1]  # green == blue
    hsv = tf.image.rgb_to_hsv(rgb)
    np.testing.assert_allclose(spmd_image_ops.rgb_to_hsv_by_ops(rgb), hsv,
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(spmd_image_ops.hsv_to_rgb_by_ops(hsv),
                               tf.image.hsv_to_rgb(hsv), rtol=1e-6,
                               atol=1e-7)
