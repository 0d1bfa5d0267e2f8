"""Run by tests/test_reset_context.py in a process of its own: resets TF's
eager context several times, the ways TF/Keras (context only) and DTensor's
test utilities (context and DTensor device) do, and after each reset trains
a fresh ParallelStrategy in parity with one device: `fit`, and `strategy.run`
with a Keras optimizer's `apply_gradients` inside a `tf.function`. The
strategy from before each reset must raise a clear RuntimeError."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.dtensor.python import api  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tfpar  # noqa: E402
from models import HOST_RULES, host_mlp, mlp_data, relative_error  # noqa: E402

tfpar.use_virtual_cpus(8)
X, Y = mlp_data(n=32)


def train(strategy):
    """(fit weights, custom-loop weights) from the same seeded start; one
    device when `strategy` is None."""
    keras.utils.set_random_seed(1)
    start = host_mlp().get_weights()
    scope = strategy.scope() if strategy else tf.init_scope()
    with scope:
        model = host_mlp()
        model.set_weights(start)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    fitted = model.get_weights()

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    if strategy:
        dataset = strategy.experimental_distribute_dataset(dataset)
        traced = tf.function(lambda x, y: strategy.run(step, args=(x, y)))
    else:
        traced = tf.function(step)
    for x, y in dataset:
        assert np.isfinite(float(traced(x, y)))
    return fitted, model.get_weights(), model


def reset(dtensor_too):
    context._reset_context()  # noqa: SLF001
    if dtensor_too:
        api._reset()  # noqa: SLF001
    # What Keras' distribute tests do after the reset (not use_virtual_cpus).
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 8)


def expect_reset_error(what, call):
    try:
        call()
    except RuntimeError as error:
        assert "belongs to a reset TensorFlow context" in str(error), error
        return
    raise AssertionError(f"{what} on a strategy from before the reset ran")


old = None
for round_ in range(4):
    if round_:
        reset(dtensor_too=round_ % 2 == 0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=tfpar.LayoutRules(HOST_RULES))
    fitted, looped, model = train(strategy)
    fitted_1, looped_1, _ = train(None)
    for a, b in zip(fitted + looped, fitted_1 + looped_1):
        assert relative_error(b, a) < 1e-4, relative_error(b, a)
    if old is not None:
        old_strategy, old_model = old
        expect_reset_error("fit", lambda: old_model.fit(X, Y, verbose=0))
        expect_reset_error("predict", lambda: old_model(X))
        expect_reset_error("scope", old_strategy.scope)
        expect_reset_error("run", lambda: old_strategy.run(tf.reduce_sum,
                                                           args=(X,)))
    old = strategy, model
    print(f"round {round_}: parity after reset", flush=True)
print("ok")
