"""`tfpar.memory_report` of a `PipelineModel` (issue 15): each stage's
devices get their row from their stage's compiled program (DTensor expands
the pipeline step into one program per stage mesh), checked on
pipe=2 x data=4 against the analytic figures of a four-layer MLP and
against `memory_per_device()`, GPipe against 1F1B (m=4 > p=2: 1F1B holds
fewer micro-batches' activations)."""

import keras
import numpy as np
import pytest

import tfpar
from tfpar.pipeline.schedules import FORWARD

P, M, BATCH, DATA = 2, 4, 32, 4
ROWS = BATCH // M // DATA  # rows of one micro-batch on one device


def _mlp():
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu", name="a"),
        keras.layers.Dense(32, activation="relu", name="b"),  # stage 0 | 1
        keras.layers.Dense(32, activation="relu", name="c"),
        keras.layers.Dense(8, name="d")], name="mlp")


def _data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((BATCH, 16)).astype("float32"),
            rng.standard_normal((BATCH, 8)).astype("float32"))


def _report(schedule, **options):
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": P, "data": DATA}),
                                      **options)
    with strategy.scope():
        pipe = tfpar.PipelineModel(_mlp(), num_microbatches=M,
                                   schedule=schedule)
        pipe.compile(optimizer="adam", loss="mse")
    weights = pipe.get_weights()
    report = tfpar.memory_report(pipe, *_data())
    for before, after in zip(weights, pipe.get_weights()):
        np.testing.assert_array_equal(before, after)  # put back
    return strategy, pipe, report


@pytest.fixture(scope="module")
def reports():
    return {name: _report(name) for name in ("gpipe", "1f1b")}


def _in_flight(schedule, stage):
    """The most micro-batches whose forward ran and backward did not, on
    `stage`, in the schedule's execution order (the formula: GPipe m,
    1F1B min(p - stage, m))."""
    held, most = set(), 0
    for action in schedule.execution_order():
        if action.stage != stage:
            continue
        if action.kind == FORWARD:
            held.add(action.microbatch)
        else:
            held.discard(action.microbatch)
        most = max(most, len(held))
    return most


def _stage_devices(strategy):
    return [list(mesh.devices) for mesh in strategy.extended.stage_meshes]


def test_stored_state_is_each_stages_part(reports):
    """params, gradients, optimizer: the stage's own layers (a, b on stage
    0; c, d on stage 1), as `memory_per_device()` has them."""
    params = [4 * (16 * 32 + 32 + 32 * 32 + 32), 4 * (32 * 32 + 32 + 32 * 8 + 8)]
    for strategy, _, report in reports.values():
        held = strategy.memory_per_device()
        assert sorted(report) == sorted(held)
        for stage, devices in enumerate(_stage_devices(strategy)):
            for device in devices:
                row = report[device]
                assert row["params"] == row["gradients"] == params[stage]
                assert row["optimizer"] == 2 * params[stage]  # Adam
                for kind in ("params", "optimizer", "other"):
                    assert row[kind] == held[device][kind]


def test_activations_are_the_schedules_micro_batches_in_flight(reports):
    """Per micro-batch and device (2 rows): stage 0 saves its input and
    a's and b's ReLU outputs, stage 1 what stage 0 sent, c's ReLU output
    and the MSE difference; GPipe holds all m micro-batches', 1F1B
    p - s of them (m > p)."""
    per_microbatch = [4 * ROWS * (16 + 32 + 32), 4 * ROWS * (32 + 32 + 8)]
    found = {}
    for name, (strategy, pipe, report) in reports.items():
        for stage, devices in enumerate(_stage_devices(strategy)):
            figures = report.stages[stage]
            held = _in_flight(pipe.schedule, stage)
            assert held == (M if name == "gpipe" else P - stage)
            assert figures.devices == tuple(devices)
            assert figures.in_flight == held, (name, stage)
            assert figures.per_microbatch == per_microbatch[stage]
            assert {report[d]["activations"] for d in devices} == {
                held * per_microbatch[stage]}
            assert {report[d]["gathered"] for d in devices} == {0}
            found[(name, stage)] = report[devices[0]]
    for stage in range(P):
        assert (found[("1f1b", stage)]["activations"]
                < found[("gpipe", stage)]["activations"])
        assert found[("1f1b", stage)]["peak"] < found[("gpipe", stage)]["peak"]


def test_peak_is_the_stage_programs_most_live_bytes(reports):
    """peak = the stage's variables + the batch blocks it holds (the
    inputs on stage 0, the targets on stage 1, each split 4 ways) + the
    most bytes its program's tensors hold at once, which include its
    saved activations."""
    batch = [BATCH * 16 * 4 // DATA, BATCH * 8 * 4 // DATA]
    for strategy, _, report in reports.values():
        for stage, devices in enumerate(_stage_devices(strategy)):
            live = max(report.stages[stage].live)
            assert live >= report.stages[stage].activations
            for device in devices:
                row = report[device]
                assert row["peak"] == (row["params"] + row["optimizer"]
                                       + row["other"] + batch[stage] + live)
        assert max(report.live) == max(max(s.live) for s in report.stages)
    strategy, _, report = reports["1f1b"]
    # Named as the layer's weights are ("mlp/a/kernel"), not by its scope
    # in the step ("a_1").
    model = reports["1f1b"][1]
    assert "mlp/a/kernel" in [w.path for w in model.weights]
    assert report.by_layer["mlp/a"]["activations"] == 4 * ROWS * 32


def test_a_single_program_report_refuses_a_pipeline(reports):
    _, pipe, _ = reports["1f1b"]
    with pytest.raises(ValueError, match="is a tfpar.PipelineModel, whose "
                       "step is one program per stage.*memory_report"):
        tfpar.communication_report(pipe, *_data())


@pytest.mark.slow
def test_fsdp_stages_gather_each_weight_once_per_step():
    """fsdp inside stages: the micro-batches' reads of a weight are one
    read in the compiled stage program, so each weight is all-gathered
    once per step (counted: 4 weights per stage) and held whole until the
    last backward reading it, whatever the schedule: b's kernel on stage 0
    (a's is read by no backward: the input needs no gradient), c's and
    d's on stage 1. Activations as without fsdp."""
    kernels = [4 * 32 * 32, 4 * (32 * 32 + 32 * 8)]
    for name in ("gpipe", "1f1b"):
        strategy, pipe, report = _report(name, fsdp=True)
        for stage, devices in enumerate(_stage_devices(strategy)):
            figures = report.stages[stage]
            # (The others gather a micro-batch's (8, 32) activations or
            # gradients for the move between the stages.)
            weights = [c.shape for c in figures.communication.select(
                purpose="all-gather") if c.shape != (BATCH // M, 32)]
            assert len(weights) == 4, (name, stage, weights)
            assert {report[d]["gathered"] for d in devices} == {
                kernels[stage]}, (name, stage)
            assert figures.in_flight == _in_flight(pipe.schedule, stage)


@pytest.mark.slow
def test_offloaded_pipeline_reports_its_host_devices():
    """offload="optimizer" (pipe=2 x data=2 on CPU:0-3, the host CPU:4-7):
    the stage devices hold no optimizer state, each host device its stage
    device's slots, the weights' copy and the gradients moved there (no
    activations), as `memory_per_device()` has them."""
    devices = [f"CPU:{i}" for i in range(4)]
    hosts = [f"CPU:{i}" for i in range(4, 8)]
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"pipe": P, "data": 2}, devices=devices),
        offload="optimizer", offload_devices=hosts)
    with strategy.scope():
        pipe = tfpar.PipelineModel(_mlp(), num_microbatches=M,
                                   schedule="1f1b")
        pipe.compile(optimizer="adam", loss="mse")
    report = tfpar.memory_report(pipe, *_data())
    held = strategy.memory_per_device()
    assert sorted(report) == sorted(devices + hosts)
    for device, host in zip(devices, hosts):
        assert report[device]["optimizer"] == 0
        assert report[device]["activations"] > 0
        assert report[host]["optimizer"] == held[host]["optimizer"] == (
            2 * report[device]["params"])
        assert report[host]["activations"] == 0
        assert report[host]["peak"] == (2 * held[host]["params"]
                                        + held[host]["optimizer"]
                                        + held[host]["other"])
