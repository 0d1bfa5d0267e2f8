"""Smoke tests: every example script runs with small settings and --help."""

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


@pytest.mark.parametrize("script", ["quickstart.py", "gpt.py"])
def test_help(script):
    assert "usage:" in run(script, "--help")


def test_quickstart_reports_parity_and_placement():
    out = run("quickstart.py", "--epochs", "1")
    assert "largest relative weight difference" in out
    difference = float(out.split("largest relative weight difference:")[1].split()[0])
    assert difference < 1e-4
    assert "mlp/up0/kernel" in out and "(None, 'model')" in out


def test_gpt_example_trains_in_parity():
    out = run("gpt.py", "--epochs", "1", "--layers", "1")
    difference = float(out.split("largest relative loss difference:")[1].split()[0])
    assert difference < 1e-4
    assert "b0_attn/query/kernel" in out
