"""Minimal reproduction: DTensor 2.21's `Unpack` (`tf.unstack`, and the
gradient TF gives `Pack`/`tf.stack`) cannot split an output dimension its
input holds whole.

On a mesh data=2 x model=2, a (8, 4, 8, 2, 1) tensor laid out
[data, -, -, -, -] unstacked along dimension 3 (its axis spelled -2 or 3)
into values a consumer needs split along dimension 2 ([data, -, model, -]):
layout propagation gives the Unpack that split for its outputs, and its
SPMD expansion does not slice the input to match, so compilation fails:
"SPMD expansion resulted in op output inconsistent with the provided
layout. Expected shape: <8,4,16,1> got shape: <8,4,8,1>" (each device's
output holds all 8 rows of dimension 2; read with the split layout that is
16). The same in the backward pass of `tf.stack`: keras-hub's rotate-half
(`RotaryEmbedding._apply_rotary_pos_emb`, `stack((-x2, x1), axis=-2)`) on
Qwen3.5's partial rotary dimensions of query heads split over "model"
failed to compile there ("Expected shape: <8,8,16,1> got shape:
<8,8,8,1>"; Llama's full-width rotary did not meet it).

The workaround tfpar's steps use (`tfpar.spmd_ops.stack_by_concat`): the
stack as a `ConcatV2` of the values each given the new dimension
(`expand_dims`, non-negative axis); its gradient is slices of the
incoming gradient, which DTensor lays out. Each way's values are compared
with numpy's.

Run: python tests/dtensor_unpack_layout_repro.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["DTENSOR_USE_ALL_TO_ALL_RELAYOUT"] = "0"  # as `import tfpar` sets

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

U = dtensor.UNSHARDED
SHAPE = (8, 4, 8, 2)  # (batch, sequence, heads, rotary dims)


def stacked_by_concat(values, axis):
    """tf.stack(values, axis) as a concat of expand_dims (the workaround)."""
    axis %= values[0].shape.rank + 1
    return tf.raw_ops.ConcatV2(
        values=[tf.expand_dims(v, axis) for v in values], axis=axis)


def cases(mesh):
    """{way: (function of (x, dy), numpy's result)}; x (8, 4, 8, 2) split
    over heads, dy (8, 4, 8, 2, 1) whole over heads."""
    split = dtensor.Layout(["data", U, "model", U], mesh)

    def unstack(axis):
        def f(x, dy):
            return [dtensor.relayout(v, split)
                    for v in tf.unstack(dy, axis=axis)]
        return f

    def stack_gradient(stack):
        def f(x, dy):
            halves = tf.split(x, 2, axis=-1)
            with tf.GradientTape() as tape:
                tape.watch(halves)
                y = stack([-halves[1], halves[0]], -2)
            return [dtensor.relayout(g, split) for g in tape.gradient(
                y, halves, output_gradients=dy)]
        return f

    rng = np.random.default_rng(0)
    x = rng.normal(size=SHAPE).astype("float32")
    dy = rng.normal(size=SHAPE[:3] + (2, 1)).astype("float32")
    unstacked = [dy[..., 0, :], dy[..., 1, :]]
    gradient = [dy[..., 1, :], -dy[..., 0, :]]
    return (x, dy), {
        "unstack(axis=-2) into heads split": (unstack(-2), unstacked),
        "unstack(axis=3) into heads split": (unstack(3), unstacked),
        "gradient of stack(axis=-2)": (stack_gradient(tf.stack), gradient),
        "gradient of concat(expand_dims, axis=3)": (
            stack_gradient(stacked_by_concat), gradient),
    }


def unpack_case(mesh=None):
    """{way: "right" | "wrong" | "fails: <DTensor's error>"}."""
    mesh = mesh or dtensor.create_mesh(
        [("data", 2), ("model", 2)], devices=[f"CPU:{i}" for i in range(4)])
    (x, dy), ways = cases(mesh)
    inputs = (dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, 4)),
              dtensor.copy_to_mesh(dy, dtensor.Layout.replicated(mesh, 5)))
    inputs = (dtensor.relayout(inputs[0], dtensor.Layout(
                  ["data", U, "model", U], mesh)),
              dtensor.relayout(inputs[1], dtensor.Layout(
                  ["data", U, U, U, U], mesh)))
    found = {}
    for name, (f, want) in ways.items():
        try:
            got = tf.function(f, autograph=False)(*inputs)
        except tf.errors.OpError as error:
            found[name] = ("fails: " +
                           str(error).split("error: ")[-1].splitlines()[0])
            continue
        replicated = [dtensor.relayout(g, dtensor.Layout.replicated(
            mesh, g.shape.rank)) for g in got]
        right = all(np.allclose(dtensor.unpack(g)[0].numpy(), w, atol=1e-6)
                    for g, w in zip(replicated, want))
        found[name] = "right" if right else "wrong"
    return found


def main():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    for name, result in unpack_case().items():
        print(f"{name}: {result}", flush=True)


if __name__ == "__main__":
    main()
