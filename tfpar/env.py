"""What to paste into a tfpar bug report: versions, devices, settings.

Run it as a command (it prints the report and exits):

    python -m tfpar.env                    # the devices TensorFlow finds
    python -m tfpar.env --virtual-cpus 8   # as tfpar's tests and demos see it

It initialises no virtual CPUs and no TPU unless asked with
`--virtual-cpus N`; listing logical devices does start TensorFlow's runtime.
"""

import argparse
import collections
import os
import platform
import sys

import keras
import numpy as np
import tensorflow as tf

import tfpar
from tfpar import mesh as _mesh
from tfpar import tpu as _tpu

_ENV_PREFIXES = ("TF_", "DTENSOR_", "LOWER_DTENSOR_")
_ENV_NAMES = (
    "KERAS_BACKEND",
    "CUDA_VISIBLE_DEVICES",
    "XLA_FLAGS",
    "TPU_NAME",
)
# Terraform also uses TF_* variables, some of them secrets: leave them out.
_ENV_SKIP_PREFIXES = (
    "TF_VAR_",
    "TF_TOKEN_",
    "TF_CLI_",
    "TF_LOG",
    "TF_PLUGIN_",
    "TF_REGISTRY_",
    "TF_WORKSPACE",
    "TF_IN_AUTOMATION",
    "TF_INPUT",
    "TF_IGNORE",
    "TF_STATE",
)
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "KEY")


def report():
    """Returns the environment report as a string, one `key: value` a line.

    Example:

    >>> from tfpar import env
    >>> print(env.report())           # doctest: +ELLIPSIS
    tfpar: 0.1.0
    ...
    """
    sections = (_versions, _devices, _runtime, _environment_variables,
                _default_mesh)
    return "\n".join(line for section in sections for line in section())


def _versions():
    build = tf.sysconfig.get_build_info()
    return [
        f"tfpar: {tfpar.__version__}",
        f"tensorflow: {tf.__version__}",
        f"keras: {keras.__version__} (backend: {keras.backend.backend()})",
        f"numpy: {np.__version__}",
        f"python: {platform.python_version()} ({sys.executable})",
        f"platform: {platform.platform()} ({platform.machine()})",
        f"host cpu count: {os.cpu_count()}",
        "tensorflow build: " + ", ".join(
            f"{key}={build.get(key)}"
            for key in ("is_cuda_build", "cuda_version", "cudnn_version")
            if key in build),
    ]


def _devices():
    physical = tf.config.list_physical_devices()
    logical = tf.config.list_logical_devices()
    lines = [f"physical devices: {_count_by_type(physical)}",
             f"logical devices: {_count_by_type(logical)}"]
    for device_type in sorted({d.device_type for d in logical}):
        names = _mesh._pick_devices(
            [d for d in logical if d.device_type == device_type]
        )
        lines.append(f"  {device_type}: {_mesh._device_range(names)}")
    return lines


def _runtime():
    lines = []
    try:
        from tensorflow.experimental import dtensor  # noqa: F401

        lines.append(
            "dtensor: importable (preferred device type: "
            f"{dtensor.preferred_device_type()})"
        )
    except Exception as e:  # pragma: no cover - tfpar imports it too
        lines.append(f"dtensor: NOT importable ({type(e).__name__}: {e})")
    lines.append(f"tfpar.connect_tpu: {_tpu.connected_tpu_cores()} TPU core(s)")
    threading = tf.config.threading
    lines.append(
        "tf.config.threading: "
        f"inter_op={threading.get_inter_op_parallelism_threads()}, "
        f"intra_op={threading.get_intra_op_parallelism_threads()} "
        "(0 = TensorFlow picks)"
    )
    return lines


def _environment_variables():
    env = {
        k: "<redacted>" if any(w in k.upper() for w in _SECRET_WORDS) else v
        for k, v in os.environ.items()
        if (k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES)
        and not k.startswith(_ENV_SKIP_PREFIXES)
    }
    return (["environment variables:" + ("" if env else " (none set)")]
            + [f"  {k}={env[k]}" for k in sorted(env)])


def _default_mesh():
    try:
        devices = _mesh.default_devices()
        default = tfpar.Mesh({"data": len(devices)}, devices=devices)
        return [f"default mesh: {default!r} (device type: {default.device_type})"]
    except Exception as e:
        return [f"default mesh: cannot be built ({type(e).__name__}: {e})"]


def _count_by_type(devices):
    counts = collections.Counter(d.device_type for d in devices)
    if not counts:
        return "none"
    return ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))


def main(argv=None):
    """Command line entry point: `python -m tfpar.env [--virtual-cpus N]`."""
    parser = argparse.ArgumentParser(
        prog="python -m tfpar.env",
        description=(
            "Print the tfpar, TensorFlow, Keras and device information to "
            "paste into a bug report."
        ),
    )
    parser.add_argument(
        "--virtual-cpus",
        type=int,
        metavar="N",
        default=None,
        help=(
            "first split the host CPU into N logical devices "
            "(tfpar.use_virtual_cpus(N)), as tfpar's tests and demos do; "
            "by default no virtual CPUs are created"
        ),
    )
    args = parser.parse_args(argv)
    if args.virtual_cpus is not None:
        if args.virtual_cpus < 1:
            parser.error(
                "--virtual-cpus needs a positive int. "
                f"Received: --virtual-cpus {args.virtual_cpus}"
            )
        tfpar.use_virtual_cpus(args.virtual_cpus)
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
