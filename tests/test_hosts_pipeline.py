"""Pipeline stages on different hosts: two processes on this machine, 4
virtual CPUs each, started by `python -m tfpar.launch` (the child,
tests/hosts_pipeline_child.py, calls nothing host-specific).

A `PipelineModel` of `models.host_mlp` whose pipe axis runs along the hosts
(one stage per host) trains with the host-driven step of
`tfpar.pipeline.cross_host` in parity with single-device Keras on the same
weights and data: per-batch losses, final weights, evaluate and predict
within 1e-4 relative (fp32); each host holds only its stage's weights and
optimizer slots; both hosts read back the same weights. What stays refused
across hosts is the same clear error on both hosts.
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

TESTS = Path(__file__).resolve().parent
CHILD = TESTS / "hosts_pipeline_child.py"
RTOL = 1e-4
DEFAULT = ["pipe2-data2-model2:gpipe:adam", "pipe2-data4:1f1b:sgd"]
SLOW = ["pipe2-data2-model2:1f1b:sgd", "pipe2-data4:gpipe:adam"]


def launch(workdir, cases, timeout=900):
    """Runs the child on 2 hosts for `cases`; asserts that both finished."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DTENSOR_", "TFPAR_"))}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "tfpar.launch", "--hosts", "2",
         "--virtual-cpus", "4", str(CHILD), str(workdir), *cases],
        capture_output=True, text=True, timeout=timeout, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    return output


def given(workdir):
    keras.utils.set_random_seed(0)
    weights = models.host_mlp().get_weights()
    x, y = models.mlp_data(n=64)
    np.savez(workdir / "given.npz", x=x, y=y,
             **{f"w{i}": w for i, w in enumerate(weights)})


def one_device(workdir, optimizer):
    """The single-device run the child's pipeline must match: (per-batch
    losses, weights, evaluate, predict)."""
    data = np.load(workdir / "given.npz")
    model = models.host_mlp()
    model.set_weights([data[f"w{i}"] for i in range(6)])
    model.compile(optimizer=keras.optimizers.Adam(0.01)
                  if optimizer == "adam" else keras.optimizers.SGD(),
                  loss="mse", metrics=["mae"])
    losses = models.BatchLosses()
    model.fit(data["x"], data["y"], batch_size=16, epochs=1, shuffle=False,
              verbose=0, callbacks=[losses])
    return (losses.losses, model.get_weights(),
            model.evaluate(data["x"], data["y"], batch_size=16, verbose=0),
            model.predict(data["x"], batch_size=16, verbose=0))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hosts_pipeline")
    given(workdir)
    launch(workdir, DEFAULT + ["refusals"])
    return workdir


def check_case(workdir, case):
    losses, weights, evaluated, predicted = one_device(
        workdir, case.split(":")[2])
    hosts = [np.load(workdir / f"{case}-host{h}.npz") for h in (0, 1)]
    assert len(losses) == 4  # 64 samples, batch 16
    for host in hosts:
        assert models.relative_error(losses, host["losses"]) < RTOL
        assert models.relative_error(evaluated, host["evaluate"]) < RTOL
        assert models.relative_error(predicted, host["predict"]) < RTOL
        for i, want in enumerate(weights):
            assert models.relative_error(want, host[f"w{i}"]) < RTOL
    # One program: both hosts report the same losses and read back the
    # same weights.
    np.testing.assert_array_equal(hosts[0]["losses"], hosts[1]["losses"])
    for i in range(len(weights)):
        np.testing.assert_array_equal(hosts[0][f"w{i}"], hosts[1][f"w{i}"])
    return hosts


@pytest.mark.parametrize("case", DEFAULT)
def test_stages_on_two_hosts_train_in_parity_with_one_device(default_run,
                                                             case):
    check_case(default_run, case)


def test_each_host_holds_only_its_stages_weights_and_slots(default_run):
    """Stage 0 (up0) on host 0's devices 0..3, stage 1 (down0, head) on
    host 1's 4..7: the other host holds no block of them (no component on
    any of its devices), Adam's slots likewise."""
    hosts = [np.load(default_run / f"{DEFAULT[0]}-host{h}.npz")
             for h in (0, 1)]
    held = [ast.literal_eval(str(host["held"])) for host in hosts]
    stage_of = {"up0": 0, "down0": 1, "head": 1}
    slots = [p for p in held[0] if p.startswith("adam/")]
    assert len(slots) == 12  # momentum and velocity of 6 weights
    for path in held[0]:
        layer = next(name for name in stage_of if name in path)
        owner = stage_of[layer]
        assert held[owner][path] == [4 * owner + d for d in range(4)], path
        assert held[1 - owner][path] == [], path


def test_what_stays_refused_is_the_same_clear_error_on_both_hosts(
        default_run):
    hosts = [np.load(default_run / f"refusals-host{h}.npz") for h in (0, 1)]
    for key in ("zero_bubble", "straddling"):
        assert str(hosts[0][key]) == str(hosts[1][key])
    assert "does not support schedule='zb-h1'" in str(hosts[0]["zero_bubble"])
    assert "Use schedule='gpipe' or '1f1b'" in str(hosts[0]["zero_bubble"])
    message = str(hosts[0]["straddling"])
    assert "consecutive devices of one host" in message
    assert "devices=[CPU:0, CPU:1, CPU:4, CPU:5]" in message


@pytest.mark.slow
def test_other_schedules_and_optimizers_in_parity(tmp_path):
    given(tmp_path)
    launch(tmp_path, SLOW)
    for case in SLOW:
        check_case(tmp_path, case)
