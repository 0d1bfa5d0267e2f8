"""Pure TF + DTensor: how optimizer state can (and cannot) move to a host.

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
4. "per_device_route": what works, and what `tfpar.offload` does. Eagerly,
   `dtensor.unpack` the sharded value, copy each device's block to the
   matching device of the other mesh (`tf.identity` under `tf.device`),
   `dtensor.pack` the blocks with the same sharding there, compute on that
   mesh in a tf.function, and come back the same way: each block stays on
   its own device of either mesh, nothing is replicated. It cannot run
   inside one compiled step (the moves are eager), so the host round trip
   is not overlapped with the step's compute.

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


def per_device(x, layout):
    """x's blocks, device i's to device i of `layout`'s mesh, as one
    DTensor laid out by `layout` (eager)."""
    blocks = []
    for block, device in zip(dtensor.unpack(x), layout.mesh.local_devices()):
        with tf.device(device):
            blocks.append(tf.identity(block))
    return dtensor.pack(blocks, layout)


@tf.function
def update_on_other(x):
    return x * 2.0 + 1.0


value = dtensor.relayout(dtensor.copy_to_mesh(
    tf.range(8.0), dtensor.Layout.replicated(devices, 1)),
    dtensor.Layout(["data"], devices))
moved = per_device(value, dtensor.Layout(["data"], other))
back = per_device(update_on_other(moved), dtensor.Layout(["data"], devices))
homes = [block.device.rsplit(":", 1)[-1] for block in dtensor.unpack(moved)]
exact = all(
    (b.numpy() == a.numpy() * 2 + 1).all()
    for a, b in zip(dtensor.unpack(value), dtensor.unpack(back)))
found["per_device_route"] = (
    f"works: blocks on CPU:{','.join(homes)}, "
    f"back {dtensor.fetch_layout(back).sharding_specs}, exact={exact}")
print(json.dumps(found))
