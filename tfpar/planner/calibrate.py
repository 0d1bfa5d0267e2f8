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

Example:

>>> tfpar.use_virtual_cpus(8)
>>> from tfpar.planner import calibrate
>>> alpha, beta = calibrate.collective_alpha_beta(
...     tfpar.mesh.default_devices())
>>> alpha > 0 and beta > 0
True
"""

import time

import numpy as np

_SMALL, _LARGE = 1 << 12, 1 << 22   # bytes per device


def _best_seconds(fn, *args, repeats=9):
    """The fastest of `repeats` calls: on a host other jobs load, the
    least disturbed one (steady under load where the median is not)."""
    fn(*args)  # trace and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.asarray(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.min(times))


def collective_alpha_beta(devices):
    """(α seconds, β bytes/s per device) of an all-reduce over `devices`
    (a mesh of all of them), fitted to α + n · B/β at two message sizes."""
    import tensorflow as tf  # noqa: PLC0415

    from tfpar import mesh as mesh_lib  # noqa: PLC0415

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
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

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
