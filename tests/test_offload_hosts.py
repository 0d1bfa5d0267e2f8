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
data=8 fsdp runs by default; data=8 and data=2 x model=4 are
slow (about a minute each here), and so is `offload="optimizer+master"`
on data=8 fsdp (82 s here: three trainings and two restores per host).
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

CHILD = Path(__file__).with_name("offload_hosts_child.py")
RTOL = 1e-4
MESH = [f"CPU:{8 * h + k}" for h in range(2) for k in range(4)]
HOST = [f"CPU:{8 * h + k}" for h in range(2) for k in range(4, 8)]


def _run_hosts(workdir, configs):
    """Both hosts' results (dicts of arrays) of `configs`, and the
    single-device run (`models.train_host_mlp`)."""
    keras.utils.set_random_seed(0)
    weights = models.host_mlp().get_weights()
    x, y = models.mlp_data(n=96)
    np.savez(workdir / "given.npz", x=x, y=y,
             **{f"w{i}": w for i, w in enumerate(weights)})
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
    reference = models.train_host_mlp(models.host_mlp(), x, y, weights)
    return results, reference


def _check(results, reference, config):
    losses, weights, evaluated, predicted = reference
    for h, host in enumerate(results):
        assert int(host["host"]) == h
        for run in ("plain", "offload"):
            got = {k[len(f"{config}_{run}_"):]: v for k, v in host.items()
                   if k.startswith(f"{config}_{run}_")}
            assert models.relative_error(losses, got["losses"]) < RTOL
            assert models.relative_error(evaluated, got["evaluate"]) < RTOL
            assert models.relative_error(predicted, got["predict"]) < RTOL
            for i, want in enumerate(weights):
                assert models.relative_error(want, got[f"w{i}"]) < RTOL
        _check_placement(host, config, h)
        _check_checkpoint(host, config)


def _check_placement(host, config, h):
    """This host's blocks of every optimizer variable on its own CPU:4-7;
    per mesh device no optimizer state, per host device the slots (and
    the weights' host copies) of its mesh device."""
    assert list(host[f"{config}_slot_devices"]) == [
        f"/job:worker/replica:0/task:{h}/device:CPU:{k}" for k in range(4, 8)]
    before = ast.literal_eval(str(host[f"{config}_plain_memory"]))
    after = ast.literal_eval(str(host[f"{config}_offload_memory"]))
    assert sorted(before) == sorted(MESH)
    assert sorted(after) == sorted(MESH + HOST)
    for device, cpu in zip(MESH, HOST):
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


def test_offload_across_hosts_fsdp(tmp_path):
    """data=8 fsdp: each host's devices hold a 1/8 block of every weight,
    its CPUs the blocks' slots."""
    results, reference = _run_hosts(tmp_path, ["fsdp"])
    _check(results, reference, "fsdp")
    _check_refusals(results)
    files = sorted(p.name for p in (tmp_path / "ckpt_fsdp" / "ckpt-6").iterdir())
    # up0's first Adam slot split over data=8: one block per host device,
    # both hosts' (written from the host CPUs).
    assert [f for f in files if "up0_kernel_momentum" in f] == [
        f"v0008_mlp_up0_kernel_momentum.b{d}.npy" for d in range(8)]


def _check_refusals(results):
    """The same clear error on both hosts (one host going on alone would
    wait forever in its next collective)."""
    for key in ("no_devices", "other_host", "pipeline"):
        assert str(results[0][key]) == str(results[1][key]) != "", key
    first = results[0]
    assert "across hosts needs the host devices named" in str(
        first["no_devices"])
    assert "offload_devices=None (2 hosts)" in str(first["no_devices"])
    assert ("needs each mesh device's host device on its own host" in str(
        first["other_host"]))
    assert "('CPU:0', 'CPU:12')" in str(first["other_host"])
    assert ("host-driven step that does not support offload='optimizer'"
            in str(first["pipeline"]))
    assert "Use offload=None" in str(first["pipeline"])


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
