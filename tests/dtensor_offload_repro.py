"""Pure TF + DTensor: why tfpar cannot offload optimizer state on this host.

Offload (ZeRO-Offload, FSDP2's CPUOffloadPolicy) keeps each device's block
of the optimizer slots in host memory and runs the update there. With
DTensor that means a host mesh next to the device mesh and moving each
device's block between the two inside the step. On TF 2.21 with CPU
devices:

1. "host_mesh": `Mesh.host_mesh()` of a CPU mesh is the mesh itself (same
   devices): the devices are the host, there is nothing to offload to.
2. "copy_sharded": `dtensor.copy_to_mesh` of a sharded value to another
   mesh (even one of the same shape, with the same sharding) fails in SPMD
   expansion ("op output inconsistent with the provided layout"), eagerly
   and inside a tf.function.
3. "copy_replicated": the route that compiles relays the value out to
   replicated first, i.e. every device holds the whole tensor, then copies
   and splits it again: for optimizer slots that is data x the memory the
   offload was to save.

Prints one JSON line {case: result}.
"""

import json
import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
names = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(8)]
devices = dtensor.create_mesh([("data", 4)], devices=names[:4])
other = dtensor.create_mesh([("data", 4)], devices=names[4:],
                            mesh_name="other")
found = {"host_mesh": ("same devices"
                       if devices.host_mesh().local_devices()
                       == devices.local_devices() else "separate")}
value = dtensor.call_with_layout(tf.ones, dtensor.Layout(["data"], devices),
                                 shape=(8,))


@tf.function
def copy_sharded(x):
    return dtensor.copy_to_mesh(x, dtensor.Layout(["data"], other)) * 2


@tf.function
def copy_replicated(x):
    whole = dtensor.relayout(x, dtensor.Layout.replicated(devices, 1))
    moved = dtensor.copy_to_mesh(whole, dtensor.Layout.replicated(other, 1))
    return dtensor.relayout(moved, dtensor.Layout(["data"], other))


for name, function in [("copy_sharded", copy_sharded),
                       ("copy_replicated", copy_replicated)]:
    try:
        result = function(value)
        found[name] = f"works: {dtensor.fetch_layout(result).sharding_specs}"
    except Exception as error:  # noqa: BLE001 (MLIR errors are UnknownError)
        message = str(error)
        found[name] = "fails: " + (
            "inconsistent with the provided layout"
            if "inconsistent with the provided layout" in message
            else message[:200])
print(json.dumps(found))
