"""Pure TF + DTensor reproduction: the two ops of a Keras int8-quantized
layer that DTensor 2.21 cannot compile.

On 8 CPU devices, mesh (data 2, model 4):

1. `tf.matmul(x, w, output_type=tf.int32)` of int8 operands (Keras'
   `ops.matmul` of an int8 Dense's quantized inputs and kernel) is a
   `BatchMatMulV3`, which has no DTensor expander ("op does not implement
   layout propagation"), even with every operand replicated. The same
   integers as float32 (`tfpar.spmd_ops.integer_matmul_in_float`) compile
   and are exact here (contraction 64: every partial sum below 2**24).
2. `tf.squeeze` of a replicated (1, 1, 4, 16) scale whose consumer wants the
   result split over "model" along its heads (an int8 EinsumDense's kernel
   scale divided into its kernel, split on the heads, in Keras' backward
   pass) fails ("SPMD expansion resulted in op output inconsistent with the
   provided layout"); the same shape change as a `tf.reshape`
   (`tfpar.spmd_ops.expand_then_squeeze_by_reshape`) compiles and is right.

`cases()` returns {case: "right" | "wrong" | "fails: <first line>"}; the
default test of tests/test_quantized.py pins it. If it changes on a newer
TF, DTensor lays these ops out itself and tfpar's stand-ins can go.

Run: python tests/dtensor_quantized_ops_repro.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

import repro_report  # noqa: E402


def _placed(array, specs, dmesh):
    replicated = dtensor.copy_to_mesh(
        tf.constant(array), dtensor.Layout.replicated(dmesh, array.ndim))
    return dtensor.relayout(replicated, dtensor.Layout(specs, dmesh))


def _verdict(compute, want, dmesh):
    def whole():
        result = compute()
        return dtensor.relayout(
            result, dtensor.Layout.replicated(dmesh, result.shape.rank))

    status, got = repro_report.compiled_or_error(whole)
    if got is None:
        return f"fails: {status}"
    return "right" if np.array_equal(got, want) else "wrong"


def cases():
    dmesh = repro_report.cpu_mesh([("data", 2), ("model", 4)])
    rng = np.random.default_rng(0)
    unsplit = dtensor.UNSHARDED
    x = rng.integers(-127, 128, (8, 64)).astype("int8")
    w = rng.integers(-127, 128, (64, 16)).astype("int8")
    product = x.astype("int32") @ w.astype("int32")
    px = _placed(x, [unsplit] * 2, dmesh)
    pw = _placed(w, [unsplit] * 2, dmesh)
    kernel = rng.normal(size=(64, 4, 16)).astype("float32")
    scale = rng.uniform(1, 2, (1, 1, 4, 16)).astype("float32")
    pk = _placed(kernel, [unsplit, "model", unsplit], dmesh)
    ps = _placed(scale, [unsplit] * 4, dmesh)
    divided = kernel / scale[0]
    return {
        "int8 matmul to int32": _verdict(lambda: tf.function(
            lambda a, b: tf.matmul(a, b, output_type=tf.int32))(px, pw),
            product, dmesh),
        "the same in float32": _verdict(lambda: tf.function(
            lambda a, b: tf.cast(tf.matmul(tf.cast(a, tf.float32),
                                           tf.cast(b, tf.float32)),
                                 tf.int32))(px, pw), product, dmesh),
        "kernel / squeeze(scale)": _verdict(lambda: tf.function(
            lambda k, s: k / tf.squeeze(s, [1]))(pk, ps), divided, dmesh),
        "kernel / reshape(scale)": _verdict(lambda: tf.function(
            lambda k, s: k / tf.reshape(s, [1, 4, 16]))(pk, ps),
            divided, dmesh),
    }


if __name__ == "__main__":
    for case, verdict in cases().items():
        print(f"{case}: {verdict}")
