"""Micro-benchmarks that fit `Cluster.local()`'s figures on virtual CPUs.

On a host whose logical CPUs share two cores, a DTensor collective is host
memory copies: each of the n devices of a group reads the n blocks, so an
all-reduce of B bytes per device costs about α + n · B/β (measured here
on 8 virtual CPUs of a loaded 2-core host: 16 MB per device took 135 ms
over groups of 2, 209 ms over groups of 4 and 520 ms over 8 — n · B/β
with β of 250–320 MB/s per device, where a ring predicts 1 : 1.5 : 1.75).
`collective_alpha_beta` fits α and β from an all-reduce over all devices
of a small and a large message; `update_bandwidth` times Keras' Adam
update of one large weight on one device.

Every micro-benchmark here is timed by the process' CPU time (`_best_seconds`):
the host's other jobs stretch the wall clock by a factor that differs
between micro-benchmarks and calibrations, where the CPU seconds of the
same work stay put (benchmarks/planner.py measures steps the same way).

The runtime's fixed costs (measured here, docs/guides/planner.md): every
op of a compiled step runs once per device of its mesh, one after another
on the shared cores, at a few µs each whatever its size — a step of a
tiny model costs about (ops × devices of their mesh) · `op_time`.
`op_time` is Keras' Adam on many small weights (its 41 ops per weight,
counted in the traced update) timed per op on one device; `send_time` is
one `copy_to_mesh` between two single-device meshes (a pipeline's
stage-to-stage move), per device of the stage.

Convolutions (`conv_rate_and_time`): a 3×3 Conv2D's forward and backward
pass runs at its own FLOP rate, below a matmul's here, and every device
that runs one pays a cost beyond its FLOPs (measured on this machine, load
11–14, batch 64, 16×16×16 → 32 channels: 5.6 ms on one device, 6.8, 13.3
and 15.3 ms with the batch split over 2, 4 and 8 — the same FLOPs). Both
come from that conv timed on one device and with its batch split over
all: the difference per added device is `conv_time`, the rest is FLOPs.

The repeats of every micro-benchmark are kept (`timing_spread`): on a
loaded host they spread, and so would another calibration's figures;
`Plan.explain()` states that spread next to the predictions.

Example:

>>> tfpar.use_virtual_cpus(8)
>>> from tfpar.planner import calibrate
>>> alpha, beta = calibrate.collective_alpha_beta(
...     tfpar.mesh.default_devices())
>>> alpha > 0 and beta > 0
True
"""

import os
import time

import keras
import numpy as np
import tensorflow as tf

from tfpar import mesh as mesh_lib

_SMALL, _LARGE = 1 << 12, 1 << 22   # bytes per device
# The repeats' seconds of every micro-benchmark timed in this process.
_TIMINGS = []


def timing_spread():
    """{"spread", "timings", "load", "cores"} of the micro-benchmarks timed
    in this process, None before any: `spread` is the median over them of
    their repeats' half-range relative to its middle, (max − min) /
    (max + min) (0.1: ±10%), `timings` how many repeats were timed,
    `load` the host's 1-minute load average now and `cores` its CPUs.

    >>> calibrate.timing_spread()["spread"] < 1
    True
    """
    if not _TIMINGS:
        return None
    spreads = [(max(t) - min(t)) / max(max(t) + min(t), 1e-12)
               for t in _TIMINGS]
    return {"spread": float(np.median(spreads)),
            "timings": sum(len(t) for t in _TIMINGS),
            "load": os.getloadavg()[0], "cores": os.cpu_count()}


def _best_seconds(fn, *args, repeats=9):
    """The least CPU time of `repeats` calls (this process' CPU seconds,
    all threads: the work a call costs, which other jobs' load hardly
    changes; measured on this host at load 22–26, a step's CPU time stayed
    within ~10% where its wall-clock time spread 2–5×)."""
    fn(*args)  # trace and warm up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        np.asarray(fn(*args))
        times.append(time.process_time() - start)
    _TIMINGS.append(times)
    return float(np.min(times))


def collective_alpha_beta(devices):
    """(α seconds, β bytes/s per device) of an all-reduce over `devices`
    (a mesh of all of them), fitted to α + n · B/β at two message sizes."""
    dtensor = tf.experimental.dtensor
    n = len(devices)
    mesh = mesh_lib.Mesh({"x": n}, devices=list(devices)).dtensor_mesh
    # Summing over the split first dimension all-reduces each device's
    # (1, k) block; the first element alone comes back to the host. The
    # same program on a (1, k) block whole on every device (no collective)
    # is subtracted: the call's own overhead is not the collective's.
    reduce = tf.function(lambda v: tf.reduce_sum(v, 0)[:1])
    seconds = []
    for nbytes in (_SMALL, _LARGE):
        split, whole = (dtensor.call_with_layout(
            tf.ones, dtensor.Layout(spec, mesh), shape=(rows, nbytes // 4))
            for spec, rows in ((["x", dtensor.UNSHARDED], n),
                               ([dtensor.UNSHARDED] * 2, 1)))
        seconds.append(_best_seconds(reduce, split)
                       - _best_seconds(reduce, whole))
    small, large = seconds
    beta = n * (_LARGE - _SMALL) / max(large - small, 1e-9)
    return max(small - n * _SMALL / beta, 1e-6), beta


def update_bandwidth(device, nbytes=1 << 24):
    """Bytes/s of weights Keras' Adam updates on `device` (one weight of
    `nbytes`, compiled, the fastest of a few updates)."""
    with tf.device(device):
        weight = tf.Variable(tf.zeros(nbytes // 4))
        grad = tf.ones(nbytes // 4)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build([weight])

        @tf.function
        def update(g):
            optimizer.apply([g], [weight])
            return weight[:1]

        return nbytes / _best_seconds(update, grad)


def _adam_seconds(device, count, shape=(16, 16)):
    """(seconds, ops) of one compiled Keras Adam update of `count` weights
    of `shape` on `device` (the fastest of a few updates)."""
    with tf.device(device):
        weights = [tf.Variable(tf.zeros(shape)) for _ in range(count)]
        grads = [tf.ones(shape) for _ in range(count)]
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(weights)

        @tf.function
        def update(g):
            optimizer.apply(g, weights)
            return weights[0][0, :1]

        seconds = _best_seconds(update, grads)
        ops = len(update.get_concrete_function(grads).graph.get_operations())
    return seconds, ops


def op_time(device, few=2, many=18):
    """Seconds per op per device: Keras' Adam on `many` and on `few` small
    weights, the difference over the difference of their traced op counts
    (the ops' size is negligible: what is left is the runtime's cost of
    running an op)."""
    (t_few, ops_few), (t_many, ops_many) = (
        _adam_seconds(device, count) for count in (few, many))
    return max(t_many - t_few, 1e-9) / max(ops_many - ops_few, 1)


def send_time(devices, few=1, many=33):
    """Seconds of one `copy_to_mesh` of a small tensor from a mesh of
    `devices[0]` to one of `devices[1]` (a pipeline's stage-to-stage move
    between single-device stages; 0 with fewer than two devices)."""
    if len(devices) < 2:
        return 0.0
    dtensor = tf.experimental.dtensor
    source, target = (mesh_lib.Mesh({"x": 1}, devices=[d]).dtensor_mesh
                      for d in devices[:2])
    value = dtensor.call_with_layout(
        tf.ones, dtensor.Layout.replicated(source, 2), shape=(8, 8))

    def moves(k):
        # k copies of distinct tensors (no common subexpression to share).
        return tf.function(lambda v: tf.add_n([dtensor.copy_to_mesh(
            v * (1.0 + i), dtensor.Layout.replicated(target, 2))
            for i in range(k)])[:1, :1])

    seconds = [_best_seconds(moves(k), value) for k in (few, many)]
    return max(seconds[1] - seconds[0], 1e-9) / (many - few)


def _conv_step(x, kernel):
    """A Conv2D layer's forward (3×3, same padding, ReLU) and backward pass
    (gradients of its input and kernel), as Keras' training step runs it."""
    with tf.GradientTape() as tape:
        tape.watch([x, kernel])
        loss = tf.reduce_sum(tf.nn.relu(tf.nn.conv2d(x, kernel, 1, "SAME")))
    dx, dk = tape.gradient(loss, [x, kernel])
    return dx[:1, :1, :1, :1] + dk[:1, :1, :1, :1]


def conv_rate_and_time(devices, batch=64, size=16, channels=16, filters=32):
    """(host FLOP/s of a convolution's forward and backward pass, seconds
    per device beyond its FLOPs): the conv of `_conv_step` timed on a mesh
    of `devices[0]` and with its batch split over all `devices`; t(n) =
    FLOPs / rate + n · conv_time."""
    dtensor = tf.experimental.dtensor
    n = len(devices)
    seconds = []
    for group in ([devices[0]], list(devices)):
        mesh = mesh_lib.Mesh({"x": len(group)}, devices=group).dtensor_mesh
        x = dtensor.call_with_layout(
            tf.ones, dtensor.Layout(["x"] + [dtensor.UNSHARDED] * 3, mesh),
            shape=(batch, size, size, channels))
        kernel = dtensor.call_with_layout(
            tf.ones, dtensor.Layout.replicated(mesh, 4),
            shape=(3, 3, channels, filters))
        seconds.append(_best_seconds(tf.function(_conv_step), x, kernel))
    one, spread = seconds
    per_device = max(spread - one, 0.0) / max(n - 1, 1)
    flops = 3 * 2 * batch * size * size * 9 * channels * filters
    return flops / max(one - per_device, 1e-9), per_device
