"""Pure TF + DTensor reproduction of the stale-read bug tfpar works around.

Two independent all-reduces in one step (the batch sum feeding `total` and
the batch-reduced update of `w`) let DTensor's all-reduce combiner move
`total`'s update after the later read of `total`, so the step returns the
stale value. Run with DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=1 (TF's
default) it prints "stale"; with "=0" (what `import tfpar` sets) "fresh".
"""

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
mesh = dtensor.create_mesh([("data", 8)], device_type="CPU")


def put(value, layout):
    replicated = dtensor.Layout.replicated(mesh, len(layout.sharding_specs))
    return dtensor.relayout(dtensor.copy_to_mesh(tf.constant(value), replicated),
                            layout)


w = dtensor.DVariable(put(np.zeros([4, 1], np.float32),
                          dtensor.Layout.replicated(mesh, 2)))
total = dtensor.DVariable(put(np.float32(0), dtensor.Layout.replicated(mesh, 0)))
x = put(np.ones([32, 4], np.float32), dtensor.Layout.batch_sharded(mesh, "data", 2))


@tf.function
def step(x):
    total.assign_add(tf.reduce_sum(x))  # all-reduce 1
    w.assign_sub(tf.reshape(tf.reduce_sum(x, 0), [4, 1]))  # all-reduce 2
    return total.read_value()  # must see this step's update: 128


returned = float(dtensor.unpack(step(x))[0].numpy())
print("fresh" if returned == 128.0 else f"stale (returned {returned})")
