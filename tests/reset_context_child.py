"""Run by tests/test_reset_context.py in a process of its own: resets TF's
eager context several times, the ways TF/Keras (context only) and DTensor's
test utilities (context and DTensor device) do, and after each reset trains
a fresh ParallelStrategy: `fit`, and `strategy.run` with a Keras
optimizer's `apply_gradients` inside a `tf.function`. Op determinism is on,
so "as in a fresh process" is checked to the bit: every round's weights
equal round 0's (before any reset). Round 0 is in parity with one device,
float32's rounding noise bounded by a float64 run as the fuzzing does
(`fuzzing.NOISE`): on an AMD EPYC (AVX2) host data=2 x model=4 ends
1.12e-4 from one device after Adam, every run. The strategy from before
each reset must raise a clear RuntimeError."""

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
from fuzzing import NOISE, float64_policy  # noqa: E402
from models import HOST_RULES, host_mlp, mlp_data, relative_error  # noqa: E402

tfpar.use_virtual_cpus(8)
tf.config.experimental.enable_op_determinism()
X, Y = mlp_data(n=32)
keras.utils.set_random_seed(1)
START = host_mlp().get_weights()


def train(strategy, dtype="float32"):
    """(fit weights, custom-loop weights, model) from START; one device when
    `strategy` is None."""
    keras.utils.set_random_seed(1)
    start = [w.astype(dtype) for w in START]
    x, y = X.astype(dtype), Y.astype(dtype)
    scope = strategy.scope() if strategy else tf.init_scope()
    with scope:
        model = host_mlp()
        model.set_weights(start)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    fitted = model.get_weights()

    def step(inputs, targets):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(inputs, training=True)
                                            - targets))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    if strategy:
        dataset = strategy.experimental_distribute_dataset(dataset)
        traced = tf.function(lambda x, y: strategy.run(step, args=(x, y)))
    else:
        traced = tf.function(step)
    for inputs, targets in dataset:
        assert np.isfinite(float(traced(inputs, targets)))
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


fitted_1, looped_1, _ = train(None)
with float64_policy():
    fitted_64, looped_64, _ = train(None, "float64")
one_device = fitted_1 + looped_1
bounds = [max(1e-4, NOISE * relative_error(exact, want)) for exact, want
          in zip(fitted_64 + looped_64, one_device)]
old = first = None
for round_ in range(4):
    if round_:
        reset(dtensor_too=round_ % 2 == 0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=tfpar.LayoutRules(HOST_RULES))
    fitted, looped, model = train(strategy)
    if first is None:
        first = fitted + looped
        for i, (a, b, bound) in enumerate(zip(first, one_device, bounds)):
            assert relative_error(b, a) < bound, (i, relative_error(b, a),
                                                  bound)
    for i, (a, b) in enumerate(zip(fitted + looped, first)):
        assert np.array_equal(a, b), (round_, i, relative_error(b, a))
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
