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
  gradient equals "whole"'s computed on one device.

tfpar's hidden-split embeddings therefore keep the context split
(`tfpar.context_parallel.split_along_sequence`, used by `tfpar.styles`).

Run: python tests/dtensor_context_lookup_repro.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import tfpar  # noqa: E402

VOCAB, HIDDEN, BATCH, SEQ, HEADS = 16, 8, 2, 8, 2


def mesh():
    tfpar.use_virtual_cpus(8)
    return tfpar.Mesh({"data": 2, "model": 2, "context": 2})


def attempt(sequence, on_mesh):
    """"compiled <gradient norm>" or the first line of DTensor's error, for
    the lookup laid out along the sequence as `sequence` ("whole" or
    "split")."""
    import tensorflow as tf  # noqa: PLC0415
    from tensorflow.experimental import dtensor  # noqa: PLC0415

    from tfpar import placement  # noqa: PLC0415

    dmesh = on_mesh.dtensor_mesh
    along = "context" if sequence == "split" else dtensor.UNSHARDED

    def laid(tensor, *specs):
        return dtensor.relayout(tensor, dtensor.Layout(list(specs), dmesh))

    rng = np.random.default_rng(0)
    table = placement.put(rng.normal(size=(VOCAB, HIDDEN)).astype("float32"),
                          (None, "model"), on_mesh)
    ids = placement.put(rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32"),
                        ("data", "context"), on_mesh)
    u = dtensor.UNSHARDED

    @tf.function
    def gradient(table, ids):
        with tf.GradientTape() as tape:
            tape.watch(table)
            stream = laid(tf.gather(table, laid(ids, "data", along)),
                          "data", along, u)
            heads = tf.reshape(stream, (BATCH, SEQ, HEADS, HIDDEN // HEADS))
            query = laid(heads, "data", "context", u, u)
            key = laid(heads, "data", u, u, u)
            scores = tf.einsum("bqhd,bkhd->bhqk", query, key)
            attended = tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores),
                                 key)
            out = stream + tf.reshape(attended, (BATCH, SEQ, HIDDEN))
            loss = tf.reduce_sum(out * out)
        return tf.convert_to_tensor(tape.gradient(loss, table))

    try:
        grad = gradient(table, ids)
    except Exception as error:  # noqa: BLE001 - DTensor's compile error
        return str(error).strip().splitlines()[0]
    return f"compiled {np.linalg.norm(placement.fetch(grad)):.4f}"


def main():
    on_mesh = mesh()
    for sequence in ("whole", "split"):
        print(f"{sequence}: {attempt(sequence, on_mesh)}")


if __name__ == "__main__":
    main()
