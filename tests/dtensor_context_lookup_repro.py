"""Minimal reproduction: DTensor 2.21 cannot compile the backward pass of
attention plus a residual over a stream laid out whole along the sequence
beside a context axis.

On a data=2 × model=2 × context=2 mesh, a hidden-split table (vocab, hidden)
laid out (None, "model") is looked up by token ids (batch, sequence); the
lookup (batch, sequence, hidden/model) is gathered along the hidden
dimension. Then one attention layer as context parallelism computes it
(queries pinned split along the sequence over "context", keys and values
pinned whole along it: `dtensor.relayout`), and a residual adds the
attention output to the stream it read.

- "whole": the lookup's ids and output whole along the sequence (the batch
  split over "data"), what a tensor-parallel embedding did before: the
  forward pass compiles, the gradient does not ("output layout of Relayout
  op after layout propagation does not match layout specified by Relayout
  op", on the `RelayoutLike` of a key/value pin: the pin's gradient). It
  compiles without the residual; the table's layout does not matter (a
  replicated table fails alike): the stream whole along the sequence does.
- "split": the ids and output kept split along the sequence over "context"
  as the step's inputs are (the lookup is per token): it compiles, and the
  table's gradient equals the one computed on one device without layouts
  (`one_device_gradient`).

tfpar's hidden-split embeddings therefore keep the context split
(`tfpar.context_parallel.split_along_sequence`, used by `tfpar.styles`).

Run: python tests/dtensor_context_lookup_repro.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import repro_report  # noqa: E402

VOCAB, HIDDEN, BATCH, SEQ, HEADS = 16, 8, 2, 8, 2
U = dtensor.UNSHARDED


def mesh():
    """The data=2 × model=2 × context=2 DTensor mesh on 8 CPU devices."""
    return repro_report.cpu_mesh([("data", 2), ("model", 2), ("context", 2)])


def _inputs():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(VOCAB, HIDDEN)).astype("float32"),
            rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32"))


def _loss(table, ids, lay=lambda tensor, *specs: tensor, along=U):
    """The lookup, attention (queries split along the sequence over
    "context", keys/values whole: `lay`) and the residual; sum of squares."""
    stream = lay(tf.gather(table, lay(ids, "data", along)), "data", along, U)
    heads = tf.reshape(stream, (BATCH, SEQ, HEADS, HIDDEN // HEADS))
    query = lay(heads, "data", "context", U, U)
    key = lay(heads, "data", U, U, U)
    scores = tf.einsum("bqhd,bkhd->bhqk", query, key)
    attended = tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores), key)
    out = stream + tf.reshape(attended, (BATCH, SEQ, HIDDEN))
    return tf.reduce_sum(out * out)


def one_device_gradient():
    """The table's gradient without any layout (numpy)."""
    table, ids = (tf.constant(v) for v in _inputs())
    with tf.GradientTape() as tape:
        tape.watch(table)
        loss = _loss(table, ids)
    return tf.convert_to_tensor(tape.gradient(loss, table)).numpy()


def attempt(sequence, dmesh):
    """("compiled", the table's gradient as numpy) or (the first line of
    DTensor's error, None), for the lookup laid out along the sequence as
    `sequence` ("whole" or "split")."""
    def lay(tensor, *specs):
        return dtensor.relayout(tensor, dtensor.Layout(list(specs), dmesh))

    def put(array, *specs):
        return lay(dtensor.copy_to_mesh(
            tf.constant(array), dtensor.Layout.replicated(dmesh, array.ndim)),
            *specs)

    table, ids = _inputs()
    along = "context" if sequence == "split" else U

    @tf.function
    def gradient(table, ids):
        with tf.GradientTape() as tape:
            tape.watch(table)
            loss = _loss(table, ids, lay, along)
        return lay(tf.convert_to_tensor(tape.gradient(loss, table)), U, U)

    return repro_report.compiled_or_error(
        lambda: gradient(put(table, U, "model"),
                         put(ids, "data", "context")))


def main():
    dmesh = mesh()
    repro_report.print_beside_one_device(attempt, ("whole", "split"), dmesh,
                                         one_device_gradient())


if __name__ == "__main__":
    main()
