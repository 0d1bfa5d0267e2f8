"""A few minutes' check that tfpar trains right on this machine's devices.

`python -m tfpar.env --smoke` runs it and prints a Markdown report to paste
into an issue. Each check trains a small MLP (up/down pairs, a layer norm)
for a few steps under tfpar on one way of splitting it over the devices —
data parallel, tensor parallel, fsdp, a 2-stage pipeline, mixed precision —
and the same steps on one device from the same weights, then compares the
two. A check PASSes when each weight's update is within that weight's
tolerance of one device's (relative difference; a NaN or an infinity
FAILs; the report shows the weight nearest its bound); one that raises
is reported FAIL with its exception, and the others still run. Each
check's median step time is timed next to one device's.

The devices are TensorFlow's: the TPU cores if a TPU was connected
(`tfpar.connect_tpu`), else the GPUs, else the CPU split into virtual CPUs
(`prepare_devices`). float32 checks run with TensorFloat-32 off, so that
an Ampere GPU's matmuls round as one device's float32 does.

Example (on 8 virtual CPUs, as the tests run it):

>>> import tfpar
>>> from tfpar import smoke
>>> tfpar.use_virtual_cpus(8)
>>> result = smoke.run(["data"])
>>> [(check.name, check.status) for check in result.checks]
[('data', 'PASS')]
"""

import dataclasses
import math
import os
import statistics
import time
import traceback

import keras
import numpy as np
import tensorflow as tf

from tfpar import logs as _logs
from tfpar import mesh as _mesh
from tfpar import tpu as _tpu
from tfpar.pipeline.model import PipelineModel
from tfpar.strategy import ParallelStrategy

# float32: the house parity bound, relative to one device's weight update.
FLOAT32_TOLERANCE = 1e-4
# Mixed precision: each weight's sharded update may differ from one device's
# mixed one by up to this many times that weight's own one-device
# mixed-vs-float32 difference (the mesh sums partial gradients in the low
# precision: a few more roundings), plus MIXED_FLOOR.
MIXED_SLACK = 3.0
MIXED_FLOOR = 1e-3
PARITY_STEPS = 4
TIMED_STEPS = 5
SAMPLES_PER_DEVICE = 8
FEATURES, WIDTH, OUTPUTS = 32, 128, 8
FLOAT16_LOSS_SCALE = 2**15  # never overflows on this model and data
MICROBATCHES = 4

# Megatron pairs: up column-parallel (outputs split), down row-parallel.
TENSOR_RULES = {
    r".*up\d/kernel": (None, "model"),
    r".*up\d/bias": ("model",),
    r".*down\d/kernel": ("model", None),
}
CHECK_NAMES = ("data", "tensor", "fsdp", "pipeline", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Check:
    """One way of splitting the model; `axes` None means skipped."""

    name: str
    title: str
    axes: dict | None
    rules: dict | None = None
    fsdp: bool = False
    microbatches: int | None = None
    policy: str = "float32"
    skip_reason: str = ""


@dataclasses.dataclass
class CheckResult:
    """A check's outcome: status "PASS", "FAIL" or "SKIP"."""

    name: str
    title: str
    mesh: str
    status: str
    error: float | None = None
    tolerance: float | None = None
    step_ms: float | None = None
    reference_ms: float | None = None
    failure: str = ""


@dataclasses.dataclass
class SmokeResult:
    """All checks of one run, with the devices they ran on."""

    device_type: str
    devices: list
    reference_device: str
    checks: list

    @property
    def passed(self):
        """True when no check failed (skipped ones do not count)."""
        return all(check.status != "FAIL" for check in self.checks)

    def as_dict(self):
        return {"passed": self.passed, "device_type": self.device_type,
                "devices": list(self.devices),
                "reference_device": self.reference_device,
                "checks": [dataclasses.asdict(c) for c in self.checks]}

    def markdown(self):
        """The checks as Markdown: a table, then each failure's text."""
        return "\n".join(_markdown_lines(self))


def prepare_devices(virtual_cpus=8):
    """Picks the devices to check, before TensorFlow starts its runtime.

    A TPU (connected already, or found from `TPU_NAME` or this host's TPU
    chips and connected with `tfpar.connect_tpu`), else the GPUs, else the
    CPU split into `virtual_cpus` logical devices. Returns a list of notes
    (why a TPU found was not used), empty when there is nothing to say.

    Example (on a host without TPU or GPU):

    >>> from tfpar import smoke
    >>> smoke.prepare_devices(8)
    []
    >>> tfpar.mesh.default_devices()[-1]
    'CPU:7'
    """
    notes = []
    wants_tpu = os.environ.get("TPU_NAME") or _tpu._local_tpu_chips()
    if not _tpu.connected_tpu_cores() and wants_tpu:
        try:
            _tpu.connect_tpu()
        except RuntimeError as e:
            notes.append(f"TPU not used: {e}")
    with _logs.filtered_stderr(_logs.NO_GPU_DRIVER_LINES):  # CPU-only hosts
        gpus = tf.config.list_physical_devices("GPU")
    if not _tpu.connected_tpu_cores() and not gpus:
        _mesh.use_virtual_cpus(virtual_cpus)
    return notes


def checks_for(device_type, count):
    """The checks `count` devices of `device_type` allow, in run order;
    those it does not allow have `axes` None and say why.

    Example:

    >>> [(c.name, c.axes) for c in smoke.checks_for("GPU", 2)][:3]
    [('data', {'data': 2}), ('tensor', {'data': 1, 'model': 2}), ('fsdp', {'data': 2})]
    """
    model = next((m for m in (4, 2) if count % m == 0), None)
    tensor = {"data": count // model, "model": model} if model else None
    odd = "needs an even number of devices"
    # Mixed precision on the tensor-parallel mesh, else data parallel.
    mixed, mixed_rules = (tensor, TENSOR_RULES) if tensor else (
        {"data": count}, None)
    split = "tensor parallel" if tensor else "data parallel"
    float16_skip = ("" if device_type == "GPU"
                    else f"float16 is for GPUs; {device_type} uses bfloat16")
    return [
        Check("data", "data parallel", {"data": count}),
        Check("tensor", "tensor parallel", tensor, TENSOR_RULES,
              skip_reason=odd),
        Check("fsdp", "fsdp", {"data": count} if count > 1 else None,
              fsdp=True, skip_reason="needs 2 or more devices"),
        Check("pipeline", f"pipeline, 2 stages, {MICROBATCHES} micro-batches",
              {"pipe": 2, "data": count // 2} if count % 2 == 0 else None,
              microbatches=MICROBATCHES, skip_reason=odd),
        Check("bfloat16", f"mixed_bfloat16, {split}", mixed, mixed_rules,
              policy="mixed_bfloat16"),
        Check("float16", f"mixed_float16, {split}",
              None if float16_skip else mixed, mixed_rules,
              policy="mixed_float16", skip_reason=float16_skip),
    ]


def run(names=None):
    """Runs the checks named in `names` (all of `CHECK_NAMES` by default)
    on `tfpar.mesh.default_devices()` and returns a `SmokeResult`.

    Example:

    >>> result = smoke.run(["data", "tensor"])
    >>> result.passed, [c.mesh for c in result.checks]
    (True, ['data=8', 'data=2 × model=4'])
    >>> print(result.markdown())             # doctest: +ELLIPSIS
    **PASS**: 2 of 2 checks passed on 8 CPU device(s); one device = CPU:0.
    ...
    """
    unknown = sorted(set(names or ()) - set(CHECK_NAMES))
    if unknown:
        raise ValueError(f"unknown smoke check(s) {unknown}. Received: "
                         f"names={list(names)}; choose from {CHECK_NAMES}.")
    devices = _mesh.default_devices()
    device_type = devices[0].split(":")[0]
    # A plain Keras step on a TPU core needs TPUStrategy: one device is the
    # host CPU there; elsewhere the first device of the mesh.
    reference_device = "CPU:0" if device_type == "TPU" else devices[0]
    selected = [check for check in checks_for(device_type, len(devices))
                if names is None or check.name in names]
    data = _data(len(devices) * SAMPLES_PER_DEVICE)
    keras.utils.set_random_seed(0)
    initial = _build("float32").get_weights()
    runs = _Runs(initial, data, reference_device)
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        results = [runs.check(check) for check in selected]
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
    return SmokeResult(device_type, devices, reference_device, results)


def _build(policy):
    # Layers in `policy` (their weights stay float32); the head in float32.
    layers = [keras.Input((FEATURES,))]
    for i in range(2):
        layers += [
            keras.layers.Dense(WIDTH, activation="relu", name=f"up{i}",
                               dtype=policy),
            keras.layers.Dense(FEATURES, name=f"down{i}", dtype=policy),
            keras.layers.LayerNormalization(name=f"norm{i}", dtype=policy),
        ]
    layers.append(keras.layers.Dense(OUTPUTS, name="head"))
    return keras.Sequential(layers, name="smoke_mlp")


def _compile(model, policy):
    # SGD with momentum: Adam's early steps are about lr * sign(gradient),
    # which turns a rounding difference in a tiny gradient into a whole step.
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    if policy == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer, initial_scale=FLOAT16_LOSS_SCALE)
    model.compile(optimizer=optimizer, loss="mse")


def _data(batch):
    rng = np.random.default_rng(0)
    steps = PARITY_STEPS + TIMED_STEPS
    x = rng.normal(size=(steps * batch, FEATURES)).astype("float32")
    y = np.tanh(x[:, :OUTPUTS] * x[:, OUTPUTS:2 * OUTPUTS]).astype("float32")
    return x, y, batch


@dataclasses.dataclass
class _Trained:
    updates: list  # trained weights minus the initial ones
    step_ms: float


class _Runs:
    """Trains the checks' models from the same weights on the same data;
    each policy's one-device run is trained once and kept."""

    def __init__(self, initial, data, reference_device):
        self.initial = initial
        self.data = data
        self.reference_device = reference_device
        self.references = {}

    def check(self, check):
        mesh = " × ".join(f"{axis}={n}" for axis, n in (check.axes or {}).items())
        result = CheckResult(check.name, check.title, mesh or "-", "SKIP")
        if check.axes is None:
            result.failure = check.skip_reason
            return result
        try:
            reference = self.reference(check.policy)
            tolerances = self.tolerances(check.policy)
            result.tolerance = min(tolerances)
            trained = self.parallel(check)
        except Exception as e:  # a report of it is the check's result
            result.status, result.failure = "FAIL", _describe(e)
            return result
        result.error, result.tolerance = _worst_weight(
            _relative_differences(trained.updates, reference.updates),
            tolerances)
        result.step_ms, result.reference_ms = trained.step_ms, reference.step_ms
        within = math.isfinite(result.error) and (
            result.error <= result.tolerance)
        result.status = "PASS" if within else "FAIL"
        return result

    def reference(self, policy):
        if policy not in self.references:
            with tf.device(self.reference_device):
                model = _build(policy)
                model.set_weights(self.initial)
                _compile(model, policy)
                self.references[policy] = self.train(model)
        return self.references[policy]

    def tolerances(self, policy):
        """Each weight's bound on its update's relative difference."""
        if policy == "float32":
            return [FLOAT32_TOLERANCE] * len(self.initial)
        precision = _relative_differences(self.reference(policy).updates,
                                          self.reference("float32").updates)
        return [MIXED_SLACK * p + MIXED_FLOOR for p in precision]

    def parallel(self, check):
        strategy = ParallelStrategy(_mesh.Mesh(check.axes), rules=check.rules,
                                    fsdp=check.fsdp)
        with strategy.scope():
            model = _build(check.policy)
            if check.microbatches:
                model = PipelineModel(model, num_microbatches=check.microbatches)
            model.set_weights(self.initial)
            _compile(model, check.policy)
        return self.train(model)

    def train(self, model):
        """One `fit` over PARITY_STEPS + TIMED_STEPS batches: the weights'
        updates after the first PARITY_STEPS, and the median time between
        the ends of two steps after the first (which compiles)."""
        x, y, batch = self.data
        watch = _StepWatch(PARITY_STEPS)
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[watch])
        updates = [np.asarray(w, "float64") - w0
                   for w, w0 in zip(watch.weights, self.initial)]
        return _Trained(updates, 1e3 * statistics.median(np.diff(watch.ends)))


class _StepWatch(keras.callbacks.Callback):
    """Each step's end time (the loss read first, so the step has run) and
    the weights after step `weights_after`."""

    def __init__(self, weights_after):
        super().__init__()
        self.weights_after = weights_after
        self.ends = []
        self.weights = None

    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])  # waits for the step's result
        self.ends.append(time.perf_counter())
        if batch + 1 == self.weights_after:
            self.weights = self.model.get_weights()


def _relative_differences(updates, reference_updates):
    """Each weight's max|u - r| / max|r|: how far its update is from one
    device's, relative to the size of that update; inf when either update
    holds a NaN or an infinity (a NaN would otherwise compare as small)."""
    differences = []
    for u, r in zip(updates, reference_updates):
        if not (np.all(np.isfinite(u)) and np.all(np.isfinite(r))):
            differences.append(float("inf"))
            continue
        scale = max(float(np.max(np.abs(r), initial=0.0)), 1e-30)
        differences.append(float(np.max(np.abs(u - r), initial=0.0)) / scale)
    return differences


def _worst_weight(errors, tolerances):
    """(error, tolerance) of the weight with the largest error / tolerance:
    the check passes when that weight's error is within its tolerance. A
    non-finite error is the worst."""
    return max(zip(errors, tolerances), key=lambda pair: (
        pair[0] / pair[1] if math.isfinite(pair[0]) else math.inf))


def _describe(error, lines=8, frames=3):
    """The exception's type and first lines, and where it was raised."""
    message = f"{type(error).__name__}: {error}".splitlines()
    text = message[:lines] + (["…"] if len(message) > lines else [])
    for frame in traceback.extract_tb(error.__traceback__)[-frames:]:
        text.append(f"  at {frame.filename}:{frame.lineno} in {frame.name}")
    return "\n".join(text)


def _number(value, spec):
    return "-" if value is None else format(value, spec)


def _markdown_lines(result):
    failed = [c for c in result.checks if c.status == "FAIL"]
    ran = [c for c in result.checks if c.status != "SKIP"]
    lines = [
        f"**{'PASS' if result.passed else 'FAIL'}**: {len(ran) - len(failed)}"
        f" of {len(ran)} checks passed on {len(result.devices)} "
        f"{result.device_type} device(s); one device = "
        f"{result.reference_device}.",
        *([f"No TPU or GPU was found: these are the host CPU split in "
           f"{len(result.devices)}, which tells nothing about accelerators."]
          if result.device_type == "CPU" else []),
        "",
        "| check | mesh | result | max rel. error | tolerance "
        "| step ms (tfpar) | step ms (one device) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in result.checks:
        status = {"SKIP": f"SKIP ({c.failure})",
                  "FAIL": f"FAIL ({c.failure.split(':', 1)[0]})"}.get(
                      c.status, c.status) if c.failure else c.status
        lines.append(
            f"| {c.name}: {c.title} | {c.mesh} | {status} "
            f"| {_number(c.error, '.2e')} | {_number(c.tolerance, '.1e')} "
            f"| {_number(c.step_ms, '.1f')} | {_number(c.reference_ms, '.1f')} |")
    lines += ["", "Error: the largest relative difference of a weight's "
              f"update after {PARITY_STEPS} steps from one device's; step "
              f"time: the median of the {PARITY_STEPS + TIMED_STEPS - 1} "
              "steps after the first (which compiles)."]
    for c in failed:
        lines += ["", f"### {c.name} failed", "", "```",
                  c.failure or (f"max rel. error {c.error:.2e} > tolerance "
                                f"{c.tolerance:.1e}"), "```"]
    return lines
