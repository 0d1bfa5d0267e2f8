"""Connecting to a Colab or Cloud TPU for DTensor meshes.

Only the error path and the repeat-call path of `connect_tpu` are tested (with
mocks, in tests/test_env.py); it has not been run on a TPU yet.
"""

import glob

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import mesh as _mesh

# Set by the first successful connect_tpu(): {"tpu": ..., "cores": n}.
_connected = None

_RUNTIME_HINT = (
    "on Colab choose Runtime > Change runtime type > TPU; on a Cloud TPU VM "
    "pass tpu='local' or the TPU name"
)


def connect_tpu(tpu=None):
    """Connects to the TPU and initialises it for DTensor, once.

    Call it first thing in the program, before any TensorFlow op, model,
    `tfpar.Mesh` or `tfpar.use_virtual_cpus`. It resolves the TPU
    (`tf.distribute.cluster_resolver.TPUClusterResolver`), connects to it
    (`tf.config.experimental_connect_to_cluster`, a no-op for a TPU attached
    to this host) and initialises DTensor's TPU system
    (`tf.experimental.dtensor.initialize_accelerator_system("TPU")`). Calling
    it again does nothing and returns the same number. Afterwards
    `tfpar.Mesh(...)` uses all TPU cores by default.

    Example (on a TPU runtime):

    >>> import tfpar
    >>> cores = tfpar.connect_tpu()          # e.g. 8 on a v2-8
    >>> mesh = tfpar.Mesh({"data": cores})

    Args:
        tpu: TPU name or address as `TPUClusterResolver(tpu=...)` takes it;
            None (the default) finds the TPU of a Colab or Cloud TPU VM
            runtime (from `TPU_NAME`, else the TPU chips attached to this
            host), "local" means a TPU attached to this host.

    Returns:
        The number of TPU cores (int).

    Raises:
        RuntimeError: no TPU was found, TensorFlow was already initialised,
            or the TPU system could not be initialised; or `connect_tpu` was
            called again with another `tpu`.
    """
    global _connected
    if _connected is not None:
        if tpu is not None and tpu != _connected["tpu"]:
            raise RuntimeError(
                f"connect_tpu() already connected to tpu={_connected['tpu']!r} "
                f"({_connected['cores']} cores); one process uses one TPU. "
                f"Received: tpu={tpu!r}. Call connect_tpu() once, or restart "
                "the runtime to use another TPU."
            )
        return _connected["cores"]

    try:
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        except ValueError:
            # A TPU VM without TPU_NAME set: its chips are attached locally.
            if tpu is not None or not _local_tpu_chips():
                raise
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
                tpu="local"
            )
    except (ValueError, RuntimeError) as e:
        raise RuntimeError(
            f"connect_tpu(): no TPU found ({e}). Received: tpu={tpu!r}; "
            f"{_RUNTIME_HINT}. Without a TPU, omit connect_tpu(): tfpar uses "
            "the GPUs, else the CPUs."
        ) from e
    tf.config.experimental_connect_to_cluster(resolver)
    try:
        dtensor.initialize_accelerator_system("TPU")
    except ValueError as e:
        if "TensorFlow has already been initialized" in str(e):
            fix = (
                "Call tfpar.connect_tpu() first thing in the program, before "
                "any TensorFlow op, model, tfpar.Mesh or use_virtual_cpus; on "
                "Colab restart the runtime"
            )
        else:
            fix = _RUNTIME_HINT
        raise RuntimeError(
            f"connect_tpu() could not initialise the TPU system for DTensor "
            f"({e}). Received: tpu={tpu!r}. {fix}."
        ) from e

    cores = len(
        [
            d
            for d in _mesh._pick_devices(tf.config.list_logical_devices())
            if d.startswith("TPU:")
        ]
    )
    if cores == 0:
        raise RuntimeError(
            "connect_tpu(): no TPU found: the TPU system initialised but "
            f"TensorFlow lists no TPU core. Received: tpu={tpu!r}; "
            f"{_RUNTIME_HINT}."
        )
    _connected = {"tpu": tpu, "cores": cores}
    return cores


def _local_tpu_chips():
    """Device files of TPU chips attached to this host (TPU VMs)."""
    return glob.glob("/dev/accel*") + glob.glob("/dev/vfio/[0-9]*")


def connected_tpu_cores():
    """TPU cores connected by `connect_tpu()` in this process, or 0."""
    return 0 if _connected is None else _connected["cores"]
