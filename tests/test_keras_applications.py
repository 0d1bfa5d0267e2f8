"""keras.applications models nobody here wrote, built with random weights,
train under tfpar on data=8 as on one device.

In float32 a deep BatchNormalization network fed 32×32 images normalises
1×1 and 2×2 feature maps over 8 examples: its small variances amplify
rounding (MobileNet: losses 2e-4 apart after two steps, a depthwise
kernel's update 8% apart, with the same math). So the parity is shown in
float64 (the `float64` fixture, tests/conftest.py), where the runs agree
to ~1e-11: weights within 1e-8 of their own scale (floored at 1e-2: a
bias before BatchNormalization has no gradient and stays at its noise
around 0), losses within 1e-8 relative.

MobileNet (depthwise convolutions, strided "same" and padded valid, BN,
ReLU6, Dropout) is the default case; the other families are slow
(DenseNet average-pools, ConvNeXt convolves by groups: both failed before).
"""

import keras
import numpy as np
import pytest

import tfpar

import models

APPLICATIONS = {
    "MobileNet": dict(alpha=0.25),
    "MobileNetV2": dict(alpha=0.35),
    "MobileNetV3Small": dict(alpha=0.75, include_preprocessing=False),
    "EfficientNetB0": {},
    "EfficientNetV2B0": {},
    "ResNet50": {},
    "Xception": {},
    "DenseNet121": {},
    "ConvNeXtTiny": {},
}
# The smallest input each family accepts, else 32.
SIZES = {"Xception": 71}


def _builder(name):
    size = SIZES.get(name, 32)

    def build():
        keras.utils.set_random_seed(0)
        model = getattr(keras.applications, name)(
            weights=None, input_shape=(size, size, 3), classes=4,
            **APPLICATIONS[name])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss="sparse_categorical_crossentropy")
        return model

    return build, size


def _assert_trains_like_one_device(name):
    build, size = _builder(name)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, size, size, 3))
    y = rng.integers(0, 4, 16)
    reference, want = models.train_built(None, build, x, y, 8)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    model, got = models.train_built(strategy, build, x, y, 8)
    assert models.relative_error(np.array(want), np.array(got)) < 1e-8
    for weight, a, b in zip(reference.weights, reference.get_weights(),
                            model.get_weights()):
        scale = max(np.abs(a).max(), 1e-2)
        assert np.abs(a - b).max() / scale < 1e-8, weight.path


def test_mobilenet_trains_like_one_device(float64):
    _assert_trains_like_one_device("MobileNet")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in APPLICATIONS
                                  if n != "MobileNet"])
def test_keras_applications_train_like_one_device(name, float64):
    _assert_trains_like_one_device(name)
