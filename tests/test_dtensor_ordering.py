"""Why tfpar turns off DTensor's all-reduce combiner (see tfpar/__init__.py).

On TF 2.21 the combiner makes a step read a variable before its own update
(Keras metrics report stale values, Adam diverges under data parallelism).
If this test starts failing on a newer TF because the default is fixed, the
workaround in tfpar/__init__.py can go.
"""

import os
import subprocess
import sys
from pathlib import Path

REPRO = Path(__file__).with_name("dtensor_ordering_repro.py")


def run_repro(combiner):
    env = dict(os.environ,
               DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=combiner)
    result = subprocess.run([sys.executable, str(REPRO)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_combiner_reads_stale_values_and_tfpar_setting_fixes_it():
    assert run_repro("1").startswith("stale")
    assert run_repro("0") == "fresh"


def test_importing_tfpar_turns_the_combiner_off():
    assert os.environ["DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"] == "0"
