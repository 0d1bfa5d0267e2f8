"""Zeros computed from a tensor: adding one makes an op wait for that tensor.

TF's executor runs an op as soon as its inputs exist, and DTensor keeps
data dependencies only (its SPMD expansion drops control edges). To make an
op wait for a tensor t it must read a value computed from t; tfpar adds to
one of the op's inputs a zero computed from t:

    zero(t) = 0 where t == t, and t (NaN) where t is NaN

elementwise, or of the float32 sum Σt (one scalar: a single all-reduce under
DTensor, not a gather of t). The sum q + zero(t) is q (q + 0 = q exactly,
but for -0.0, which becomes +0.0), unless t holds a NaN: then the sum is NaN,
where the computation waiting on t would give NaN anyway. ±inf gives 0
(inf == inf).

Why this form, and not another:

* `tf.zeros_like(t)` of a tensor whose shape is known is a constant in a
  graph: it reads nothing, so nothing waits.
* a constant 0 added (q + 0.0) is removed by Grappler's constant folding
  (its "x + 0 = x" rule), and a control dependency is dropped by DTensor.
* t·0 is a value computed from t, but it is NaN at ±inf too (0·inf = NaN):
  an overflow in t would turn into a NaN the computation would not give.
  (Grappler also has a rule replacing a product with a constant zero by a
  constant, leaving a control edge at most.)
* t == t is False exactly at NaN, so no compiler may fold it (nor the
  `tf.where` reading it) to a constant: the zero is computed at run time,
  after t.

Two shapes (they differ in the gradient they carry, too):

* `zeros_like_waiting_on(t)`: elementwise, t's shape and dtype; its
  gradient is tf.where's: the upstream gradient at t's NaN entries, 0 at
  the others;
* `scalar_zero_waiting_on(t)`: a float32 scalar from Σt (the branches of
  its `tf.where` are constants): no gradient flows back to t.

Example (a NaN in t spreads; everything else adds exactly 0):

>>> import numpy as np, tensorflow as tf
>>> t = tf.constant([1.0, np.inf, np.nan])
>>> q = tf.constant([2.0, 3.0, 4.0])
>>> (q + zeros_like_waiting_on(t)).numpy()
array([ 2.,  3., nan], dtype=float32)
>>> float(q[0] + scalar_zero_waiting_on(t[:2]))
2.0
>>> bool(tf.math.is_nan(scalar_zero_waiting_on(t)))
True
"""

import tensorflow as tf


def zeros_like_waiting_on(tensor):
    """0 with the shape and dtype of `tensor`, NaN where `tensor` is NaN,
    computed from it at run time (see the module docstring): added to an
    input of an op, it makes the op wait for `tensor`.

    Gradient: the upstream gradient at `tensor`'s NaN entries, 0 elsewhere
    (tf.where's).

    >>> import numpy as np, tensorflow as tf
    >>> zeros_like_waiting_on(tf.constant([5.0, -np.inf, np.nan])).numpy()
    array([ 0.,  0., nan], dtype=float32)
    """
    return tf.where(tf.equal(tensor, tensor), tf.zeros_like(tensor), tensor)


def scalar_zero_waiting_on(tensor):
    """A float32 scalar 0 (NaN if the float32 sum of `tensor` is NaN)
    computed from `tensor` at run time: one all-reduced scalar under
    DTensor, not a gather of `tensor`. A `tf.IndexedSlices` (a sparse
    gradient) is read through its values. Both branches of the `tf.where`
    are constants, so no gradient flows back to `tensor`.

    >>> import numpy as np, tensorflow as tf
    >>> float(scalar_zero_waiting_on(tf.constant([[1.0, 2.0]])))
    0.0
    >>> float(scalar_zero_waiting_on(tf.constant([1.0, np.nan])))
    nan
    """
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tensor.values
    total = tf.reduce_sum(tf.cast(tensor, tf.float32))
    return tf.where(tf.equal(total, total), 0.0, float("nan"))
