"""What the pure TF + DTensor reproductions in tests/ share: running one
attempt to its first error, and printing each attempt beside one device's
result. Imports TF and DTensor only, so the reproductions stay free of
tfpar.

>>> compiled_or_error(lambda: 1 / 0)
('division by zero', None)
"""

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor


def cpu_mesh(axes):
    """A DTensor mesh of `axes` ([(name, size), ...]) on virtual CPU
    devices (8 configured here when TF has not started yet, e.g. when a
    reproduction runs as a script; the test suite configures them
    itself)."""
    try:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * 8)
    except RuntimeError:  # already configured (e.g. by the test suite)
        pass
    return dtensor.create_mesh(axes, device_type="CPU")


def compiled_or_error(compute):
    """("compiled", the first device's block of `compute()` as numpy) or
    (the first line of the error it raised — DTensor's compile error —,
    None)."""
    try:
        result = compute()
    except Exception as error:  # noqa: BLE001 - DTensor's compile error
        return str(error).strip().splitlines()[0], None
    return "compiled", dtensor.unpack(result)[0].numpy()


def print_beside_one_device(attempt, cases, dmesh, want):
    """Prints, for each case, `attempt(case, dmesh)`'s status and, when it
    compiled, its largest difference from `want` (one device's result)."""
    for case in cases:
        status, got = attempt(case, dmesh)
        if got is not None:
            status += f", {np.abs(got - want).max():.1e} from one device"
        print(f"{case}: {status}")
