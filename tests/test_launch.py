"""`python -m tfpar.launch`: N hosts from one unchanged script, a dead or
stopped host an error (not a hang), restart and resume.

Each case launches tests/launch_child.py as two processes of 4 virtual CPUs
(data=8 across both), on loopback only. The oracle for the resumed run is
the same 4 epochs of plain SGD on one device here.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

import models
import tfpar
from tfpar import hosts
from tfpar import launch as launch_lib
from tfpar.launch import main as launch_main

TESTS = Path(__file__).resolve().parent
CHILD = TESTS / "launch_child.py"
PER_HOST_CHILD = TESTS / "per_host_child.py"


def launch(workdir, mode, *flags, heartbeat=60, timeout=400, child=CHILD):
    """Runs the launcher; (exit status, output, seconds)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DTENSOR_", "TFPAR_"))}
    env["HEARTBEAT"] = str(heartbeat)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "tfpar.launch", "--hosts", "2",
         "--virtual-cpus", "4", *flags, str(child), mode, str(workdir)],
        capture_output=True, text=True, timeout=timeout, env=env)
    return result.returncode, result.stdout + result.stderr, (
        time.monotonic() - start)


def given_data(tmp_path):
    """Writes the children's weights and data (given.npz) to `tmp_path`."""
    keras.utils.set_random_seed(0)
    weights = models.host_mlp().get_weights()
    x, y = models.mlp_data(n=96)
    np.savez(tmp_path / "given.npz", x=x, y=y,
             **{f"w{i}": w for i, w in enumerate(weights)})
    return tmp_path


@pytest.fixture()
def workdir(tmp_path):
    return given_data(tmp_path)


def one_device_losses(workdir, epochs=4, trained=None):
    """The per-batch losses of one device's run (`trained`: a list that
    receives the trained model)."""
    given = np.load(workdir / "given.npz")
    model = models.host_mlp()
    model.set_weights([given[f"w{i}"] for i in range(6)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    recorder = models.BatchLosses()
    model.fit(given["x"], given["y"], batch_size=32, epochs=epochs,
              shuffle=False, verbose=0, callbacks=[recorder])
    if trained is not None:
        trained.append(model)
    return np.array(recorder.losses)


def losses(workdir, host, attempt):
    return json.loads((workdir / f"losses-host{host}-attempt{attempt}.json")
                      .read_text())


def test_a_killed_host_restarts_the_group_and_training_resumes(workdir):
    # --grace 60: the launcher leaves host 0 time to notice by itself (as
    # on a cluster without this launcher) instead of killing it first.
    status, out, _ = launch(workdir, "kill", "--max-restarts", "1",
                            "--grace", "60", heartbeat=15)
    assert status == 0, out[-4000:]
    # Output of each host is prefixed; host 0 noticed host 1's death.
    assert "[host 0] " in out and "[host 1] host 1 attempt 1 done" in out
    assert "[launch] host 1 exited with status -9" in out
    assert "tfpar: host 1 (localhost:" in out, out
    assert "[launch] host 0 exited with status 70" in out
    assert "[launch] restarting all 2 hosts (restart 1 of 1)" in out
    # Epochs 1-2 ran in attempt 0, epochs 3-4 resumed in attempt 1 from
    # BackupAndRestore: together the losses of one uninterrupted run.
    want = one_device_losses(workdir)
    per_epoch = len(want) // 4
    for host in (0, 1):
        first = losses(workdir, host, 0)[:2 * per_epoch]
        resumed = losses(workdir, host, 1)
        np.testing.assert_allclose(first + resumed, want, rtol=1e-4)


@pytest.mark.slow  # a dead host's detection: test_a_killed_host_restarts_...
def test_a_stopped_host_is_an_error_within_the_heartbeat_timeout(workdir):
    status, out, seconds = launch(workdir, "stop", heartbeat=8)
    assert status == hosts.LOST_HOST_EXIT_CODE, out[-4000:]
    assert "[host 0] " in out and "tfpar: host 1 (localhost:" in out, out
    # Ours or TF's own heartbeats (whichever notices first) gave the verdict.
    assert ("has not answered for" in out
            or "TensorFlow's collective with it failed" in out), out
    assert "exits with status 70" in out
    assert "host 0 attempt 0 done" not in out
    # Bounded: start-up plus two epochs plus the timeout, not forever.
    assert seconds < 300, seconds


@pytest.mark.parametrize("mode", [
    pytest.param("kill-in-save", marks=pytest.mark.slow),
    pytest.param("kill-in-restore", marks=pytest.mark.slow),
    pytest.param("stop-in-save", marks=pytest.mark.slow),
    pytest.param("stop-in-restore", marks=pytest.mark.slow)])
def test_a_host_killed_in_a_checkpoint_is_an_error_not_a_hang(workdir, mode):
    """Host 1 SIGKILLs (SIGSTOPs) itself writing its file of a sharded
    checkpoint (reading its first block): host 0, waiting for it inside save_checkpoint
    (restore_checkpoint), names the lost host and exits within the
    heartbeat timeout; a save it died in is not published."""
    status, out, seconds = launch(workdir, mode, heartbeat=8)
    assert status != 0, out[-4000:]
    if mode.startswith("kill-"):
        assert "[launch] host 1 exited with status -9" in out, out[-4000:]
    assert "tfpar: host 1 (localhost:" in out, out[-4000:]
    assert "[launch] host 0 exited with status 70" in out, out[-4000:]
    assert "host 0 restored" not in out
    assert seconds < 300, seconds
    directory = workdir / "checkpoints"
    if mode.endswith("-in-save"):
        assert "host 0 saved" not in out
        assert tfpar.latest_checkpoint(str(directory)) is None
        published = [p.name for p in directory.iterdir()
                     if re.fullmatch(r"ckpt-\d+", p.name)]
        assert not published, published   # only ckpt-<step>.tmp-<tag>
    else:  # the checkpoint both saved is whole and restores
        assert "[host 0] host 0 saved" in out and "host 1 saved" in out
        assert tfpar.latest_checkpoint(str(directory)) is not None


@pytest.mark.slow
def test_a_host_that_raises_stops_the_others_at_once(workdir):
    status, out, _ = launch(workdir, "fail", heartbeat=600)
    assert status != 0, out[-4000:]
    assert "host 1 fails on purpose" in out
    assert "tfpar: host 1 (localhost:" in out, out[-4000:]
    # Host 1's "fail" is heard at once unless host 0 then waits inside an
    # eager DTensor collective (e.g. `dtensor.unpack` of a weight
    # assignment), which holds the GIL: host 0's heartbeat threads then
    # run only once host 1's exit fails that collective, and the verdict
    # is TF's (or the closed port's).
    assert ("ended with an error" in out
            or "TensorFlow's collective with it failed" in out
            or "refuses connections on its heartbeat port" in out), out[-4000:]


def test_one_script_runs_alone_without_a_cluster(workdir):
    """No cluster variables: connect_hosts() is a no-op, one host."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DTENSOR_", "TFPAR_"))}
    env.update(TFPAR_RESTART="0", TFPAR_VIRTUAL_CPUS="8",
               PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]))
    result = subprocess.run([sys.executable, str(CHILD), "none", str(workdir)],
                            capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    np.testing.assert_allclose(losses(workdir, 0, 0),
                               one_device_losses(workdir), rtol=1e-4)


def set_cluster_environment(monkeypatch, environ):
    """Exactly `environ` of the variables connect_hosts() reads."""
    for name in ("TFPAR_HOSTS", "TFPAR_HOST_ID", "DTENSOR_JOBS",
                 "DTENSOR_CLIENT_ID", "TF_CONFIG", "TFPAR_VIRTUAL_CPUS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("environ,want", [
    ({"TFPAR_HOSTS": "a:1,b:2", "TFPAR_HOST_ID": "1"}, (["a:1", "b:2"], 1)),
    ({"DTENSOR_JOBS": "a:1,b:2,c:3", "DTENSOR_CLIENT_ID": "2"},
     (["a:1", "b:2", "c:3"], 2)),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["a:1"],
                                           "worker": ["b:2", "c:3"]},
                               "task": {"type": "worker", "index": 1}})},
     (["a:1", "b:2", "c:3"], 2)),
    ({}, None),
])
def test_the_cluster_comes_from_the_environment(monkeypatch, environ, want):
    set_cluster_environment(monkeypatch, environ)
    assert hosts.cluster_from_environment() == want


@pytest.mark.parametrize("environ,match", [
    ({"TFPAR_HOSTS": "a:1,b:2"}, "TFPAR_HOST_ID is not"),
    ({"TFPAR_HOSTS": "a:1,b:2", "TFPAR_HOST_ID": "one"},
     "TFPAR_HOST_ID needs an integer. Received: TFPAR_HOST_ID='one'"),
    ({"TF_CONFIG": "{not json"}, "TF_CONFIG must be JSON"),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}})},
     "TF_CONFIG must be JSON.*'task'"),
])
def test_a_malformed_environment_is_a_clear_error(monkeypatch, environ, match):
    set_cluster_environment(monkeypatch, environ)
    with pytest.raises(ValueError, match=match):
        hosts.cluster_from_environment()


@pytest.mark.parametrize("argv,match", [
    (["--hosts", "0", "x.py"], "--hosts needs a positive integer"),
    (["--max-restarts", "-1", str(CHILD)], "--max-restarts needs"),
    (["missing.py"], "no such script: 'missing.py'"),
])
def test_bad_launcher_arguments_are_clear_errors(argv, match, capsys,
                                                 monkeypatch):
    # In-process: `python -m tfpar.launch` runs this `main` (a subprocess
    # would spend its time importing TensorFlow, up to a minute under load).
    monkeypatch.chdir(TESTS.parent)
    with pytest.raises(SystemExit) as exit_:
        launch_main(argv)
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and match in stderr, stderr


@pytest.mark.parametrize("mode", [
    "arrays", pytest.param("dataset", marks=pytest.mark.slow),
    pytest.param("files", marks=pytest.mark.slow)])
def test_each_host_feeds_only_its_share(workdir, mode):
    """per_host_input=True: host h gives fit only rows 16h..16h+15 of each
    32-row global batch (from arrays, a tf.data dataset, or files sharded
    by host: file 2k+h holds them, and host h's tf.data pipeline reads
    every other file); the losses equal one device's on whole batches.
    From arrays, evaluate on each host's rows gives one device's loss on
    all of them, and predict returns every host's predictions in order
    (it stopped in a TensorFlow error before 2026-12-07: Keras' predict
    loop hands over batches already placed, which per-host placement
    read again as host arrays)."""
    if mode == "files":
        given = np.load(workdir / "given.npz")
        for k in range(len(given["x"]) // 32):
            for h in (0, 1):
                rows = slice(32 * k + 16 * h, 32 * k + 16 * h + 16)
                np.savez(workdir / f"rows-{2 * k + h:03d}.npz",
                         x=given["x"][rows], y=given["y"][rows])
    status, out, _ = launch(workdir, mode, child=PER_HOST_CHILD)
    assert status == 0, out[-4000:]
    trained = []
    want = one_device_losses(workdir, epochs=2, trained=trained)
    for host in (0, 1):
        got = json.loads((workdir / f"losses-host{host}.json").read_text())
        np.testing.assert_allclose(got, want, rtol=1e-4)
    if mode != "arrays":
        return
    given = np.load(workdir / "given.npz")
    for host in (0, 1):
        result = {name: json.loads((workdir / f"{name}-host{host}.json")
                                   .read_text())
                  for name in ("evaluate", "predict")}
        np.testing.assert_allclose(result["evaluate"], trained[0].evaluate(
            given["x"], given["y"], batch_size=32, verbose=0), rtol=1e-4)
        np.testing.assert_allclose(result["predict"], trained[0].predict(
            given["x"], batch_size=32, verbose=0), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_datasets_from_function_get_each_host_its_input_context(workdir):
    status, out, _ = launch(workdir, "function", child=PER_HOST_CHILD)
    assert status == 0, out[-4000:]
    x = np.load(workdir / "given.npz")["x"]
    for host in (0, 1):
        got = json.loads((workdir / f"batches-host{host}.json").read_text())
        np.testing.assert_allclose(np.concatenate(got), x, rtol=0)


@pytest.mark.slow  # a clear error of a multi-host input; two processes
def test_hosts_with_different_numbers_of_batches_are_a_clear_error(workdir):
    status, out, _ = launch(workdir, "uneven", child=PER_HOST_CHILD)
    assert status != 0
    assert "every host must feed a batch of the same size" in out, out[-4000:]
    assert "host 0: 3 batches, host 1: 2 batches" in out


def test_the_launcher_forwards_sigterm_and_kills_after_the_grace(
        tmp_path, capsys):
    """In-process, with two shell "hosts": SIGTERM to the launcher reaches
    both; the one that traps it exits 0 at once, the one that ignores it
    is killed after the 2 s grace (not the 60 s failure grace), and the
    launcher says which host it killed."""
    hosts_ = [subprocess.Popen(["sh", "-c", script]) for script in (
        f"trap 'echo got > {tmp_path}/h0; exit 0' TERM; "
        "while :; do sleep 0.1; done",
        "trap '' TERM; while :; do sleep 0.1; done")]
    launch_lib._signalled.clear()
    launch_lib._signalled_at.clear()
    previous = launch_lib._forwarding(hosts_)
    try:
        time.sleep(0.5)  # the shells' traps are set
        start = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        status = launch_lib._wait(hosts_, grace=60, signal_grace=2)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        launch_lib._signalled.clear()
        launch_lib._signalled_at.clear()
    assert (tmp_path / "h0").read_text() == "got\n"
    assert hosts_[0].returncode == 0 and hosts_[1].returncode == -9
    assert status == 0  # the launcher's own status is 128 + SIGTERM
    assert 2 <= time.monotonic() - start < 10
    captured = capsys.readouterr()
    assert "[launch] host 1 did not exit within 2 s: killed" in (
        captured.out + captured.err)
