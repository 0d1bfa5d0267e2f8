"""Ordering tokens: a stage's actions run in its schedule's order.

DTensor's graph lowering keeps only data dependencies between stateless
ops (control dependencies are dropped), so a stage's actions are chained by
data: each action yields a zero "token" computed from its results
(`token_of`), and the next action on that stage adds the token to its
inputs (`after`). Adding zeros changes no value; the executor cannot start
the action before the previous one produced its results.

Example:

>>> import tensorflow as tf
>>> token = token_of([tf.ones((4, 3))], rows=4)   # one zero per row
>>> [v.numpy().tolist() for v in after([tf.ones((4, 1))], token)][0]
[[1.0], [1.0], [1.0], [1.0]]
"""

import tensorflow as tf

from tfpar import _compat


def token_of(tensors, rows):
    """Zeros that depend on `tensors`. From a tensor with `rows` (micro-batch)
    rows: one zero per row, split like the batch (no communication);
    otherwise a scalar (e.g. from a loss or a weight gradient). None when
    no tensor is floating."""
    tensors = [t for t in tensors if t is not None and t.dtype.is_floating]
    if not tensors:
        return None
    batched = [t for t in tensors if t.shape.rank and t.shape[0] == rows]
    source = min(batched or tensors,
                 key=lambda t: t.shape.num_elements() or 0)
    if batched and source.shape.rank > 1:
        source = source[..., :1]  # one column: the batch split stays local
    # min(|t|, 0) is 0 but, unlike t * 0 or zeros_like(t), is not folded
    # away by TF's graph optimiser, so the dependency survives.
    zeros = tf.cast(tf.minimum(tf.abs(source), 0), tf.float32)
    axes = list(range(1 if batched else 0, source.shape.rank))
    return tf.reduce_sum(zeros, axis=axes) if axes else zeros


def after(values, token):
    """`values` plus zero from `token`: they exist only after the token.

    The token is NaN where the results it came from are (a diverged
    step): floating values then turn NaN too, as the step's would; integer
    values (token ids) get min(isnan(t), 0), a zero whatever t is, since
    NaN cast to an integer is the most negative one (an Embedding would
    then fail on an index out of range instead of training on to a NaN
    loss as one device does)."""
    if token is None:
        return values
    out = []
    for v in values:
        if v is None or v.dtype == tf.bool:
            out.append(v)
            continue
        t = token
        if t.shape.rank and not (v.shape.rank and v.shape[0] == t.shape[0]):
            t = tf.reduce_sum(t)  # a value without the batch dimension
        if t.shape.rank:
            t = tf.reshape(t, [-1] + [1] * (v.shape.rank - 1))
        if v.dtype.is_floating or v.dtype.is_complex:
            waiting = v + tf.cast(t, v.dtype)
        else:
            waiting = v + tf.minimum(tf.cast(tf.math.is_nan(t), v.dtype), 0)
        # The same value, so the same Keras mask (a layer that reads its
        # input's mask, e.g. MultiHeadAttention, reads it from the value).
        _compat.set_keras_mask(waiting, _compat.keras_mask(v))
        out.append(waiting)
    return out
