"""Device discovery on faked device lists, connect_tpu (mocked), tfpar.env
and its smoke check."""

import json
import math
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar
from tfpar import env, smoke, tpu
from tfpar.mesh import _pick_devices, default_device_type, default_devices


def _devices(*names):
    """LogicalDevices for short names like "GPU:0" (TPU_SYSTEM:0 allowed)."""
    return [
        tf.config.LogicalDevice(
            name=f"/job:localhost/replica:0/task:0/device:{n}",
            device_type=n.rsplit(":", 1)[0],
        )
        for n in names
    ]


@pytest.fixture
def fake_devices(monkeypatch):
    """Makes tf.config.list_logical_devices report the given devices."""

    def install(*names):
        devices = _devices(*names)

        def list_logical_devices(device_type=None):
            return [
                d
                for d in devices
                if device_type is None or d.device_type == device_type
            ]

        monkeypatch.setattr(tf.config, "list_logical_devices", list_logical_devices)

    return install


def test_pick_devices_prefers_tpu_then_gpu_then_cpu():
    cpus = ("CPU:0", "CPU:1")
    assert _pick_devices(_devices(*cpus)) == ["CPU:0", "CPU:1"]
    assert _pick_devices(_devices(*cpus, "GPU:1", "GPU:0")) == ["GPU:0", "GPU:1"]
    tpu_host = _devices(*cpus, "GPU:0", "TPU_SYSTEM:0", "TPU:1", "TPU:0")
    assert _pick_devices(tpu_host) == ["TPU:0", "TPU:1"]
    assert _pick_devices([]) == []


def test_pick_devices_orders_by_numeric_index():
    gpus = [f"GPU:{i}" for i in (10, 2, 0, 11, 1)]
    assert _pick_devices(_devices(*gpus)) == ["GPU:0", "GPU:1", "GPU:2", "GPU:10", "GPU:11"]


def test_pick_devices_accepts_pairs_and_drops_duplicate_names():
    pairs = [
        ("GPU", "/job:localhost/replica:0/task:0/device:GPU:1"),
        ("gpu", "GPU:0"),
        ("GPU", "/job:worker/replica:0/task:0/device:GPU:1"),
    ]
    assert _pick_devices(pairs) == ["GPU:0", "GPU:1"]


def test_pick_devices_rejects_other_items():
    with pytest.raises(TypeError, match=r"\(device_type, name\) pairs.*Received: 'GPU:0'"):
        _pick_devices(["GPU:0"])


def test_default_devices_and_mesh_on_faked_gpus(fake_devices):
    fake_devices("CPU:0", *[f"GPU:{i}" for i in range(12)])
    assert default_device_type() == "GPU"
    assert default_devices()[-3:] == ["GPU:9", "GPU:10", "GPU:11"]
    mesh = tfpar.Mesh({"data": 3, "model": 4})  # no DTensor mesh is created
    assert mesh.device_type == "GPU"
    assert mesh.devices[:3] == ("GPU:0", "GPU:1", "GPU:2")
    assert repr(mesh) == "Mesh({'data': 3, 'model': 4}, devices=GPU:0..GPU:11)"


def test_default_mesh_on_faked_tpu(fake_devices):
    fake_devices("CPU:0", "TPU_SYSTEM:0", *[f"TPU:{i}" for i in range(8)])
    mesh = tfpar.Mesh({"data": 2, "model": 4})
    assert mesh.device_type == "TPU"
    assert repr(mesh) == "Mesh({'data': 2, 'model': 4}, devices=TPU:0..TPU:7)"


def test_explicit_devices_checked_against_faked_gpus(fake_devices):
    fake_devices("CPU:0", "GPU:0", "GPU:1", "GPU:2")
    mesh = tfpar.Mesh({"model": 2}, devices=["GPU:2", "/device:GPU:0"])
    assert mesh.devices == ("GPU:2", "GPU:0")
    assert repr(mesh) == "Mesh({'model': 2}, devices=[GPU:2, GPU:0])"
    with pytest.raises(
        ValueError,
        match=r"\['GPU:7'\] do not exist.*Received: devices=\['GPU:0', 'GPU:7'\]"
        r".*available GPU devices \['GPU:0', 'GPU:1', 'GPU:2'\]",
    ):
        tfpar.Mesh({"model": 2}, devices=["GPU:0", "GPU:7"])


def test_explicit_gpu_devices_on_cpu_host_say_how_to_fix(fake_devices):
    fake_devices("CPU:0", "CPU:1")
    with pytest.raises(
        ValueError,
        match=r"do not exist.*Received: devices=\['GPU:0', 'GPU:1'\]\. This "
        r"host has no GPU device; omit devices= to use \[CPU:0, CPU:1\]",
    ):
        tfpar.Mesh({"model": 2}, devices=["GPU:0", "GPU:1"])


def test_default_devices_without_any_device_raises(fake_devices):
    fake_devices("TPU_SYSTEM:0")
    with pytest.raises(RuntimeError, match=r"no TPU, GPU or CPU device\. Received"):
        default_devices()


# connect_tpu: only the error and repeat-call paths, with mocks.


@pytest.fixture
def fresh_tpu_state(monkeypatch):
    monkeypatch.setattr(tpu, "_connected", None)


def test_connect_tpu_without_tpu_raises_clear_error(fresh_tpu_state, monkeypatch):
    def no_tpu(tpu=None, **kwargs):
        raise ValueError("Please provide a TPU Name to connect to.")

    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", no_tpu)
    with pytest.raises(
        RuntimeError,
        match=r"no TPU found.*Received: tpu=None; on Colab choose "
        r"Runtime > Change runtime type > TPU",
    ):
        tpu.connect_tpu()
    assert tpu.connected_tpu_cores() == 0


def test_connect_tpu_falls_back_to_local_chips(fresh_tpu_state, monkeypatch, fake_devices):
    tried = []

    def resolver(tpu=None):
        tried.append(tpu)
        if tpu is None:
            raise ValueError("Please provide a TPU Name to connect to.")
        return "local resolver"

    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", resolver)
    monkeypatch.setattr(tpu, "_local_tpu_chips", lambda: ["/dev/accel0"])
    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", lambda r: None)
    monkeypatch.setattr(dtensor, "initialize_accelerator_system", lambda t: t)
    fake_devices("CPU:0", "TPU:0", "TPU:1", "TPU:2", "TPU:3")
    assert tpu.connect_tpu() == 4
    assert tried == [None, "local"]


@pytest.mark.skipif(
    bool(os.environ.get("TPU_NAME") or tpu._local_tpu_chips()),
    reason="this host may have a TPU",
)
def test_connect_tpu_real_resolver_without_tpu_raises(fresh_tpu_state):
    # This host has no TPU: the real resolver raises ValueError, which we wrap.
    with pytest.raises(RuntimeError, match=r"no TPU found.*Received: tpu=None"):
        tpu.connect_tpu()


def test_connect_tpu_initialises_once(fresh_tpu_state, monkeypatch, fake_devices):
    calls = []
    monkeypatch.setattr(
        tf.distribute.cluster_resolver,
        "TPUClusterResolver",
        lambda tpu=None: calls.append(("resolve", tpu)) or "resolver",
    )
    monkeypatch.setattr(
        tf.config,
        "experimental_connect_to_cluster",
        lambda resolver: calls.append(("connect", resolver)),
    )
    monkeypatch.setattr(
        dtensor,
        "initialize_accelerator_system",
        lambda device_type: calls.append(("init", device_type)) or device_type,
    )
    fake_devices("CPU:0", "TPU_SYSTEM:0", *[f"TPU:{i}" for i in range(8)])
    assert tpu.connect_tpu("local") == 8
    assert tpu.connect_tpu() == 8
    assert tpu.connect_tpu("local") == 8
    assert calls == [
        ("resolve", "local"),
        ("connect", "resolver"),
        ("init", "TPU"),
    ]
    assert tpu.connected_tpu_cores() == 8
    with pytest.raises(RuntimeError, match=r"already connected.*Received: tpu='other'"):
        tpu.connect_tpu("other")


def test_connect_tpu_after_tensorflow_started_says_call_it_first(
    fresh_tpu_state, monkeypatch
):
    monkeypatch.setattr(
        tf.distribute.cluster_resolver, "TPUClusterResolver", lambda tpu=None: "r"
    )
    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", lambda r: None)

    def already(device_type):
        raise ValueError("TensorFlow has already been initialized. ...")

    monkeypatch.setattr(dtensor, "initialize_accelerator_system", already)
    with pytest.raises(
        RuntimeError, match=r"Received: tpu=None\. Call tfpar\.connect_tpu\(\) first"
    ):
        tpu.connect_tpu()
    assert tpu.connected_tpu_cores() == 0


# python -m tfpar.env


def test_report_in_process():
    text = env.report()
    lines = text.splitlines()
    assert lines[0] == f"tfpar: {tfpar.__version__}"
    assert f"tensorflow: {tf.__version__}" in lines
    for key in ("keras: ", "numpy: ", "python: ", "platform: ", "tf.config.threading: "):
        assert any(line.startswith(key) for line in lines), key
    assert "logical devices: 8 CPU" in lines
    assert "  CPU: CPU:0..CPU:7" in lines
    assert any(line.startswith("dtensor: importable") for line in lines)
    assert "  DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=0" in lines
    assert lines[-1] == (
        "default mesh: Mesh({'data': 8}, devices=CPU:0..CPU:7) (device type: CPU)"
    )


def test_report_leaves_out_terraform_and_secret_variables(monkeypatch):
    monkeypatch.setenv("TF_VAR_db_password", "hunter2")
    monkeypatch.setenv("TF_TOKEN_app_terraform_io", "tok")
    monkeypatch.setenv("TF_SOME_API_KEY", "abc")
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    text = env.report()
    assert "hunter2" not in text and "TF_TOKEN" not in text
    assert "  TF_SOME_API_KEY=<redacted>" in text.splitlines()
    assert "  KERAS_BACKEND=tensorflow" in text.splitlines()


def test_env_help_and_bad_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        env.main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--virtual-cpus N" in help_text and "--smoke" in help_text
    with pytest.raises(SystemExit) as exit_info:
        env.main(["--virtual-cpus", "0"])
    assert exit_info.value.code == 2
    assert "Received: --virtual-cpus 0" in capsys.readouterr().err


def test_python_m_tfpar_env_with_virtual_cpus():
    environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-m", "tfpar.env", "--virtual-cpus", "8"],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"tfpar: {tfpar.__version__}"
    assert any(line.startswith("physical devices: ") for line in lines)
    assert "logical devices: 8 CPU" in lines
    assert "  TF_CPP_MIN_LOG_LEVEL=2" in lines
    assert lines[-1] == (
        "default mesh: Mesh({'data': 8}, devices=CPU:0..CPU:7) (device type: CPU)"
    )


@pytest.mark.parametrize("preset,expected", [(None, "1"), ("0", "0")])
def test_import_turns_on_nccl_for_gpu_meshes_unless_the_user_chose(
        preset, expected):
    environment = {k: v for k, v in os.environ.items()
                   if k != "DTENSOR_GPU_USE_NCCL_COMMUNICATION"}
    if preset is not None:
        environment["DTENSOR_GPU_USE_NCCL_COMMUNICATION"] = preset
    code = ("import os, tfpar; "
            "print(os.environ['DTENSOR_GPU_USE_NCCL_COMMUNICATION'])")
    result = subprocess.run([sys.executable, "-c", code], env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == expected


# python -m tfpar.env --smoke


def _smoke_rows(markdown):
    """{check name: (mesh, result, error, tolerance)} from the report's
    table, errors and tolerances as floats (None for "-")."""
    rows = {}
    for line in markdown.splitlines():
        match = re.match(r"\| (\w+): [^|]+ \| ([^|]+) \| ([^|]+) \| ([^|]+) "
                         r"\| ([^|]+) \|", line)
        if match:
            name, mesh, result, error, tolerance = (
                g.strip() for g in match.groups())
            rows[name] = (mesh, result, None if error == "-" else float(error),
                          None if tolerance == "-" else float(tolerance))
    return rows


def test_python_m_tfpar_env_smoke_passes_on_virtual_cpus():
    environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-m", "tfpar.env", "--smoke"],
                            capture_output=True, text=True, env=environ,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = result.stdout
    lines = report.splitlines()
    assert lines[0] == "# tfpar smoke check"
    assert f"- tensorflow: {tf.__version__}" in lines
    assert "- logical devices: 8 CPU" in lines and "- CPU: CPU:0..CPU:7" in lines
    assert ("**PASS**: 5 of 5 checks passed on 8 CPU device(s); one device = "
            "CPU:0.") in lines
    rows = _smoke_rows(report)
    meshes = {"data": "data=8", "tensor": "data=2 × model=4", "fsdp": "data=8",
              "pipeline": "pipe=2 × data=4", "bfloat16": "data=2 × model=4"}
    for name, mesh in meshes.items():
        row_mesh, status, error, tolerance = rows[name]
        assert (row_mesh, status) == (mesh, "PASS"), (name, rows[name])
        assert error <= tolerance, (name, rows[name])
    for name in ("data", "tensor", "fsdp", "pipeline"):
        assert rows[name][3] == smoke.FLOAT32_TOLERANCE
    # bfloat16 moves the update by percents: its bound is 3 times that.
    assert 1e-3 < rows["bfloat16"][3] / smoke.MIXED_SLACK < 1
    assert rows["float16"][1].startswith("SKIP (float16 is for GPUs")
    assert "FAIL" not in report


def test_smoke_planted_failures_are_reported_and_exit_nonzero(
        monkeypatch, capsys):
    """A check that raises is FAIL with its exception and the next still
    runs; a tensor-parallel run whose learning rate is 1% off is FAIL by
    its error."""
    def broken_step(runs, check):
        raise RuntimeError("planted: the data-parallel step broke\nline 2")

    original_compile = smoke._compile

    def off_by_one_percent(model, policy):
        if not tf.distribute.has_strategy():
            return original_compile(model, policy)
        model.compile(optimizer=keras.optimizers.SGD(0.0505, momentum=0.9),
                      loss="mse")

    original_parallel = smoke._Runs.parallel
    monkeypatch.setattr(smoke._Runs, "parallel", lambda runs, check: (
        broken_step if check.name == "data" else original_parallel)(
            runs, check))
    monkeypatch.setattr(smoke, "_compile", off_by_one_percent)
    assert env.main(["--smoke", "--checks", "data,tensor"]) == 1
    report = capsys.readouterr().out
    assert ("**FAIL**: 0 of 2 checks passed on 8 CPU device(s); one device "
            "= CPU:0.") in report.splitlines()
    rows = _smoke_rows(report)
    assert rows["data"] == ("data=8", "FAIL (RuntimeError)", None, 1e-4)
    mesh, status, error, tolerance = rows["tensor"]
    assert (mesh, status, tolerance) == ("data=2 × model=4", "FAIL", 1e-4)
    assert 1e-3 < error < 0.1
    failure = report.split("### data failed", 1)[1]
    assert "RuntimeError: planted: the data-parallel step broke\nline 2" in failure
    assert re.search(r"at .*test_env\.py:\d+ in broken_step", failure)
    assert f"max rel. error {error:.2e} > tolerance 1.0e-04" in report


def test_smoke_nan_or_inf_in_any_weight_update_fails():
    """A NaN after the first weight used to vanish in max(); now any
    non-finite update is an infinite error, and the check FAILs."""
    reference = [np.ones((2, 2)), np.ones(3), np.ones(3)]
    for bad in (np.nan, np.inf):
        updates = [np.ones((2, 2)), np.array([1.0, bad, 1.0]), np.ones(3)]
        assert smoke._relative_differences(updates, reference) == [
            0.0, math.inf, 0.0]
    runs = smoke._Runs(initial=[np.zeros(3)] * 3, data=None,
                       reference_device="CPU:0")
    runs.references["float32"] = smoke._Trained(reference, 1.0)
    runs.parallel = lambda check: smoke._Trained(updates, 1.0)
    check = smoke.Check("data", "data parallel", {"data": 8})
    result = runs.check(check)
    assert (result.status, result.error, result.tolerance) == (
        "FAIL", math.inf, smoke.FLOAT32_TOLERANCE)


def test_smoke_mixed_precision_bound_is_per_weight(monkeypatch):
    """bfloat16: a 5% error planted in one kernel's update FAILs, though
    the first kernel's own bfloat16 rounding moves its update ~10% (one
    bound for all weights let it pass)."""
    names = [w.path for w in smoke._build("float32").weights]
    planted = names.index("smoke_mlp/down1/kernel")
    original_parallel = smoke._Runs.parallel

    def five_percent_off(runs, check):
        trained = original_parallel(runs, check)
        trained.updates[planted] = trained.updates[planted] * 1.05
        return trained

    monkeypatch.setattr(smoke._Runs, "parallel", five_percent_off)
    (check,) = smoke.run(["bfloat16"]).checks
    assert check.status == "FAIL", check
    assert 0.04 < check.error < 0.07 and check.tolerance < 0.04, check


def test_smoke_json_and_its_flags(capsys):
    assert env.main(["--smoke", "--checks", "float16", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["passed"] is True and answer["device_type"] == "CPU"
    assert answer["devices"] == [f"CPU:{i}" for i in range(8)]
    assert [(c["name"], c["status"]) for c in answer["checks"]] == [
        ("float16", "SKIP")]
    assert answer["environment"][0] == f"tfpar: {tfpar.__version__}"
    for argv, message in [
            (["--smoke", "--checks", "data,bogus"],
             "--checks takes names from data,tensor,fsdp,pipeline,bfloat16,"
             "float16. Received: --checks data,bogus"),
            (["--json"], "--checks and --json go with --smoke. Received: "
             "--json")]:
        with pytest.raises(SystemExit) as exit_info:
            env.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_float16_check_on_cpus(monkeypatch):
    """The GPU-only mixed_float16 check (loss scaling), run on the CPUs."""
    checks_for = smoke.checks_for
    monkeypatch.setattr(smoke, "checks_for",
                        lambda device_type, count: checks_for("GPU", count))
    (check,) = smoke.run(["float16"]).checks
    assert (check.mesh, check.status) == ("data=2 × model=4", "PASS")
    assert 0 < check.error <= check.tolerance
    # float16 moves one device's updates by percents (bfloat16: about 10%).
    assert 1e-3 < check.tolerance / smoke.MIXED_SLACK < 0.05


def test_smoke_checks_follow_the_device_count():
    def axes(device_type, count):
        return {c.name: c.axes for c in smoke.checks_for(device_type, count)}

    assert axes("GPU", 1) == {
        "data": {"data": 1}, "tensor": None, "fsdp": None, "pipeline": None,
        "bfloat16": {"data": 1}, "float16": {"data": 1}}
    assert axes("GPU", 2)["tensor"] == {"data": 1, "model": 2}
    odd = {c.name: (c.title, c.axes, c.rules)
           for c in smoke.checks_for("GPU", 3)}
    assert odd["bfloat16"] == ("mixed_bfloat16, data parallel", {"data": 3},
                               None)
    assert odd["pipeline"][1] is None
    assert axes("TPU", 32)["pipeline"] == {"pipe": 2, "data": 16}
    assert axes("TPU", 32)["float16"] is None
    with pytest.raises(ValueError, match=r"unknown smoke check\(s\) \['dp'\]"
                       r"\. Received: names=\['dp'\]"):
        smoke.run(["dp"])


def test_report_names_each_gpu_and_the_driver(monkeypatch, tmp_path):
    gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU")
            for i in range(2)]
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda device_type=None: gpus)
    monkeypatch.setattr(tf.config.experimental, "get_device_details",
                        lambda gpu: {"device_name": "NVIDIA A100-SXM4-40GB",
                                     "compute_capability": (8, 0)})
    fake_smi = tmp_path / "nvidia-smi"
    fake_smi.write_text("#!/bin/sh\necho 550.54.15\necho 550.54.15\n")
    fake_smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    lines = env.report().splitlines()
    assert "physical devices: 2 GPU" in lines
    assert ("  /physical_device:GPU:1: NVIDIA A100-SXM4-40GB (compute "
            "capability (8, 0))") in lines
    assert "gpu driver: 550.54.15" in lines
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert "gpu driver: unknown (no nvidia-smi on PATH)" in env.report()
