"""Preemption and the step watchdog through the launcher (issue 38).

SIGTERM to the launcher (host 0 sends it to its parent at the end of
step 2): forwarded to both hosts, which save one checkpoint at one agreed
step under `tfpar.PreemptionCheckpoint`; the next start restores that step
and those weights. A host that never begins a step ends the job within the
step timeout (every step on several hosts is watched: TFPAR_STEP_TIMEOUT),
named; a host that exits cleanly (under a `StepWatchdog`) is named so.

Custom loops (`tfpar.on_preemption`, the loop of tests/preemption_loop.py):
on one process a real SIGTERM at step 3 saves step 3 and stops; the next
loop restores those weights bit for bit and ends in parity with one
device's uninterrupted run (Adam: its state is restored too). On two hosts
(tests/preemption_loop_child.py) both save one agreed step and resume, also
when one host's loop runs a step behind the other's (TF runs a step
asynchronously) and hears the other's proposal late.
"""

import contextlib
import os
import re
import signal
import zipfile

import keras
import numpy as np
import pytest

import fuzzing
import models
import preemption_loop
import tfpar
from test_launch import TESTS, launch, workdir  # noqa: F401 (fixture)
from tfpar import hosts, preemption

LOOP_CHILD = TESTS / "preemption_loop_child.py"


def host_result(workdir, name, out):
    """`np.load` of a host's result file WORKDIR/NAME.npz. A missing or
    unreadable one (a host killed at the end of the launcher's grace period
    writes none) fails the test with the files there and the launch's
    output (every host's, prefixed), not a bare FileNotFoundError."""
    path = workdir / f"{name}.npz"
    try:
        result = np.load(path)
        return {key: result[key] for key in result.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        files = sorted(p.name for p in workdir.iterdir())
        pytest.fail(f"{path.name}: {error!r}. Files: {files}. Output:\n"
                    f"{out[-12000:]}")


@pytest.mark.slow  # two launches of two TF processes
def test_sigterm_saves_every_host_at_one_step_and_the_job_resumes(workdir):
    status, out, _ = launch(workdir, "preempt")
    assert status == 128 + signal.SIGTERM, out[-4000:]
    assert "[launch] received SIGTERM: forwarded to every host" in out
    assert "restarting" not in out
    saved = [host_result(workdir, f"preempt-host{h}-attempt0", out)
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
        resumed = host_result(workdir, f"resume-host{h}-attempt0", out)
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


# -- custom loops: tfpar.on_preemption ----------------------------------------

LOOP_STEPS = 8  # 128 rows, batch 16: one pass


def loop_start():
    """The loop tests' first weights and data."""
    keras.utils.set_random_seed(0)
    weights = models.host_mlp().get_weights()
    return weights, *models.mlp_data(n=128)


def uninterrupted(weights, x, y, steps):
    """One device's (losses, weights) of the loop run without a stop, and
    the same in float64 (the Adam check's `exact`, fuzzing.assert_parity)."""
    runs = []
    for dtype in ("float32", "float64"):
        with fuzzing.float64_policy() if dtype == "float64" else \
                contextlib.nullcontext():
            model = preemption_loop.compiled_mlp(
                None, [w.astype(dtype) for w in weights])
            losses = preemption_loop.train(None, model, x.astype(dtype),
                                           y.astype(dtype), steps)
            runs.append((losses, model.get_weights()))
    return runs


def test_a_custom_loop_saves_at_the_signal_and_resumes_in_parity(tmp_path):
    weights, x, y = loop_start()
    directory = str(tmp_path / "preempt")
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2}, devices=["CPU:0", "CPU:1"]))
    before = signal.getsignal(signal.SIGTERM)
    model = preemption_loop.compiled_mlp(strategy, weights)

    def preempt_at_step_3(step):
        if step == 2:  # the third step
            os.kill(os.getpid(), signal.SIGTERM)

    with tfpar.on_preemption(directory, model) as guard:
        assert signal.getsignal(signal.SIGTERM) != before
        assert guard.restored_step is None and guard.start_step == 0
        first = preemption_loop.train(strategy, model, x, y, LOOP_STEPS,
                                      guard, preempt_at_step_3)
    assert signal.getsignal(signal.SIGTERM) == before  # restored on exit
    # One host: saved at the end of the step the signal came in, stopped.
    assert guard.requested and guard.preempted and guard.saved_step == 3
    assert len(first) == 3 and guard.step == 3
    assert tfpar.latest_checkpoint(directory).endswith("ckpt-3")
    saved = model.get_weights()

    resumed_model = preemption_loop.compiled_mlp(strategy, weights)
    with tfpar.on_preemption(directory, resumed_model) as resumed:
        assert resumed.restored_step == 3 and resumed.start_step == 3
        for got, want in zip(resumed_model.get_weights(), saved):
            np.testing.assert_array_equal(got, want)  # bit for bit
        rest = preemption_loop.train(strategy, resumed_model, x, y,
                                     LOOP_STEPS, resumed)
    assert not resumed.preempted and resumed.step == LOOP_STEPS
    (want_losses, want_weights), exact = uninterrupted(weights, x, y,
                                                       LOOP_STEPS)
    fuzzing.assert_parity(want_losses, np.concatenate([first, rest]),
                          want_weights, resumed_model.get_weights(),
                          exact=exact)


def test_on_preemption_refuses_bad_input(tmp_path):
    model = models.host_mlp()
    with pytest.raises(ValueError, match=r"has no optimizer: compile it.*"
                       r"Received: model='mlp'"):
        tfpar.on_preemption(str(tmp_path), model)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"directory.*Received: directory="
                       r"PosixPath"):
        tfpar.on_preemption(tmp_path, model)
    with pytest.raises(ValueError, match=r"needs the Keras model.*"
                       r"Received: model=None"):
        tfpar.on_preemption(str(tmp_path), None)
    with pytest.raises(ValueError, match=r"signals=.*Received: signals="):
        tfpar.on_preemption(str(tmp_path), model, signals=("TERM",))
    guard = tfpar.on_preemption(str(tmp_path), model)
    with pytest.raises(RuntimeError, match=r"inside `with tfpar.on_preemp"):
        guard.step_end()


@pytest.mark.slow  # two launches of two TF processes
def test_a_custom_loop_on_two_hosts_saves_one_step_and_resumes(workdir):
    status, out, _ = launch(workdir, "preempt", child=LOOP_CHILD)
    assert status == 128 + signal.SIGTERM, out[-4000:]
    assert "[launch] received SIGTERM: forwarded to every host" in out
    saved = [host_result(workdir, f"loop-preempt-host{h}", out)
             for h in (0, 1)]
    # The agreed step: the same on both hosts. Host 0 signals before its
    # second step is reported (`after_step` runs before `step_end`) and
    # proposes 2 + the 2-step margin = 4, unless host 1 proposed 1 + 2 = 3
    # first; host 1 cannot report step 3 (and propose 5) before host 0 has
    # begun it, i.e. before it has host 0's proposal. (5 and 6 were seen
    # while a loop counted steps as their calls returned, before their
    # collectives: see the race test below.)
    step = int(saved[0]["step"])
    assert step in (3, 4) and int(saved[1]["step"]) == step, out[-4000:]
    for h in (0, 1):
        assert f"host {h} preempted=True saved step {step}" in out, (
            out[-4000:])
    assert tfpar.latest_checkpoint(str(workdir / "preempt")).endswith(
        f"ckpt-{step}")
    status, out, _ = launch(workdir, "resume", child=LOOP_CHILD)
    assert status == 0, out[-4000:]
    given = np.load(workdir / "given.npz")
    weights = [given[f"w{i}"] for i in range(6)]
    (want_losses, want_weights), exact = uninterrupted(
        weights, given["x"], given["y"], 12)
    for h in (0, 1):
        resumed = host_result(workdir, f"loop-resume-host{h}", out)
        assert int(resumed["step"]) == step
        for i in range(6):
            np.testing.assert_array_equal(resumed[f"w{i}"], saved[h][f"w{i}"])
        end = host_result(workdir, f"loop-end-host{h}", out)
        assert int(end["step"]) == 12
        # Steps step..11 after the restore: as the uninterrupted run's.
        fuzzing.assert_parity(want_losses[step:], end["losses"],
                              want_weights, [end[f"w{i}"] for i in range(6)],
                              exact=(exact[0][step:], exact[1]))


@pytest.mark.slow  # one launch of two TF processes
def test_hosts_agree_when_one_loop_runs_behind_and_hears_late(workdir):
    # Host 0's loop reports step 2 (its step calls return before their
    # collectives complete) while host 1's reports step 1 only 2 s after
    # the signal, and host 1 takes host 0's proposals only once its own
    # loop has saved. Host 0 must wait for its step 2's collectives (which
    # need host 1's step 2, begun after host 1 proposed step 1 + 2 = 3)
    # before counting it: it then knows step 3 and proposes nothing. It
    # used to count it at once and propose 4 while host 1 saved at 3; each
    # then waited for the other in a collective until the launcher's grace
    # period ended and killed both (no result file: the flaky failures of
    # the test above, at ~70 s).
    status, out, _ = launch(workdir, "race", "--signal-grace", "30",
                            child=LOOP_CHILD)
    assert status == 128 + signal.SIGTERM, out[-4000:]
    assert "did not exit within 30 s: killed" not in out, out[-4000:]
    saved = [host_result(workdir, f"loop-race-host{h}", out) for h in (0, 1)]
    assert [int(result["step"]) for result in saved] == [3, 3], out[-4000:]
    assert tfpar.latest_checkpoint(str(workdir / "preempt")).endswith(
        "ckpt-3")


def test_a_host_past_the_agreed_step_stops_with_a_clear_error():
    # A peer's proposed step heard once this host has finished it (what the
    # agreement rules out): an error naming both steps, not a save at a
    # step the other hosts never reach (they would wait for it forever).
    agreement = preemption.PreemptionAgreement(signals=())
    agreement.begin(0)
    try:
        for _ in range(4):
            assert not agreement.step_end()
        agreement._heard(4)  # noqa: SLF001 (the peer hook)
        with pytest.raises(RuntimeError, match=r"has finished step 5, past "
                           r"the step 4 the hosts agreed to save at"):
            agreement.step_end()
    finally:
        agreement.uninstall()


# -- reuse for a second run, and bad arguments ---------------------------------

def kill_at(step):
    """A callable sending this process SIGTERM after step `step` (0-based,
    counted over the whole run as the loop's `after_step` counts)."""
    def after_step(current):
        if current == step:
            os.kill(os.getpid(), signal.SIGTERM)
    return after_step


def test_a_reused_guard_restores_counts_and_saves_afresh(tmp_path):
    """One guard, two `with` runs: the second restores the first's save
    (step 3), counts from it and saves at its own signal (step 6); the
    steps of both runs are one device's 6 steps (losses and Adam weights)."""
    weights, x, y = loop_start()
    directory = str(tmp_path / "preempt")
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2}, devices=["CPU:0", "CPU:1"]))
    model = preemption_loop.compiled_mlp(strategy, weights)
    guard = tfpar.on_preemption(directory, model)
    with guard:
        first = preemption_loop.train(strategy, model, x, y, LOOP_STEPS,
                                      guard, kill_at(2))
    assert guard.saved_step == 3 and len(first) == 3
    model.set_weights([np.zeros_like(w) for w in weights])  # the restore's
    with guard:
        assert guard.restored_step == 3 and guard.start_step == 3
        assert not guard.preempted and not guard.requested
        assert guard.saved_step is None and guard.step == 3
        second = preemption_loop.train(strategy, model, x, y, LOOP_STEPS,
                                       guard, kill_at(5))
    assert guard.preempted and guard.saved_step == 6 and guard.step == 6
    assert len(second) == 3
    assert tfpar.latest_checkpoint(directory).endswith("ckpt-6")
    (want_losses, want_weights), exact = uninterrupted(weights, x, y, 6)
    fuzzing.assert_parity(want_losses, np.concatenate([first, second]),
                          want_weights, model.get_weights(), exact=exact)


class KillAtBatch(keras.callbacks.Callback):
    """SIGTERM to this process at the end of batch `batch` of a fit (before
    the preemption callback's step end: it comes first in the list)."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)


def batch_losses(running_means):
    """Each batch's loss from Keras' logged running means over a fit (equal
    batches): loss_k = (k + 1) m_k - k m_(k-1)."""
    means = np.asarray(running_means, "float64")
    totals = means * np.arange(1, len(means) + 1)
    return np.diff(totals, prepend=0.0)


def test_a_reused_callback_restores_counts_and_saves_afresh(tmp_path):
    """One PreemptionCheckpoint, two fits: the second restores the first's
    save (step 3), counts from it and saves at its own signal (step 6),
    and the 6 steps are one device's."""
    weights, x, y = loop_start()
    directory = str(tmp_path / "preempt")
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2}, devices=["CPU:0", "CPU:1"]))
    model = preemption_loop.compiled_mlp(strategy, weights)
    callback = tfpar.PreemptionCheckpoint(directory)
    before = signal.getsignal(signal.SIGTERM)
    losses = []
    for start, kill in ((0, 2), (3, 2)):  # steps 0..2, then 3..5
        recorded = models.BatchLosses()
        rows = slice(start * preemption_loop.BATCH, None)
        model.fit(x[rows], y[rows], batch_size=preemption_loop.BATCH,
                  shuffle=False, verbose=0,
                  callbacks=[recorded, KillAtBatch(kill), callback])
        assert signal.getsignal(signal.SIGTERM) == before
        assert callback.restored_step == (start or None)
        assert callback.preempted and callback.saved_step == start + 3
        losses.extend(batch_losses(recorded.losses))
        model.set_weights([np.zeros_like(w) for w in weights])  # restored
    assert tfpar.latest_checkpoint(directory).endswith("ckpt-6")
    tfpar.restore_checkpoint(model, directory)
    (want_losses, want_weights), exact = uninterrupted(weights, x, y, 6)
    fuzzing.assert_parity(want_losses, np.array(losses), want_weights,
                          model.get_weights(), exact=exact)


def test_the_constructors_refuse_bad_arguments_before_training(tmp_path):
    """Each bad argument of PreemptionCheckpoint, PreemptionGuard and
    on_preemption: a ValueError naming the caller and argument, what came
    and what to pass, from the constructor (nothing installed)."""
    model = models.host_mlp()
    model.compile(optimizer="sgd", loss="mse")
    directory = str(tmp_path)
    bad = [  # (keyword arguments, the error's pattern)
        ({"directory": tmp_path}, r"\(directory=\.\.\.\) needs a directory "
         r"path \(a non-empty str, e\.g\. str\(path\)\).*Received: "
         r"directory=PosixPath"),
        ({"directory": ""}, r"\(directory=\.\.\.\).*Received: directory=''"),
        ({"resume": "yes"}, r"\(resume=\.\.\.\) is True or False\. "
         r"Received: resume='yes'"),
        ({"signals": ("TERM",)}, r"\(signals=\.\.\.\) is a sequence of "
         r"signal numbers.*Received: signals=\('TERM',\)"),
        ({"signals": signal.SIGTERM}, r"\(signals=\.\.\.\) is a sequence"
         r".*Received: signals=<Signals\.SIGTERM"),
        ({"signals": (signal.SIGTERM, signal.SIGKILL)}, r"\(signals=\.\.\.\)"
         r" cannot catch SIGKILL.*e\.g\. \(signal\.SIGTERM, signal\.SIGINT"
         r"\)\. Received: signals="),
    ]
    makers = {
        "PreemptionCheckpoint": lambda **kw: tfpar.PreemptionCheckpoint(
            **{"directory": directory, **kw}),
        "PreemptionGuard": lambda **kw: tfpar.preemption.PreemptionGuard(
            **{"directory": directory, "model": model, **kw}),
        "on_preemption": lambda **kw: tfpar.on_preemption(
            **{"directory": directory, "model": model, **kw}),
    }
    handlers = {number: signal.getsignal(number) for number in
                tfpar.preemption.SIGNALS}
    for caller, make in makers.items():
        for arguments, pattern in bad:
            with pytest.raises(ValueError, match=re.escape(caller) + pattern):
                make(**arguments)
    for caller in ("PreemptionGuard", "on_preemption"):
        with pytest.raises(ValueError, match=re.escape(caller) + r"\(model="
                           r"\.\.\.\) needs the Keras model.*Received: "
                           r"model=None"):
            makers[caller](model=None)
        with pytest.raises(ValueError, match=re.escape(caller) + r"\(model="
                           r"\.\.\.\) saves the model with its optimizer's"
                           r".*Received: model='mlp'"):
            makers[caller](model=models.host_mlp())
    assert handlers == {number: signal.getsignal(number) for number in
                        tfpar.preemption.SIGNALS}
    makers["PreemptionCheckpoint"]()  # the defaults are good
    makers["PreemptionGuard"]()


class _Fails(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("a step failed")


def test_a_fit_that_raised_leaves_no_handler_behind(tmp_path):
    """A fit that raises skips on_train_end (Keras 3): tfpar's `fit` patch
    ends the callback's run, so the handlers from before are back at once
    (Ctrl-C and SIGTERM work again). A run begun without ending (no fit)
    is ended by the next one's start. A guard entered twice at once is
    refused."""
    model = models.host_mlp()
    model.compile(optimizer="sgd", loss="mse")
    before = {number: signal.getsignal(number) for number in
              tfpar.preemption.SIGNALS}
    callback = tfpar.PreemptionCheckpoint(str(tmp_path / "fit"))
    x, y = np.zeros((8, 16), "float32"), np.zeros((8, 3), "float32")
    with pytest.raises(RuntimeError, match="a step failed"):
        model.fit(x, y, batch_size=4, verbose=0,
                  callbacks=[callback, _Fails()])
    assert before == {number: signal.getsignal(number) for number in
                      tfpar.preemption.SIGNALS}
    callback.on_train_begin()  # begun by hand, never ended
    callback.on_train_begin()
    callback.on_train_end()
    assert before == {number: signal.getsignal(number) for number in
                      tfpar.preemption.SIGNALS}
    guard = tfpar.on_preemption(str(tmp_path / "loop"), model)
    with guard:
        with pytest.raises(RuntimeError, match=r"already entered: one "
                           r"`with` at a time"):
            guard.__enter__()
    assert before == {number: signal.getsignal(number) for number in
                      tfpar.preemption.SIGNALS}
