"""The benchmark scripts the docs quote run from a fresh process.

`benchmarks/compare_commits.py` (docs/benchmarks.md, "Step overhead across
commits") stopped running once the strategy's patches imported keras-hub:
run as a script, its folder comes first on the path, and the folder's
keras_hub.py (a benchmark) shadowed the package. Nothing ran it, so nothing
saw. This runs it as the docs do, on this checkout against itself, at the
smallest size (slow: two subprocesses of TensorFlow).
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_compare_commits_runs_and_reports_each_mesh():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "compare_commits.py"),
         "WORKTREE", "WORKTREE", "--pairs", "1", "--rounds", "1",
         "--steps", "2", "--meshes", "data=8"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "data=8     wall clock" in done.stdout, done.stdout[-3000:]
    assert "ops of the compiled train step" in done.stdout
