"""Keras' TPUStrategy special cases never run under ParallelStrategy.

Keras 3's TensorFlow trainer checks `isinstance(strategy, TPUStrategy)` (and
`_is_tpu_strategy`) only in `reduce_per_replica` and the multi-host concat
of its own train/test/predict functions. tfpar builds those functions
itself, so on a TPU mesh training never reaches these checks: this test
makes every one of them raise and trains, evaluates and predicts anyway.
(`ParallelStrategy` is not a `TPUStrategy`, so the checks would take the
generic branch even if they ran.)
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer

import tfpar

import models


def _tpu_checking_functions():
    source = inspect.getsource(tf_trainer)
    assert "TPUStrategy" in source  # what this test guards against
    return ["reduce_per_replica", "_is_tpu_strategy", "_is_tpu_multi_host",
            "_tpu_multi_host_concat"]


def test_no_keras_tpu_branch_is_reached(monkeypatch):
    for name in _tpu_checking_functions():
        def boom(*args, _name=name, **kwargs):
            raise AssertionError(f"Keras TPU code path {_name} was reached")
        monkeypatch.setattr(tf_trainer, name, boom)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=models.tp_rules("sequential"))
    assert not isinstance(strategy, tf.distribute.TPUStrategy)
    with strategy.scope():
        model = models.sequential()
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = models.data("sequential", n=32)
    model.fit(x, y, batch_size=16, verbose=0)
    model.evaluate(x, y, batch_size=16, verbose=0)
    assert model.predict(x, batch_size=16, verbose=0).shape == (32, 4)


def test_the_guard_fires_for_plain_keras(monkeypatch):
    """The patched functions are the ones Keras really calls (without tfpar
    a strategy's fit reaches reduce_per_replica), so the test above can
    fail."""
    def boom(*args, **kwargs):
        raise AssertionError("reached")
    monkeypatch.setattr(tf_trainer, "reduce_per_replica", boom)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(AssertionError, match="reached"):
        model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
