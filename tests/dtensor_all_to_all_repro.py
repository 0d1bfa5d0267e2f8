"""Pure TF + DTensor reproduction of the wrong all-to-all tfpar works around.

On a 2 x 2 CPU mesh, every relayout of a 4 x 4 x 4 x 4 tensor (ranks 2 and
3 too) from one layout with each axis on at most one dimension to another:
DTensor moves a split between dimensions by an all-to-all, and on a rank-4
tensor every such move between dimensions 1-3 returns wrong values (eager
and in a tf.function alike; no error). Run with
DTENSOR_USE_ALL_TO_ALL_RELAYOUT unset (TF's default: on) it prints
"wrong N of M" with N > 0 and the first wrong cases; with "=0" (what
`import tfpar` sets) DTensor gathers and slices instead and it prints
"right M". With REPRO_QUICK=1 only rank 4 and only mesh axis a moves
(the default test run's case; the full sweep is a slow test).
"""

import itertools
import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
mesh = dtensor.create_mesh([("a", 2), ("b", 2)], device_type="CPU")
U = dtensor.UNSHARDED


def put(value, specs):
    replicated = dtensor.Layout.replicated(mesh, value.ndim)
    return dtensor.relayout(dtensor.copy_to_mesh(tf.constant(value), replicated),
                            dtensor.Layout(list(specs), mesh))


def whole(value):
    replicated = dtensor.Layout.replicated(mesh, value.shape.rank)
    return dtensor.unpack(dtensor.relayout(value, replicated))[0].numpy()


QUICK = os.environ.get("REPRO_QUICK") == "1"


def layouts(rank):
    """Every spec placing axis a and axis b on at most one dimension each
    (with REPRO_QUICK=1, axis b on none)."""
    for a, b in itertools.product([None, *range(rank)],
                                  [None] if QUICK else [None, *range(rank)]):
        if a is None or a != b:
            yield tuple("a" if d == a else "b" if d == b else U
                        for d in range(rank))


wrong, total = [], 0
for rank in (4,) if QUICK else (2, 3, 4):
    x = np.random.RandomState(rank).normal(size=(4,) * rank).astype("float32")
    for source, target in itertools.permutations(set(layouts(rank)), 2):
        total += 1
        moved = dtensor.relayout(put(x, source), dtensor.Layout(list(target),
                                                                mesh))
        if not np.array_equal(whole(moved), x):
            wrong.append((rank, source, target))
for case in wrong[:4]:
    print("wrong:", *case)
print(f"wrong {len(wrong)} of {total}" if wrong else f"right {total}")
