"""Minimal reproduction: DTensor 2.21 cannot lay out TensorList ops, so a
recurrence written as Keras' TensorFlow backend writes it (a
`tf.while_loop` reading and writing `tf.TensorArray`s) does not compile in
a DTensor function, on a data-only mesh too; the same recurrence unrolled
(one copy of the cell per time step) compiles and gives one device's
gradient.

A (batch, time, features) input split over "data" on 8 CPU devices runs a
tanh recurrence h_t = tanh(x_t W + h_{t-1} U):

- "loop": the `tf.while_loop` over a TensorArray fails ("'tf.
  EmptyTensorList' op does not implement layout propagation"), as every
  Keras LSTM, GRU, SimpleRNN and ConvLSTM did under tfpar;
- "unrolled": compiles, and the gradient of W equals the one computed on
  one device without layouts (`one_device_gradient`).

tfpar therefore unrolls Keras' recurrences in a step
(`tfpar.recurrent`).

Run: python tests/dtensor_tensor_list_repro.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import repro_report  # noqa: E402

BATCH, TIME, FEATURES, UNITS = 8, 5, 3, 4
U = dtensor.UNSHARDED


def mesh():
    """A data=8 DTensor mesh on 8 CPU devices."""
    return repro_report.cpu_mesh([("data", 8)])


def _inputs():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(BATCH, TIME, FEATURES)).astype("float32"),
            rng.normal(size=(FEATURES, UNITS)).astype("float32"),
            rng.normal(size=(UNITS, UNITS)).astype("float32"))


def _looped(x, w, u):
    """The recurrence as a while loop over TensorArrays (Keras' way)."""
    steps = tf.TensorArray(tf.float32, TIME).unstack(
        tf.transpose(x, (1, 0, 2)))
    h0 = tf.zeros_like(tf.matmul(x[:, 0], w))

    def body(t, h, out):
        h = tf.tanh(tf.matmul(steps.read(t), w) + tf.matmul(h, u))
        return t + 1, h, out.write(t, h)

    _, _, out = tf.while_loop(lambda t, *_: t < TIME, body,
                              (0, h0, tf.TensorArray(tf.float32, TIME)))
    return tf.reduce_sum(out.stack() ** 2)


def _unrolled(x, w, u):
    """The same recurrence, one copy of the cell per time step."""
    h = tf.zeros_like(tf.matmul(x[:, 0], w))
    total = 0.0
    for t in range(TIME):
        h = tf.tanh(tf.matmul(x[:, t], w) + tf.matmul(h, u))
        total += tf.reduce_sum(h ** 2)
    return total


def one_device_gradient():
    """W's gradient without any layout (numpy)."""
    x, w, u = (tf.constant(v) for v in _inputs())
    with tf.GradientTape() as tape:
        tape.watch(w)
        loss = _unrolled(x, w, u)
    return tape.gradient(loss, w).numpy()


def attempt(kind, dmesh):
    """("compiled", W's gradient as numpy) or (the first line of DTensor's
    error, None) for the recurrence written as `kind` ("loop" or
    "unrolled")."""
    def put(array, *specs):
        return dtensor.copy_to_mesh(tf.constant(array),
                                    dtensor.Layout(list(specs), dmesh))

    recurrence = _looped if kind == "loop" else _unrolled
    x, w, u = _inputs()

    @tf.function
    def gradient(x, w, u):
        with tf.GradientTape() as tape:
            tape.watch(w)
            loss = recurrence(x, w, u)
        return dtensor.relayout(tape.gradient(loss, w),
                                dtensor.Layout.replicated(dmesh, 2))

    return repro_report.compiled_or_error(
        lambda: gradient(put(x, "data", U, U), put(w, U, U),
                         put(u, U, U)))


def main():
    dmesh = mesh()
    repro_report.print_beside_one_device(attempt, ("loop", "unrolled"), dmesh,
                                         one_device_gradient())


if __name__ == "__main__":
    main()
