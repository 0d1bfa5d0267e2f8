"""The benchmark scripts the docs quote run from a fresh process.

`benchmarks/compare_commits.py` (docs/benchmarks.md, "Step overhead across
commits") stopped running once the strategy's patches imported keras-hub:
run as a script, its folder comes first on the path, and the folder's
keras_hub.py (a benchmark, now hub_model_plans.py) shadowed the package.
Nothing ran it, so nothing saw. This runs it as the docs do, on this checkout
against itself, at the smallest size (slow: two subprocesses of TensorFlow),
and checks (fast) that no benchmark's file is named like a module this
environment imports.
"""

import json
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


# -- no benchmark file is named like an importable module ---------------------

# Run as a script, a benchmark's folder is sys.path[0]: a file there named like
# an installed or standard module (benchmarks/keras_hub.py, once) is what
# `import <name>` finds, in the benchmark and in every library it imports.
# find_spec runs in a fresh interpreter of this environment (this process may
# have imported benchmarks already, or put their folder on its path), with the
# benchmarks' folder taken off the path so a benchmark cannot find itself.
_FIND_SPECS = """
import importlib.util, json, os, sys
folder = os.path.abspath(sys.argv[1])
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != folder]
specs = {name: importlib.util.find_spec(name) for name in sys.argv[2:]}
print(json.dumps({name: spec.origin for name, spec in specs.items() if spec}))
"""
# Names the check must report (installed, standard library, built in) and
# one it must not: without them, a probe that never finds anything would pass.
_MUST_FIND = ("keras_hub", "statistics", "sys")
_MUST_NOT_FIND = "tfpar_no_such_module_for_this_test"


def importable_elsewhere(names):
    """{name: origin} of `names` that this environment imports from outside
    benchmarks/ (site-packages, editable installs, the standard library,
    built-in modules, PYTHONPATH)."""
    benchmarks = os.path.join(ROOT, "benchmarks")
    done = subprocess.run(
        [sys.executable, "-c", _FIND_SPECS, benchmarks, *names],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_no_benchmark_file_is_named_like_an_importable_module():
    stems = sorted(name[:-3] for name in os.listdir(
        os.path.join(ROOT, "benchmarks")) if name.endswith(".py"))
    assert "step_time" in stems and len(stems) >= 10, stems  # read the folder
    found = importable_elsewhere([*stems, *_MUST_FIND, _MUST_NOT_FIND])
    assert set(_MUST_FIND) <= set(found) and _MUST_NOT_FIND not in found, found
    shadowing = {stem: found[stem] for stem in stems if stem in found}
    assert not shadowing, (
        f"benchmarks/ holds files named like importable modules: {shadowing}. "
        "Run as a script, a benchmark's folder comes first on sys.path, so "
        "`import <name>` would load the benchmark instead (in the benchmark "
        "and in every library it imports). Rename the file (git mv) to a "
        "name no installed or standard module has.")
