"""Pure TF + DTensor: where a row-split table's sparse gradient failed
under `offload="optimizer"`, and why.

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
   table: compiles.

So the device step was never at fault. The op at fault is in the host
update: Keras' optimizers turn a sparse gradient dense against a slot
(Adam: m += (g - m)(1 - beta_1)), `tf.convert_to_tensor(IndexedSlices)`,
an UnsortedSegmentSum over `dense_shape[0]` rows. tfpar passed the dense
shape into the compiled update as an argument: the sum's row count is
unknown when the graph is built (DTensor folds the argument to a constant
later, too late for the shapes), and a row-split slot needs the sum split
over its rows, a replicated -> ("data", None) slice of a dynamic axis:

5. "slot_rows_split_shape_argument": fails, "EmitAllScatter requires
   slice on input axis 0 which is dynamic" (the error tfpar's offload
   raised for an fsdp Embedding);
6. "slot_rows_split_shape_constant": the dense shape a constant of the
   function (what `tfpar.offload.host._with_dense_shape` does): compiles;
7. "slot_columns_split_shape_argument": a column-split slot fails too
   ("operands don't have broadcast-compatible shapes": the unknown rows);
8. "slot_columns_split_shape_constant": compiles.

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


def slot_update(specs, shape_as):
    """Keras' dense use of a sparse gradient g against a slot m laid out
    by `specs`: m += (dense(g) - m) * 0.1, g's dense shape an argument of
    the function or a constant in it."""
    slot = table(specs)
    values = dtensor.copy_to_mesh(tf.ones((6, 4)),
                                  dtensor.Layout.replicated(mesh, 2))
    rows = dtensor.copy_to_mesh(tf.constant([1, 3, 3, 6, 0, 7]),
                                dtensor.Layout.replicated(mesh, 1))
    shape = dtensor.copy_to_mesh(tf.constant([8, 4], tf.int64),
                                 dtensor.Layout.replicated(mesh, 1))

    @tf.function
    def update(values, rows, shape):
        if shape_as == "constant":
            shape = tf.constant([8, 4], tf.int64)
        grad = tf.convert_to_tensor(tf.IndexedSlices(values, rows, shape))
        slot.assign_add((grad - slot) * 0.1)
        return (slot.read_value(),)

    return lambda _: update(values, rows, shape)


def outcome(run):
    try:
        result = run(ids)
        return f"works: {[tuple(r.shape) for r in result]}"
    except Exception as error:  # noqa: BLE001 (MLIR errors are UnknownError)
        message = str(error)
        for known in ("EmitAllScatter requires slice on input axis 0 which "
                      "is dynamic", "operands don't have broadcast-compatible "
                      "shapes"):
            if known in message:
                return "fails: " + known
        return "fails: " + message[:300]


found = {}
for name, specs, out in [
        ("rows_whole", [dtensor.UNSHARDED, "data"], parts),
        ("rows_split", ["data", dtensor.UNSHARDED], parts),
        ("rows_split_replicated", ["data", dtensor.UNSHARDED],
         parts_replicated),
        ("rows_split_dense", ["data", dtensor.UNSHARDED], dense)]:
    found[name] = outcome(step(table(specs), out))
for name, specs in [("rows_split", ["data", dtensor.UNSHARDED]),
                    ("columns_split", [dtensor.UNSHARDED, "data"])]:
    for shape_as in ("argument", "constant"):
        found[f"slot_{name}_shape_{shape_as}"] = outcome(
            slot_update(specs, shape_as))
print(json.dumps(found))
