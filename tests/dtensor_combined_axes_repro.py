"""Pure DTensor: one tensor dimension cannot be split over two mesh axes.

A DTensor `Layout` names one mesh dimension (or UNSHARDED) per tensor
dimension: on a data=2 x context=4 mesh, splitting a weight's rows eight
ways over "data" and "context" together (Megatron's distributed optimizer,
ZeRO over the data x context group) is refused when the layout is made:
`Layout(["data,context", ...])` raises ValueError ("A dimension sharding
must either be a valid mesh dimension or UNSHARDED") and a tuple of axes
raises TypeError. Hence tfpar's fsdp on a data x context mesh splits a
weight over data on one dimension and over context on another
(`tfpar.layout.fully_sharded_spec`): a rank >= 2 weight is split eight
ways, a rank-1 one (a bias, a norm's scale) over data alone.

Run: python tests/dtensor_combined_axes_repro.py (prints one line per
spelling: "refused: <error type>" or "accepted").
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

SPELLINGS = {"comma": "data,context", "tuple": ("data", "context")}


def mesh():
    cpu = tf.config.list_physical_devices("CPU")[0]
    if tf.config.get_logical_device_configuration(cpu) is None:
        try:  # 8 virtual CPUs, unless the devices are set up already
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
        except RuntimeError:
            pass
    devices = tf.config.list_logical_devices("CPU")
    return dtensor.create_mesh([("data", 2), ("context", 4)],
                               devices=[d.name for d in devices[:8]])


def attempt(spelling, on_mesh):
    """'accepted' (with the per-device shapes) or 'refused: <error>'."""
    try:
        layout = dtensor.Layout([SPELLINGS[spelling], dtensor.UNSHARDED],
                                on_mesh)
        value = dtensor.call_with_layout(tf.zeros, layout, shape=(8, 4))
        return f"accepted {[b.shape.as_list() for b in dtensor.unpack(value)]}"
    except (ValueError, TypeError) as error:
        return f"refused: {type(error).__name__}"


if __name__ == "__main__":
    on_mesh = mesh()
    for name in SPELLINGS:
        print(f"{name}: {attempt(name, on_mesh)}")
