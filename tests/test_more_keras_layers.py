"""Keras layers no other test named train on data=8 as on one device.

On 2026-12-06, 86 of Keras 3's 163 layer classes were named by no test
(about 20 of them aliases). Asked of the rest, each trained as one device
but three: MelSpectrogram (Keras' centred STFT pads by reflection:
`MirrorPad`, which DTensor 2.21 cannot lay out; now a gather in a step,
`tests/test_spmd_linear_attention_ops.py`), Equalization and RandAugment
(below). Randomised layers are seeded, as Keras draws each model's seeds
anew. MelSpectrogram and Equalization's case run by default; the rest are
slow.

Not here, and why: MixUp, CutMix and AugMix draw from `keras.random.beta`
or `gamma`, refused in a step with an error naming the layer and the fix
(`tests/test_random_layers.py`); Equalization, and RandAugment through it,
count a histogram with `DenseBincount`, which DTensor cannot lay out (left;
the error names the op; Equalization's test below);
RandomElasticTransform's step does not compile (a Reshape of a shape
unknown when traced; it fails naming the op,
tests/test_compile_errors.py); STFTSpectrogram needs scipy, not
installed; the backend wrappers (JaxLayer, FlaxLayer, TorchModuleWrapper,
TFSMLayer) and string preprocessing (TextVectorization, StringLookup,
Hashing, ...) are not model layers a step trains.
"""

import keras
import numpy as np
import pytest

import models

L = keras.layers
IMAGE = (8, 8, 3)


def _merged(merge):
    """A layer of one's own joining two Dense branches of its input with
    `merge()` (the merging layers take a list)."""
    class Merged(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.left, self.right = L.Dense(4), L.Dense(4)
            self.merge = merge()

        def call(self, x):
            return self.merge([self.left(x), self.right(x)])

    return Merged


# name: (input shape without the batch, the layer)
LAYERS = {
    "MelSpectrogram": ((256,), lambda: L.MelSpectrogram(
        fft_length=64, sequence_stride=32, num_mel_bins=8)),
    "AdaptiveAveragePooling1D": ((10, 3), lambda: L.AdaptiveAveragePooling1D(
        4)),
    "AdaptiveAveragePooling2D": ((6, 6, 3), lambda: L.AdaptiveAveragePooling2D(
        4)),
    "AdaptiveAveragePooling3D": ((4, 4, 4, 2),
                                 lambda: L.AdaptiveAveragePooling3D(3)),
    "AdaptiveMaxPooling1D": ((10, 3), lambda: L.AdaptiveMaxPooling1D(4)),
    "AdaptiveMaxPooling2D": ((6, 6, 3), lambda: L.AdaptiveMaxPooling2D(4)),
    "AdaptiveMaxPooling3D": ((4, 4, 4, 2), lambda: L.AdaptiveMaxPooling3D(3)),
    "ConvLSTM3D": ((3, 3, 3, 3, 2), lambda: L.ConvLSTM3D(2, 2)),
    "Cropping1D": ((10, 3), lambda: L.Cropping1D(2)),
    "UpSampling1D": ((5, 3), lambda: L.UpSampling1D(2)),
    "ZeroPadding3D": ((3, 3, 3, 2), lambda: L.ZeroPadding3D(1)),
    "ELU": ((10,), L.ELU),
    "LeakyReLU": ((10,), L.LeakyReLU),
    "PReLU": ((10,), L.PReLU),
    "PReLU_shared_axes": ((4, 5, 3), lambda: L.PReLU(shared_axes=[1, 2])),
    "RepeatVector": ((6,), lambda: L.RepeatVector(3)),
    "UnitNormalization": ((10,), L.UnitNormalization),
    "SpectralNormalization": ((10,), lambda: L.SpectralNormalization(
        L.Dense(6))),
    "TimeDistributed": ((4, 5), lambda: L.TimeDistributed(L.Dense(6))),
    "TimeDistributed_Conv2D": ((3, 6, 6, 2), lambda: L.TimeDistributed(
        L.Conv2D(3, 3))),
    "ActivityRegularization": ((10,), lambda: L.ActivityRegularization(
        0.01, 0.01)),
    "AdditiveAttention": ((10,), _merged(L.AdditiveAttention)),
    "Dot": ((10,), _merged(lambda: L.Dot(axes=1))),
    "Maximum": ((10,), _merged(L.Maximum)),
    "Minimum": ((10,), _merged(L.Minimum)),
    "Multiply": ((10,), _merged(L.Multiply)),
    "Subtract": ((10,), _merged(L.Subtract)),
    "StackedRNNCells": ((5, 3), lambda: L.RNN(L.StackedRNNCells(
        [L.LSTMCell(4), L.GRUCell(3), L.SimpleRNNCell(2)]))),
    "SpatialDropout3D": ((3, 3, 3, 2), lambda: L.SpatialDropout3D(
        0.3, seed=1)),
    "RandomBrightness": (IMAGE, lambda: L.RandomBrightness(
        0.3, value_range=(-3, 3), seed=1)),
    "RandomColorDegeneration": (IMAGE, lambda: L.RandomColorDegeneration(
        0.5, value_range=(-3, 3), seed=1)),
    "RandomColorJitter": (IMAGE, lambda: L.RandomColorJitter(
        value_range=(-3, 3), brightness_factor=0.2, contrast_factor=0.2,
        saturation_factor=0.5, hue_factor=0.2, seed=1)),
    "RandomErasing": (IMAGE, lambda: L.RandomErasing(
        factor=1.0, value_range=(-3, 3), seed=1)),
    "RandomGaussianBlur": (IMAGE, lambda: L.RandomGaussianBlur(
        factor=1.0, value_range=(-3, 3), seed=1)),
    "RandomGrayscale": (IMAGE, lambda: L.RandomGrayscale(0.5, seed=1)),
    "RandomInvert": (IMAGE, lambda: L.RandomInvert(
        0.5, value_range=(-3, 3), seed=1)),
    "RandomSharpness": (IMAGE, lambda: L.RandomSharpness(
        0.5, value_range=(-3, 3), seed=1)),
    "Solarization": (IMAGE, lambda: L.Solarization(
        0.5, value_range=(-3, 3), seed=1)),
    "CenterCrop": (IMAGE, lambda: L.CenterCrop(6, 6)),
    "AutoContrast": (IMAGE, lambda: L.AutoContrast(value_range=(-3, 3))),
}


@pytest.mark.parametrize("name", [
    name if name == "MelSpectrogram" else pytest.param(
        name, marks=pytest.mark.slow) for name in LAYERS])
def test_keras_layer_trains_as_one_device(name):
    models.assert_layer_trains_as_one_device(*LAYERS[name])


class _Equalized(L.Layer):
    """`Equalization` called in a layer's own `call`, where it runs."""
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.equalization = L.Equalization(value_range=(-3, 3))

    def call(self, images):
        return self.equalization(images, training=True)


def test_a_layer_keras_leaves_out_of_the_model_is_refused_not_passed():
    """Keras 3.15's `Equalization` returns its own input when called on a
    `keras.Input`, so a functional model skips it: a parity test of it
    trained the Dense after it alone, and passed (this file's first
    version). `models.assert_layer_trains_as_one_device` now refuses such
    a layer. Applied in a layer of one's own it runs, and on data=8 its
    step does not compile: DTensor 2.21 cannot lay out the `DenseBincount`
    of its histogram (nor, after it, the first-nonzero read of the
    cumulative histogram, whose shape is known only when run); tfpar's
    error names the op at the first step."""
    with pytest.raises(AssertionError, match="returned its input"):
        models.assert_layer_trains_as_one_device(
            IMAGE, lambda: L.Equalization(value_range=(-3, 3)))
    with pytest.raises(ValueError, match="DenseBincount"):
        models.assert_layer_trains_as_one_device(IMAGE, _Equalized)


@pytest.mark.slow
def test_random_posterization_trains_as_one_device():
    """RandomPosterization reads 8-bit images (values 0-255)."""
    def build():
        x = keras.Input(IMAGE)
        h = L.RandomPosterization(4, value_range=(0, 255), seed=1)(x)
        return keras.Model(x, L.Dense(3)(L.Flatten()(h)))

    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, size=(16,) + IMAGE).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    models.assert_trains_in_order_like_one_device(build, x, y, {"data": 8})
