"""Two hosts as one mesh: two processes on this machine, 4 virtual CPUs each,
joined by `tfpar.connect_hosts` (DTensor multi-client over gRPC).

The hosts train the same MLP from the same weights under data=2 × model=4
(Megatron rules) and data=8 fsdp, each mesh spanning both processes; the
results must match single-device Keras here, and each host must hold only
its own devices' blocks.
"""

import ast
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

import models
import tfpar
from tfpar import host_watch, hosts, launch

CHILD = Path(__file__).with_name("hosts_child.py")
RTOL = 1e-4


def run_two_hosts(child, workdir, timeout=600):
    """Runs `child HOST_ID ADDRESSES WORKDIR` as two hosts joined into one
    cluster; asserts both exit 0, showing every host's output if not."""
    addresses = ",".join(f"localhost:{p}" for p in launch.free_ports(2))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DTENSOR_")}
    processes = [subprocess.Popen(
        [sys.executable, str(child), str(i), addresses, str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for i in range(2)]
    # A host stuck in a collective (its peer died) ignores SIGTERM: kill
    # both when one fails or time runs out, and show every host's output.
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in processes):
        failed = any(p.poll() not in (None, 0) for p in processes)
        if failed or time.monotonic() > deadline:
            for process in processes:
                process.kill()
            break
        time.sleep(0.5)
    outputs = [p.communicate()[0] for p in processes]
    for process in processes:
        assert process.returncode == 0, "\n".join(
            f"host {j} (exit {p.returncode}):\n{out[-3000:]}"
            for j, (p, out) in enumerate(zip(processes, outputs)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(results of host 0 and host 1, the single-device reference)."""
    workdir = tmp_path_factory.mktemp("hosts")
    keras.utils.set_random_seed(0)
    weights = models.host_mlp().get_weights()
    x, y = models.mlp_data(n=96)
    np.savez(workdir / "given.npz", x=x, y=y,
             **{f"w{i}": w for i, w in enumerate(weights)})
    run_two_hosts(CHILD, workdir)
    results = [dict(np.load(workdir / f"host{i}.npz"), workdir=workdir, x=x)
               for i in range(2)]
    reference = models.train_host_mlp(models.host_mlp(), x, y, weights)
    return results, reference


@pytest.mark.parametrize("config", ["tp", "fsdp"])
def test_two_hosts_train_in_parity_with_one_device(cluster, config):
    results, (losses, weights, evaluated, predicted) = cluster
    assert len(losses) == 6  # 96 samples, batch 32, 2 epochs
    for host in results:
        assert models.relative_error(losses, host[f"{config}_losses"]) < RTOL
        assert models.relative_error(evaluated, host[f"{config}_evaluate"]) < RTOL
        assert models.relative_error(predicted, host[f"{config}_predict"]) < RTOL
        for i, want in enumerate(weights):
            assert models.relative_error(want, host[f"{config}_w{i}"]) < RTOL
    for host in results:  # save_weights on every host, load_weights back
        assert models.relative_error(predicted,
                                     host[f"{config}_reloaded"]) < RTOL
    # Both hosts see the same global results (one SPMD program).
    np.testing.assert_array_equal(results[0][f"{config}_losses"],
                                  results[1][f"{config}_losses"])


def test_each_host_holds_only_its_own_devices_blocks(cluster):
    results, _ = cluster
    for i, host in enumerate(results):
        assert (int(host["hosts"]), int(host["host"])) == (2, i)
        assert list(host["mesh_devices"]) == [f"CPU:{d}" for d in range(8)]
        tp = ast.literal_eval(str(host["tp_blocks"]))
        # Four local devices each: column-split up0, row-split down0,
        # replicated head (and Adam's slots follow their weights).
        assert tp["mlp/up0/kernel"] == [(16, 8)] * 4
        assert tp["mlp/up0/bias"] == [(8,)] * 4
        assert tp["mlp/down0/kernel"] == [(8, 16)] * 4
        assert tp["mlp/head/kernel"] == [(16, 3)] * 4
        fsdp = ast.literal_eval(str(host["fsdp_blocks"]))
        assert fsdp["mlp/up0/kernel"] == [(2, 32)] * 4   # 16 rows / 8
        assert fsdp["mlp/down0/kernel"] == [(4, 16)] * 4
        memory = ast.literal_eval(str(host["tp_memory"]))
        assert sorted(memory) == [f"CPU:{d}" for d in range(8)]
        # up0 (16x32 + 32) and down0's kernel (32x16) split 4 ways, the
        # rest (down0's bias, head) whole: float32 bytes per device.
        params = 4 * ((16 * 32 + 32 + 32 * 16) // 4 + 16 + 16 * 3 + 3)
        assert {m["params"] for m in memory.values()} == {params}
        assert {m["optimizer"] for m in memory.values()} == {2 * params}


def test_sharded_checkpoint_written_by_both_hosts(cluster):
    """The fsdp model's checkpoint (each host wrote its devices' blocks,
    host 0 the manifest) restores on both hosts onto data=2 x model=4, and
    here, on one host, into plain Keras: the trained model either way."""
    results, (_, weights, _, predicted) = cluster
    for host in results:
        assert int(host["restored_step"]) == 6
        assert models.relative_error(predicted, host["restored_predict"]) < RTOL
    directory = results[0]["workdir"] / "ckpt"
    files = sorted(p.name for p in (directory / "ckpt-6").iterdir())
    # up0's kernel split over data=8: one block per device, both hosts'.
    assert [f for f in files if "_mlp_up0_kernel.b" in f] == [
        f"v0000_mlp_up0_kernel.b{d}.npy" for d in range(8)]
    assert not [f for f in files if f.startswith("host")]
    plain = models.host_mlp()
    tfpar.restore_checkpoint(plain, directory, optimizer=False)
    assert models.relative_error(predicted, plain.predict(
        results[0]["x"], verbose=0)) < RTOL


def test_a_failure_on_one_host_raises_on_both(cluster):
    """Block writes failing on host 1 only: both hosts raise, nothing is
    published (the step-6 checkpoint stays the latest); a restore that
    finds nothing on host 1 only: both raise. Neither host is left waiting
    in a collective (the cluster fixture would time out)."""
    first, second = cluster[0]
    assert str(second["failed_save"]).startswith("OSError: No space left")
    assert str(first["failed_save"]) == (
        "RuntimeError: save_checkpoint failed on another host while "
        "writing blocks; nothing was published (see that host's error).")
    for host in (first, second):
        assert str(host["latest_after_failed_save"]).endswith("ckpt-6")
    assert not list((first["workdir"] / "ckpt").glob("*.tmp-*"))
    assert str(second["failed_restore"]).startswith(
        "FileNotFoundError: No complete checkpoint")
    assert str(first["failed_restore"]).startswith(
        "RuntimeError: restore_checkpoint failed on another host while "
        "reading the checkpoint")


def test_a_subset_mesh_is_a_clear_error_on_every_host(cluster):
    """On every host alike (a host that went on alone would wait forever
    in its next collective)."""
    results, _ = cluster
    for host in results:
        message = str(host["subset_error"])
        assert "must use all 8 devices in order (CPU:0..CPU:7)" in message
        assert "or consecutive devices of one host" in message
        assert "devices=CPU:2..CPU:5" in message


def test_a_strategy_on_one_hosts_devices_is_a_clear_error_on_every_host(
        cluster):
    """A strategy whose mesh leaves out a host (host 0's CPU:0-3): host 1
    crashed (a segfault) in the first step."""
    results, _ = cluster
    for host in results:
        message = str(host["one_host_strategy_error"])
        assert "must include devices of every host" in message
        assert "on host(s) [0] of 2; host(s) [1] hold none of it" in message


def test_hosts_agree_on_weights_they_made_on_their_own(cluster):
    """Unseeded initializers and set_weights of each host's own random
    arrays give every host host 0's values under tfpar (plain Keras on the
    two hosts differs: the check is not vacuous)."""
    results, _ = cluster
    first, second = results
    assert any(not np.array_equal(first[f"own_plain_w{i}"],
                                  second[f"own_plain_w{i}"]) for i in range(6))
    assert not np.array_equal(first["own_mine_w0"], second["own_mine_w0"])
    for i in range(6):
        np.testing.assert_array_equal(first[f"own_built_w{i}"],
                                      second[f"own_built_w{i}"])
        np.testing.assert_array_equal(first[f"own_assigned_w{i}"],
                                      first[f"own_mine_w{i}"])
        np.testing.assert_array_equal(second[f"own_assigned_w{i}"],
                                      first[f"own_mine_w{i}"])


@pytest.mark.parametrize("addresses,host_id,match", [
    ("localhost:1", 0, "list of 'host:port'"),
    ([], 0, "list of 'host:port'"),
    (["localhost"], 0, "'host:port' strings.*'localhost'"),
    (["a:1", "a:1"], 0, "twice"),
    (["a:1", "b:1"], 2, r"host_id\) needs an int in \[0, 2\).*host_id=2"),
    (["a:1", "b:1"], True, "host_id=True"),
    (["a:1", "b:70000"], 0, "port in 1..65535.*'b:70000'"),
    (["a:1", "b:1"], 0, None),  # timeout=0 below
    (["[::1]:1", "b:1"], 0, "IPv4.*'\\[::1\\]:1'"),
])
def test_bad_cluster_arguments_are_clear_errors(addresses, host_id, match):
    if match is None:
        with pytest.raises(ValueError, match=r"timeout\) needs .*timeout=0"):
            tfpar.connect_hosts(addresses, host_id, timeout=0)
        return
    with pytest.raises((TypeError, ValueError), match=match):
        tfpar.connect_hosts(addresses, host_id)


def test_connecting_after_tensorflow_started_is_a_clear_error():
    # This process already runs TensorFlow (conftest made its devices):
    # refused before any handshake, so no other host is left waiting.
    with pytest.raises(RuntimeError, match="must run before TensorFlow"):
        tfpar.connect_hosts(["localhost:1", "localhost:2"], 0)
    assert (hosts.num_hosts(), hosts._connected) == (1, None)


def test_a_missing_host_times_out_naming_it():
    """Without the handshake, TF's cluster setup on host 0 waits forever
    (and ignores SIGTERM) for a host that never starts."""
    ports = launch.free_ports(2)
    addresses = [f"localhost:{p}" for p in ports]
    with pytest.raises(TimeoutError, match=rf"hosts \[1\] \(\['localhost:"
                                           rf"{ports[1]}'\]\)"):
        hosts._wait_for_hosts(addresses, 0, timeout=1)


def test_one_host_is_the_default():
    assert (hosts.num_hosts(), hosts.host_id()) == (1, 0)


def in_process_watches(monkeypatch, timeout=60):
    """Two started heartbeat Watches in this process; each one's verdict
    is recorded in `verdicts` instead of ending the process."""
    monkeypatch.setenv("TFPAR_JOB_SECRET", "0123456789abcdef0123456789abcdef")
    addresses = ["localhost:1", "localhost:2"]
    watches = [host_watch.Watch(addresses, h, timeout) for h in (0, 1)]
    verdicts = {0: [], 1: []}
    for h, watch in enumerate(watches):
        monkeypatch.setattr(watch, "_exit", verdicts[h].append)
        monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    watches[0].start({1: watches[1].port})
    watches[1].start({0: watches[0].port})
    return watches, verdicts


def test_a_peer_whose_port_refuses_is_lost_at_once_and_a_late_step_named(
        monkeypatch):
    """In-process heartbeats (60 s timeout): host 1 begins 2 steps, host 0
    a 3rd that exceeds its 1 s step timeout, naming host 1 as not arrived;
    then host 1's port closes without a word: host 0 loses it within two
    pings, not after 60 s."""
    watches, verdicts = in_process_watches(monkeypatch)
    try:
        for _ in range(2):
            watches[1].begin_step()
            watches[0].begin_step()
        watches[0].begin_step()
        watches[0].step_timeout = 1.0
        deadline = time.monotonic() + 10
        while not verdicts[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert verdicts[0] and "step 3 did not finish within 1 s: host 1 " \
            "(localhost:2) has not arrived (at step 2)" in verdicts[0][0]
        assert verdicts[1] and "host 0 (localhost:1) ended the job" \
            in verdicts[1][0]
        watches[0].step_timeout = None
        time.sleep(1.0)  # the watchdog's last look
        verdicts[0].clear()
        start = time.monotonic()
        watches[1].close()  # no "bye": as if killed
        while not verdicts[0] and time.monotonic() - start < 10:
            time.sleep(0.1)
        assert verdicts[0] and "refuses connections on its heartbeat port" \
            in verdicts[0][0]
        assert time.monotonic() - start < 5
    finally:
        for watch in watches:
            watch.close()
        host_watch._current[:] = []
