"""`ParallelStrategy(offload=...)`: what DTensor 2.21 allows on this host,
and the errors raised before training.

Offload is not implemented: on a mesh of CPU devices there is no separate
host to offload to, and DTensor cannot copy a sharded value to another
mesh inside a step (tests/dtensor_offload_repro.py; the replicated route
that compiles holds the whole state on every device).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tfpar


def test_dtensor_has_no_separate_host_and_no_sharded_copy():
    """If this fails on a newer TF, offload may become possible: revisit
    `ParallelStrategy(offload=...)` and the README."""
    repro = Path(__file__).with_name("dtensor_offload_repro.py")
    result = subprocess.run([sys.executable, str(repro)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {
        "host_mesh": "same devices",
        "copy_sharded": "fails: inconsistent with the provided layout",
        "copy_replicated": "works: ['data']"}


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+master"])
def test_offload_on_a_cpu_mesh_is_refused(offload):
    with pytest.raises(ValueError, match=(
            rf"offload='{re.escape(offload)}'.*nothing to offload to.*"
            r"Received: mesh=")):
        tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), fsdp=True,
                               offload=offload)


def test_unknown_offload_value_is_refused():
    with pytest.raises(ValueError, match=r"one of \[None, 'optimizer', "
                       r"'optimizer\+master'\]. Received: offload='cpu'"):
        tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), offload="cpu")
