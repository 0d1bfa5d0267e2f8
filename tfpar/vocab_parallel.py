"""Vocabulary-parallel argmax: the index of the largest logit, by reductions.

With the output head split over the vocabulary (`tfpar.VocabParallel`,
`auto_rules(vocab_parallel=True)`) each device holds logits (batch,
sequence, vocab/k). The loss keeps them split (DTensor expands
`SparseSoftmaxCrossEntropyWithLogits` into local work and (tokens, 1)
all-reduces), but `tf.argmax` over a split axis makes DTensor gather the
whole logits on every device: keras-hub's default training metric
(`SparseCategoricalAccuracy`, `ops.argmax(y_pred, -1)`) and the greedy
sampler do that. Inside a tfpar step, `keras.ops.argmax` over the last axis
is computed instead as

    m = max_j z_j                      (local max, all-reduced: max)
    argmax = min {j : z_j == m}        (local min of matching indices,
                                        all-reduced: min)

two reductions DTensor runs on the local blocks with (tokens, 1)
all-reduces. It is the same index as `tf.argmax` (the first largest value)
(NaN skipped, as `tf.argmax` on CPU skips it); Keras' -0.0 -> -tiny
rewrite is kept. Outside a step, and for other axes, Keras' own argmax runs.

`PATCHES` is installed with the strategy's (`tfpar.patches.install`).

Example:

>>> z = tf.constant([[1.0, 3.0, 3.0, -2.0]])
>>> int(argmax_by_reductions(z)[0])
1
"""

import functools

import numpy as np
import tensorflow as tf

from tfpar import _compat
from tfpar.step_context import in_spmd_step


def argmax_by_reductions(logits):
    """The index (int32) of the first largest value along the last axis of
    float `logits`, from a max and a min over that axis (no argmax op).
    NaN is skipped, as `tf.argmax` skips it (a row of only NaN and -inf:
    index 0)."""
    # NaN as -inf: tf.reduce_max propagates NaN, tf.argmax skips it.
    logits = tf.where(tf.math.is_nan(logits),
                      tf.constant(-np.inf, logits.dtype), logits)
    largest = tf.reduce_max(logits, axis=-1, keepdims=True)
    size = tf.shape(logits)[-1]
    index = tf.range(size, dtype=tf.int32)
    return tf.reduce_min(tf.where(tf.equal(logits, largest), index, size),
                         axis=-1)


def _argmax_in_step(original, hooks):
    """Keras' TF-backend `argmax`: in a tfpar step, over the last axis of a
    float tensor, by reductions (`argmax_by_reductions`)."""
    del hooks  # no strategy hook needed

    @functools.wraps(original)
    def argmax(x, axis=None, keepdims=False):
        x = tf.convert_to_tensor(x)
        if (not in_spmd_step() or not x.dtype.is_floating or x.shape.rank
                is None or x.shape.rank == 0 or axis is None
                or axis not in (-1, x.shape.rank - 1)):
            return original(x, axis=axis, keepdims=keepdims)
        x = tf.cast(x, tf.float32) if x.dtype.size < 4 else x
        # Keras' flush-to-zero fix: -0.0 counts as the smallest negative.
        negative_zero = tf.logical_and(tf.equal(x, 0.0),
                                       tf.math.sign(1.0 / x) < 0)
        x = tf.where(negative_zero,
                     tf.constant(-np.finfo(x.dtype.as_numpy_dtype).tiny,
                                 x.dtype), x)
        index = argmax_by_reductions(x)
        return tf.expand_dims(index, -1) if keepdims else index

    return argmax


def _keras_numpy():
    return _compat.keras_module("backend.tensorflow.numpy")


PATCHES = (_compat.Patch("argmax_by_reductions", _keras_numpy, "argmax",
                         _argmax_in_step),)
