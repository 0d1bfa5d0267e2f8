"""BatchNormalization with its moving statistics split by a rule trains as
one device.

Found by the fuzzing (extra=2 × model=2 × data=2 with MultiHeadAttention,
then minimised): a rule splitting `moving_mean` over any axis made DTensor
2.21 fail compiling the step at BatchNormalization's tf.Mean
("EmitAllScatter was passed a desired_layout ... not more sharded"), the
smallest case a Dense before it on model=2. In a step the batch statistics
are laid out whole on every device
(`tfpar.spmd_patches._replicated_batch_moments_in_step`); each device still holds
only its block of the moving statistics.
"""


import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar

import models

RTOL = 1e-4


def build():
    x = keras.Input((16,))
    h = keras.layers.Dense(8, activation="tanh", name="up")(x)
    h = keras.layers.BatchNormalization(name="norm")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def train(strategy, weights):
    """Two epochs of SGD(0.1), batch 16, in order: (losses, model)."""
    return models.train_sgd_in_order(strategy, build, weights, *models.mlp_data())


@pytest.mark.parametrize("axes,rules", [
    ({"model": 2}, {r"norm/moving_mean": ("model",)}),
    ({"data": 2}, {r"norm/moving_mean": ("data",)}),
    ({"extra": 2, "model": 2, "data": 2},
     {r"up/kernel": (None, "data"), r"norm/moving_mean": ("model",),
      r"norm/moving_variance": ("extra",), r"norm/gamma": ("data",)}),
], ids=["model2", "data2", "extra2xmodel2xdata2"])
def test_split_moving_statistics_train_as_one_device(axes, rules):
    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    want_losses, single = train(None, weights)
    devices = [f"CPU:{i}" for i in range(int(np.prod(list(axes.values()))))]
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes, devices=devices),
                                      rules=rules)
    got_losses, model = train(strategy, weights)
    assert models.relative_error(want_losses, got_losses) < RTOL, (
        want_losses, got_losses)
    for a, b in zip(single.get_weights(), model.get_weights()):
        assert models.relative_error(a, b) < RTOL
    # Each device holds only its block of what a rule splits.
    for weight in model.weights:
        spec = next((s for p, s in rules.items() if weight.path.endswith(p)),
                    None)
        if spec is None:
            continue
        want_shape = tuple(n // (axes[a] if a else 1)
                           for n, a in zip(weight.shape, spec))
        blocks = dtensor.unpack(weight.value.read_value())
        assert {tuple(b.shape) for b in blocks} == {want_shape}, weight.path
