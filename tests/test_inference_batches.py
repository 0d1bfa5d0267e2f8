"""evaluate/predict accept any batch size under a mesh, as Keras does.

A batch the data axis does not divide runs replicated over the data axis;
the results equal one device's. Training keeps its clear error
(tests/test_errors.py).
"""

import keras
import numpy as np
import pytest

import tfpar
import models

# (samples, batch_size): few samples, batches the data axis (2 or 8) does
# not divide, a partial last batch, and batch sizes 7 and 33 over many
# batches.
CASES = [(1, None), (3, None), (7, None), (33, None), (101, None),
         (101, 7), (101, 33)]


def _compiled(model, weights):
    model.set_weights(weights)
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("axes", [
    pytest.param({"data": 2, "model": 4}, id="data2_model4"),
    pytest.param({"data": 8}, id="data8", marks=pytest.mark.slow)])
def test_evaluate_and_predict_any_batch_size_equal_one_device(axes):
    keras.utils.set_random_seed(0)
    reference = models.host_mlp()
    weights = reference.get_weights()
    _compiled(reference, weights)
    rules = models.HOST_RULES if "model" in axes else None
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules)
    with strategy.scope():
        model = _compiled(models.host_mlp(), weights)
    x, y = models.mlp_data(n=101, seed=1)
    for n, batch_size in CASES:
        xs, ys = x[:n], y[:n]
        expected = reference.predict(xs, batch_size=batch_size, verbose=0)
        got = model.predict(xs, batch_size=batch_size, verbose=0)
        assert got.shape == expected.shape == (n, 3)
        assert models.relative_error(expected, got) < 1e-4, (n, batch_size)
        expected = reference.evaluate(xs, ys, batch_size=batch_size,
                                      verbose=0)
        got = model.evaluate(xs, ys, batch_size=batch_size, verbose=0)
        np.testing.assert_allclose(got, expected, rtol=1e-4,
                                   err_msg=f"n={n}, batch_size={batch_size}")


def test_training_still_refuses_an_indivisible_batch_size():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((20, 4), "float32")
    model.predict(x, batch_size=7, verbose=0)  # inference: fine
    with pytest.raises(ValueError, match=r"global batch size 7 is not "
                       r"divisible by the data axis 'data' of size 2"):
        model.fit(x, x[:, :2], batch_size=7, verbose=0)


def test_pipeline_evaluate_and_predict_any_batch_size_equal_one_device():
    keras.utils.set_random_seed(0)
    reference = models.host_mlp()
    weights = reference.get_weights()
    _compiled(reference, weights)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        model = models.host_mlp()
        model.set_weights(weights)
        pipe = tfpar.PipelineModel(model, num_microbatches=2)
        pipe.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    x, y = models.mlp_data(n=20, seed=1)
    # Batches of 7, 7, 6: one, one and three micro-batches, none split by 4.
    np.testing.assert_allclose(pipe.predict(x, batch_size=7, verbose=0),
                               reference.predict(x, batch_size=7, verbose=0),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        pipe.evaluate(x, y, batch_size=7, verbose=0),
        reference.evaluate(x, y, batch_size=7, verbose=0), rtol=1e-4)
