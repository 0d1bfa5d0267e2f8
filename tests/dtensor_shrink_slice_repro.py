"""Minimal reproduction: DTensor 2.21 lays out a StridedSlice that drops a
dimension wrongly when a later dimension is sharded.

`x[:, 1]` of x with shape (2, 3, 8, 4) split over "model" on dimension 2
should be split on dimension 1 of the (2, 8, 4) result; DTensor keeps the
sharding at position 2 (now the size-4 dimension). On model=8 the compile
fails ("requires dimension 2 to be divisible ..."). On model=4 the values
came out wrong without an error while DTensor's all-to-all relayout was on
(TF's default; it is wrong on rank-4 tensors, tests/dtensor_all_to_all_repro.py);
with tfpar's DTENSOR_USE_ALL_TO_ALL_RELAYOUT=0, which this script gets by
importing tfpar, they are right. keras-hub's KV cache is indexed this way
(`cache[:, i, ...]`), so tfpar's steps index tensors with a one-long slice
and a squeeze instead (`tfpar.spmd_ops.index_keeping_dims`).

Run: python tests/dtensor_shrink_slice_repro.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import tfpar  # noqa: E402


def main():
    tfpar.use_virtual_cpus(8)
    import tensorflow as tf  # noqa: PLC0415
    from tensorflow.experimental import dtensor  # noqa: PLC0415
    from tensorflow.python.framework import tensor as tensor_lib  # noqa: PLC0415

    from tfpar import _compat, placement  # noqa: PLC0415

    mesh = tfpar.Mesh({"model": 4, "data": 2})
    a = np.arange(2 * 3 * 8 * 4, dtype="float32").reshape(2, 3, 8, 4)
    x = placement.put(a, (None, None, "model", None), mesh)
    # TF's own indexing, not tfpar's (which is active only in tfpar steps).
    plain_getitem = _compat.unpatched(tensor_lib.Tensor, "__getitem__")

    @tf.function
    def dropped(x):
        return plain_getitem(x, (slice(None), 1)) * 1.0

    @tf.function
    def kept(x):
        return tf.squeeze(x[:, 1:2], 1) * 1.0

    for name, f in (("x[:, 1]", dropped), ("squeeze(x[:, 1:2], 1)", kept)):
        y = f(x)
        print(f"{name}: layout {dtensor.fetch_layout(y).sharding_specs}, "
              f"values right: {np.array_equal(placement.fetch(y), a[:, 1])}")


if __name__ == "__main__":
    main()
