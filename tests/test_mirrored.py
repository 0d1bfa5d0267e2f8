"""Next to MirroredStrategy: one model-building function, both strategies.

The comparison runs in a fresh process: once DTensor has run collectives in
a process, MirroredStrategy's collectives there are cancelled ("Function was
cancelled before it was started"), so the two are not mixed in one process
in that order (README, "When to use which").
"""

import subprocess
import sys
from pathlib import Path

import pytest

if __name__ == "__main__":
    import tfpar

    tfpar.use_virtual_cpus(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402


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


def relative_error(a, b):
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-12))


def compare():
    devices = [f"/cpu:{i}" for i in range(8)]
    mirrored_loss, mirrored_weights = build_and_train(
        tf.distribute.MirroredStrategy(devices))
    tfpar_loss, tfpar_weights = build_and_train(
        tfpar.ParallelStrategy(tfpar.Mesh({"data": 8})))
    assert relative_error(mirrored_loss, tfpar_loss) < 1e-4
    for a, b in zip(mirrored_weights, tfpar_weights):
        assert relative_error(a, b) < 1e-4
    print("same loss:", [round(v, 6) for v in tfpar_loss])


# Slow profile: 85 s in the default suite (25 s alone, a fresh process with
# both strategies); the parity oracle everywhere else is one device.
@pytest.mark.slow
def test_same_code_same_loss_as_mirrored_strategy():
    result = subprocess.run([sys.executable, str(Path(__file__).resolve())],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "same loss:" in result.stdout


if __name__ == "__main__":
    compare()
