"""`offload="optimizer"` across two hosts (issue 15): two processes on this
machine joined by `tfpar.connect_hosts`, 8 virtual CPUs each; the mesh is
CPU:0-3 of each host (global CPU:0-3 and CPU:8-11), the offload devices
CPU:4-7 of each (global CPU:4-7 and CPU:12-15): a "spread" mesh
(`tfpar.Mesh` across hosts), so each host keeps the optimizer state of
its own devices' blocks on its own CPUs (`tests/offload_hosts_child.py`, started by `tfpar.launch`).

Each case trains the MLP of `models.host_mlp` without and with offload
on the same mesh and checks, on every host: parity with one device and
with no offload, where this host's optimizer blocks live, the memory
report, and a sharded checkpoint saved with offload restored without it
(and back); and what offload refuses across hosts, alike on both.
data=8 fsdp runs by default (its issue's one two-host case); data=8 and
data=2 x model=4 are slow (about a minute each here), and so are the
pipelines whose stages live on different hosts (one launch for their
cases, about a minute) and `offload="optimizer+master"` on data=8 fsdp
(82 s here: three trainings and two restores per host).
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import models
import tfpar

CHILD = Path(__file__).with_name("offload_hosts_child.py")
RTOL = 1e-4
MESH = [f"CPU:{8 * h + k}" for h in range(2) for k in range(4)]
HOST = [f"CPU:{8 * h + k}" for h in range(2) for k in range(4, 8)]
# The pipeline across hosts (offload_hosts_child.py's PIPE_MESH, PIPE_HOST)
# and the weights of each of its stages.
PIPE_MESH = ["CPU:0", "CPU:1", "CPU:8", "CPU:9"]
PIPE_HOST = ["CPU:4", "CPU:5", "CPU:12", "CPU:13"]
STAGES = [["mlp/up0/kernel", "mlp/up0/bias"],
          ["mlp/down0/kernel", "mlp/down0/bias", "mlp/head/kernel",
           "mlp/head/bias"]]


def _run_hosts(workdir, configs):
    """Both hosts' results (dicts of arrays) of `configs`, and the
    single-device run (`models.train_host_mlp`, Adam)."""
    keras.utils.set_random_seed(0)
    weights = models.host_mlp().get_weights()
    x, y = models.mlp_data(n=96)
    # (From seed 0 the loss-scaled pipeline's first step overflows stage 0
    # at 2**20, and only that one: test_offload_pipeline's case.)
    keras.utils.set_random_seed(0)
    mixed = models.host_mixed_mlp().get_weights()
    tied = models.host_tied_mlp().get_weights()
    rng = np.random.default_rng(0)
    np.savez(workdir / "given.npz", x=x, y=y,
             mx=rng.standard_normal((64, 16)).astype("float32"),
             my=rng.standard_normal((64, 8)).astype("float32"),
             **{f"w{i}": w for i, w in enumerate(weights)},
             **{f"m{i}": w for i, w in enumerate(mixed)},
             **{f"t{i}": w for i, w in enumerate(tied)})
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DTENSOR_", "TFPAR_"))}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(CHILD.parent), str(CHILD.parent.parent),
         env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "tfpar.launch", "--hosts", "2",
         "--virtual-cpus", "8", str(CHILD), str(workdir), *configs],
        capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    results = [dict(np.load(workdir / f"host{i}.npz")) for i in range(2)]
    return results, _one_device(workdir)


def _one_device(workdir, optimizer="adam"):
    """`models.train_host_mlp` on one device from the given weights and
    data, with `models.HOST_OPTIMIZERS[optimizer]`."""
    given = np.load(workdir / "given.npz")
    return models.train_host_mlp(models.host_mlp(), given["x"], given["y"],
                                 [given[f"w{i}"] for i in range(6)],
                                 optimizer)


def _check(results, reference, config):
    for h, host in enumerate(results):
        assert int(host["host"]) == h
        for run in ("plain", "offload"):
            models.assert_trained_like(reference, {
                k[len(f"{config}_{run}_"):]: v for k, v in host.items()
                if k.startswith(f"{config}_{run}_")}, RTOL)
        _check_placement(host, config, h)
        _check_checkpoint(host, config)


def _check_placement(host, config, h):
    """This host's blocks of every optimizer variable on its own CPU:4-7;
    per mesh device no optimizer state, per host device the slots (and
    the weights' host copies) of its mesh device."""
    assert list(host[f"{config}_slot_devices"]) == [
        f"/job:worker/replica:0/task:{h}/device:CPU:{k}" for k in range(4, 8)]
    _check_memory(host[f"{config}_plain_memory"],
                  host[f"{config}_offload_memory"], MESH, HOST)


def _check_memory(plain, offloaded, mesh, host):
    """`memory_per_device()` without and with offload (reprs): per mesh
    device the same params and no optimizer state (Adam's m and v before),
    per host device the optimizer state and weights' copies of its mesh
    device."""
    before = ast.literal_eval(str(plain))
    after = ast.literal_eval(str(offloaded))
    assert sorted(before) == sorted(mesh)
    assert sorted(after) == sorted(mesh + host)
    for device, cpu in zip(mesh, host):
        assert before[device]["optimizer"] == 2 * before[device]["params"] > 0
        assert after[device]["params"] == before[device]["params"]
        assert after[device]["optimizer"] == 0
        assert after[cpu]["optimizer"] == before[device]["optimizer"]
        assert after[cpu]["params"] == before[device]["params"]


def _check_checkpoint(host, config):
    """Saved with offload, restored without: the same model and optimizer
    variables; and back into offload: the same next epoch."""
    assert int(host[f"{config}_restored_step"]) == 6
    np.testing.assert_array_equal(host[f"{config}_restored_predict"],
                                  host[f"{config}_offload_predict"])
    slots = [k for k in host if k.startswith(f"{config}_offload_opt")]
    assert len(slots) == 2 + 2 * 6  # iterations, rate; m and v of 6 weights
    for key in slots:
        np.testing.assert_array_equal(
            host[key], host[key.replace("_offload_opt", "_restored_opt")])
    for what in ("losses", "predict"):
        assert models.relative_error(host[f"{config}_restored_more_{what}"],
                                     host[f"{config}_back_more_{what}"]) < RTOL


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """One launch of the two hosts for the default case, data=8 fsdp:
    (workdir, both hosts' results, the one-device run)."""
    workdir = tmp_path_factory.mktemp("offload_hosts")
    return (workdir, *_run_hosts(workdir, ["fsdp"]))


# The pipelines across hosts: Adam (1F1B, with its checkpoints), SGD with
# momentum (GPipe) and plain SGD (1F1B), each with and without offload.
PIPE_OPTIMIZERS = ("adam", "sgdm", "sgd")


@pytest.fixture(scope="module")
def pipelines_run(tmp_path_factory):
    """One launch of the two hosts for the pipeline cases (slow): every
    `PIPE_OPTIMIZERS` with and without offload, and "pipe_resume" (after
    "pipe_adam", whose checkpoint it restores): as `default_run`."""
    workdir = tmp_path_factory.mktemp("offload_hosts_pipelines")
    return (workdir, *_run_hosts(workdir, [
        f"pipe{plain}_{name}" for name in PIPE_OPTIMIZERS
        for plain in ("", "_plain")] + ["pipe_resume", "pipe_tied"]))


def test_offload_across_hosts_fsdp(default_run):
    """data=8 fsdp: each host's devices hold a 1/8 block of every weight,
    its CPUs the blocks' slots."""
    workdir, results, reference = default_run
    _check(results, reference, "fsdp")
    _check_refusals(results)
    files = sorted(p.name for p in (workdir / "ckpt_fsdp" / "ckpt-6").iterdir())
    # up0's first Adam slot split over data=8: one block per host device,
    # both hosts' (written from the host CPUs).
    assert [f for f in files if "up0_kernel_momentum" in f] == [
        f"v0008_mlp_up0_kernel_momentum.b{d}.npy" for d in range(8)]


def _check_refusals(results):
    """The same clear error on both hosts (one host going on alone would
    wait forever in its next collective)."""
    for key in ("no_devices", "other_host"):
        assert str(results[0][key]) == str(results[1][key]) != "", key
    first = results[0]
    assert "across hosts needs the host devices named" in str(
        first["no_devices"])
    assert "offload_devices=None (2 hosts)" in str(first["no_devices"])
    assert ("needs each mesh device's host device on its own host" in str(
        first["other_host"]))
    assert "('CPU:0', 'CPU:12')" in str(first["other_host"])


def _pipe_runs(results, config):
    """Each host's results of pipeline `config`, its prefix taken off."""
    return [{k[len(config) + 1:]: v for k, v in host.items()
             if k.startswith(f"{config}_")} for host in results]


def _check_pipe_parity(runs, reference):
    """Losses, weights, evaluate and predict of both hosts within RTOL of
    `reference` (one device); both hosts' weights equal."""
    for run in runs:
        models.assert_trained_like(reference, run, RTOL)
    for i in range(len(reference[1])):
        np.testing.assert_array_equal(runs[0][f"w{i}"], runs[1][f"w{i}"])


def _check_pipe_placement(runs, slots_per_weight):
    """Stage s lives on host s: its weights' blocks on that host's CPU:0,1,
    every variable of its optimizer (slots, iterations, learning rate) on
    that host's CPU:4,5 (its offload devices); the other host holds no
    block of either."""
    held = [ast.literal_eval(str(run["held"])) for run in runs]
    for stage, weights in enumerate(STAGES):
        task = f"/job:worker/replica:0/task:{stage}/device:CPU:"
        mine, other = held[stage], held[1 - stage]
        assert len(mine["parts"][stage]) == 2 + slots_per_weight * len(
            weights)
        assert mine["parts"][stage] == [[f"{task}4", f"{task}5"]] * len(
            mine["parts"][stage])
        assert other["parts"][stage] == [[]] * len(mine["parts"][stage])
        for path in weights:
            assert mine["weights"][path] == [f"{task}0", f"{task}1"], path
            assert other["weights"][path] == [], path


@pytest.mark.slow
def test_offload_of_a_pipeline_whose_stages_live_on_different_hosts(
        pipelines_run):
    """pipe=2 x data=2, stage 0 on host 0, stage 1 on host 1 (the
    host-driven step of `tfpar.pipeline.cross_host`), Adam, 1F1B: in
    parity with one device; each stage's slots and counters on its own
    host's offload devices, checked on both hosts; `memory_per_device()`
    per stage device down by its slots (the pipeline without offload, as
    restored below, the "before"); the sharded checkpoint saved with
    offload restored without offload and that one's back into offload:
    weights and every optimizer variable equal to the bit."""
    workdir, results, reference = pipelines_run
    runs = _pipe_runs(results, "pipe_adam")
    _check_pipe_parity(runs, reference)
    _check_pipe_placement(runs, 2)  # Adam's m and v
    for run in runs:
        _check_memory(run["plain_memory"], run["memory"], PIPE_MESH,
                      PIPE_HOST)
        assert int(run["restored_step"]) == int(run["back_step"]) == 6
        saved = [k for k in run if k.startswith("saved_")]
        assert len(saved) == 6 + 2 * 2 + 2 * 6  # weights; 2 parts' state
        for key in saved:
            for other in ("restored_", "back_"):
                np.testing.assert_array_equal(
                    run[key], run[key.replace("saved_", other)], err_msg=key)
    files = [p.name for p in (workdir / "ckpt_pipe" / "ckpt-6").iterdir()]
    # Adam's momentum of up0's kernel (stage 0, replicated over data) is
    # written from host 0's CPU:4, that of head's (stage 1) from host 1's
    # CPU:4 (global CPU:12).
    assert [f.rsplit(".", 2)[1] for f in files
            if "up0_kernel_momentum" in f] == ["b4"]
    assert [f.rsplit(".", 2)[1] for f in files
            if "head_kernel_momentum" in f] == ["b12"]


@pytest.mark.slow
def test_offload_across_hosts_data_and_tensor_parallel(tmp_path):
    """data=8 (every weight and slot replicated) and data=2 x model=4
    (Megatron rules: column- and row-split blocks and their slots)."""
    results, reference = _run_hosts(tmp_path, ["data8", "tp"])
    for config in ("data8", "tp"):
        _check(results, reference, config)


def _check_master(host, h, config):
    """`offload="optimizer+master"` across hosts on host `h`: the same
    losses, weights, evaluate and predict as "optimizer" and no offload
    (mixed_bfloat16, to the bit); this host's devices hold bfloat16 blocks
    only, its CPU:4-7 the float32 masters and the slots; per mesh device
    half the params and no optimizer state; the checkpoint restored
    without offload and back: weights and optimizer variables equal."""
    key = f"master_{config}"
    runs = {run: {k[len(f"{key}_{run}_"):]: v for k, v in host.items()
                  if k.startswith(f"{key}_{run}_")}
            for run in ("plain", "optimizer", "master")}
    for name in ("losses", "evaluate", "predict",
                 *(f"w{i}" for i in range(6))):
        for run in ("plain", "optimizer"):
            np.testing.assert_array_equal(runs["master"][name],
                                          runs[run][name], err_msg=name)
    task = f"/job:worker/replica:0/task:{h}/device:CPU:"
    assert [tuple(b) for b in host[f"{key}_device_blocks"]] == [
        ("bfloat16", f"{task}{k}") for k in range(4)]
    assert [tuple(b) for b in host[f"{key}_master_blocks"]] == [
        ("float32", f"{task}{k}") for k in range(4, 8)]
    assert list(host[f"{key}_slot_devices"]) == [
        f"{task}{k}" for k in range(4, 8)]
    before = ast.literal_eval(str(runs["plain"]["memory"]))
    after = ast.literal_eval(str(runs["master"]["memory"]))
    for device, cpu in zip(MESH, HOST):
        assert before[device]["optimizer"] == 2 * before[device]["params"] > 0
        assert after[device]["params"] == before[device]["params"] // 2
        assert after[device]["optimizer"] == 0
        assert after[cpu]["params"] == before[device]["params"]
        assert after[cpu]["optimizer"] == before[device]["optimizer"]
    assert int(host[f"{key}_restored_step"]) == 6
    assert int(host[f"{key}_back_step"]) == 6
    saved = sorted(k for k in host if k.startswith(f"{key}_saved_"))
    assert len(saved) == 6 + 2 + 2 * 6  # weights; iterations, rate, m, v
    for name in saved:
        assert host[name].dtype != np.dtype("bfloat16")
        for run in ("restored", "back"):
            np.testing.assert_array_equal(
                host[name], host[name.replace("_saved_", f"_{run}_")],
                err_msg=name)


@pytest.mark.slow
def test_master_offload_across_hosts(tmp_path):
    """"optimizer+master" on data=8 fsdp across the two hosts (each host's
    masters and slots on its own CPUs), checked on both; both hosts'
    weights equal."""
    results, _ = _run_hosts(tmp_path, ["master_fsdp"])
    for h, host in enumerate(results):
        assert int(host["host"]) == h
        _check_master(host, h, "fsdp")
    for i in range(6):
        np.testing.assert_array_equal(results[0][f"master_fsdp_master_w{i}"],
                                      results[1][f"master_fsdp_master_w{i}"])


@pytest.mark.slow
def test_a_tied_weight_in_a_cross_host_pipeline_with_offload(
        pipelines_run):
    """A layer called on both stages (its weights' copy on host 1, their
    gradients summed between the hosts after each step) trains with
    offload as without, both within 1e-4 of one device (Adam); the copy
    equals its weight after training."""
    workdir, results, _ = pipelines_run
    given = np.load(workdir / "given.npz")
    losses, weights, evaluated, _ = models.train_host_mlp(
        models.host_tied_mlp(), given["x"], given["y"],
        [given[f"t{i}"] for i in range(6)], "adam")
    for host in results:
        for run in ("plain", "offload"):
            key = f"pipe_tied_{run}"
            assert models.relative_error(losses, host[f"{key}_losses"]) < \
                RTOL
            assert models.relative_error(evaluated,
                                         host[f"{key}_evaluate"]) < RTOL
            for i, want in enumerate(weights):
                assert models.relative_error(want, host[f"{key}_w{i}"]) < \
                    RTOL, (run, i)
            np.testing.assert_array_equal(host[f"{key}_copy"],
                                          host[f"{key}_w0"])  # shared/kernel


def test_offload_of_cross_host_pipelines_equals_no_offload(pipelines_run):
    """Adam (1F1B), SGD with momentum (GPipe) and plain SGD (1F1B, Keras'
    defaults) in the pipeline across hosts: with offload equal to the
    same pipeline without (to the bit, on both hosts), both within 1e-4
    of one device; each stage's slots on its host's offload devices. And
    the checkpoint saved with offload, restored into the pipeline without
    offload and into one with offload, trains one more epoch alike."""
    workdir, results, _ = pipelines_run
    for run in _pipe_runs(results, "pipe_resume"):
        for key in ("losses", *(f"w{i}" for i in range(6))):
            assert models.relative_error(run[f"plain_{key}"],
                                         run[f"offload_{key}"]) < RTOL, key
    for name, slots in zip(PIPE_OPTIMIZERS, (2, 1, 0)):
        offloaded = _pipe_runs(results, f"pipe_{name}")
        plain = _pipe_runs(results, f"pipe_plain_{name}")
        reference = _one_device(workdir, name)
        _check_pipe_parity(offloaded, reference)
        _check_pipe_parity(plain, reference)
        _check_pipe_placement(offloaded, slots)
        for a, b in zip(offloaded, plain):
            for key in ("losses", "evaluate", "predict",
                        *(f"w{i}" for i in range(6))):
                np.testing.assert_array_equal(a[key], b[key],
                                              err_msg=f"{name} {key}")


@pytest.mark.slow
def test_master_offload_of_a_cross_host_pipeline(tmp_path):
    """"optimizer+master" under mixed_bfloat16 in the pipeline across
    hosts (Adam, 1F1B): equal to "optimizer" and to no offload on both
    hosts (to the bit); each host's stage devices hold bfloat16 blocks,
    its CPU:4,5 the float32 masters; per stage device half the params and
    no optimizer state."""
    results, _ = _run_hosts(tmp_path, ["pipe_master"])
    for h, host in enumerate(results):
        runs = _pipe_runs([host], "pipe_master")[0]
        for key in ("losses", "evaluate", "predict",
                    *(f"w{i}" for i in range(6))):
            for run in ("plain", "optimizer"):
                np.testing.assert_array_equal(
                    runs[f"master_{key}"], runs[f"{run}_{key}"], err_msg=key)
        task = f"/job:worker/replica:0/task:{h}/device:CPU:"
        assert [tuple(b) for b in runs["device_blocks"]] == [
            ("bfloat16", f"{task}0"), ("bfloat16", f"{task}1")]
        assert [tuple(b) for b in runs["master_blocks"]] == [
            ("float32", f"{task}4"), ("float32", f"{task}5")]
        before = ast.literal_eval(str(runs["plain_memory"]))
        after = ast.literal_eval(str(runs["master_memory"]))
        for device, cpu in zip(PIPE_MESH, PIPE_HOST):
            assert after[device]["params"] == before[device]["params"] // 2
            assert after[device]["optimizer"] == 0
            assert after[cpu]["params"] == before[device]["params"]
            assert after[cpu]["optimizer"] == before[device]["optimizer"] > 0


def _loss_scaled_on_one_host(workdir):
    """The loss-scaled pipeline of `pipe_loss_scale` on one host (pipe=2 x
    data=2 on CPU:0-3, no offload): per-batch losses, weights, each part's
    step count and scale."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(
        {"pipe": 2, "data": 2}, devices=[f"CPU:{i}" for i in range(4)]))
    with strategy.scope():
        pipe = tfpar.PipelineModel(models.host_mixed_mlp(),
                                   num_microbatches=2, schedule="gpipe")
    return models.train_loss_scaled(pipe, np.load(workdir / "given.npz"))


@pytest.mark.slow
def test_loss_scaling_across_hosts_skips_every_part_together(tmp_path):
    """A LossScaleOptimizer (SGD with momentum, from 2**20) on a pipeline
    across hosts whose stage 0 is float16: its first step overflows stage
    0's gradients only. One decision for both parts (each part's finite
    flag through the bridge): without and with offload, both parts skip
    it and take the other 7 steps at the same scale, as the pipeline on
    one host does (losses within 1e-4 of it, the float32 stage's weights
    too, the float16 stage's within 1e-3), offload equal to no offload.
    Before, each part decided alone: steps [4, 8], scales [2**16, 2**20]
    (measured)."""
    results, _ = _run_hosts(tmp_path, ["pipe_loss_scale"])
    losses, weights, steps, scales = _loss_scaled_on_one_host(tmp_path)
    assert steps == [7, 7] and scales == [2.0**19] * 2
    for run in _pipe_runs(results, "pipe_loss_scale"):
        for name in ("plain", "offload"):
            assert list(run[f"{name}_steps"]) == steps, name
            assert list(run[f"{name}_scales"]) == scales, name
            assert models.relative_error(losses, run[f"{name}_losses"]) < RTOL
            for i, want in enumerate(weights):
                # Stage 0 (weights 0-3) computes in float16: its biases
                # end 2.4e-4 and 3.1e-4 relative from the one-host
                # pipeline's (measured; their gradients are float16 sums,
                # whose rounding the host-driven step's separate programs
                # need not share), its kernels 2.6e-5; the float32
                # stage's weights within 3e-5.
                assert models.relative_error(
                    want, run[f"{name}_w{i}"]) < (1e-3 if i < 4 else RTOL)
        for i in range(len(weights)):
            np.testing.assert_array_equal(run[f"plain_w{i}"],
                                          run[f"offload_w{i}"])
