"""Pure TF + DTensor: a row-split table's sparse gradient *can* leave a
compiled step as IndexedSlices, so what keeps `offload="optimizer"` moving
an fsdp Embedding's gradient to the host dense (`tfpar.offload._rows_whole`)
is something tfpar's (or Keras') training step adds, not DTensor itself.

On TF 2.21 with 4 CPU devices, a table of 8 rows split over "data" (fsdp's
layout) read as tfpar reads it (a GatherV2 of the stored blocks: DTensor
has no ResourceGather from a row-split table), the batch's ids split over
"data", a tf.function returning the gradient of the look-up (an
IndexedSlices: the looked-up rows' gradients and their ids):

1. "rows_whole": a table with its rows whole (split by columns): values
   and indices returned, compiles.
2. "rows_split": the row-split table: compiles too.
3. "rows_split_replicated": values and indices relaid out to replicated
   first (what `Offload.step_gradients` does): compiles.
4. "rows_split_dense": converted to a dense tensor laid out like the
   table (what tfpar does for a row-split table): compiles.

The same IndexedSlices returned from tfpar's compiled step of a Keras
Embedding (tests/test_offload.py, `_rows_whole` forced True, with and
without the relayout) fails: "EmitAllScatter requires slice on input axis
0 which is dynamic" (measured); the op behind it is not identified yet.

Prints one JSON line {case: result}.
"""

import json
import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
mesh = dtensor.create_mesh([("data", 4)], devices=[
    f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)])
# The batch's ids, split over "data" as a step's batch is.
ids = dtensor.relayout(dtensor.copy_to_mesh(
    tf.constant([1, 3, 3, 6, 0, 3, 7, 7]), dtensor.Layout.replicated(mesh, 1)),
    dtensor.Layout(["data"], mesh))


def table(specs):
    return dtensor.DVariable(dtensor.call_with_layout(
        tf.ones, dtensor.Layout(specs, mesh), shape=(8, 4)))


def step(variable, out):
    @tf.function
    def run(ids):
        with tf.GradientTape() as tape:
            # A GatherV2 of the stored blocks, as tfpar reads a row-split table
            # (DTensor has no ResourceGather from it).
            loss = tf.reduce_sum(tf.gather(variable.read_value(), ids) ** 2)
        grad = tape.gradient(loss, variable)
        return out(grad)
    return run


def parts(grad):
    return grad.values, grad.indices


def parts_replicated(grad):
    return (dtensor.relayout(grad.values, dtensor.Layout.replicated(mesh, 2)),
            dtensor.relayout(grad.indices, dtensor.Layout.replicated(mesh, 1)))


def dense(grad):
    return (dtensor.relayout(tf.convert_to_tensor(grad),
                             dtensor.Layout(["data", dtensor.UNSHARDED],
                                            mesh)),)


found = {}
for name, specs, out in [
        ("rows_whole", [dtensor.UNSHARDED, "data"], parts),
        ("rows_split", ["data", dtensor.UNSHARDED], parts),
        ("rows_split_replicated", ["data", dtensor.UNSHARDED],
         parts_replicated),
        ("rows_split_dense", ["data", dtensor.UNSHARDED], dense)]:
    try:
        result = step(table(specs), out)(ids)
        found[name] = f"works: {[tuple(r.shape) for r in result]}"
    except Exception as error:  # noqa: BLE001 (MLIR errors are UnknownError)
        message = str(error)
        found[name] = "fails: " + (
            "EmitAllScatter requires slice on input axis 0 which is dynamic"
            if "EmitAllScatter" in message else message[:300])
print(json.dumps(found))
