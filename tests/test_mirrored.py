"""Next to MirroredStrategy: one model-building function, both strategies."""

import keras
import numpy as np
import tensorflow as tf

import tfpar

import models


def build_and_train(strategy):
    """User code that does not care which strategy it runs under."""
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((16,)),
             keras.layers.Dense(32, activation="relu", name="up"),
             keras.layers.Dense(16, name="down"),
             keras.layers.Dense(1, name="out")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.RandomState(0)
    x = rng.normal(size=(128, 16)).astype("float32")
    y = x[:, :4].sum(1, keepdims=True)
    history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False,
                        verbose=0)
    return history.history["loss"], model.get_weights()


def test_same_code_same_loss_as_mirrored_strategy():
    devices = [f"/cpu:{i}" for i in range(8)]
    mirrored_loss, mirrored_weights = build_and_train(
        tf.distribute.MirroredStrategy(devices))
    tfpar_loss, tfpar_weights = build_and_train(
        tfpar.ParallelStrategy(tfpar.Mesh({"data": 8})))
    assert models.relative_error(mirrored_loss, tfpar_loss) < 1e-4
    for a, b in zip(mirrored_weights, tfpar_weights):
        assert models.relative_error(a, b) < 1e-4
