"""A ParallelStrategy survives a reset TF eager context.

TF's, Keras' and DTensor's test classes reset the eager context between
tests (`context._reset_context()`, then new logical devices; DTensor's also
drop its device). A strategy created afterwards must train as in a fresh
process, and one from before must say it belongs to the reset context.
The resets run in a child process (`reset_context_child.py`) so they cannot
disturb the other tests of this process.
"""

import os
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).with_name("reset_context_child.py")


def test_strategy_after_several_context_resets_trains_in_parity():
    result = subprocess.run([sys.executable, str(CHILD)], env=dict(os.environ),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines()
            if line.startswith("round")] == [
        f"round {i}: parity after reset" for i in range(4)]
