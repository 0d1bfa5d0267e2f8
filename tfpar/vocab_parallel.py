"""Vocabulary-parallel ops: the argmax of split logits, a split table's lookup.

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

A token table split by rows over the model axis (a tied head's, under
`tfpar.VocabParallel`) is looked up as Megatron-LM's vocab-parallel
embedding does (`lookup`): each device reads the rows it holds and the
blocks are summed, an all-reduce of the (tokens, hidden) output instead of
the whole table gathered on every device.

Example:

>>> z = tf.constant([[1.0, 3.0, 3.0, -2.0]])
>>> int(argmax_by_reductions(z)[0])
1
"""

import functools

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import keras_graph
from tfpar import step_context
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


def lookup(table, ids, mesh_axis):
    """The rows `table[ids]` of a (vocab, hidden) `table` split by rows
    over `mesh_axis`, as Megatron-LM's vocab-parallel embedding computes
    them: device k of n holds rows [k·V/n, (k+1)·V/n) and reads, for each
    id, row id - k·V/n where it holds it and zeros elsewhere; the (n,
    *ids.shape, hidden) blocks summed over k (an all-reduce over
    `mesh_axis` of the output, the size of the lookup) give each id its
    row. Written on the global view: (n, V/n, hidden) blocks split over
    `mesh_axis` along the first dimension and a batched gather, so that
    DTensor runs each device's block locally; DTensor 2.21 gathers the
    whole table for a plain `tf.gather` of a row-split table.

    Backward: block k's gradient is onehot(local_k)ᵀ · dy, local_k the
    ids' rows in block k (-1, a zero one-hot row, where k does not hold
    the id): a batched matmul over the ids (2·T·V/n·hidden FLOPs per
    device, T the ids on it; its (T, V/n) one-hot the size of a
    vocab-parallel head's logits block, built in the backward pass),
    dense as a tied table's gradient is anyway, summed over the data axis
    as every gradient is; dy needs no communication. DTensor 2.21 runs
    the gather's own gradient (a segment sum, whose output it cannot
    split) as a (vocab, hidden) partial gradient on every device,
    reduce-scattered over `mesh_axis`, with dy gathered over the data
    axis (measured, tests/test_vocab_parallel_lookup.py). Outside a step,
    or when `mesh_axis` is not an axis of the step's mesh with more than
    one device: `tf.gather`. Ids (of rank up to 7) outside [0, V) read
    zeros (a one-device gather on CPU raises).

    Example (inside a step on Mesh({"data": 2, "model": 4}), a 512 × 64
    table split [model, None]):

    >>> lookup(table, token_ids, "model").shape   # token_ids: (8, 128)
    TensorShape([8, 128, 64])
    """
    mesh = step_context.step_mesh()
    mesh = None if mesh is None else mesh.dtensor_mesh
    if (mesh is None or mesh_axis not in mesh.dim_names
            or mesh.dim_size(mesh_axis) == 1):
        return tf.gather(table, ids)
    with tf.name_scope("vocab_parallel_lookup"):
        return _lookup_by_blocks(table, ids, mesh_axis, mesh)


def _lookup_by_blocks(table, ids, mesh_axis, mesh):
    """`lookup` inside a step on `mesh` (see there)."""
    n = mesh.dim_size(mesh_axis)
    vocab, hidden = table.shape
    rows = vocab // n
    unsharded = dtensor.UNSHARDED
    blocks = dtensor.relayout(
        tf.reshape(table, (n, rows, hidden)),
        dtensor.Layout([mesh_axis, unsharded, unsharded], mesh))
    first_rows = dtensor.relayout(tf.range(n, dtype=ids.dtype) * rows,
                                  dtensor.Layout([mesh_axis], mesh))
    # local[k, ...] = ids - k·V/n: the row of block k, if block k holds it
    # (else -1, whose one-hot row is zeros).
    local = tf.expand_dims(ids, 0) - tf.reshape(
        first_rows, [n] + [1] * ids.shape.rank)
    held = tf.logical_and(local >= 0, local < rows)
    local = tf.where(held, local, -tf.ones_like(local))
    letters = "abcdefg"[:ids.shape.rank]  # the ids' dimensions
    if ids.shape.rank > len(letters):
        raise ValueError(
            "vocab_parallel.lookup takes ids of rank up to 7. Received: "
            f"ids of shape {ids.shape}. Reshape them to fewer dimensions.")

    @tf.custom_gradient
    def rows_of(blocks):
        def gradient(dy):
            # The one-hot ids (T × V/n) made from dy's values too, so that
            # they are built in the backward pass, not kept from the
            # forward one (-1 where dy is NaN: every row's gradient is NaN
            # then, where one device's has NaN in that id's row).
            waiting = tf.where(tf.math.is_nan(tf.reduce_sum(dy, axis=-1)),
                               -tf.ones_like(ids), tf.zeros_like(ids))
            return tf.einsum(f"k{letters}r,{letters}h->krh",
                             tf.one_hot(local + waiting, rows, dtype=dy.dtype),
                             dy)
        read = tf.gather(blocks, tf.maximum(local, 0), batch_dims=1)
        return tf.einsum(f"k{letters}h,k{letters}->{letters}h", read,
                         tf.cast(held, read.dtype)), gradient

    return rows_of(blocks)


def takes_vocab_parallel_lookups(layer):
    """Whether `embedding_lookup` computes `layer`'s lookups: a tied Keras
    ReversibleEmbedding (keras-hub's too), not quantized, whose class does
    not override `call` (its lookup is `take(embeddings, ids)` cast to the
    compute dtype, the Embedding's mask set on it). Tied, because one
    device's gradient of a tied table is dense (the projection's part
    added to the lookup's rows), as `lookup`'s is: a table only looked up
    has a sparse one, whose repeated ids Keras' Adam squares apart
    (Σ g², not (Σ g)²), so it keeps Keras' lookup (the table gathered)."""
    return (isinstance(layer, keras.layers.ReversibleEmbedding)
            and type(layer).call is keras.layers.ReversibleEmbedding.call
            and getattr(layer, "tie_weights", False)
            and getattr(layer, "quantization_mode", None) is None)


def reverse_head_biases(head):
    """The logits' biases of a head that projects onto a token embedding
    it holds (`head.token_embedding`, keras-hub's MaskedLMHead: that
    table's reverse call, then the head's own (vocab,) bias), or None for
    any other layer: every weight the head owns itself (not through its
    sublayers) must be such a bias. `auto_rules(vocab_parallel=True)`
    splits the table and these biases over the vocabulary; the planner
    costs them so."""
    table_layer = getattr(head, "token_embedding", None)
    table = getattr(table_layer, "embeddings", None)
    if table is None or len(table.shape) != 2:
        return None
    own = keras_graph.own_weights(head)
    if not own or any(tuple(w.shape) != (table.shape[0],) for w in own):
        return None
    return own


def embedding_lookup(layer, ids, mesh_axis):
    """`layer(ids)` for a tied ReversibleEmbedding whose table is split by
    rows over `mesh_axis` (`takes_vocab_parallel_lookups`), its rows read
    by `lookup`; a LoRA-enabled table's `embeddings` (table + A·B) read
    the same way."""
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    rows = tf.cast(lookup(tf.convert_to_tensor(layer.embeddings), ids,
                          mesh_axis), layer.compute_dtype)
    mask = keras.layers.Embedding.compute_mask(layer, ids)
    if mask is not None:
        _compat.set_keras_mask(rows, mask)
    return rows


def _keras_numpy():
    return _compat.keras_module("backend.tensorflow.numpy")


PATCHES = (_compat.Patch("argmax_by_reductions", _keras_numpy, "argmax",
                         _argmax_in_step),)
