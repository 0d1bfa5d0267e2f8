"""Preemption and the step watchdog through the launcher (issue 38).

SIGTERM to the launcher (host 0 sends it to its parent at the end of
step 2): forwarded to both hosts, which save one checkpoint at one agreed
step under `tfpar.PreemptionCheckpoint`; the next start restores that step
and those weights. A host that never begins a step ends the job within the
`StepWatchdog` timeout, named; a host that exits cleanly is named so.
"""

import os
import signal

import numpy as np
import pytest

import tfpar
from test_launch import launch, workdir  # noqa: F401 (fixture)
from tfpar import hosts


@pytest.mark.slow  # two launches of two TF processes
def test_sigterm_saves_every_host_at_one_step_and_the_job_resumes(workdir):
    status, out, _ = launch(workdir, "preempt")
    assert status == 128 + signal.SIGTERM, out[-4000:]
    assert "[launch] received SIGTERM: forwarded to every host" in out
    assert "restarting" not in out
    saved = [np.load(workdir / f"preempt-host{h}-attempt0.npz")
             for h in (0, 1)]
    step = int(saved[0]["step"])
    assert step == int(saved[1]["step"]) and 2 < step < 12, out[-4000:]
    assert f"host 0 preempted=True saved step {step}" in out
    assert f"host 1 preempted=True saved step {step}" in out
    assert tfpar.latest_checkpoint(str(workdir / "preempt")).endswith(
        f"ckpt-{step}")
    status, out, _ = launch(workdir, "resume")
    assert status == 0, out[-4000:]
    for h in (0, 1):
        resumed = np.load(workdir / f"resume-host{h}-attempt0.npz")
        assert int(resumed["step"]) == step
        for i in range(6):
            np.testing.assert_array_equal(resumed[f"w{i}"], saved[h][f"w{i}"])


def launch_with_step_timeout(workdir, mode, seconds):
    os.environ["STEP_TIMEOUT"] = str(seconds)
    try:
        return launch(workdir, mode, "--grace", "120", heartbeat=600)
    finally:
        del os.environ["STEP_TIMEOUT"]


@pytest.mark.slow
def test_a_host_that_never_begins_a_step_is_named_within_the_timeout(
        workdir):
    status, out, seconds = launch_with_step_timeout(workdir, "hang", 40)
    assert status == hosts.LOST_HOST_EXIT_CODE, out[-4000:]
    assert "[host 0] " in out and "step 3 did not finish within 40 s" in out
    assert "host 1 (localhost:" in out and "has not arrived (at step 2)" in out
    # Host 1, asleep in Python, is ended by host 0's "abort".
    assert "[launch] host 1 exited with status 70" in out, out[-4000:]
    assert "host 0 (localhost:" in out and "ended the job" in out
    assert seconds < 300, seconds


@pytest.mark.slow
def test_a_host_that_exits_cleanly_is_named_so(workdir):
    status, out, _ = launch_with_step_timeout(workdir, "exit-early", 60)
    assert status == hosts.LOST_HOST_EXIT_CODE, out[-4000:]
    assert "host 1 exits early" in out
    assert "[launch] host 1 exited with status" not in out  # status 0
    assert "exited cleanly" in out, out[-4000:]
    assert "killed, stopped or unreachable" not in out
