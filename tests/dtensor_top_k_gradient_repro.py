"""Pure TF + DTensor reproduction: TopKV2's gradient on a batch-split
tensor fails.

On 8 CPU devices, mesh ("data", 8), logits (16, 8, 4) split over the batch:
the gradient of sum(top_k(softmax(z), 2).values ** 2) inside a tf.function
raises "indices[..] = [..] does not index into shape [..]" (TopKV2's
gradient scatters into the flattened *global* shape with per-device
indices, or the reverse). The same weights read by a one-hot product of
the top-k indices (what `tfpar.experts.route` does) give one device's
gradient (checked in tfpar by tests/test_moe_layer.py). Prints
"top_k: failed, <error class>" or "top_k: right".
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
logits = np.random.RandomState(0).normal(size=(16, 8, 4)).astype("float32")
split = dtensor.Layout(["data", dtensor.UNSHARDED, dtensor.UNSHARDED], mesh)
placed = dtensor.relayout(dtensor.copy_to_mesh(
    tf.constant(logits), dtensor.Layout.replicated(mesh, 3)), split)


def top_k_values(z):
    return tf.math.top_k(tf.nn.softmax(z), k=2).values


def gradient(values, z):
    with tf.GradientTape() as tape:
        tape.watch(z)
        total = tf.reduce_sum(values(z) ** 2)
    return tape.gradient(total, z)


def on_mesh(values):
    grad = tf.function(lambda z: gradient(values, z))(placed)
    replicated = dtensor.Layout.replicated(mesh, 3)
    return dtensor.unpack(dtensor.relayout(grad, replicated))[0].numpy()


want = gradient(top_k_values, tf.constant(logits)).numpy()
try:
    got = on_mesh(top_k_values)
    print("top_k:", "right" if np.allclose(got, want, atol=1e-6) else "wrong")
except tf.errors.OpError as error:
    # The failing device's InvalidArgumentError, or the CancelledError of
    # a peer whose collective it cancelled first: the same failure.
    print("top_k: failed,", type(error).__name__)
