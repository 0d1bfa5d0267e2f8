#!/usr/bin/env python3
"""Set up a virtual environment and run the demo, the tests or the benchmarks.

    python3 dev.py demo     # trains a data x model parallel model on 8 virtual CPUs
    python3 dev.py test     # runs the test suite (fast profile: what CI runs)
    python3 dev.py test-all # also the slow sweeps (keras-hub matrices, fuzzing);
                            # first makes .venv-transformers (torch, transformers:
                            # requirements-transformers.txt) for Hugging Face's logits
    python3 dev.py fuzz     # the long property-based fuzzing profile; prints
                            # the cases tried per property (TFPAR_FUZZ_EXAMPLES,
                            # default 25 per property)
    python3 dev.py bench    # runs benchmarks/step_time.py
    python3 dev.py docs     # builds the documentation site into site/ (warnings are errors)

Needs only Python 3.10+: the first run creates .venv/ and installs tfpar with
its dependencies (TensorFlow, Keras) into it.
"""

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
STAMP = VENV / ".tfpar-installed"

# The tests run in one pytest worker per core (pytest-xdist, at most 4: each
# worker holds its own 8 virtual CPUs and compiled programs), a test file per
# worker at a time so that module fixtures are built once. A single test
# process uses about one core (tracing and DTensor's compiler are serial).
WORKERS = ["-n", str(max(1, min(4, os.cpu_count() or 1))), "--dist", "loadfile"]

COMMANDS = {
    "demo": ["examples/quickstart.py"],
    "test": ["-m", "pytest", "-q", "--durations=30", *WORKERS],
    "test-all": ["-m", "pytest", "-q", "--durations=30", *WORKERS,
                 "-m", "slow or not slow"],
    "fuzz": ["-m", "pytest", "-q", "-m", "slow", "-k", "fuzz and long",
             "--hypothesis-show-statistics", "tests"],
    "bench": ["benchmarks/step_time.py"],
    "docs": ["-m", "mkdocs", "build", "--strict"],  # mkdocs.yml, docs/
}


def ensure_venv():
    if not PYTHON.exists():
        print(f"creating {VENV} ...", flush=True)
        venv.create(VENV, with_pip=True)
    manifest = (ROOT / "pyproject.toml").stat().st_mtime
    if not STAMP.exists() or STAMP.stat().st_mtime < manifest:
        print("installing tfpar and its dependencies ...", flush=True)
        subprocess.run(
            [str(PYTHON), "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]"],
            check=True,
        )
        STAMP.touch()


TRANSFORMERS_VENV = ROOT / ".venv-transformers"
TRANSFORMERS_REQUIREMENTS = ROOT / "requirements-transformers.txt"


def ensure_transformers_venv():
    """The slow profile's second environment: torch and transformers as
    pinned in requirements-transformers.txt, apart from .venv (TensorFlow
    and torch are not imported in one process). Returns its Python, which
    tests/test_transformers_logits.py runs Hugging Face's models with."""
    python = TRANSFORMERS_VENV / PYTHON.relative_to(VENV)
    stamp = TRANSFORMERS_VENV / ".tfpar-installed"
    if not python.exists():
        print(f"creating {TRANSFORMERS_VENV} ...", flush=True)
        venv.create(TRANSFORMERS_VENV, with_pip=True)
    manifest = TRANSFORMERS_REQUIREMENTS.stat().st_mtime
    if not stamp.exists() or stamp.stat().st_mtime < manifest:
        print("installing torch and transformers ...", flush=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r",
                        str(TRANSFORMERS_REQUIREMENTS)], check=True)
        stamp.touch()
    return python


def main(argv):
    if len(argv) < 1 or argv[0] not in COMMANDS:
        print(__doc__)
        return 2
    ensure_venv()
    env = dict(os.environ)
    if argv[0] == "test-all":  # tests/test_transformers_logits.py
        env["TFPAR_TRANSFORMERS_PYTHON"] = str(ensure_transformers_venv())
    command = [str(PYTHON), *COMMANDS[argv[0]], *argv[1:]]
    return subprocess.run(command, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
