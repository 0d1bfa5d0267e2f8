"""Pure TF + DTensor reproduction: indexing with new axes in front of a
split dimension fails to lay out.

On 8 CPU devices, mesh (data 2, expert 4), a bias (8, 16) split over
"expert" on its first dimension (GPT-OSS's per-expert biases): inside a
tf.function, `bias[None, :, None, :]` (a StridedSlice with new-axis masks)
raises "'tf.StridedSlice' op ComputeLayoutForward error: sharding spec";
in a compiled keras-hub GPT-OSS training step the same indexing crashed
the process. `tf.expand_dims` of the same bias lays out and gives the
right sum, which is what `tfpar.moe_keras_hub` uses. Prints
"newaxis: failed, <error class>" or "newaxis: right", then
"expand_dims: right" or "expand_dims: wrong".
"""

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
mesh = dtensor.create_mesh([("data", 2), ("expert", 4)], device_type="CPU")
UNSPLIT = dtensor.UNSHARDED


def put(array, spec):
    replicated = dtensor.copy_to_mesh(
        tf.constant(array), dtensor.Layout.replicated(mesh, array.ndim))
    return dtensor.relayout(replicated, dtensor.Layout(spec, mesh))


rng = np.random.RandomState(0)
bias_value = rng.normal(size=(8, 16)).astype("float32")
hidden_value = rng.normal(size=(8, 6, 16)).astype("float32")
bias = put(bias_value, ["expert", UNSPLIT])
hidden = put(hidden_value, ["expert", UNSPLIT, UNSPLIT])
want = float(np.sum(hidden_value[None] + bias_value[None, :, None, :]))


@tf.function
def with_new_axes(bias, hidden):
    return tf.reduce_sum(hidden[None] + bias[None, :, None, :])


@tf.function
def with_expand_dims(bias, hidden):
    return tf.reduce_sum(tf.expand_dims(hidden, 0)
                         + tf.expand_dims(tf.expand_dims(bias, 1), 0))


try:
    got = float(with_new_axes(bias, hidden))
    print("newaxis: right" if abs(got - want) <= 1e-3 * abs(want)
          else "newaxis: wrong")
except Exception as error:  # noqa: BLE001 - the class is the finding
    print(f"newaxis: failed, {type(error).__name__}")
got = float(with_expand_dims(bias, hidden))
print("expand_dims: right" if abs(got - want) <= 1e-3 * abs(want)
      else "expand_dims: wrong")
