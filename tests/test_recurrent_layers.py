"""Keras' recurrent layers under tfpar (`tfpar.recurrent`): DTensor 2.21
lays out no TensorList op, so Keras' `tf.while_loop` recurrences failed to
compile on every mesh, a data-only one included
(tests/dtensor_tensor_list_repro.py, pure TF + DTensor). In a step they are
unrolled; here they train as on one device (losses and weights, 1e-4), a
sequence of unknown length is a clear error before training, and the cuDNN
kernels are never asked for in a step.

The default run trains one model with masked, padded sequences through a
Bidirectional LSTM and a backwards GRU on data=8; SimpleRNN, ConvLSTM,
stateful and state-returning layers, and the planned data=2 × model=4
mesh are slow cases.
"""

import contextlib
import doctest

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import _compat
from tfpar import recurrent
from tfpar.step_context import in_spmd_step

import dtensor_tensor_list_repro as repro
import models

L = keras.layers
TIME, FEATURES = 6, 5


def _padded_sequences(n=32, seed=0):
    """(x, y): n sequences of TIME steps, the last 0-3 steps of each zero
    (padding that `Masking` masks), and (n, 3) targets."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, TIME, FEATURES)).astype("float32")
    for row, pad in enumerate(rng.integers(0, 4, n)):
        x[row, TIME - pad:] = 0.0
    return x, rng.normal(size=(n, 3)).astype("float32")


def _masked_bidirectional():
    x = keras.Input((TIME, FEATURES))
    h = L.Masking()(x)
    h = L.Bidirectional(L.LSTM(4, return_sequences=True), name="bi")(h)
    h = L.GRU(4, go_backwards=True, name="gru")(h)
    return keras.Model(x, L.Dense(3, name="out")(h))


def _simple_rnn():
    x = keras.Input((TIME, FEATURES))
    h = L.SimpleRNN(8, return_sequences=True, name="rnn")(x)
    h = L.Flatten()(h)
    return keras.Model(x, L.Dense(3, name="out")(h))


def _conv_lstm():
    x = keras.Input((TIME, FEATURES))
    h = L.Reshape((TIME, FEATURES, 1))(x)
    h = L.ConvLSTM1D(2, 3, name="conv_lstm")(h)
    h = L.Flatten()(h)
    return keras.Model(x, L.Dense(3, name="out")(h))


def _state_returning():
    x = keras.Input((TIME, FEATURES))
    _, h, c = L.LSTM(4, return_state=True, name="lstm")(x)
    return keras.Model(x, L.Dense(3, name="out")(L.Concatenate()([h, c])))


def _stateful():
    x = keras.Input(batch_shape=(16, TIME, FEATURES))
    h = L.LSTM(4, stateful=True, name="lstm")(x)
    return keras.Model(x, L.Dense(3, name="out")(h))


def _assert_trains_like_one_device(build, mesh, rules=None):
    """Two epochs of SGD in order at batch 16: losses and weights within
    1e-4 relative of one device's, from the same initial weights."""
    x, y = _padded_sequences()
    keras.utils.set_random_seed(0)
    models.assert_trains_in_order_like_one_device(build, x, y, mesh, rules)


def test_dtensor_cannot_loop_over_tensor_lists_but_can_unroll():
    """The premise (tests/dtensor_tensor_list_repro.py): Keras' loop over
    TensorArrays does not compile on data=8; unrolled, the recurrence
    compiles and gives one device's gradient. If the first half fails,
    DTensor learned TensorLists and the unrolling can go."""
    mesh = repro.mesh()
    status, _ = repro.attempt("loop", mesh)
    assert "EmptyTensorList" in status, status
    status, grad = repro.attempt("unrolled", mesh)
    assert status == "compiled"
    np.testing.assert_allclose(grad, repro.one_device_gradient(),
                               rtol=1e-5, atol=1e-6)


def test_masked_bidirectional_lstm_and_gru_train_like_one_device():
    """Masking, a Bidirectional LSTM returning sequences (its backward
    copy reverses them) and a GRU reading backwards, on padded sequences:
    every Keras recurrent layer failed to compile before."""
    _assert_trains_like_one_device(_masked_bidirectional, {"data": 8})


@pytest.mark.slow
@pytest.mark.parametrize("build", [_simple_rnn, _conv_lstm,
                                   _state_returning, _stateful])
def test_recurrent_layers_train_like_one_device(build):
    _assert_trains_like_one_device(build, {"data": 8})


@pytest.mark.slow
def test_recurrent_layers_train_planned_on_data_and_model():
    """`auto_rules` on data=2 × model=4 (the recurrent kernels stay
    replicated: no MLP or attention pattern), fsdp-free."""
    mesh = tfpar.Mesh({"data": 2, "model": 4})
    rules = tfpar.auto_rules(_masked_bidirectional, mesh=mesh)
    _assert_trains_like_one_device(_masked_bidirectional,
                                   {"data": 2, "model": 4}, rules)


def _varying_lengths():
    """Batches of 8 sequences of 3, 4, ..., 7 steps (a padded dataset of
    unknown length: its element spec says None)."""
    rng = np.random.default_rng(0)

    def sequences():
        for length in range(3, 8):
            for _ in range(8):
                yield (rng.normal(size=(length, FEATURES)).astype("float32"),
                       rng.normal(size=(3,)).astype("float32"))

    return tf.data.Dataset.from_generator(sequences, output_signature=(
        tf.TensorSpec((None, FEATURES)), tf.TensorSpec((3,)))).padded_batch(8)


def _any_length_lstm():
    x = keras.Input((None, FEATURES))
    return keras.Model(x, L.Dense(3)(L.LSTM(4, name="encoder")(x)))


def test_sequences_of_varying_length_train_like_one_device():
    """`fit` on batches of five lengths through `keras.Input((None, f))`:
    the step traces each length (Keras' relaxed retracing would give it a
    length of None, which a step cannot unroll)."""
    keras.utils.set_random_seed(0)
    weights = _any_length_lstm().get_weights()
    runs = []
    for strategy in (None, tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))):
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = _any_length_lstm()
            model.set_weights(weights)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        losses = models.BatchLosses()
        model.fit(_varying_lengths(), epochs=1, verbose=0,
                  callbacks=[losses])
        runs.append((np.array(losses.losses), model.get_weights()))
    (want, reference), (got, trained) = runs
    assert models.relative_error(want, got) < 1e-4, (want, got)
    for a, b in zip(reference, trained):
        assert models.relative_error(a, b) < 1e-4


def test_unknown_sequence_length_in_a_custom_loop_is_a_clear_error():
    """A custom `strategy.run` loop whose `tf.function` relaxes the length
    to None (`reduce_retracing=True`, at its second length): the error
    names the layer, what it received and the fix, and that step changes
    no weight."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    with strategy.scope():
        model = _any_length_lstm()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads,
                                            model.trainable_variables))
        return loss

    traced = tf.function(lambda x, y: strategy.run(step, args=(x, y)),
                         reduce_retracing=True)
    batches = iter(strategy.experimental_distribute_dataset(
        _varying_lengths()))
    traced(*next(batches))
    before = model.get_weights()
    with pytest.raises(ValueError) as raised:
        traced(*next(batches))
    message = str(raised.value)
    for expected in ("encoder", "(8, None, 5)", "keras.Input",
                     "padded_batch"):
        assert expected in message, message
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_cudnn_kernels_are_not_asked_for_in_a_step(monkeypatch):
    """Keras takes its cuDNN LSTM and GRU where cuDNN is available; DTensor
    lays out no cuDNN op, so a step declines them. With cuDNN faked
    available (a kernel that records its call, then declines as Keras'
    does without cuDNN), one device asks for it, and a tfpar step never
    does (the build outside a step may)."""
    rnn = _compat.keras_module("backend.tensorflow.rnn")
    calls = []

    def fake_cudnn(*args, **kwargs):
        calls.append(in_spmd_step())
        raise NotImplementedError  # as Keras' kernel does without cuDNN

    monkeypatch.setattr(rnn, "cudnn_ok", lambda *a, **k: True)
    monkeypatch.setattr(rnn, "_cudnn_lstm", fake_cudnn)
    monkeypatch.setattr(rnn, "_cudnn_gru", fake_cudnn)

    def build():
        x = keras.Input((TIME, FEATURES))
        h = L.LSTM(4, return_sequences=True)(x)
        return keras.Model(x, L.Dense(3)(L.GRU(4)(h)))

    x, y = _padded_sequences(16)
    build()(x)
    assert calls == [False, False]  # one device asks for both kernels
    calls.clear()
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    with strategy.scope():
        model = build()
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert True not in calls, calls


def test_docstring_examples_run():
    result = doctest.testmod(recurrent)
    assert result.attempted >= 3 and result.failed == 0


def test_a_long_unrolled_sequence_warns_of_its_compile_time():
    """Over `LONG_SEQUENCE` steps the unrolled step compiles slowly (a copy
    of the cell per step): a warning names the layer and the length,
    before Keras' function runs (here a stand-in recording its arguments)."""
    calls = []

    def keras_rnn(step_function, inputs, initial_states, **kwargs):
        calls.append(kwargs)
        return "ran"

    steps = recurrent.LONG_SEQUENCE + 1
    with tf.name_scope("encoder"), pytest.warns(UserWarning) as warned:
        out = recurrent.unrolled_rnn(keras_rnn, None, tf.zeros((2, steps, 3)),
                                     [])
    message = str(warned[0].message)
    assert "encoder" in message and str(steps) in message, message
    assert out == "ran" and calls[0]["unroll"] is True
