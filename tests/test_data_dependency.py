"""`tfpar.data_dependency`: the zeros that make an op wait for a tensor.

What can go wrong with such a zero: it is not exactly 0 (a value changes), it
spreads a NaN where there is none or loses one, it carries a gradient the
code it replaced did not, or it reads nothing at run time (a constant: the
op no longer waits). Each test below checks one of these; the last one shows
its graph check fails for `tf.zeros_like`, which is such a constant.
"""

import doctest

import numpy as np
import pytest
import tensorflow as tf

from tfpar import blockwise_attention
from tfpar import data_dependency
from tfpar.data_dependency import scalar_zero_waiting_on
from tfpar.data_dependency import zeros_like_waiting_on


def _values(shape, seed):
    """Random normals with NaN, +inf and -inf at a few places."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype("float32")
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, 3, replace=False)] = [np.nan, np.inf, -np.inf]
    return x


def _bits(tensor):
    return tf.bitcast(tensor, tf.int32).numpy() if tensor.dtype == tf.float32 \
        else np.asarray(tensor)


# The four copies this module replaced, as they were (tfpar before it).
def _old_elementwise(rows):
    return tf.where(tf.equal(rows, rows), tf.zeros_like(rows), rows)


def _old_scalar(tensor):
    total = tf.reduce_sum(tf.cast(tensor, tf.float32))
    return tf.where(tf.equal(total, total), 0.0, float("nan"))


def test_zeros_are_exact_and_only_nan_spreads():
    x = _values((4, 6), seed=0)
    zero = zeros_like_waiting_on(tf.constant(x)).numpy()
    assert zero.shape == x.shape and zero.dtype == np.float32
    assert np.array_equal(np.isnan(zero), np.isnan(x))  # ±inf give 0
    assert np.all(zero[~np.isnan(x)] == 0.0)
    q = np.random.default_rng(1).normal(size=x.shape).astype("float32")
    added = (tf.constant(q) + zero).numpy()
    kept = ~np.isnan(x)
    assert np.array_equal(added[kept], q[kept])  # bit for bit
    assert np.all(np.isnan(added[~kept]))
    for dtype in (tf.bfloat16, tf.float16, tf.float64):
        typed = zeros_like_waiting_on(tf.cast(x, dtype))
        assert typed.dtype == dtype
        assert np.array_equal(np.isnan(tf.cast(typed, tf.float32)),
                              np.isnan(x))


def test_scalar_zero_is_nan_only_when_the_sum_is():
    finite = np.arange(6, dtype="float32").reshape(2, 3)
    cases = {
        "finite": (finite, 0.0),
        "+inf": (np.array([1.0, np.inf], "float32"), 0.0),  # Σ = inf
        "inf-inf": (np.array([np.inf, -np.inf], "float32"), np.nan),
        "nan": (np.array([1.0, np.nan], "float32"), np.nan),
    }
    for name, (x, want) in cases.items():
        zero = scalar_zero_waiting_on(tf.constant(x))
        assert zero.dtype == tf.float32 and zero.shape == (), name
        np.testing.assert_equal(zero.numpy(), np.float32(want), err_msg=name)
    half = scalar_zero_waiting_on(tf.constant([1.0, -2.0], tf.float16))
    assert half.dtype == tf.float32 and float(half) == 0.0
    sparse = tf.IndexedSlices(tf.constant([[np.nan, 1.0]]), tf.constant([2]),
                              tf.constant([4, 2]))
    assert np.isnan(float(scalar_zero_waiting_on(sparse)))


@pytest.mark.parametrize("seed", [0, 1])
def test_bit_identical_to_the_code_it_replaced(seed):
    x = tf.constant(_values((2, 5, 3, 4), seed))
    assert np.array_equal(_bits(zeros_like_waiting_on(x)),
                          _bits(_old_elementwise(x)))
    assert np.array_equal(_bits(scalar_zero_waiting_on(x)),
                          _bits(_old_scalar(x)))
    finite = tf.constant(np.nan_to_num(x.numpy(), posinf=0.0, neginf=0.0))
    assert np.array_equal(_bits(scalar_zero_waiting_on(finite)),
                          _bits(_old_scalar(finite)))
    # blockwise_attention's two users: (b, n, q) rows -> (b, q, n, 1); a
    # key block's gradient (b, block, n, h) -> (b, 1, n, 1).
    rows = x[..., 0]
    want = tf.expand_dims(tf.transpose(_old_elementwise(rows), (0, 2, 1)), -1)
    assert np.array_equal(_bits(blockwise_attention._waiting_on(rows)),
                          _bits(want))
    per_head = _old_elementwise(
        tf.reduce_sum(x[..., :1], axis=1, keepdims=True))
    assert np.array_equal(_bits(blockwise_attention._zero_per_head(x)),
                          _bits(per_head))


def test_gradients_are_those_of_the_code_it_replaced():
    x = tf.constant(_values((3, 4), seed=2))
    weights = tf.constant(np.arange(12, dtype="float32").reshape(3, 4) + 1)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        new = tf.reduce_sum(weights * zeros_like_waiting_on(x))
        old = tf.reduce_sum(weights * _old_elementwise(x))
        scalar = scalar_zero_waiting_on(x) * 2.0
    got = tape.gradient(new, x).numpy()
    # tf.where's gradient: the upstream one at NaN entries, 0 elsewhere.
    np.testing.assert_array_equal(
        got, np.where(np.isnan(x.numpy()), weights.numpy(), 0.0))
    np.testing.assert_array_equal(got, tape.gradient(old, x).numpy())
    assert tape.gradient(scalar, x) is None  # constants in both branches


def _reads_the_source(function, *args):
    """Whether the traced `function`'s output is computed from its Sqrt op
    (through data inputs only: DTensor keeps no control edge)."""
    graph = function.get_concrete_function(*args).graph
    seen, todo = set(), [t.op for t in graph.outputs]
    while todo:
        op = todo.pop()
        if op.name not in seen:
            seen.add(op.name)
            todo.extend(t.op for t in op.inputs)
    (sqrt,) = [op for op in graph.get_operations() if op.type == "Sqrt"]
    return sqrt.name in seen


@pytest.mark.parametrize("make_zero", [zeros_like_waiting_on,
                                       scalar_zero_waiting_on])
def test_the_dependency_survives_tf_function(make_zero):
    """Traced and run through Grappler: the sum reads the source's op (a
    data edge, which DTensor keeps), and its NaN arrives at run time, so
    nothing folded the zero to a constant."""
    @tf.function
    def waiting(x, q):
        source = tf.sqrt(x)  # NaN where x < 0: known only at run time
        return q + make_zero(source)

    q = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    x = tf.constant([[4.0, 9.0], [1.0, 16.0]])
    assert _reads_the_source(waiting, x, q)
    np.testing.assert_array_equal(waiting(x, q), q)
    negative = tf.constant([[4.0, -1.0], [1.0, 16.0]])
    nan_at = np.isnan(waiting(negative, q).numpy())
    assert nan_at[0, 1] and (nan_at.all() if make_zero is
                             scalar_zero_waiting_on else nan_at.sum() == 1)


def test_the_graph_check_sees_a_zero_that_reads_nothing():
    """tf.zeros_like of a tensor of known shape is a constant in a graph:
    the check above fails for it (the consumer would not wait)."""
    @tf.function
    def constant_zero(x, q):
        return q + tf.zeros_like(tf.sqrt(x))

    q = x = tf.ones((2, 2))
    assert not _reads_the_source(constant_zero, x, q)


def test_docstring_examples_run():
    result = doctest.testmod(data_dependency)
    assert result.attempted >= 5 and result.failed == 0
