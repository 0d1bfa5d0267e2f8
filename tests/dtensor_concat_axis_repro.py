"""Minimal reproduction: DTensor 2.21 silently concatenates each device's
blocks when `tf.concat`'s axis is negative and a consumer splits that axis.

a (16, 8) and b (16, 64), both replicated, are joined along their last
dimension and multiplied by g (72,) split over a mesh axis of 4: DTensor
propagates g's split back into the ConcatV2, relays a and b out to blocks
of 2 and 16 columns and concatenates those on each device. Device i then
holds [a[:, 2i:2i+2], b[:, 16i:16i+16]] where columns 18i..18i+17 of
[a | b] belong: a wrong result, no error. With `axis=1` (the same axis,
non-negative) DTensor's Concat expander sees the split and refuses ("Concat
op SPMD with concat dimension in sharded dimension is not supported"); its
check misses the negative spelling, which is Keras' (`Concatenate(axis=-1)`
calls `tf.concat(xs, axis=-1)`). The right result comes from pinning the
joined dimension whole after the concat (a relayout, every other dimension
`MATCH`): what tfpar's steps do (`tfpar._compat._concatenate_whole_along_axis`).

Found by tfpar's fuzzing (issue 17): an Embedding and features joined by a
Concatenate into a BatchNormalization whose gamma is split over `extra`,
every layer recomputed. The forward pass computed the concat whole (its
consumer there was a replicated tensor); the recomputation's fresh ops
took gamma's split, so the backward pass saw other activations: the second
loss 2.6% off one device's.

Run: python tests/dtensor_concat_axis_repro.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import tfpar  # noqa: E402


def results():
    """{way of joining: "right", "wrong" or "fails: <DTensor's error>"} on
    a mesh extra=4 (the first four devices)."""
    import tensorflow as tf  # noqa: PLC0415
    from tensorflow.experimental import dtensor  # noqa: PLC0415

    from tfpar import placement  # noqa: PLC0415

    mesh = tfpar.Mesh({"extra": 4}, devices=[f"CPU:{i}" for i in range(4)])
    rng = np.random.default_rng(0)
    a = rng.normal(size=(16, 8)).astype("float32")
    b = rng.normal(size=(16, 64)).astype("float32")
    g = rng.normal(size=(72,)).astype("float32")
    want = np.concatenate([a, b], axis=1) * g
    whole_columns = dtensor.Layout([dtensor.MATCH, dtensor.UNSHARDED],
                                   mesh.dtensor_mesh)
    ways = {
        "concat(axis=-1) * g": lambda a, b, g: tf.concat([a, b], -1) * g,
        "concat(axis=1) * g": lambda a, b, g: tf.concat([a, b], 1) * g,
        "relayout(concat(axis=-1), whole columns) * g":
            lambda a, b, g: dtensor.relayout(
                tf.concat([a, b], -1), whole_columns) * g,
    }
    inputs = (placement.put(a, (None, None), mesh),
              placement.put(b, (None, None), mesh),
              placement.put(g, ("extra",), mesh))
    found = {}
    for name, f in ways.items():
        try:
            got = placement.fetch(tf.function(f)(*inputs))
        except tf.errors.UnknownError as error:
            found[name] = "fails: " + str(error).split("error: ")[-1].splitlines()[0]
            continue
        found[name] = "right" if np.allclose(got, want, atol=1e-6) else "wrong"
    return found


def main():
    tfpar.use_virtual_cpus(8)
    for name, result in results().items():
        print(f"{name}: {result}")


if __name__ == "__main__":
    main()
