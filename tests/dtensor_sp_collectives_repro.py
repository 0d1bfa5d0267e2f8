"""Pure TF + DTensor: which collectives sequence parallelism gets on CPU.

Megatron-SP needs an all-gather of sequence blocks (before a column-parallel
matmul) and a reduce-scatter of partial sums (after a row-parallel one). On
TF 2.21 with a CPU mesh DTensor compiles:

1. "gather": a relayout (b, s/4, h) -> (b, s, h) over a 4-device axis as a
   CollectiveReduceV2 of a zero-padded (b, s, h) buffer (an all-reduce: each
   device sends 2(n-1)/n of the whole tensor instead of (n-1)/n);
2. "reduce_scatter": a row-parallel einsum relaid out to (b, s/4, h) as a
   CollectiveReduceV2 of the whole (b, s, h) result followed by a slice
   (DTensor's lowering says "For CPU and non-NCCL GPU devices, decompose to
   DTensorAllReduce+DTensorAllScatter");
3. "gather_v2": with LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2=1 (read
   each time a function is compiled) the gather of case 1 becomes a real
   CollectiveGatherV2 — but a relayout that gathers over two mesh axes at
   once ((data, model, -) -> (-, -, -) on a 2x4 mesh) no longer compiles
   ("'tf.Reshape' op requires 'output' number of elements to match").

Prints one JSON line {case: sorted collective op names, or "fails: ..."}.
"""

import json
import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
mesh = dtensor.create_mesh([("data", 2), ("model", 4)], device_type="CPU")
U = dtensor.UNSHARDED


def put(value, specs):
    replicated = dtensor.Layout.replicated(mesh, len(specs))
    return dtensor.relayout(dtensor.copy_to_mesh(tf.constant(value), replicated),
                            dtensor.Layout(specs, mesh))


def collectives(function, *args):
    """Sorted collective ops DTensor compiled for `function`, or the error."""
    before = set(context.context().list_function_names())
    try:
        function(*args)
    except Exception as error:  # noqa: BLE001 (report any compile failure)
        return "fails: " + str(error).splitlines()[0][:160]
    ops = []
    for name in context.context().list_function_names():
        if name not in before:
            ops += [n.op for n in context.context().get_function_def(name).node_def
                    if n.op.startswith("Collective")]
    return sorted(ops)


x = put(np.ones((4, 8, 16), np.float32), ["data", "model", U])  # (b, s/4, h)
xh = put(np.ones((4, 8, 16), np.float32), ["data", U, "model"])  # (b, s, h/4)
w = put(np.ones((16, 16), np.float32), ["model", U])             # row-parallel


@tf.function
def gather(x):
    return dtensor.relayout(x * 2.0, dtensor.Layout(["data", U, U], mesh))


@tf.function
def reduce_scatter(xh, w):
    partial = tf.einsum("bsh,hk->bsk", xh, w)  # a partial sum on each device
    return dtensor.relayout(partial, dtensor.Layout(["data", "model", U], mesh))


@tf.function
def gather_v2(x):
    return dtensor.relayout(x * 3.0, dtensor.Layout([U, U, U], mesh))


result = {"gather": collectives(gather, x),
          "reduce_scatter": collectives(reduce_scatter, xh, w)}
os.environ["LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"] = "1"
result["gather_v2"] = collectives(gather_v2, x)
print(json.dumps(result))
