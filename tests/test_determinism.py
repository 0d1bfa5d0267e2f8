"""Determinism: with `keras.utils.set_random_seed` and
`tf.config.experimental.enable_op_determinism()`, two runs of the same
parallel training (shuffled batches, Dropout in training, Adam) give
bit-identical weights. Each run is a fresh process (determinism_child.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("determinism_child.py")


def digests(meshes):
    result = subprocess.run([sys.executable, str(CHILD), *meshes],
                            env=dict(os.environ), capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split("\n")
    return [line for line in lines if line.split(" ")[0] in meshes]


def check_two_runs_agree(meshes):
    first, second = digests(meshes), digests(meshes)
    assert len(first) == len(meshes)
    assert first == second


def test_two_seeded_runs_give_bit_identical_weights():
    check_two_runs_agree(["data=2,model=4"])


@pytest.mark.slow
def test_two_seeded_runs_give_bit_identical_weights_on_more_meshes():
    check_two_runs_agree(["data=8,fsdp", "model=8", "pipe=2,data=2,model=2"])
