"""Smoke tests: every example script's --help, and each runs with small
settings — the quickstart (the README's demo) in the default run, the others
in the slow profile (`python3 dev.py test-all`: their flows are parity-tested
by the suite's own files, named at each test)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script, *args):
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *args],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("script", ["quickstart.py", "gpt.py", "pipeline.py",
                                    "checkpoints.py", "hosts.py",
                                    "keras_hub_llama.py", "does_not_fit.py"])
def test_help(script):
    assert "usage:" in run(script, "--help")


def test_quickstart_reports_parity_and_placement():
    out = run("quickstart.py", "--epochs", "1")
    assert "largest relative weight difference" in out
    difference = float(out.split("largest relative weight difference:")[1].split()[0])
    assert difference < 1e-4
    assert "mlp/up0/kernel" in out and "(None, 'model')" in out
    assert "parity with one device (losses and weights within 1e-4): OK" in out
    assert "bytes per device:" in out
    assert out.count("\n  CPU:") == 8  # one table row per device


def test_does_not_fit_plans_trains_and_resumes_on_another_mesh_in_parity():
    """The README's newcomer path: a keras-hub causal LM, `tfpar.plan` (as a
    builder) under a memory limit plain data parallelism exceeds, `fit`,
    and a checkpoint resumed on a data x model mesh, each beside one device.
    The default run's case of tests/test_plans_train.py's newcomer plans."""
    out = run("does_not_fit.py")
    assert "Chosen: " in out and "memory limit 900.0 kB" in out
    assert "Self-check: passed" in out, out[:3000]
    # The chosen plan's own memory, printed as "..., 740.2 kB per device (".
    chosen = out.split("Chosen: ")[1].split(" per device (")[0]
    assert chosen.endswith(" kB") and float(chosen.split()[-2]) <= 900, chosen
    differences = [float(part.split()[0]) for part in
                   out.split("largest relative loss difference:")[1:]]
    assert len(differences) == 2 and max(differences) < 1e-4, out[-2000:]
    assert "resumed step 1 from" in out


@pytest.mark.slow  # its gpt.train is parity-tested in tests/test_gpt_example.py
def test_gpt_example_trains_in_parity():
    out = run("gpt.py", "--epochs", "1", "--layers", "1")
    difference = float(out.split("largest relative loss difference:")[1].split()[0])
    assert difference < 1e-4
    assert "b0_attn/query/kernel" in out


@pytest.mark.slow  # the same flow is parity-tested in tests/test_gpt_example.py / test_pipeline.py
def test_gpt_example_in_three_dimensions_with_fsdp_and_recompute():
    out = run("gpt.py", "--epochs", "1", "--layers", "1", "--data", "2",
              "--pipe", "2", "--model", "2", "--fsdp", "--recompute")
    difference = float(out.split("largest relative loss difference:")[1].split()[0])
    assert difference < 1e-4
    assert "stage 1 on" in out
    assert "('data', 'model', None)" in out  # attention kernels, fsdp


@pytest.mark.slow  # its flow: tests/test_pipeline.py (parity, executed timelines)
def test_pipeline_example_trains_in_parity_and_draws_the_timeline(tmp_path):
    gantt = tmp_path / "pipeline.png"
    out = run("pipeline.py", "--epochs", "1", "--depth", "4",
              "--microbatches", "4", "--gantt", str(gantt))
    difference = float(out.split("largest relative weight difference:")[1].split()[0])
    assert difference < 1e-4
    assert "stage 3 on" in out and gantt.stat().st_size > 0


@pytest.mark.slow  # the same flow is parity-tested in tests/test_gpt_example.py / test_pipeline.py
def test_pipeline_example_interleaved(tmp_path):
    out = run("pipeline.py", "--epochs", "1", "--depth", "3", "--pipe", "2",
              "--data", "4", "--microbatches", "4", "--virtual-stages", "2",
              "--gantt", str(tmp_path / "interleaved.png"))
    difference = float(out.split("largest relative weight difference:")[1].split()[0])
    assert difference < 1e-4
    assert "part 3 (stage 1, chunk 1) on CPU:4..CPU:7" in out
    assert "theory (p-1)/(v·m+p-1) = 11%" in out   # 1 / (2 * 4 + 1)


@pytest.mark.slow  # its flow: tests/test_checkpoint_sharded.py, test_checkpoint_keras.py
def test_checkpoints_example_resumes_and_exports(tmp_path):
    out = run("checkpoints.py", "--width", "64", "--directory", str(tmp_path))
    difference = float(out.split("largest relative loss difference:")[1].split()[0])
    assert difference < 1e-4
    served = float(out.split("largest prediction difference:")[1].split()[0])
    assert served < 1e-5


@pytest.mark.slow  # two-host training: tests/test_hosts.py
def test_hosts_example_trains_one_mesh_over_two_processes():
    out = run("hosts.py", "--epochs", "1")
    difference = float(out.split("largest relative weight difference to one "
                                 "device:")[1].split()[0])
    assert difference < 1e-4
    assert "host 0 holds these blocks of up/kernel (16, 64): CPU:0 (16, 16)" in out
    assert "host 1 holds these blocks of up/kernel (16, 64): CPU:4 (16, 16)" in out


def _llama_parity(*args):
    out = run("keras_hub_llama.py", "--layers", "1", "--steps", "2", *args)
    assert "parity with one device: OK" in out
    for gap in ("loss", "weight"):
        value = out.split(f"largest relative {gap} difference:")[1].split()[0]
        assert float(value) < 1e-4
    return out


@pytest.mark.slow  # colab/keras_hub_llama.ipynb runs both flows by default
def test_keras_hub_llama_through_keras_distribution():
    out = _llama_parity("--keras-distribution")
    # keras-hub's layout map: split over both axes, blocks per device.
    assert re.search(r"transformer_layer_0/feedforward_gate_dense/kernel +"
                     r"\('batch', 'model'\) +per-device block \(32, 32\)", out)


@pytest.mark.slow
def test_keras_hub_llama_with_auto_rules():
    out = _llama_parity()
    assert "auto_rules plan on Mesh({'data': 2, 'model': 4}" in out
