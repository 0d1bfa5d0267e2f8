"""A custom training loop under `tfpar.on_preemption` on two hosts
(tests/test_preemption.py).

    python -m tfpar.launch --hosts 2 --virtual-cpus 4 \
        preemption_loop_child.py MODE WORKDIR

Trains `preemption_loop`'s loop (Adam, `strategy.run`) on data=8 across
both hosts from WORKDIR/given.npz for STEPS steps, saving to WORKDIR/preempt.
MODE "preempt": at the end of step 2 host 0 sends SIGTERM to the launcher
(its parent) and waits until the forwarded signal has reached its own
handler (before its second step is reported); the hosts agree on step 3
at the earliest, later when one hears the other's proposal late (a loaded
machine). Each host writes WORKDIR/loop-preempt-host<I>.npz (saved step,
weights at the save). MODE "race": as "preempt", and host 1, a step behind
host 0 (TF runs a step asynchronously: host 0's loop may report step 2
before host 1 reports step 1), reports step 1 only 2 s after the forwarded
signal reached it, and takes a proposal from host 0 only once its own
loop has saved: the hosts agree all the same (on step 3); each writes
WORKDIR/loop-race-host<I>.npz. MODE "resume": each host writes
WORKDIR/loop-resume-host<I>.npz (restored step, weights on entering),
trains to the end and writes WORKDIR/loop-end-host<I>.npz (the losses it
ran and the final weights). Every file is written whole or not at all.
"""

import contextlib
import os
import signal
import sys
import time

import tfpar

tfpar.connect_hosts(heartbeat_timeout=60)

import numpy as np  # noqa: E402

import preemption_loop  # noqa: E402

STEPS = 12
mode, workdir = sys.argv[1], sys.argv[2]
host = tfpar.hosts.host_id()
given = np.load(os.path.join(workdir, "given.npz"))
strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
model = preemption_loop.compiled_mlp(
    strategy, [given[f"w{i}"] for i in range(6)])


def record(name, step, **arrays):
    """Writes WORKDIR/loop-NAME-host<I>.npz whole or not at all (a
    temporary file renamed): a host killed while writing leaves none."""
    path = os.path.join(workdir, f"loop-{name}-host{host}.npz")
    with open(f"{path}.tmp", "wb") as file:
        np.savez(file, step=-1 if step is None else step, **arrays,
                 **{f"w{i}": w for i, w in enumerate(model.get_weights())})
    os.replace(f"{path}.tmp", path)


def preempt_after_step_2(step):
    if mode == "race" and host == 1 and step == 0:
        wait_until(lambda: guard.requested, "the forwarded SIGTERM")
        time.sleep(2)  # host 0 (done with step 2) proposes first
    if mode not in ("preempt", "race") or host != 0 or step != 1:
        return
    os.kill(os.getppid(), signal.SIGTERM)  # the launcher forwards it
    wait_until(lambda: guard.requested, "the forwarded SIGTERM")


def wait_until(condition, what, seconds=60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.05)


def hear_proposals_after_the_loop(watch):
    """This host takes another host's proposed step only once its own
    loop has saved (or after 20 s)."""
    heard = watch.on_preempt

    def late(target):
        if target:
            with contextlib.suppress(AssertionError):
                wait_until(lambda: guard.preempted, "the save", 20)
        heard(target)

    watch.on_preempt = late


with tfpar.on_preemption(os.path.join(workdir, "preempt"), model) as guard:
    if mode == "race" and host == 1:
        hear_proposals_after_the_loop(tfpar.host_watch.current())
    if mode == "resume":
        record("resume", guard.restored_step)
    losses = preemption_loop.train(strategy, model, given["x"], given["y"],
                                   STEPS, guard, preempt_after_step_2)
if mode in ("preempt", "race"):
    print(f"host {host} preempted={guard.preempted} saved step "
          f"{guard.saved_step}", flush=True)
    record(mode, guard.saved_step)
else:
    record("end", guard.step, losses=losses)
print(f"host {host} {mode} done", flush=True)
