"""tfpar.StepTimeMonitor: each epoch's measured step time next to the
estimate's, the achieved model FLOP/s and MFU; `Cluster.calibrated` makes
the estimate reproduce a measured step time."""

import dataclasses
import os
import sys

import keras
import numpy as np
import pytest

import tfpar
from tfpar.planner import monitor as monitor_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import build_gpt  # noqa: E402

WIDTHS = (32, 64, 64, 8)
BATCH = 64


def mlp():
    inputs = keras.Input((WIDTHS[0],))
    h = inputs
    for i, width in enumerate(WIDTHS[1:-1]):
        h = keras.layers.Dense(width, activation="relu", name=f"hidden{i}")(h)
    out = keras.layers.Dense(WIDTHS[-1], name="out")(h)
    return keras.Model(inputs, out, name="mlp")


def mlp_model_flops_per_step():
    """Counted by hand: 2 FLOPs per kernel weight per sample forward, the
    backward pass twice that, over the global batch."""
    kernels = sum(a * b for a, b in zip(WIDTHS, WIDTHS[1:]))
    return 3 * 2 * kernels * BATCH


def small_gpt():
    return build_gpt(vocab=1024, seq_len=128, dim=256, heads=4, layers=2)


def test_fit_logs_measured_next_to_predicted_under_a_strategy(capsys):
    """A data=2 × model=4 MLP fit for 2 epochs of 8 steps: the monitor
    logs every key into Keras' History, and MFU is the achieved model
    FLOP/s (hand-counted FLOPs over the measured time) over the peak."""
    local = tfpar.Cluster.local()
    plan = tfpar.plan(mlp, BATCH, cluster=local)
    candidate = next(c for c in plan.candidates if c.estimate is not None
                     and c.axes == {"data": 2, "pipe": 1, "model": 4})
    monitor = tfpar.StepTimeMonitor(candidate.estimate, cluster=local,
                                    global_batch_size=BATCH)
    with pytest.warns(UserWarning, match="output head"):
        rules = tfpar.auto_rules(mlp(), axis_size=4)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=rules)
    rng = np.random.RandomState(0)
    x = rng.normal(size=(8 * BATCH, WIDTHS[0])).astype("float32")
    y = rng.normal(size=(8 * BATCH, WIDTHS[-1])).astype("float32")
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
        history = model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                            callbacks=[monitor])
    assert len(monitor.history) == 2
    assert [r["steps"] for r in monitor.history] == [6, 8]  # 2 warm-up steps
    flops = mlp_model_flops_per_step()
    assert monitor.model_flops_per_step == flops
    assert monitor.peak_flops == local.device_flops  # a described cluster
    for epoch, r in enumerate(monitor.history):
        assert 0 < r["step_time_s"] < 10, r
        assert r["predicted_step_time_s"] == candidate.estimate.step_time_s
        assert r["step_time_ratio"] == pytest.approx(
            r["step_time_s"] / r["predicted_step_time_s"])
        achieved = flops / local.num_devices / r["step_time_s"]
        assert r["model_flops_per_s"] == pytest.approx(achieved)
        assert r["mfu"] == pytest.approx(achieved / local.device_flops)
        assert r["predicted_mfu"] == pytest.approx(
            r["mfu"] * r["step_time_ratio"])
        assert "hfu" not in r  # the α-β estimate does not count them
        for key in monitor_lib.LOG_KEYS[:-1]:
            assert history.history[key][epoch] == r[key]
    assert monitor.measured_step_time_s > 0
    printed = capsys.readouterr().out
    assert "StepTimeMonitor epoch 2: measured" in printed
    assert f"MFU {monitor.history[1]['mfu']:.1%}" in printed


def test_steps_per_execution_count_as_their_steps():
    """One interval from step 0 to step 3 (steps_per_execution=4) is four
    steps of a quarter of its time each; the first two are warm-up."""
    monitor = tfpar.StepTimeMonitor(
        tfpar.estimate(small_gpt(), 64, cluster=tfpar.Cluster.preset(
            "a100-80gb"), axes={"data": 8}),
        cluster=tfpar.Cluster.preset("a100-80gb"), global_batch_size=64,
        verbose=0)
    ticks = iter([0.0, 4.0, 10.0, 18.0])
    monitor._clock = lambda: next(ticks)
    monitor.on_epoch_begin(0)
    for first, last in ((0, 1), (2, 5)):
        monitor.on_train_batch_begin(first)
        monitor.on_train_batch_end(last)
    assert monitor._epoch_steps == [2.0] * 4  # (18 - 10) / 4, 4 times


def test_a_plan_gives_estimate_cluster_batch_and_model_flops():
    local = tfpar.Cluster.local()
    plan = tfpar.plan(mlp, BATCH, cluster=local)
    monitor = tfpar.StepTimeMonitor(plan)
    assert monitor.estimate is plan.estimate
    assert monitor.cluster == local and monitor.global_batch_size == BATCH
    assert monitor.model_flops_per_step == mlp_model_flops_per_step()


def test_a_preset_monitor_logs_hfu_against_the_dtype_peak():
    """On a preset the peak is the vendor's in the compute dtype and HFU
    counts the roofline's executed FLOPs (recomputation included)."""
    dgx = tfpar.Cluster.preset("a100-80gb")
    e = tfpar.estimate(small_gpt(), 64, cluster=dgx, axes={"data": 8},
                       recompute="full")
    monitor = tfpar.StepTimeMonitor(e, cluster=dgx, model_flops_per_step=1e15)
    monitor.peak_flops = monitor_lib.peak_flops(dgx, "bfloat16")
    assert monitor.peak_flops == 312e12
    r = monitor.record(2 * e.step_time_s)
    assert r["hfu"] == pytest.approx(e.executed_flops / r["step_time_s"]
                                     / 312e12)
    assert r["mfu"] == pytest.approx(1e15 / 8 / r["step_time_s"] / 312e12)


@pytest.mark.parametrize("ratio", [3.0, 1.3, 0.95])
def test_calibration_reproduces_the_measured_step_time(ratio):
    """Slower and faster than predicted: the calibrated preset's estimate
    is the measurement; the hardware facts stay, the kernel efficiencies
    move together and never above 1."""
    gpt = small_gpt()
    dgx = tfpar.Cluster.preset("a100-80gb")

    def same(cluster):
        return tfpar.estimate(gpt, 64, cluster=cluster,
                              axes={"data": 2, "model": 4})

    predicted = same(dgx).step_time_s
    tuned = dgx.calibrated(ratio * predicted, same)
    assert same(tuned).step_time_s == pytest.approx(ratio * predicted,
                                                    rel=1e-6)
    old, new = dgx.hardware, tuned.hardware
    for fact in ("peak_flops", "memory", "hbm_bandwidth", "intra_bandwidth",
                 "inter_bandwidth", "intra_latency", "inter_latency"):
        assert getattr(new, fact) == getattr(old, fact), fact
    assert (new.gemm < old.gemm) == (ratio > 1)
    assert max(new.gemm, new.flash, new.hbm) <= 1.0
    assert tuned.device_flops == pytest.approx(312e12 * new.gemm)
    assert "calibrated" in tuned.source


def test_calibration_of_a_described_cluster_scales_its_device_rates():
    gpt = small_gpt()
    described = tfpar.Cluster(1, 8, 1e9, 1e10, 1e9, 1e9)

    def same(cluster):
        return tfpar.estimate(gpt, 64, cluster=cluster, axes={"data": 8})

    predicted = same(described).step_time_s
    tuned = described.calibrated(0.5 * predicted, same)
    assert same(tuned).step_time_s == pytest.approx(0.5 * predicted,
                                                    rel=1e-6)
    assert tuned.device_flops > described.device_flops
    assert dataclasses.replace(tuned, device_flops=1e10,
                               source=None) == described


def test_calibration_of_a_plans_candidate_on_this_host():
    """tfpar.plan's α-β estimate on the measured virtual CPUs: the same
    candidate re-planned on the calibrated cluster predicts the
    measurement; the per-op runtime cost slows with the device rates."""
    local = tfpar.Cluster.local()
    label = tfpar.plan(mlp, BATCH, cluster=local).candidates[0].label

    def same(cluster):
        return next(c.estimate for c in tfpar.plan(
            mlp, BATCH, cluster=cluster).candidates if c.label == label)

    measured = 4 * same(local).step_time_s
    tuned = local.calibrated(measured, same)
    assert same(tuned).step_time_s == pytest.approx(measured, rel=1e-6)
    speed = tuned.device_flops / local.device_flops
    assert speed < 1
    assert tuned.op_time == pytest.approx(local.op_time / speed)
    assert tuned.intra_host_bandwidth == local.intra_host_bandwidth


def test_bad_input_is_refused_with_what_to_pass():
    dgx = tfpar.Cluster.preset("a100-80gb")
    e = tfpar.estimate(small_gpt(), 64, cluster=dgx, axes={"data": 8})
    with pytest.raises(TypeError, match="needs the estimate.*Received: None"):
        tfpar.StepTimeMonitor(None)
    with pytest.raises(TypeError, match="cluster.*Received: cluster=None"):
        tfpar.StepTimeMonitor(e)
    with pytest.raises(ValueError, match="global_batch_size="):
        tfpar.StepTimeMonitor(e, cluster=dgx)
    with pytest.raises(ValueError, match="warmup_steps"):
        tfpar.StepTimeMonitor(e, cluster=dgx, global_batch_size=64,
                              warmup_steps=-1)
    with pytest.raises(ValueError, match="timed no step"):
        tfpar.StepTimeMonitor(e, cluster=dgx,
                              global_batch_size=64).measured_step_time_s
    with pytest.raises(TypeError, match="an Estimate alone cannot"):
        dgx.calibrated(1.0, e)
    with pytest.raises(ValueError, match="positive number of seconds"):
        dgx.calibrated(-1.0, lambda c: e)
    with pytest.raises(ValueError, match="faster than the estimate allows"):
        dgx.calibrated(0.1 * e.step_time_s, lambda c: tfpar.estimate(
            small_gpt(), 64, cluster=c, axes={"data": 8}))
