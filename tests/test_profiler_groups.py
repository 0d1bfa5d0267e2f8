"""`PipelineModel(record_timeline=True)` forms every collective group of its
step before TF's profiler starts.

TF 2.21's profiler aborts the process now and then when a group of devices
forms while it runs (`tests/tf_profiler_crash_repro.py`: within seconds for
fresh groups; docs/guides/robustness.md, "The native abort, found"). Which
groups form when is read from TF's own log (a group forming logs one
`CompleteGroupLocal` line per member), so this test does not wait for the
abort's luck: without `form_collective_groups` the profiled step forms its
groups, with it none.
"""

import os
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).with_name("profiler_groups_child.py")
FORMING = "collective_param_resolver_local.cc"  # and "CompleteGroupLocal"


def start_child(*flags):
    """The child started with TF's log of forming groups on (`collect`
    reads it); children started one after the other run together."""
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith("TF_CPP_")}
    environment.update(TF_CPP_MIN_LOG_LEVEL="0",
                       TF_CPP_VMODULE="collective_param_resolver_local=1")
    return subprocess.Popen([sys.executable, str(CHILD), *flags],
                            env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


# SIGSEGV, SIGABRT: TF's native abort at the profiler's stop.
NATIVE_ABORT = (-11, -6)


def collect(child, may_abort=False):
    """(group-forming log lines before the profiler ran, inside it).
    `may_abort`: the child forms groups while the profiler runs, so TF's
    native abort may end it when the profiler stops (the crash the forming
    first avoids, `tests/tf_profiler_crash_repro.py`; it ended CI's child
    once, 2026-12-08): then it must have reached the stop."""
    stdout, stderr = child.communicate(timeout=600)
    if not (may_abort and child.returncode in NATIVE_ABORT):
        assert child.returncode == 0, stderr[-3000:]
        # 2 stages x 2 micro-batches x F/B (printed after the stop)
        assert "TIMELINE 8" in stdout, stdout
    before, inside, where = [], [], None
    for line in stderr.splitlines():
        if "TFPAR-PROFILER-STARTED" in line:
            where = inside
        elif "TFPAR-PROFILER-STOPPING" in line:
            where = None
        elif FORMING in line and "CompleteGroupLocal" in line:
            (before if where is None else where).append(line)
    assert "TFPAR-PROFILER-STOPPING" in stderr
    return before, inside


def test_record_timeline_forms_collective_groups_before_profiling():
    formed, unformed = start_child(), start_child("--no-form")
    before, inside = collect(formed)
    assert before and not inside, inside[:3]
    # The same step without forming first: its groups form while TF's
    # profiler runs (so the check above can fail).
    _, inside = collect(unformed, may_abort=True)
    assert inside
