"""Every Keras loss in its default configuration, compiled into `fit`, on
data 2 x model 4 (the MLP's kernels split) against one device: per-step
losses and final weights within 1e-4 relative, or within float32's own
noise where one device's float32 run is itself that far from float64's
(`fuzzing.assert_parity(exact=...)`: MeanAbsolutePercentageError divides
by targets near zero).

Not here: Circle (with its default gamma of 80 the loss is about 3.5e5
and one device's float32 run ends 8% from float64's: no oracle), and
whole-batch losses in a pipeline, which see micro-batches
(`tests/test_pipeline_microbatch_layers.py`). Probed on 2026-12-07 with
the metrics (`tests/test_every_metric.py`); no loss needed a change.
"""
import keras
import numpy as np
import pytest

import fuzzing
import models
from test_every_metric import build  # the same MLP, its head given

L = keras.losses
N = 32


def _targets():
    rng = np.random.RandomState(0)
    x = rng.normal(size=(N, 8)).astype("float32")
    classes = rng.randint(0, 3, size=(N,)).astype("int32")
    binary = (rng.uniform(size=(N, 1)) > 0.5).astype("float32")
    real = rng.normal(size=(N, 3)).astype("float32")
    one_hot = np.eye(3, dtype="float32")[classes]
    return x, {"classes": classes, "binary": binary, "real": real,
               "one_hot": one_hot, "signs": binary * 2 - 1,
               "positive": np.abs(real),
               "smoothed": one_hot * 0.8 + 0.2 / 3}


# loss: (output activation, width, targets)
LOSSES = {
    "BinaryCrossentropy": ("sigmoid", 1, "binary"),
    "BinaryFocalCrossentropy": ("sigmoid", 1, "binary"),
    "CategoricalCrossentropy": ("softmax", 3, "one_hot"),
    "CategoricalFocalCrossentropy": ("softmax", 3, "one_hot"),
    "CategoricalGeneralizedCrossEntropy": ("softmax", 3, "classes"),
    "CategoricalHinge": ("softmax", 3, "one_hot"),
    "CosineSimilarity": (None, 3, "real"),
    "Dice": ("sigmoid", 3, "one_hot"),
    "Hinge": (None, 1, "signs"),
    "Huber": (None, 3, "real"),
    "KLDivergence": ("softmax", 3, "smoothed"),
    "LogCosh": (None, 3, "real"),
    "MeanAbsoluteError": (None, 3, "real"),
    "MeanAbsolutePercentageError": (None, 3, "real"),
    "MeanSquaredError": (None, 3, "real"),
    "MeanSquaredLogarithmicError": ("softplus", 3, "positive"),
    "Poisson": ("softplus", 3, "positive"),
    "SparseCategoricalCrossentropy": ("softmax", 3, "classes"),
    "SquaredHinge": (None, 1, "signs"),
    "Tversky": ("sigmoid", 3, "one_hot"),
}


def trained(name, axes=None, float64=False):
    activation, width, target = LOSSES[name]
    x, targets = _targets()
    y = targets[target]
    keras.utils.set_random_seed(0)
    weights = build(activation, width).get_weights()
    if float64:
        return fuzzing.train_in_float64(
            lambda: _compiled(build(activation, width), name), x, y, weights,
            keras.optimizers.SGD(0.1))
    model = models.built_on(
        lambda: build(activation, width), axes,
        rules={r".*up/kernel": (None, "model"),
               r".*mid/kernel": ("model", None)} if axes else None)
    result = fuzzing.train(_compiled(model, name), x, y, weights,
                           models.BatchLosses(), keras.optimizers.SGD(0.1))
    assert type(model.loss).__name__ == name  # trained with that loss
    return result


def _compiled(model, name):
    """`model` whose `compile` (called by `fuzzing.train`) takes loss
    `name` in place of the "mse" it is given."""
    compile_ = model.compile

    def compile_with_the_loss(**kwargs):
        kwargs["loss"] = getattr(L, name)()
        return compile_(**kwargs)

    model.compile = compile_with_the_loss
    return model


@pytest.mark.parametrize("name", [
    name if name == "CategoricalFocalCrossentropy"
    else pytest.param(name, marks=pytest.mark.slow) for name in LOSSES])
def test_every_loss_trains_as_one_device(name):
    want = trained(name)
    got = trained(name, {"data": 2, "model": 4})
    fuzzing.assert_parity(want[0], got[0], want[1], got[1],
                          exact=trained(name, float64=True))
