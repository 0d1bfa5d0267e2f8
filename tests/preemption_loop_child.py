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
machine). Each host writes
WORKDIR/loop-preempt-host<I>.npz (saved step, weights at the save). MODE
"resume": each host writes WORKDIR/loop-resume-host<I>.npz (restored step,
weights on entering), trains to the end and writes
WORKDIR/loop-end-host<I>.npz (the losses it ran and the final weights).
"""

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
    np.savez(os.path.join(workdir, f"loop-{name}-host{host}.npz"),
             step=-1 if step is None else step, **arrays,
             **{f"w{i}": w for i, w in enumerate(model.get_weights())})


def preempt_after_step_2(step):
    if mode != "preempt" or host != 0 or step != 1:
        return
    os.kill(os.getppid(), signal.SIGTERM)  # the launcher forwards it
    deadline = time.monotonic() + 60
    while not guard.requested:
        assert time.monotonic() < deadline, "the forwarded SIGTERM never came"
        time.sleep(0.05)


with tfpar.on_preemption(os.path.join(workdir, "preempt"), model) as guard:
    if mode == "resume":
        record("resume", guard.restored_step)
    losses = preemption_loop.train(strategy, model, given["x"], given["y"],
                                   STEPS, guard, preempt_after_step_2)
if mode == "preempt":
    print(f"host {host} preempted={guard.preempted} saved step "
          f"{guard.saved_step}", flush=True)
    record("preempt", guard.saved_step)
else:
    record("end", guard.step, losses=losses)
print(f"host {host} {mode} done", flush=True)
