"""Minimal reproduction: DTensor 2.21 cannot lay out a transpose whose
consumer wants a layout the permuted operand does not have.

k (batch, seq, heads, head_dim) split over "data" only, transposed to
(batch, heads, head_dim, seq) for a matmul with queries split over "data"
and "model" (by heads): DTensor gives the transpose's output the queries'
layout and fails ("TransposeOp SPMD needs communication is not supported
yet") instead of relaying out its operand. This is Keras' TF einsum of
keras-hub's cached Gemma attention ("btkgh,bskh->bkgts", written as
transposes and a matmul), with the key read from the KV cache. The same
contraction as one Einsum op compiles: DTensor's Einsum expander relayouts
its operands (`tfpar.spmd_ops.activation_einsum`, used in tfpar's steps).

Run: python tests/dtensor_transpose_repro.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import tfpar  # noqa: E402


def main():
    tfpar.use_virtual_cpus(8)
    import tensorflow as tf  # noqa: PLC0415

    from tfpar import placement  # noqa: PLC0415

    mesh = tfpar.Mesh({"data": 2, "model": 4})
    rng = np.random.default_rng(0)
    k = rng.random((8, 8, 8, 8), dtype=np.float32)  # b s k h
    q = rng.random((8, 8, 8, 8), dtype=np.float32)  # b k t h
    want = q @ k.transpose(0, 2, 3, 1)
    keys = placement.put(k, ("data", None, None, None), mesh)
    queries = placement.put(q, ("data", "model", None, None), mesh)
    ways = {
        "matmul(q, transpose(k))":
            lambda q, k: tf.matmul(q, tf.transpose(k, [0, 2, 3, 1])),
        "einsum('bkth,bskh->bkts', q, k)":
            lambda q, k: tf.einsum("bkth,bskh->bkts", q, k),
    }
    for name, f in ways.items():
        try:
            got = placement.fetch(tf.function(f)(queries, keys))
            print(f"{name}: compiles, values right: {np.allclose(got, want)}")
        except tf.errors.UnknownError as error:
            print(f"{name}: fails: {str(error).splitlines()[0]}")


if __name__ == "__main__":
    main()
