"""Slices that add axes, in a step: `expand_dims` after the slice.

DTensor 2.21 cannot lay out a StridedSlice with a new-axis mask on a split
tensor: a compile error ("'tf.StridedSlice' op ComputeLayoutForward
error: sharding spec") or a segmentation fault of the whole process
(tests/dtensor_newaxis_slice_repro.py). keras-hub's XLNet indexes
`segment_ids[:, None]` and failed on every mesh (tests/
test_keras_hub_more.py); a user's layer with `x[:, tf.newaxis]` or a raw
`tf.strided_slice(..., new_axis_mask=...)` on a batch-split activation
met the same. In a step tfpar runs such a slice as the slice without its
new axes and one `tf.expand_dims` per new axis
(`spmd_ops.slice_adding_axes_by_expand_dims`).
"""

import keras
import numpy as np
import pytest
from hypothesis import strategies as st
import tensorflow as tf
from tensorflow.python.ops import gen_array_ops

import tfpar
from tfpar import _compat, compile_errors, spmd_ops

import fuzzing
import models

MASKS = ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
         "shrink_axis_mask")


def strided_slice_of(key, x):
    """(begin, end, strides, masks) of the StridedSlice TF makes for
    `x[key]`, read from its graph."""
    graph = tf.function(lambda t: t[key]).get_concrete_function(
        tf.TensorSpec(x.shape, x.dtype)).graph
    op = next(o for o in graph.get_operations() if o.type == "StridedSlice")
    spec = [tf.get_static_value(t) for t in op.inputs[1:4]]
    return spec, [op.get_attr(mask) for mask in MASKS]


@pytest.mark.parametrize("key", [
    (slice(None), None), (None,), (None, Ellipsis, None), (Ellipsis, None),
    (1, None, slice(None)), (None, 1, Ellipsis, None),
    (slice(None), None, -1), (slice(0, 1), None, slice(None), None, 2),
    (Ellipsis, 1, None), (None, slice(None, None, -1)),
    (slice(1, None), None, slice(None, None, 2)),
])
def test_a_slice_adding_axes_equals_tf_indexing(key):
    x = tf.reshape(tf.range(2 * 3 * 4, dtype=tf.float32), (2, 3, 4))
    spec, masks = strided_slice_of(key, x)
    assert masks[3], "the key adds no axis: not this test's case"
    plain = _compat.unpatched(gen_array_ops, "strided_slice")
    got = spmd_ops.slice_adding_axes_by_expand_dims(plain, x, *spec, *masks)
    want = x[key]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


SHAPE = (2, 3, 4)


@st.composite
def keys_adding_axes(draw):
    """An index of a (2, 3, 4) tensor with at least one new axis: Nones,
    at most one Ellipsis, integers (negative too) and slices (any step but
    0) for at most three dimensions, in any order."""
    dims = draw(st.integers(0, len(SHAPE)))
    items = []
    for size in SHAPE[:dims]:
        bound = st.integers(-size - 1, size + 1) | st.none()
        items.append(draw(st.integers(-size, size - 1) | st.builds(
            slice, bound, bound, st.sampled_from([None, 1, 2, -1, -2]))))
    for _ in range(draw(st.integers(1, 3))):
        items.insert(draw(st.integers(0, len(items))), None)
    if draw(st.booleans()):
        items.insert(draw(st.integers(0, len(items))), Ellipsis)
    return tuple(items)


def check_any_slice_adding_axes_equals_tf_indexing(case):
    x = tf.reshape(tf.range(np.prod(SHAPE), dtype=tf.float32), SHAPE)
    spec, masks = strided_slice_of(case, x)
    plain = _compat.unpatched(gen_array_ops, "strided_slice")
    got = spmd_ops.slice_adding_axes_by_expand_dims(plain, x, *spec, *masks)
    want = x[case]
    assert got.shape == want.shape, (case, got.shape, want.shape)
    np.testing.assert_array_equal(got, want)


(test_any_slice_adding_axes_equals_tf_indexing,
 test_any_slice_adding_axes_equals_tf_indexing_long) = fuzzing.fast_and_long(
    check_any_slice_adding_axes_equals_tf_indexing, keys_adding_axes(), 30)


class NewAxes(keras.layers.Layer):
    """x (batch, n) -> x[:, None, :] by a raw `tf.strided_slice`, and
    x[:, tf.newaxis] by indexing, summed over the new axes."""

    def call(self, x):
        raw = tf.strided_slice(x, [0, 0, 0], [0, 0, 0], [1, 1, 1],
                               begin_mask=5, end_mask=5, new_axis_mask=2)
        return tf.reduce_sum(raw, 1) + tf.reduce_sum(x[:, tf.newaxis], 1)


def test_slices_adding_axes_train_in_a_step_like_one_device():
    """On data=8 the raw new-axis slice of a batch-split activation
    crashed the process (segmentation fault) before."""
    models.assert_layer_trains_like_one_device(NewAxes, {"data": 8}, 4)


def test_a_layout_error_without_an_operation_line_is_explained():
    """The error XLNet's step raised ("'tf.StridedSlice' op
    ComputeLayoutForward error: sharding spec (...", no "see current
    operation" line, no DTensor source path) was re-raised as TF's own
    UnknownError; such errors are DTensor's and are explained too."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    message = ("model.py:45:1: error: 'tf.StridedSlice' op "
               "ComputeLayoutForward error: sharding spec (@ "
               "[Op:__inference__in_replica_3898]")

    def step():
        raise tf.errors.UnknownError(None, None, message)

    with pytest.raises(ValueError, match=r"DTensor could not compile the "
                       r"train step.*its tf\.StridedSlice op failed"):
        compile_errors.explaining(step, model, strategy.extended, "train")()


class _PositionsOuter(keras.layers.Layer):
    """RoFormerV2's positions: `arange(seq)[None]` (new axes only) into
    Keras' "...,d->...d" einsum."""

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[1],
                                     dtype=x.dtype)[None]
        angles = keras.ops.einsum("...,d->...d", positions,
                                  keras.ops.arange(0, 4, dtype=x.dtype))
        return x + keras.ops.sum(angles, -1)


def test_a_slice_of_new_axes_only_feeds_an_ellipsis_einsum():
    """`x[None]` is `expand_dims(x)` itself: with an Identity in between,
    DTensor 2.21 could not lay out the einsum's broadcast ("Broadcasting
    is unimplemented for einsum")."""
    models.assert_layer_trains_like_one_device(
        _PositionsOuter, {"data": 2, "model": 4}, 6)
