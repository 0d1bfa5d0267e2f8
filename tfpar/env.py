"""What to paste into a tfpar bug report: versions, devices, settings.

Run it as a command (it prints the report and exits):

    python -m tfpar.env                    # the devices TensorFlow finds
    python -m tfpar.env --virtual-cpus 8   # as tfpar's tests and demos see it
    python -m tfpar.env --smoke            # and check tfpar trains right here

It initialises no virtual CPUs and no TPU unless asked with
`--virtual-cpus N`; listing logical devices does start TensorFlow's runtime.

`--smoke` first picks the devices (a TPU, else the GPUs, else 8 virtual
CPUs or `--virtual-cpus N`), runs `tfpar.smoke`'s parity and step-time
checks on them (`--checks data,tensor` for some; about a minute on 8
virtual CPUs) and prints a Markdown report (`--json` for a JSON one); the
exit code is 1 when a check failed.
"""

import argparse
import collections
import os
import json
import platform
import shutil
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf

import tfpar
from tfpar import mesh as _mesh
from tfpar import smoke as _smoke
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
    return lines + _gpu_details()


def _gpu_details():
    """Each GPU's name and compute capability, and the NVIDIA driver."""
    gpus = tf.config.list_physical_devices("GPU")
    lines = []
    for gpu in gpus:
        details = tf.config.experimental.get_device_details(gpu)
        lines.append(f"  {gpu.name}: {details.get('device_name', '?')} "
                     "(compute capability "
                     f"{details.get('compute_capability', '?')})")
    if gpus:
        lines.append(f"gpu driver: {_nvidia_driver()}")
    return lines


def _nvidia_driver():
    command = shutil.which("nvidia-smi")
    if command is None:
        return "unknown (no nvidia-smi on PATH)"
    try:
        answer = subprocess.run(
            [command, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown (nvidia-smi: {type(e).__name__})"
    return ", ".join(sorted(set(answer.stdout.split()))) or "unknown"


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


def smoke_report(result, notes=()):
    """The Markdown report of a `tfpar.smoke.SmokeResult` to paste into an
    issue: versions and devices, the checks, then the rest of `report()`.

    Example:

    >>> from tfpar import env, smoke
    >>> print(env.smoke_report(smoke.run(["data"])))  # doctest: +ELLIPSIS
    # tfpar smoke check
    ...
    """
    bullets = [*_versions(), *_devices(), *notes]
    rest = [*_runtime(), *_environment_variables(), *_default_mesh()]
    return "\n".join([
        "# tfpar smoke check", "",
        *(f"- {line.strip()}" for line in bullets), "",
        result.markdown(), "",
        "<details><summary>more of <code>python -m tfpar.env</code></summary>",
        "", "```", *rest, "```", "", "</details>"])


def _run_smoke(args, parser):
    """`--smoke`: picks the devices, runs the checks, prints the report;
    returns the exit code (1 when a check failed)."""
    names = None
    if args.checks is not None:
        names = [name.strip() for name in args.checks.split(",") if name.strip()]
        unknown = [name for name in names if name not in _smoke.CHECK_NAMES]
        if unknown or not names:
            parser.error(f"--checks takes names from {','.join(_smoke.CHECK_NAMES)}"
                         f". Received: --checks {args.checks}")
    notes = _smoke.prepare_devices(args.virtual_cpus or 8)
    result = _smoke.run(names)
    if args.json:
        print(json.dumps({**result.as_dict(), "notes": notes,
                          "environment": report().splitlines()}, indent=1))
    else:
        print(smoke_report(result, notes))
    return 0 if result.passed else 1


def main(argv=None):
    """Command line entry point:
    `python -m tfpar.env [--virtual-cpus N] [--smoke [--checks ...] [--json]]`."""
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
            "by default no virtual CPUs are created (8 with --smoke on a "
            "host without TPU or GPU)"
        ),
    )
    parser.add_argument(
        "--smoke", action="store_true",
        help=("run a short parity and step-time check of tfpar on this "
              "machine's TPU, GPUs or virtual CPUs and print a Markdown "
              "report to paste into an issue; exit code 1 if a check fails"))
    parser.add_argument(
        "--checks", metavar="NAMES", default=None,
        help=("with --smoke: the checks to run, comma-separated, from "
              f"{','.join(_smoke.CHECK_NAMES)} (default: all)"))
    parser.add_argument("--json", action="store_true",
                        help="with --smoke: print the report as JSON")
    args = parser.parse_args(argv)
    if args.virtual_cpus is not None and args.virtual_cpus < 1:
        parser.error(
            "--virtual-cpus needs a positive int. "
            f"Received: --virtual-cpus {args.virtual_cpus}"
        )
    if (args.checks is not None or args.json) and not args.smoke:
        parser.error("--checks and --json go with --smoke. Received: "
                     f"{' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.smoke:
        return _run_smoke(args, parser)
    if args.virtual_cpus is not None:
        tfpar.use_virtual_cpus(args.virtual_cpus)
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
