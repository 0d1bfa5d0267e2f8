"""keras-hub's learned position table broadcast along a split batch.

keras-hub's `PositionEmbedding` (GPT-2, and the encoders that use it)
returns `ops.broadcast_to(table_rows, (batch, seq, hidden))`: the same
(seq, hidden) rows for every example. DTensor 2.21 lays such a broadcast
out whole along the batch on every device, and the table's gradient, the
sum over the batch of the output's gradient, is then computed from the
whole batch on every device: the residual stream's gradient, split over
the data axis everywhere else, is all-gathered over data (B·S·H/t values
per device and step, H/t the hidden block; GPT-2's `AddN_13` on data=2 x
model=4).

In a step whose batch is split over the data axis
(`ParallelDims.batch_split`, the one rule), this broadcast is laid out
split over data along the batch (`broadcast_split_over_batch`): each
device keeps its own rows (forward: a local slice of the broadcast, no
collective), and the gradient d rows = sum over the batch of dy is summed
over each device's rows, then all-reduced over the data axis by DTensor
(S·H/t values: the data-parallel gradient sum every weight has). Under
context parallelism the sequence dimension stays split over the context
axis the same way. The hidden dimension keeps the layout DTensor gives it
(split over the model axis by tensor parallelism, or whole).

Scope: only keras-hub's position-embedding module is patched, at the name
its code looks Keras' ops up by (`position_embedding.ops`, `PATCHES`):
`PositionEmbedding.call` itself is `context_keras_hub`'s patch (one patch
per attribute), and a patch of every float broadcast in a step moved bytes
elsewhere and asked DTensor for impossible layouts. keras-hub's
`SinePositionEncoding` broadcasts a constant (no gradient: nothing is
gathered) and is left alone.

keras-hub's DINOv2 keeps two tables, its pretrained `position_embeddings`
and the `interpolated_position_embeddings` it trains for its image size,
and resizes one into the other (bicubic) when it builds, saves and loads
— eagerly, outside any step. Under a strategy the tables are DTensors,
DTensor 2.21 runs the resize on one device and returns a regular tensor,
and the concatenation with the class token's row then failed ("ConcatV2
got a regular tensor ... but was expecting a DTensor"): DINOv2 could not
be built in a strategy's scope. `interpolated_on_host` resizes the host
copy of the table and returns the result replicated on the table's mesh.

Example:

>>> import tensorflow as tf
>>> broadcast_split_over_batch(tf.ones((2, 3)), (4, 2, 3)).shape
TensorShape([4, 2, 3])
"""


import functools

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import context_parallel
from tfpar import placement
from tfpar import step_context


def broadcast_split_over_batch(tensor, shape):
    """`tf.broadcast_to(tensor, shape)`, in a step whose batch (`shape[0]`)
    is split over the data axis and whose `tensor` has no batch of its own
    (absent, or of size 1): the result split over data along the batch,
    the sequence (the dimension before the last) split over the context
    axis when the step splits it, the last dimension as DTensor lays it
    out, any other whole; its gradient summed over each device's rows (see
    the module docstring). Any other call: `tf.broadcast_to`'s own.

    >>> import tensorflow as tf
    >>> rows = tf.constant([[1.0, 2.0]])  # (seq=1, hidden=2)
    >>> broadcast_split_over_batch(rows, (3, 1, 2)).numpy().tolist()
    [[[1.0, 2.0]], [[1.0, 2.0]], [[1.0, 2.0]]]
    """
    tensor = tf.convert_to_tensor(tensor)
    layout = _split_layout(tensor, shape)
    if layout is None:
        return tf.broadcast_to(tensor, shape)
    shape = [int(dim) for dim in shape]
    lead = len(shape) - tensor.shape.rank
    # d tensor = dy summed over the dimensions the broadcast added or grew.
    summed = list(range(lead)) + [
        lead + i for i, dim in enumerate(tensor.shape)
        if dim == 1 and shape[lead + i] != 1]

    @tf.custom_gradient
    def broadcast(x):
        def grad(dy):
            total = tf.reduce_sum(dtensor.relayout(dy, layout), summed)
            return tf.reshape(total, tf.shape(x))
        return dtensor.relayout(tf.broadcast_to(x, shape), layout), grad

    return broadcast(tensor)


def _split_layout(tensor, shape):
    """The layout `broadcast_split_over_batch` gives the result, or None
    where it leaves the broadcast to TF: outside a step (or between a
    pipeline's parts), a non-float tensor, a shape not of static ints of
    rank >= 2, a batch the tensor has itself or the data axis does not
    split."""
    extended = step_context.step_extended()
    mesh = step_context.step_mesh()
    if (extended is None or mesh is None or not tensor.dtype.is_floating
            or tensor.shape.rank is None or isinstance(shape, tf.Tensor)
            or not all(isinstance(dim, int) for dim in shape)
            or len(shape) < max(2, tensor.shape.rank)):
        return None
    lead = len(shape) - tensor.shape.rank
    if lead == 0 and tensor.shape[0] != 1:
        return None  # the batch is the tensor's own
    data_axis = extended.dims.batch_split(shape[0])
    if data_axis is None or data_axis not in mesh.dtensor_mesh.dim_names:
        return None
    specs = [data_axis] + [dtensor.UNSHARDED] * (len(shape) - 2)
    split = context_parallel.context_in_step()
    if split is not None and len(shape) >= 3:
        specs[-1] = split.axis  # the sequence, split as the inputs are
    return dtensor.Layout(specs + [dtensor.MATCH], mesh.dtensor_mesh)


class _OpsWithSplitBroadcast:
    """Keras' `ops` module as keras-hub's position-embedding code reads it,
    its `broadcast_to` being `broadcast_split_over_batch` in a step."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def broadcast_to(self, x, shape):
        if step_context.in_spmd_step():
            return broadcast_split_over_batch(x, shape)
        return self._ops.broadcast_to(x, shape)


def _split_broadcast_ops(original, _):
    return _OpsWithSplitBroadcast(original)


def interpolated_on_host(interpolate):
    """keras-hub DINOv2's `_interpolate_position_embeddings(table, ...)`
    (a staticmethod) computed on the host copy of `table` when, eagerly,
    `table` (a variable or tensor) is a DTensor; the result replicated on
    its mesh. Otherwise `interpolate` itself.

    >>> resize = interpolated_on_host(lambda table, **_: table * 2)
    >>> float(resize(tf.ones((1, 2)))[0, 0])
    2.0
    """
    @functools.wraps(interpolate)
    def on_host(position_embeddings, **kwargs):
        value = getattr(position_embeddings, "value", position_embeddings)
        if hasattr(value, "read_value"):  # a variable: its current value
            value = value.read_value()
        if not tf.executing_eagerly() or not dtensor.is_dtensor(value):
            return interpolate(position_embeddings, **kwargs)
        mesh = dtensor.fetch_layout(value).mesh
        result = interpolate(tf.constant(placement.fetch(value)), **kwargs)
        return dtensor.copy_to_mesh(
            result, dtensor.Layout.replicated(mesh, result.shape.rank))

    return on_host


PATCHES = (
    _compat.Patch(
        "hub_position_broadcast",
        _compat.optional_owner(
            "keras_hub.src.layers.modeling.position_embedding"),
        "ops", _split_broadcast_ops),
    _compat.Patch(
        "hub_dinov2_interpolation",
        _compat.optional_owner(
            "keras_hub.src.models.dinov2.dinov2_layers", "DINOV2Embedding"),
        "_interpolate_position_embeddings",
        lambda original, _: staticmethod(interpolated_on_host(original))),
)
"""Installed with the strategy's patches (`tfpar.patches.install`)."""
