"""What ring attention needs from DTensor 2.21 on CPU, tried minimally.

Ring attention passes each device's key/value block to its neighbour on
the context axis inside one step (a collective permute), and skips the
blocks a device's queries cannot see (causal). On a 4-device CPU mesh
("context", 4), with x (8, 2) split along dimension 0 over the axis:

1. `tf.roll(x, shift=2, axis=0)` (the ring step in global view: every
   device's block moves to the next device) compiles, but not to a permute:
   DTensor makes x whole first (an all-gather), rolls, and slices; every
   device then holds every block. Printed: the collectives of the compiled
   program ("all-gather" before the roll) and whether the result is right.
2. `tf.raw_ops.CollectivePermute` (XLA's permute, what a TPU ring uses) in
   a DTensor function: DTensor has no layout propagation for it, an error.
3. A per-device skip: `tf.cond` on a predicate from the local block (is
   this device's largest position below k?). A predicate is a scalar,
   which DTensor can only lay out whole: it all-reduces the sharded
   reduction first, so every device takes the same branch; no device can
   skip a block that another one needs.

Run: python tests/dtensor_ring_permute_repro.py  (prints one line per case).
"""

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import tfpar  # noqa: E402  (reads the compiled program's collectives)

tfpar.use_virtual_cpus(4)
mesh = dtensor.create_mesh([("context", 4)], device_type="CPU")
split = dtensor.Layout(["context", dtensor.UNSHARDED], mesh)
x = dtensor.relayout(dtensor.copy_to_mesh(
    tf.constant(np.arange(16, dtype="float32").reshape(8, 2)),
    dtensor.Layout.replicated(mesh, 2)), split)


@tf.function
def ring_step(value):
    return dtensor.relayout(tf.roll(value, shift=2, axis=0), split)


def roll_case():
    report = tfpar.communication_report(ring_step, x)
    kinds = sorted({c.purpose for c in report.collectives})
    blocks = [b.numpy()[:, 0].tolist() for b in dtensor.unpack(ring_step(x))]
    right = blocks == [[14.0, 12.0][::-1], [0.0, 2.0], [4.0, 6.0],
                       [8.0, 10.0]]
    print(f"1. tf.roll as a ring step: collectives {kinds}, right={right}, "
          "permute=" + str(any("permute" in k for k in kinds)))


@tf.function
def permute(value):
    return tf.raw_ops.CollectivePermute(
        input=value, source_target_pairs=[[0, 1], [1, 2], [2, 3], [3, 0]])


def permute_case():
    permute(x)
    print("2. CollectivePermute: ran")


positions = dtensor.relayout(dtensor.copy_to_mesh(
    tf.range(8), dtensor.Layout.replicated(mesh, 1)),
    dtensor.Layout(["context"], mesh))


@tf.function
def skip_if_unseen(value, where):
    seen = tf.reduce_max(where) >= 4  # "does my block reach key block 1?"
    return tf.cond(seen, lambda: value * 2.0, lambda: value * 0.0)


def skip_case():
    report = tfpar.communication_report(skip_if_unseen, x, positions)
    reduced = [c.purpose for c in report.collectives]
    blocks = [float(b.numpy()[0, 0]) for b in dtensor.unpack(
        skip_if_unseen(x, positions))]
    print(f"3. per-device tf.cond: collectives {reduced}; first value per "
          f"device {blocks} (device 0, 1 alone would skip: positions 0-3)")


def attempt(label, case):
    try:
        case()
    except Exception as error:  # noqa: BLE001 - the repro prints what fails
        lines = [line for line in str(error).splitlines() if "error:" in line
                 or "implement" in line] or str(error).splitlines()
        print(f"{label}: {type(error).__name__}: {lines[0].strip()[:200]}")


if __name__ == "__main__":
    attempt("1. tf.roll as a ring step", roll_case)
    attempt("2. CollectivePermute", permute_case)
    attempt("3. per-device tf.cond", skip_case)
