"""Communication you can check: collectives in the compiled MLP steps.

Megatron's MLP pair (column -> row) needs exactly one all-reduce in the
forward pass (summing the row-parallel partial products) and one in the
backward pass (summing the column-parallel input gradients), except that
the first pair's input is data and needs no gradient. Two pairs on
Mesh({"model": 8}) therefore give 2 all-reduces to predict and 2 + 1 to
train. The count is read from DTensor's SPMD-expanded functions, dumped by
TF in a child process (TF reads TF_DUMP_GRAPH_PREFIX once, at start).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).with_name("collectives_child.py")


def test_megatron_mlp_pairs_need_one_all_reduce_each_way(tmp_path):
    env = dict(os.environ, TF_DUMP_GRAPH_PREFIX=str(tmp_path),
               TF_DUMP_GRAPH_NAME_FILTER="*")
    result = subprocess.run([sys.executable, str(CHILD)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts["predict"] == {"CollectiveReduceV2": 2}
    assert counts["train"] == {"CollectiveReduceV2": 3}
