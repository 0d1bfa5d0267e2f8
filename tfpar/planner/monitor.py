"""Measured next to predicted: `StepTimeMonitor`, a Keras callback that logs
each epoch's measured step time next to the planner's estimate, and the
model FLOP/s and MFU (model FLOPs utilisation) the measured time achieves.

Timing: the wall clock from `on_train_batch_begin` to `on_train_batch_end`
(the process' CPU time on a shared host, `Cluster.shared_host`, whose
`Cluster.local()` figures and estimates are CPU seconds). Keras converts a
step's logs (the loss) to Python numbers before `on_train_batch_end`,
which waits for the step's devices: that is the sync point. With
`steps_per_execution=k` one interval covers k steps (Keras passes the
first and last step of it) and counts as k steps of its mean time. The
first `warmup_steps` steps of a `fit` (tracing and compiling) are left
out; each epoch reports the median of its timed steps.

Model FLOPs (per step, all devices): 3 × the forward FLOPs per sample of
every matmul and convolution and of attention's two score products
(QKᵀ and the product with V over the full s × s scores), × the global
batch — forward once, backward twice (data and weight gradients), as
`tfpar.plan`'s profile counts them: for a GPT, 6 FLOPs per weight per
token plus 12·L·h·s per token (PaLM's and Korthikanti et al.'s model
FLOPs). Recomputation is not model FLOPs: it shows in `hfu`, which uses
the estimate's `executed_flops` (per device, recomputation included) when
the estimate counts them (`tfpar.estimate`'s roofline).

Peak: a preset's dense vendor peak in the model's compute dtype (float32
as TF32 when TensorFlow allows TF32 and the device has it; as bf16 passes
on a TPU, XLA's default); a described cluster's `device_flops` (on
`Cluster.local()` a measured matmul rate, not a vendor peak).

>>> cluster = tfpar.Cluster.preset("a100-80gb", num_hosts=4)
>>> e = tfpar.estimate(gpt, 512, cluster=cluster, axes={"data": 32})
>>> monitor = tfpar.StepTimeMonitor(e, cluster=cluster,
...                                 global_batch_size=512)
>>> model.fit(x, y, batch_size=512, epochs=3, callbacks=[monitor])
>>> monitor.history[-1]["mfu"], monitor.measured_step_time_s
>>> tuned = cluster.calibrated(monitor.measured_step_time_s,
...     lambda c: tfpar.estimate(gpt, 512, cluster=c, axes={"data": 32}))
"""

import statistics
import time

import keras
import numpy as np

from tfpar.planner import cost as cost_lib
from tfpar.planner import hardware as hardware_lib
from tfpar.planner import profile as profile_lib
from tfpar.planner.cluster import Cluster

# The keys each epoch adds to Keras' logs (History, TensorBoard) and to
# `StepTimeMonitor.history`; "hfu" only when the estimate counts executed
# FLOPs.
LOG_KEYS = ("step_time_s", "predicted_step_time_s", "step_time_ratio",
            "model_flops_per_s", "mfu", "predicted_mfu", "hfu")


class StepTimeMonitor(keras.callbacks.Callback):
    """Logs each epoch's measured step time next to the estimate's, the
    achieved model FLOP/s per device and the MFU (module docstring: what is
    timed and counted).

    Args:
        estimate: the `Estimate` to compare with (`tfpar.estimate(...)`,
            a `Plan`'s `.estimate`), or a `Plan` (`tfpar.plan(...)`: its
            estimate, cluster, global batch and model FLOPs are used).
        cluster: the `tfpar.Cluster` the estimate was made for (read from
            a `Plan` when not given).
        global_batch_size: samples per step over all devices (read from a
            `Plan`); counts the model FLOPs.
        model_flops_per_step: model FLOPs per step over all devices, in
            place of the count from the model being fit.
        warmup_steps: steps at the start of each `fit` left out (compiling).
        verbose: 1 prints one line per epoch, 0 nothing.

    Each epoch with timed steps adds to Keras' epoch logs (seen by
    `History` and by callbacks listed after this one, e.g. TensorBoard)
    and appends to `history` ({"epoch", "steps", *LOG_KEYS}):
    `step_time_s` (measured median), `predicted_step_time_s`,
    `step_time_ratio` (measured / predicted), `model_flops_per_s` (per
    device), `mfu` (that / peak), `predicted_mfu` (at the predicted step
    time) and `hfu` (executed FLOPs / measured / peak, when known).

    Example (8 virtual CPUs; on a GPU cluster use its `Cluster.preset`):

    ```python
    import keras, numpy as np, tfpar
    tfpar.use_virtual_cpus(8)

    def build():
        inputs = keras.Input((32,))
        hidden = keras.layers.Dense(128, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(4)(hidden))

    plan = tfpar.plan(build, 64)
    with plan.strategy().scope():
        model = plan.apply(build())
        model.compile(optimizer="adam", loss="mse")
    monitor = tfpar.StepTimeMonitor(plan)       # the plan's estimate
    x, y = np.ones((640, 32), "float32"), np.ones((640, 4), "float32")
    model.fit(x, y, batch_size=64, epochs=2, callbacks=[monitor])
    last = monitor.history[-1]
    print(last["step_time_s"], last["step_time_ratio"], last["mfu"])
    ```
    """

    def __init__(self, estimate, *, cluster=None, global_batch_size=None,
                 model_flops_per_step=None, warmup_steps=2, verbose=1):
        super().__init__()
        self.estimate, self.cluster, batch, flops = _prediction(
            estimate, cluster, global_batch_size)
        if model_flops_per_step is not None:
            flops = _positive("model_flops_per_step", model_flops_per_step)
        if flops is None and batch is None:
            raise ValueError(
                "StepTimeMonitor needs global_batch_size= (samples per step "
                "over all devices) to count the model FLOPs, or "
                "model_flops_per_step=. Received neither.")
        if isinstance(warmup_steps, bool) or not isinstance(
                warmup_steps, (int, np.integer)) or warmup_steps < 0:
            raise ValueError("StepTimeMonitor(warmup_steps) must be an "
                             f"integer >= 0. Received: {warmup_steps!r}")
        self.global_batch_size = batch
        self._given_flops = flops    # None: counted from the model fit
        self.model_flops_per_step = flops
        self.warmup_steps = int(warmup_steps)
        self.verbose = verbose
        self.peak_flops = None
        self.history = []
        self._clock = (time.process_time if self.cluster.shared_host
                       else time.perf_counter)
        self._all_steps, self._epoch_steps = [], []
        self._steps_seen, self._first_step, self._start = 0, 0, None

    @property
    def measured_step_time_s(self):
        """Median seconds per step over every timed step of the last `fit`
        (what `Cluster.calibrated` takes)."""
        if not self._all_steps:
            raise ValueError(
                "StepTimeMonitor has timed no step yet: fit with it for more "
                f"than warmup_steps={self.warmup_steps} steps.")
        return statistics.median(self._all_steps)

    def on_train_begin(self, logs=None):
        self.history, self._all_steps, self._steps_seen = [], [], 0
        self.model_flops_per_step = self._given_flops or (
            3.0 * _forward_flops_per_sample(self.model)
            * self.global_batch_size)
        self.peak_flops = peak_flops(self.cluster,
                                     self.model.dtype_policy.compute_dtype)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_steps = []

    def on_train_batch_begin(self, batch, logs=None):
        self._first_step, self._start = batch, self._clock()

    def on_train_batch_end(self, batch, logs=None):
        seconds = self._clock() - self._start
        steps = max(1, batch - self._first_step + 1)  # steps_per_execution
        warm = self._steps_seen >= self.warmup_steps
        self._steps_seen += steps
        if warm:
            self._epoch_steps += [seconds / steps] * steps
            self._all_steps += [seconds / steps] * steps

    def on_epoch_end(self, epoch, logs=None):
        if not self._epoch_steps:
            return
        record = self.record(statistics.median(self._epoch_steps))
        if logs is not None:
            logs.update(record)
        self.history.append({"epoch": epoch,
                             "steps": len(self._epoch_steps), **record})
        if self.verbose:
            print(_line(epoch, len(self._epoch_steps), record))

    def record(self, measured_step_time_s):
        """The logged figures ({LOG_KEYS}) for a measured step time."""
        predicted = self.estimate.step_time_s
        per_device = self.model_flops_per_step / self.cluster.num_devices
        # Achieved model FLOP/s per device = model FLOPs / devices / step.
        achieved = per_device / measured_step_time_s
        out = {"step_time_s": measured_step_time_s,
               "predicted_step_time_s": predicted,
               "step_time_ratio": measured_step_time_s / predicted,
               "model_flops_per_s": achieved,
               "mfu": achieved / self.peak_flops,
               "predicted_mfu": per_device / predicted / self.peak_flops}
        if self.estimate.executed_flops:
            out["hfu"] = (self.estimate.executed_flops
                          / measured_step_time_s / self.peak_flops)
        return out


def peak_flops(cluster, compute_dtype):
    """Dense peak FLOP/s per device of `cluster` in `compute_dtype` (see
    the module docstring)."""
    if cluster.hardware is None:
        return cluster.device_flops
    return cluster.hardware.compute_peak(compute_dtype, cost_lib.tf32())


def _prediction(estimate, cluster, batch):
    """(Estimate, Cluster, global batch or None, model FLOPs or None) from
    the monitor's arguments, checked."""
    if isinstance(estimate, cost_lib.Estimate):
        if not isinstance(cluster, Cluster):
            raise TypeError(
                "StepTimeMonitor(cluster) must be the tfpar.Cluster the "
                "estimate was made for (its device count and peak). "
                f"Received: cluster={cluster!r}")
        if batch is not None:
            batch = int(_positive("global_batch_size", batch))
        return estimate, cluster, batch, None
    plan_estimate = getattr(estimate, "estimate", None)
    info = getattr(estimate, "info", None)
    if isinstance(plan_estimate, cost_lib.Estimate) and isinstance(info, dict):
        plan_batch = info["global_batch_size"]
        flops = 3.0 * info["forward_flops_per_sample"] * plan_batch
        return (plan_estimate, cluster or _cluster_of(info["cluster"]),
                plan_batch, flops)
    raise TypeError(
        "StepTimeMonitor needs the estimate to compare with: an Estimate "
        "(tfpar.estimate(...), plan.estimate) or a tfpar.plan Plan. "
        f"Received: {estimate!r}")


def _cluster_of(saved):
    """The `Cluster` of a plan's `info["cluster"]` (`Cluster.to_dict`)."""
    hw = saved.get("hardware")
    return Cluster(**{**saved, "hardware": (hardware_lib.Hardware(**hw)
                                            if isinstance(hw, dict) else hw)})


def _forward_flops_per_sample(model):
    try:
        return profile_lib.profile_model(model).total_flops
    except (ValueError, TypeError, AttributeError, KeyError) as error:
        raise ValueError(
            f"StepTimeMonitor could not count the FLOPs of model "
            f"{model.name!r} ({error}); pass model_flops_per_step=."
        ) from error


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(
            value, (int, float, np.number)) or not value > 0 \
            or not np.isfinite(value):
        raise ValueError(f"StepTimeMonitor({name}) must be a positive "
                         f"number. Received: {name}={value!r}")
    return float(value)


def _line(epoch, steps, r):
    return (f"StepTimeMonitor epoch {epoch + 1}: measured "
            f"{r['step_time_s'] * 1e3:.4g} ms/step (median of {steps}), "
            f"predicted {r['predicted_step_time_s'] * 1e3:.4g} ms (measured "
            f"/ predicted {r['step_time_ratio']:.3g}); "
            f"{_rate(r['model_flops_per_s'])} of model FLOPs per device, "
            f"MFU {r['mfu']:.1%} (predicted {r['predicted_mfu']:.1%})"
            + (f", HFU {r['hfu']:.1%}" if "hfu" in r else ""))


def _rate(flops_per_s):
    """FLOP/s in the largest unit (T, G, M) that keeps it at least 1."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if flops_per_s >= scale:
            return f"{flops_per_s / scale:.4g} {unit}FLOP/s"
    return f"{flops_per_s:.4g} FLOP/s"
