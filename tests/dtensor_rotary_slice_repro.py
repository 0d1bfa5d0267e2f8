"""Minimal reproduction: DTensor 2.21 on a tensor split along the sequence
(dimension 1 over a "context" axis), the ops keras-hub's rotary embedding
and a straightforward blockwise attention are written with.

1. keras-hub's rotate-half (`RotaryEmbedding._apply_rotary_pos_emb`:
   `split(x, 2, -1)`, `stack((-x2, x1), -2)`, `reshape`) of a
   (batch, s, heads, dim) tensor split [data, context, -, -]: the result
   comes back laid out [data, -, -, -], i.e. DTensor all-gathers the
   sequence; inside a keras-hub Llama train step the same ops fail to
   compile ("tf.Unpack op ... inconsistent with the provided layout.
   Expected shape: <8,128,4,4> got shape: <8,32,4,4>").
2. A strided slice adding an axis after the split one (`x[:, :, None]`)
   fails in DTensor's strided-slice layout inference with an error whose
   text is not valid UTF-8 (TF raises UnicodeDecodeError); inside a
   compiled Llama step the same inference
   (`slice_util::ForwardLayoutInference::VisitImplicitAxis`) segfaulted
   the process (gdb backtrace), the crash the first attempt at context
   parallelism for keras-hub hit.

tfpar's context parallelism (`tfpar/context_keras_hub.py`) therefore
rotates with an einsum against a constant rotate-half matrix, builds the
cos/sin tables with reshapes, and `tfpar/blockwise_attention.py` adds axes
with `tf.expand_dims`, never a strided slice of a sequence-split tensor.
Each case runs in a child process (a crash must not take the script down).

Run: python tests/dtensor_rotary_slice_repro.py
"""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CASES = ("hub_rotate_half", "newaxis_after_split", "rotate_half_einsum")


def run_case(case):
    import numpy as np  # noqa: PLC0415
    import tfpar  # noqa: PLC0415
    tfpar.use_virtual_cpus(8)
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415
    from tensorflow.experimental import dtensor  # noqa: PLC0415

    mesh = dtensor.create_mesh([("data", 2), ("context", 4)],
                               devices=[f"CPU:{i}" for i in range(8)])
    layout = dtensor.Layout(["data", "context", dtensor.UNSHARDED,
                             dtensor.UNSHARDED], mesh)
    x = dtensor.call_with_layout(tf.ones, layout, shape=(8, 32, 4, 8))

    @tf.function
    def step(x):
        if case == "hub_rotate_half":
            x1, x2 = keras.ops.split(x, 2, axis=-1)
            return keras.ops.reshape(keras.ops.stack((-x2, x1), axis=-2),
                                     x.shape)
        if case == "newaxis_after_split":
            return x[:, :, None] * 2.0
        rotation = np.zeros((8, 8), np.float32)  # the workaround
        rotation[4:, :4], rotation[:4, 4:] = -np.eye(4), np.eye(4)
        return tf.einsum("bshi,ij->bshj", x, tf.constant(rotation))

    specs = dtensor.fetch_layout(step(x)).sharding_specs
    kept = specs[1] == "context"
    print(f"{case}: layout {specs}: "
          + ("the sequence stays split" if kept else
             "BUG: the sequence was gathered"))


def main():
    if len(sys.argv) > 1:
        run_case(sys.argv[1])
        return
    for case in CASES:
        child = subprocess.run([sys.executable, __file__, case],
                               capture_output=True, text=True,
                               errors="replace", check=False)
        lines = [line for line in child.stdout.splitlines()
                 if line.startswith(case)]
        if child.returncode < 0:
            print(f"{case}: BUG: the process died (signal "
                  f"{-child.returncode})")
        elif child.returncode:
            error = child.stderr.strip().splitlines()[-1:]
            print(f"{case}: BUG: failed: {' '.join(error)[:200]}")
        else:
            print(lines[-1] if lines else f"{case}: no output")


if __name__ == "__main__":
    main()
