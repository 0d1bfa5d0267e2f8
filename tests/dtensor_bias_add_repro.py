"""Pure TF + DTensor reproduction: a channels-first BiasAdd on a rank-3
batch-split value does not compile.

On 8 CPU devices, mesh ("data", 8), a value (16, 4, 12) split over its
batch plus a replicated bias (4,) by `tf.nn.bias_add(value, bias,
data_format="NCHW")` (what Keras' `ops.add` makes of a channels-first
`Conv1D`'s bias): DTensor 2.21 gives the bias the value's batch layout
and fails ("The sharding spec for axis 0 splits among 8 values, which
does not evenly divide the length of that axis (4)"). Rank 4 (NCHW
proper) compiles, and so does the same sum as a broadcast add (what
`tfpar.spmd_image_ops.bias_add_by_broadcast` does in a step). Prints one line
per case: "<case>: right", "<case>: wrong" or "<case>: failed".
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
bias = np.arange(4, dtype="float32")


def batch_split(array):
    rank = array.ndim
    replicated = dtensor.copy_to_mesh(
        tf.constant(array), dtensor.Layout.replicated(mesh, rank))
    return dtensor.relayout(replicated, dtensor.Layout(
        ["data"] + [dtensor.UNSHARDED] * (rank - 1), mesh))


def check(case, add, shape):
    value = np.random.RandomState(0).normal(size=shape).astype("float32")
    want = value + bias.reshape((1, 4) + (1,) * (len(shape) - 2))
    placed_bias = dtensor.copy_to_mesh(
        tf.constant(bias), dtensor.Layout.replicated(mesh, 1))
    try:
        got = tf.function(add)(batch_split(value), placed_bias)
        got = dtensor.unpack(dtensor.relayout(
            got, dtensor.Layout.replicated(mesh, len(shape))))[0].numpy()
        print(f"{case}:", "right" if np.allclose(got, want) else "wrong")
    except (tf.errors.OpError, ValueError):
        print(f"{case}: failed")


def nchw_bias_add(value, b):
    return tf.nn.bias_add(value, b, data_format="NCHW")


def broadcast_add(value, b):
    return value + tf.reshape(b, (1, 4, 1))


check("bias_add rank 3", nchw_bias_add, (16, 4, 12))
check("bias_add rank 4", nchw_bias_add, (16, 4, 6, 6))
check("broadcast add rank 3", broadcast_add, (16, 4, 12))
