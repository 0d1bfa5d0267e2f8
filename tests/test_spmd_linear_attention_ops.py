"""Stand-ins for ops DTensor 2.21 cannot lay out in a step: Qwen3.5's gated
delta net's (`tfpar.spmd_ops.eye_by_comparison` for `MatrixDiagV3`,
`depthwise_conv_by_shifts` for `DepthwiseConv2dNativeBackpropFilter`),
`tf.roll`, `tf.math.cumprod`, `tf.linalg.solve`, `ops.map`, `ops.scan`,
top-k, dilated, separable and grouped convolutions, a channels-first
Conv1D's bias (`BiasAdd`), average pooling
(`AvgPoolGrad`) and resizing (`ResizeBicubic`, `ScaleAndTranslate`): the
values and gradients of TF's ops on random inputs, and small models
training on data=8 as on one device.

The whole keras-hub model (a linear-attention layer beside a full-attention
one, experts dispatched) is tests/test_qwen3_5_attention_over_model.py's
parity test (slow profile).
"""

import doctest
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import _compat
from tfpar import spmd_image_ops
from tfpar import spmd_ops

import models

RTOL = 1e-5


def _keras_eye():
    return _compat.unpatched(_compat.keras_module(
        "backend.tensorflow.numpy"), "eye")


def _keras_depthwise_conv():
    return _compat.unpatched(_compat.keras_module(
        "backend.tensorflow.nn"), "depthwise_conv")


class _Hooks:
    """A strategy's hooks as a stand-in's factory reads them."""
    in_step = True

    def in_graph_step(self):
        return self.in_step


def test_a_stand_in_gets_the_calls_arguments_by_position():
    """`_compat.in_graph_step_instead` (roll, mirror pad, cumprod, bias add,
    transpose): in a graph step the stand-in gets the call's arguments in
    the original's order with its defaults, however the caller named them
    (TF's `input` is the stand-ins' `inputs` or `tensor`); elsewhere the
    original runs with the call as made."""
    def roll(input, shift, axis, name=None):  # noqa: A002 (TF's names)
        return "tf", input, shift, axis, name

    def stand_in(original, inputs, shift, axis, name=None):
        assert original is roll
        return "stand-in", inputs, shift, axis, name

    hooks = _Hooks()
    patched = _compat.in_graph_step_instead(stand_in)(roll, hooks)
    assert patched(input=1, axis=3, shift=2) == ("stand-in", 1, 2, 3, None)
    hooks.in_step = False
    assert patched(1, 2, axis=3, name="r") == ("tf", 1, 2, 3, "r")
    assert patched.__wrapped__ is roll
    assert doctest.testmod(_compat).failed == 0


@pytest.mark.parametrize("rows, columns, dtype", [
    (5, None, "float32"), (3, 5, "float32"), (5, 3, "bfloat16"),
    (4, 4, "int32")])
def test_eye_by_comparison_is_keras_eye(rows, columns, dtype):
    """Exactly Keras' `ops.eye(N, M)` (TF's `MatrixDiagV3`), also traced
    with tensor sizes; other diagonals are NumPy's `eye(N, M, k)` (the
    step keeps Keras' own op for k != 0: it pads to another shape)."""
    want = _keras_eye()(rows, columns, dtype=dtype)
    got = spmd_ops.eye_by_comparison(rows, columns, 0, dtype)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    traced = tf.function(spmd_ops.eye_by_comparison)(
        tf.constant(rows), None if columns is None else tf.constant(columns),
        0, dtype)
    np.testing.assert_array_equal(traced.numpy(), want.numpy())
    for diagonal in (-2, 1, 3):
        np.testing.assert_array_equal(
            spmd_ops.eye_by_comparison(rows, columns, diagonal).numpy(),
            np.eye(rows, columns, diagonal, "float32"))


@pytest.mark.parametrize("shape, kernel_size, multiplier, options", [
    ((9, 5), (1,), 1, {}), ((9, 5), (4,), 1, {}), ((9, 5), (3,), 2, {}),
    ((9, 5), (3,), 1, {"padding": "same", "dilation_rate": 2}),
    ((7, 6, 3), (3, 3), 1, {"padding": "same"}),
    ((7, 6, 3), (3, 2), 2, {"strides": 2}),
    ((7, 6, 3), (3, 3), 1, {"padding": "same", "strides": (2, 1)}),
    ((8, 8, 3), (2, 3), 1, {"dilation_rate": (2, 1)})])
def test_depthwise_conv_by_shifts_is_keras_op(shape, kernel_size,
                                              multiplier, options):
    """Values and gradients (inputs and kernel, under a random cotangent)
    of Keras' `ops.depthwise_conv` (channels last; 1-D and 2-D, valid and
    same padding, strides, dilations) within 1e-5 relative: only the order
    of the sum differs."""
    rng = np.random.default_rng(len(shape) + sum(kernel_size))
    x = tf.constant(rng.normal(size=(3, *shape)), tf.float32)
    kernel = tf.constant(rng.normal(
        size=(*kernel_size, shape[-1], multiplier)), tf.float32)
    want_shape = _keras_depthwise_conv()(x, kernel, **options).shape
    cotangent = tf.constant(rng.normal(size=want_shape), tf.float32)
    results = []
    for conv in (_keras_depthwise_conv(), spmd_image_ops.depthwise_conv_by_shifts):
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = conv(x, kernel, **options)
            loss = tf.reduce_sum(y * cotangent)
        results.append((y, *tape.gradient(loss, [x, kernel])))
    for want, got in zip(*results):
        assert want.shape == got.shape
        assert models.relative_error(want.numpy(), got.numpy()) < RTOL


@pytest.mark.parametrize("shape, pool_size, strides, padding", [
    ((9, 5), 2, None, "valid"), ((9, 5), 3, 2, "same"),
    ((10, 5), 4, 1, "same"), ((7, 6, 3), (3, 3), (2, 2), "same"),
    ((7, 6, 3), (2, 3), (1, 2), "valid"), ((8, 8, 3), 3, 3, "same"),
    ((5, 6, 4, 2), (2, 3, 2), (2, 1, 2), "same")])
def test_average_pool_by_shifts_is_tf_op(shape, pool_size, strides,
                                         padding):
    """Values and input gradients (under a random cotangent) of TF's
    `avg_pool` (1-D, 2-D and 3-D, valid and same padding, whose windows at
    the border divide by the inputs they hold) within 1e-5 relative."""
    rng = np.random.default_rng(len(shape) + len(padding))
    x = tf.constant(rng.normal(size=(3, *shape)), tf.float32)
    layout = {3: "NWC", 4: "NHWC", 5: "NDHWC"}[x.shape.rank]

    def tf_pool(v):
        return tf.nn.avg_pool(v, pool_size, strides or pool_size,
                              padding.upper(), data_format=layout)

    cotangent = tf.constant(rng.normal(size=tf_pool(x).shape), tf.float32)
    results = []
    for pool in (tf_pool,
                 lambda v: spmd_image_ops.average_pool_by_shifts(
                     v, pool_size, strides, padding)):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = pool(x)
            loss = tf.reduce_sum(y * cotangent)
        results.append((y, tape.gradient(loss, x)))
    for want, got in zip(*results):
        assert want.shape == got.shape
        assert models.relative_error(want.numpy(), got.numpy()) < RTOL


@pytest.mark.parametrize("shift, axis", [
    (2, 0), (-1, 1), (7, 2), ((1, -2), (0, 2)), (0, 1), ((3, 3), (1, 1))])
def test_roll_by_slices_is_tf_roll(shift, axis):
    """Values and gradients of `tf.roll` for static shifts (negative, past
    the size, several axes, one axis twice)."""
    x = tf.reshape(tf.range(2 * 3 * 4, dtype=tf.float32), (2, 3, 4))
    cotangent = tf.reshape(tf.range(24.0) ** 2, (2, 3, 4))
    results = []
    for roll in (tf.roll, lambda *a: spmd_ops.roll_by_slices(tf.roll, *a)):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = roll(x, shift, axis)
            loss = tf.reduce_sum(y * cotangent)
        results.append((y, tape.gradient(loss, x)))
    for want, got in zip(*results):
        assert got is not None
        np.testing.assert_array_equal(got, want)


class _RollFeatures(keras.layers.Layer):
    def call(self, x):
        return keras.ops.roll(x, 1, axis=1) * x


def test_a_roll_trains_in_a_step_like_one_device():
    """DTensor 2.21 cannot lay out TF's `Roll` (Swin's shifted windows
    failed on every mesh): in a step it is slices and a concatenation."""
    models.assert_layer_trains_like_one_device(_RollFeatures, {"data": 8},
                                               6)


@pytest.mark.parametrize("shape, kernel_size, dilation, padding, strides", [
    ((2, 11, 3), (3,), 2, "valid", 1), ((2, 9, 3), (2,), 3, "same", 1),
    ((2, 9, 8, 3), (3, 3), (2, 3), "same", 1),
    ((2, 9, 8, 3), (3, 2), 1, "valid", (2, 1)),
    ((1, 5, 6, 4, 2), (2, 2, 2), 2, "same", 1)])
def test_conv_by_shifts_is_tf_convolution(shape, kernel_size, dilation,
                                          padding, strides):
    """Values and gradients of `tf.nn.convolution` (1-D to 3-D, dilated,
    "same" and "valid", strided) by shifted matrix products."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=shape), tf.float32)
    kernel = tf.constant(rng.normal(size=kernel_size + (shape[-1], 5)),
                         tf.float32)
    spatial = len(kernel_size)
    results = []
    for conv in (lambda x, w: tf.nn.convolution(
            x, w, strides, padding.upper(),
            dilations=dilation if isinstance(dilation, tuple)
            else (dilation,) * spatial),
                 lambda x, w: spmd_image_ops.conv_by_shifts(x, w, strides, padding,
                                                      dilation)):
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = conv(x, kernel)
            cotangent = tf.cos(tf.reshape(tf.range(tf.size(y),
                                                   dtype=tf.float32),
                                          tf.shape(y)))
            loss = tf.reduce_sum(y * cotangent)
        results.append([y, *tape.gradient(loss, [x, kernel])])
    for want, got in zip(*results):
        assert want.shape == got.shape
        assert models.relative_error(want.numpy(), got.numpy()) < RTOL


def _dilated_convolutions(data_format="channels_last"):
    """(12, 2) series -> dilated Conv1D (rate 2, same) -> (6, 8, 1) ->
    dilated Conv2D (rates 2 and 3) -> out(3): TF runs both through
    SpaceToBatchND on CPU, which DTensor 2.21 cannot lay out."""
    first = data_format == "channels_first"
    x = keras.Input((2, 12) if first else (12, 2))
    h = keras.layers.Conv1D(4, 3, dilation_rate=2, padding="same",
                            data_format=data_format, name="conv1d")(x)
    h = keras.layers.Reshape((1, 6, 8) if first else (6, 8, 1))(h)
    h = keras.layers.Conv2D(3, 3, dilation_rate=(2, 3), padding="same",
                            data_format=data_format, name="conv2d")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


@pytest.mark.parametrize("data_format", [
    "channels_last",
    pytest.param("channels_first", marks=pytest.mark.slow)])
def test_dilated_convolutions_train_as_one_device(data_format):
    """keras-hub's DeepLabV3 (its atrous pyramid) failed to compile on a
    data-only mesh: in a step a dilated convolution is shifted matrix
    products (`spmd_image_ops.conv_by_shifts`)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32,) + _dilated_convolutions(
        data_format).input_shape[1:]).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    models.assert_trains_in_order_like_one_device(
        lambda: _dilated_convolutions(data_format), x, y, {"data": 8})


def test_channels_first_conv1d_with_bias_trains_as_one_device():
    """Found on 2026-12-05: a plain channels-first Conv1D with a bias did
    not compile on data=8 ("'tf.DTensorLayout' op requires dimension 1 to
    be divisible ... size=4 ... shards=8"). Keras adds that bias with
    `tf.nn.bias_add(..., "NCHW")` on a rank-3 value, whose bias DTensor
    lays out like the batch; in a step it is a broadcast add
    (`spmd_image_ops.bias_add_by_broadcast`)."""
    models.assert_layer_trains_as_one_device(
        (2, 12), lambda: keras.layers.Conv1D(4, 3, padding="same",
                                             data_format="channels_first"))


@pytest.mark.slow  # a child process importing TF: ~10 s
def test_channels_first_bias_add_of_rank_3_fails_in_dtensor_alone():
    """The DTensor bug the stand-in exists for, in pure TF + DTensor
    (tests/dtensor_bias_add_repro.py, in a child process): rank 3 fails,
    rank 4 and the broadcast add are right. If a newer TF lays the rank-3
    bias out right, the stand-in may go."""
    repro = Path(__file__).with_name("dtensor_bias_add_repro.py")
    result = subprocess.run([sys.executable, str(repro)], capture_output=True,
                            text=True, timeout=300)
    assert result.stdout.split("\n")[:3] == [
        "bias_add rank 3: failed", "bias_add rank 4: right",
        "broadcast add rank 3: right"], result.stdout + result.stderr[-2000:]


def test_bias_add_by_broadcast_is_tf_bias_add():
    """Values and both gradients equal TF's BiasAdd, channels first on
    ranks 3 and 5; channels last and rank 4 are TF's op itself."""
    rng = np.random.default_rng(0)
    for shape, data_format in [((2, 3, 5), "NCHW"), ((2, 3, 2, 2, 2), "NCDHW"),
                               ((2, 5, 3), "NHWC"), ((2, 3, 4, 4), "NCHW")]:
        value = tf.constant(rng.normal(size=shape))
        bias = tf.constant(rng.normal(size=(3,)))
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([value, bias])
            want = tf.nn.bias_add(value, bias, data_format) ** 2
            got = spmd_image_ops.bias_add_by_broadcast(
                tf.nn.bias_add, value, bias, data_format) ** 2
        np.testing.assert_allclose(got, want, rtol=1e-12)
        for wrt in (value, bias):
            np.testing.assert_allclose(tape.gradient(got, wrt),
                                       tape.gradient(want, wrt), rtol=1e-12)


class _TopQueriesByMap(keras.layers.Layer):
    """(batch, 6) -> 3 pairs, each example's pairs reordered by their sums'
    top-k and read with `ops.map` over the examples, as keras-hub's D-FINE
    gathers each image's top queries; plus an `ops.scan` (a decaying
    running sum over the features). `ops.map` and `ops.scan` loop over
    TensorArrays (DTensor lays out no TensorList op), and TopKV2's own
    gradient fails on a batch-split tensor."""

    def call(self, x):
        pairs = keras.ops.reshape(x, (-1, 3, 2))
        values, order = keras.ops.top_k(keras.ops.sum(pairs, -1), k=2)
        top = keras.ops.map(lambda e: keras.ops.take(e[0], e[1], axis=0),
                            (pairs, order))

        def decay(carry, column):
            carry = 0.5 * carry + column
            return carry, carry

        _, running = keras.ops.scan(decay, keras.ops.zeros_like(x[:, 0]),
                                    keras.ops.transpose(x), reverse=True)
        return keras.ops.concatenate(
            [keras.ops.reshape(top, (-1, 4)), values,
             keras.ops.transpose(running)[:, :0]], axis=-1)


def test_map_scan_and_top_k_train_in_a_step_like_one_device():
    """In a step `ops.map` and `ops.scan` are written out element by
    element (`spmd_ops.unrolled_map`, `unrolled_scan`) and top-k values
    are read by a gather (`spmd_ops.top_k_read_by_gather`). DTensor lays
    this small layer out without them too (checked): the test holds their
    values to one device's; keras-hub's D-FINE, which failed without them,
    is tests/test_keras_hub_more.py's (slow)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.normal(size=(32, 6)).astype("float32")
    keras.utils.set_random_seed(0)
    models.assert_trains_in_order_like_one_device(
        lambda: keras.Sequential([keras.Input((6,)), keras.layers.Dense(6),
                                  _TopQueriesByMap()]), x, y, {"data": 8})


def test_unrolled_map_and_scan_are_keras_ops():
    """Values of Keras' own `ops.map` and `ops.scan` (structures in and
    out, reverse, no xs but a length, no ys)."""
    rng = np.random.default_rng(0)
    xs = {"a": tf.constant(rng.normal(size=(4, 3))),
          "b": tf.constant(rng.normal(size=(4,)))}
    f = lambda e: (e["a"] * e["b"], tf.reduce_sum(e["a"]))  # noqa: E731
    for want, got in zip(keras.ops.map(f, xs),
                         spmd_ops.unrolled_map(None, f, xs)):
        np.testing.assert_allclose(got, want)

    def step(carry, x):
        total, count = carry  # Keras' TF scan: ys shaped as the carry
        return (total + x, count + 1), (total * x, count)

    for reverse in (False, True):
        want = keras.ops.scan(step, (tf.zeros(3, tf.float64), 0), xs["a"],
                              reverse=reverse)
        got = spmd_ops.unrolled_scan(None, step, (tf.zeros(
            3, tf.float64), 0), xs["a"], reverse=reverse)
        for a, b in zip(keras.tree.flatten(want), keras.tree.flatten(got)):
            np.testing.assert_allclose(b, a)
    count = lambda c, _: (c + 1, None)  # noqa: E731
    assert int(spmd_ops.unrolled_scan(None, count, 0, None, 5)[0]) == int(
        keras.ops.scan(count, 0, None, 5)[0]) == 5


def _cumprod_by_loop(x, axis, exclusive, reverse):
    """The running product element by element: the reference whose
    gradient is the product rule everywhere (TF's divides by x)."""
    parts = tf.unstack(x, axis=axis)
    if reverse:
        parts = parts[::-1]
    running, out = tf.ones_like(parts[0]), []
    for part in parts:
        out.append(running if exclusive else running * part)
        running = running * part
    return tf.stack(out[::-1] if reverse else out, axis=axis)


@pytest.mark.parametrize("axis, exclusive, reverse, dtype", [
    (0, False, False, "float32"), (1, True, False, "float32"),
    (-1, False, True, "float32"), (2, True, True, "float32"),
    (1, False, False, "int32"), (-2, True, True, "float64")])
def test_cumprod_by_shifts_is_tf_cumprod(axis, exclusive, reverse, dtype):
    """Values of `tf.math.cumprod` (exclusive, reversed, negative axes,
    sizes 2, 5 and 7 — not powers of two), and the product rule's
    gradient, also at a zero (float64), where TF's own Cumprod gradient,
    which divides by x, gives 0 instead."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.uniform(0.5, 1.5, (2, 5, 7)), dtype)
    if dtype == "int32":
        x = tf.constant(rng.integers(-3, 4, (2, 5, 7)), dtype)
    if dtype == "float64":
        x = tf.tensor_scatter_nd_update(x, [[1, 2, 3]], tf.zeros(1, dtype))
    cotangent = tf.constant(rng.normal(size=(2, 5, 7)), dtype)
    got = spmd_ops.cumprod_by_shifts(tf.math.cumprod, x, axis, exclusive,
                                     reverse)
    want = tf.math.cumprod(x, axis, exclusive=exclusive, reverse=reverse)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if dtype == "int32":
        return
    gradients = []
    for cumprod in (_cumprod_by_loop, lambda *a: spmd_ops.cumprod_by_shifts(
            tf.math.cumprod, *a)):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(cumprod(x, axis, exclusive, reverse)
                                 * cotangent)
        gradients.append(tape.gradient(loss, x).numpy())
    want, got = gradients
    np.testing.assert_allclose(got, want, rtol=1e-5,
                               atol=1e-6 * np.abs(want).max())


def test_solve_by_elimination_is_tf_solve():
    """Values and gradients of `tf.linalg.solve` in float64 for batches of
    1x1 to 8x8 systems (RandomPerspective's are 8x8), with zeros on the
    diagonal (the pivot must be searched) and several right-hand sides;
    larger systems are left to TF's op (None)."""
    rng = np.random.default_rng(0)
    for n in (1, 3, 8):
        a = rng.normal(size=(4, n, n))
        a[:, np.arange(n), np.arange(n)] = 0.0
        if n == 1:
            a += 2.0
        a, b = tf.constant(a), tf.constant(rng.normal(size=(4, n, 2)))
        results = []
        for solve in (tf.linalg.solve, spmd_image_ops.solve_by_elimination):
            with tf.GradientTape() as tape:
                tape.watch([a, b])
                x = solve(a, b)
                loss = tf.reduce_sum(x * tf.range(2.0, dtype=x.dtype))
            results.append([x, *tape.gradient(loss, [a, b])])
        for want, got in zip(*results):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    big = tf.eye(spmd_image_ops.MAX_ELIMINATION_SIZE + 1)
    assert spmd_image_ops.solve_by_elimination(big, big) is None


class _PrefixProducts(keras.layers.Layer):
    """x * cumprod(sigmoid(x)) along the sequence, forwards and backwards:
    a soft "everything before matched" mask, as keras-hub's
    SpeculativeSampler takes `ops.cumprod` of its matches."""

    def call(self, x):
        gates = keras.ops.sigmoid(x)
        forwards = keras.ops.cumprod(gates, axis=1)
        backwards = tf.math.cumprod(gates, axis=1, exclusive=True,
                                    reverse=True)
        return x * forwards + backwards


def test_a_cumprod_trains_in_a_step_like_one_device():
    """DTensor 2.21 cannot lay out TF's `Cumprod`: in a step it is
    shifted products."""
    models.assert_layer_trains_like_one_device(_PrefixProducts,
                                               {"data": 8}, 6)


class _EyeResidual(keras.layers.Layer):
    """y_i = sum_j (I + x_i W)_ij x_j over the last dimension per position:
    I from `ops.eye` added to a batch-split matrix per token, as the gated
    delta net adds the identity to its chunks' correction matrices (an eye
    added to a replicated weight alone lays out: DTensor refuses the
    MatrixDiagV3 when its sum is split)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],) * 2,
                                 initializer="glorot_uniform", name="w")

    def call(self, x):
        matrices = keras.ops.eye(x.shape[-1]) + x[..., :, None] * self.w
        return keras.ops.sum(matrices * x[..., None, :], axis=-1)


def _build():
    """(8, 6) sequences -> causal depthwise conv (pad 3, kernel 4, as
    Qwen3.5's) -> Dense(64) -> (I + x W) x, I = `ops.eye(64)` (Qwen3.5's
    chunk size; DTensor 2.21 refused the eye of 64, not those of 16 or 32:
    measured) -> Dense(3) on the flattened sequence."""
    x = keras.Input((8, 6))
    h = keras.layers.ZeroPadding1D((3, 0))(x)
    h = keras.layers.DepthwiseConv1D(4, name="conv")(h)
    h = keras.layers.Dense(64, name="wide")(h)
    h = _EyeResidual(name="eye_residual")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


@pytest.mark.parametrize("mesh", [{"data": 8}])
def test_causal_depthwise_conv_and_eye_train_as_one_device(mesh):
    """A depthwise convolution (its kernel's gradient) and `ops.eye` in a
    model on data=8: TF 2.21's DTensor refused both ops
    ("does not implement layout propagation"); with the stand-ins the
    losses and weights after two epochs of SGD are one device's (1e-4)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 6)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")
    models.assert_trains_in_order_like_one_device(_build, x, y, mesh)


def test_inference_keeps_tf_s_depthwise_convolution(monkeypatch):
    """Only steps whose gradients are taken need the shifted sums (the
    filter gradient is what DTensor cannot lay out): predict runs TF's own
    depthwise convolution, with the same values."""
    calls = []
    original = spmd_image_ops.depthwise_conv_by_shifts
    monkeypatch.setattr(spmd_image_ops, "depthwise_conv_by_shifts",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    x = np.linspace(-1, 1, 16 * 8 * 3, dtype="float32").reshape(16, 8, 3)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 3)),
                              keras.layers.DepthwiseConv1D(3)])
    want = model.predict(x, verbose=0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    with strategy.scope():
        laid = keras.Sequential([keras.Input((8, 3)),
                                 keras.layers.DepthwiseConv1D(3)])
    laid.set_weights(model.get_weights())
    np.testing.assert_allclose(laid.predict(x, verbose=0), want, rtol=1e-6)
    assert not calls
    laid.compile(optimizer="sgd", loss="mse")
    laid.fit(x, want, batch_size=16, verbose=0)
    assert calls  # the training step's forward pass


def _separable():
    """(8, 8, 3) images -> SeparableConv2D (stride 2, "same") -> rows as a
    sequence -> SeparableConv1D (dilation 2) -> Dense(3)."""
    x = keras.Input((8, 8, 3))
    h = keras.layers.SeparableConv2D(4, 3, strides=2, padding="same",
                                     depth_multiplier=2, name="conv2d")(x)
    h = keras.layers.Reshape((4, 16))(h)
    h = keras.layers.SeparableConv1D(5, 2, dilation_rate=2,
                                     name="conv1d")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def test_separable_convolutions_train_as_one_device():
    """SeparableConv1D/2D run TF's depthwise convolution, whose filter
    gradient DTensor 2.21 cannot lay out (they failed to compile on
    data=8): in a step they are the shifted-sum depthwise convolution and
    a 1×1 convolution; losses and weights are one device's (1e-4)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")
    models.assert_trains_in_order_like_one_device(_separable, x, y,
                                                  {"data": 8})


def _pooled_and_grouped_2d():
    """(9, 9, 4) -> Conv2D -> AveragePooling2D (valid) -> Conv2D with a
    group per channel -> AveragePooling2D (3, stride 2, same) -> Conv2D of
    2 groups -> Dense(3)."""
    x = keras.Input((9, 9, 4))
    h = keras.layers.Conv2D(8, 3, padding="same")(x)
    h = keras.layers.AveragePooling2D(2)(h)
    h = keras.layers.Conv2D(8, 3, padding="same", groups=8)(h)
    h = keras.layers.AveragePooling2D(3, strides=2, padding="same")(h)
    h = keras.layers.Conv2D(6, 1, groups=2)(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def _pooled_3d():
    """(4, 4, 4, 2) volumes -> Conv3D -> AveragePooling3D (same) -> Dense(3)
    (`AvgPool3DGrad`)."""
    x = keras.Input((4, 4, 4, 2))
    h = keras.layers.Conv3D(3, 2, padding="same")(x)
    h = keras.layers.AveragePooling3D(2, strides=1, padding="same")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def _pooled_and_grouped_1d():
    """(10, 4) -> Conv1D -> AveragePooling1D (3, stride 2, same) -> Conv1D
    of 4 groups -> AveragePooling1D (valid) -> Dense(3)."""
    x = keras.Input((10, 4))
    h = keras.layers.Conv1D(8, 3)(x)
    h = keras.layers.AveragePooling1D(3, strides=2, padding="same")(h)
    h = keras.layers.Conv1D(8, 3, groups=4, padding="same")(h)
    h = keras.layers.AveragePooling1D(2)(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


@pytest.mark.parametrize("build, shape", [
    (_pooled_and_grouped_2d, (9, 9, 4)), (_pooled_and_grouped_1d, (10, 4)),
    (_pooled_3d, (4, 4, 4, 2))],
    ids=["2d", "1d", "3d"])
def test_average_pooling_and_grouped_convolutions_train_as_one_device(
        build, shape):
    """Average pooling of a convolution (its `AvgPoolGrad`: DenseNet;
    `AvgPool3DGrad`) failed in a step on data=8; with the stand-in losses and weights are one
    device's."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, *shape)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    models.assert_trains_in_order_like_one_device(build, x, y, {"data": 8})


def _convnext_like():
    """(8, 8, 3) -> a 2×2 stride-2 stem -> a 3×3 Conv2D with a group per
    channel (ConvNeXt's depthwise form) -> LayerNormalization -> a 1×1
    Conv2D of 2 groups -> global average -> Dense(3)."""
    x = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 2, strides=2)(x)
    h = keras.layers.Conv2D(8, 3, padding="same", groups=8)(h)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Conv2D(6, 1, groups=2)(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def test_grouped_convolutions_train_as_one_device_in_float64(float64):
    """Keras' grouped convolution (its nested XLA function) failed in a
    float64 step on data=8 ("filter_size does not have enough elements":
    ConvNeXt); as a depthwise convolution (a group per channel) or one
    convolution per group it trains as one device."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8, 8, 3)), rng.normal(size=(32, 3))
    keras.utils.set_random_seed(0)
    models.assert_trains_in_order_like_one_device(_convnext_like, x, y,
                                                  {"data": 8})


@pytest.mark.parametrize("method", ["bicubic", "lanczos3", "lanczos5",
                                    "area", "gaussian", "mitchellcubic"])
def test_resize_by_matmul_is_tf_resize(method):
    """`spmd_image_ops.resize_by_matmul` equals `tf.image.resize` up and down,
    with and without antialiasing, 1-pixel sides included (1e-5)."""
    rng = np.random.default_rng(0)
    for antialias in (False, True):
        for old, new in (((5, 7), (9, 4)), ((8, 8), (3, 3)),
                         ((6, 4), (6, 11)), ((1, 5), (3, 2))):
            x = rng.normal(size=(2, *old, 3)).astype("float32")
            want = tf.image.resize(x, new, method, antialias=antialias)
            got = spmd_image_ops.resize_by_matmul(tf.image.resize, x, new, method,
                                            antialias)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _resized():
    """(8, 8, 3) -> Conv2D -> bicubic Resizing to 12×12 -> antialiased
    lanczos3 `ops.image.resize` to 5×5 -> Dense(3): the gradient flows
    through both (TF's ResizeBicubic and ScaleAndTranslate)."""
    x = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same")(x)
    h = keras.layers.Resizing(12, 12, interpolation="bicubic")(h)
    h = keras.layers.Lambda(lambda t: keras.ops.image.resize(
        t, (5, 5), interpolation="lanczos3", antialias=True))(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def test_bicubic_and_lanczos_resizing_train_as_one_device():
    """DTensor 2.21 cannot lay out TF's ResizeBicubic nor ScaleAndTranslate
    (the model failed to compile on data=8); as two matrix products per
    resize it trains as one device."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    models.assert_trains_in_order_like_one_device(_resized, x, y,
                                                  {"data": 8})


@pytest.mark.parametrize("mode", ["REFLECT", "SYMMETRIC"])
def test_mirror_pad_by_gather_is_tf_mirror_pad(mode):
    """Values and gradients equal TF's MirrorPad (DTensor 2.21 cannot lay
    it out: Keras' centred STFT, MelSpectrogram), on padded and unpadded
    axes of ranks 1 to 3."""
    rng = np.random.default_rng(0)
    for shape, pads in [((5,), [[2, 3]]), ((4, 6), [[0, 0], [3, 1]]),
                        ((3, 5, 4), [[1, 2], [0, 4], [2, 0]])]:
        x = tf.constant(rng.normal(size=shape))
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            want = tf.pad(x, pads, mode=mode)
            got = spmd_ops.mirror_pad_by_gather(
                tf.raw_ops.MirrorPad, x, pads, mode)
            weights = tf.constant(rng.normal(size=want.shape))
            want_sum, got_sum = [tf.reduce_sum(v * weights)
                                 for v in (want, got)]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(  # a gather's gradient: IndexedSlices
            tf.convert_to_tensor(tape.gradient(got_sum, x)),
            tape.gradient(want_sum, x), rtol=1e-12)


class _ReflectPadded(keras.layers.Layer):
    """(batch, 8, c) -> (batch, 11, c): `tf.pad` reflecting along time,
    with gradients flowing through it to the Dense before."""

    def call(self, x):
        return tf.pad(x, [[0, 0], [2, 1], [0, 0]], mode="REFLECT")

    def compute_output_shape(self, input_shape):
        return input_shape[:1] + (input_shape[1] + 3,) + input_shape[2:]


def test_reflect_padding_and_mel_spectrogram_train_as_one_device():
    """A reflecting `tf.pad` between two layers and Keras' MelSpectrogram
    (a centred STFT pads by reflection) failed to compile on data=8
    ("'tf.MirrorPad' op does not implement layout propagation"); in a
    step MirrorPad is a gather (`spmd_ops.mirror_pad_by_gather`)."""
    def build():
        audio = keras.Input((128,))
        mel = keras.layers.MelSpectrogram(fft_length=32, sequence_stride=16,
                                          num_mel_bins=8)(audio)
        h = _ReflectPadded()(keras.layers.Dense(3)(mel))
        return keras.Model(audio, keras.layers.Dense(3)(
            keras.layers.Flatten()(h)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 128)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    models.assert_trains_in_order_like_one_device(build, x, y, {"data": 8})


def test_transpose_by_einsum_is_tf_transpose():
    """The same values as TF's transpose for permutations of ranks 1 to 4
    (given, negative, or None: reversed); integer tensors and axes that
    are no permutation are left to the op itself (which refuses the
    latter)."""
    rng = np.random.default_rng(0)
    for shape, axes in [((3,), None), ((2, 3), None), ((2, 3), (1, 0)),
                        ((2, 3, 4), (2, 0, 1)), ((2, 3, 4, 5), (0, -2, -1, 1)),
                        ((2, 3, 4, 5), None)]:
        x = tf.constant(rng.normal(size=shape))
        np.testing.assert_array_equal(
            spmd_ops.transpose_by_einsum(tf.transpose, x, axes),
            tf.transpose(x, axes))
    integers = tf.reshape(tf.range(6), (2, 3))
    np.testing.assert_array_equal(
        spmd_ops.transpose_by_einsum(tf.transpose, integers), tf.transpose(
            integers))
    with pytest.raises(tf.errors.InvalidArgumentError):
        spmd_ops.transpose_by_einsum(tf.transpose, x, (0, 0, 1, 2))


class _ContrastiveHead(keras.layers.Layer):
    """keras-hub's CLIPHead: text-by-image logits t @ transpose(v), and
    the image-by-text ones as their transpose; a probe of both's means."""

    def call(self, vision, text):
        text_logits = keras.ops.matmul(text, keras.ops.transpose(vision))
        vision_logits = keras.ops.transpose(text_logits)
        return keras.ops.stack([keras.ops.mean(text_logits, 1),
                                keras.ops.mean(vision_logits, 1)], 1)

    def compute_output_shape(self, vision_shape, text_shape):
        return (vision_shape[0], 2)


def test_transposed_logits_of_split_projections_train_as_one_device():
    """keras-hub's CLIP did not compile under `auto_rules` on data=2 x
    model=4: its head transposes logits whose consumer wants another
    layout ("TransposeOp SPMD needs communication is not supported yet");
    in a step Keras' transpose is an Einsum, which DTensor relayouts
    (`spmd_ops.transpose_by_einsum`)."""
    def build():
        x = keras.Input((6,))
        vision = keras.layers.Dense(8, name="vision_projection")(x)
        text = keras.layers.Dense(8, name="text_projection")(x)
        return keras.Model(x, keras.layers.Dense(3)(
            _ContrastiveHead()(vision, text)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    models.assert_trains_in_order_like_one_device(
        build, x, y, {"data": 2, "model": 4},
        rules={"vision_projection/kernel": (None, "model"),
               "text_projection/kernel": (None, "model")})


def test_subscripts_without_ellipsis_give_tf_einsum():
    """"..." written out as letters: the same values as TF's einsum with
    it; left to Keras (None) where the written-out form would change what
    TF does (broadcast "..." dimensions, "..." summed away) or a rank is
    unknown."""
    rng = np.random.default_rng(0)
    for subscripts, shapes in [
            ("...n,d->...nd", [(2, 5, 3), (4,)]),
            ("...ij,...jk->...ik", [(2, 3, 4, 5), (3, 5, 6)]),
            ("b...d,d->b...", [(2, 3, 4, 5), (5,)]),
            ("...,...->...", [(3, 4), (3, 4)])]:
        operands = [tf.constant(rng.normal(size=s)) for s in shapes]
        written = spmd_ops.subscripts_without_ellipsis(subscripts, operands)
        assert "..." not in written
        np.testing.assert_allclose(tf.einsum(written, *operands),
                                   tf.einsum(subscripts, *operands),
                                   rtol=1e-12)
    for subscripts, shapes in [("...ij,...jk->...ik", [(1, 4, 5), (3, 5, 6)]),
                               ("i...,i...->i", [(3, 4), (3, 4)])]:
        operands = [tf.zeros(s) for s in shapes]
        assert spmd_ops.subscripts_without_ellipsis(
            subscripts, operands) is None


class _RotaryTable(keras.layers.Layer):
    """keras-hub Flux's rotary table: positions (batch, n) times
    frequencies (d,) by "...n,d->...nd", then cos and sin."""

    def call(self, positions):
        frequencies = 1.0 / (10.0 ** keras.ops.arange(0, 4, dtype="float32"))
        angles = keras.ops.einsum("...n,d->...nd", positions, frequencies)
        return keras.ops.concatenate([keras.ops.cos(angles),
                                      keras.ops.sin(angles)], -1)

    def compute_output_shape(self, input_shape):
        return input_shape + (8,)


def test_an_einsum_with_an_ellipsis_trains_as_one_device():
    """keras-hub's Flux failed to compile on every mesh, data=8 included
    ("Broadcasting is unimplemented for einsum. Received equation
    ...a,b->...ab"): in a step "..." is written out as letters
    (`spmd_ops.subscripts_without_ellipsis`)."""
    def build():
        x = keras.Input((6,))
        positions = keras.layers.Dense(5)(x)
        return keras.Model(x, keras.layers.Dense(3)(
            keras.layers.Flatten()(_RotaryTable()(positions))))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    models.assert_trains_in_order_like_one_device(build, x, y, {"data": 8})
