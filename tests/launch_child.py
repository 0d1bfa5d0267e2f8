"""A training script run by `python -m tfpar.launch` (tests/test_launch.py).

    python -m tfpar.launch --hosts 2 --virtual-cpus 4 [--max-restarts R] \
        launch_child.py MODE WORKDIR

It calls nothing host-specific: `tfpar.connect_hosts()` reads the cluster
from the environment the launcher sets. It trains `models.host_mlp` on
data=8 (both hosts) from WORKDIR/given.npz for 4 epochs with plain SGD,
resuming from `keras.callbacks.BackupAndRestore` (one directory per host),
and writes every batch's loss of this attempt to
WORKDIR/losses-host<I>-attempt<R>.json. On the first attempt host 1 then
misbehaves after epoch 2 as MODE says: "kill" (SIGKILL itself), "stop"
(SIGSTOP itself), "fail" (raise) or "none"; or, after epoch 2, both hosts
save a sharded checkpoint to WORKDIR/checkpoints and host 1 SIGKILLs
itself writing its file (its record of the blocks; on data=8 host 0 writes
the replicated blocks) ("kill-in-save"), or both save it, then
restore it and host 1 SIGKILLs itself reading its first block
("kill-in-restore"); "stop-in-save" and "stop-in-restore" SIGSTOP
instead.

Issue 38 modes: "attacked" (each host writes its ports to
WORKDIR/ports-host<I>.json at the end of the first step and waits there for
WORKDIR/attacked, while the test attacks them), "preempt" (host 0 sends
SIGTERM to the launcher, its parent, at the end of step 2; a
`PreemptionCheckpoint` saves to WORKDIR/preempt and each host writes
WORKDIR/preempt-host<I>-attempt<R>.npz: the saved step and its weights),
"resume" (the next start: the restored step and weights), "hang" (host 1
sleeps before beginning step 3, under a `StepWatchdog` of STEP_TIMEOUT
seconds) and "exit-early" (host 1 exits cleanly before step 3).
"""

import importlib
import json
import os
import signal
import sys
import time

import tfpar

tfpar.connect_hosts(heartbeat_timeout=float(os.environ.get("HEARTBEAT", 60)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import models  # noqa: E402

mode, workdir = sys.argv[1], sys.argv[2]
host, attempt = tfpar.hosts.host_id(), int(os.environ["TFPAR_RESTART"])
given = np.load(os.path.join(workdir, "given.npz"))
losses = []


class Misbehave(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        losses.append(float(logs["loss"]))

    def on_epoch_end(self, epoch, logs=None):
        with open(os.path.join(
                workdir, f"losses-host{host}-attempt{attempt}.json"), "w") as f:
            json.dump(losses, f)
        if epoch == 1 and host == 1 and attempt == 0:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif mode == "fail":
                raise RuntimeError("host 1 fails on purpose")


def die_when_called(module, name):
    """`module.name` replaced by a SIGKILL (SIGSTOP for "stop-in-...") of
    this process."""
    how = signal.SIGSTOP if mode.startswith("stop-") else signal.SIGKILL
    setattr(module, name, lambda *args, **kwargs: os.kill(os.getpid(), how))


class CheckpointThenDie(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch != 1 or attempt != 0 or "-in-" not in mode:
            return
        checkpoint_files = importlib.import_module("tfpar.checkpoint.files")
        directory = os.path.join(workdir, "checkpoints")
        if mode.endswith("-in-save") and host == 1:
            die_when_called(checkpoint_files, "write_file")  # its host record
        tfpar.save_checkpoint(self.model, directory)
        print(f"host {host} saved", flush=True)
        if mode.endswith("-in-restore") and host == 1:
            die_when_called(checkpoint_files, "load_block")
        tfpar.restore_checkpoint(self.model, directory)
        print(f"host {host} restored", flush=True)


class Issue38(keras.callbacks.Callback):
    """The modes of issue 38 (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_begin(self, batch, logs=None):
        if host == 1 and attempt == 0 and self.steps == 2:
            if mode == "hang":
                time.sleep(3600)
            elif mode == "exit-early":
                print("host 1 exits early", flush=True)
                sys.exit(0)

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if mode == "attacked" and self.steps == 1:
            watch = tfpar.host_watch.current()
            with open(os.path.join(workdir, f"ports-host{host}.json"),
                      "w") as f:
                json.dump({"cluster": os.environ["TFPAR_HOSTS"].split(",")[
                    host], "heartbeat": watch.port}, f)
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(workdir, "attacked")):
                assert time.monotonic() < deadline, "never attacked"
                time.sleep(0.2)
        if mode == "preempt" and host == 0 and self.steps == 2:
            os.kill(os.getppid(), signal.SIGTERM)  # the launcher

    def on_train_begin(self, logs=None):
        if mode == "resume":
            record(self.model, preemption.restored_step)


def record(model, step):
    np.savez(os.path.join(workdir, f"{mode}-host{host}-attempt{attempt}.npz"),
             step=-1 if step is None else step,
             **{f"w{i}": w for i, w in enumerate(model.get_weights())})


strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
with strategy.scope():
    model = models.host_mlp()
    model.set_weights([given[f"w{i}"] for i in range(6)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
backup = keras.callbacks.BackupAndRestore(
    os.path.join(workdir, f"backup-host{host}"))
callbacks = [backup, Misbehave(), CheckpointThenDie(), Issue38()]
preemption = tfpar.PreemptionCheckpoint(os.path.join(workdir, "preempt"))
if mode in ("preempt", "resume"):
    callbacks = [preemption, Misbehave(), Issue38()]
if mode in ("hang", "exit-early"):
    callbacks.append(tfpar.StepWatchdog(float(os.environ["STEP_TIMEOUT"])))
model.fit(given["x"], given["y"], batch_size=32, epochs=4, shuffle=False,
          verbose=0, callbacks=callbacks)
if mode == "preempt":
    print(f"host {host} preempted={preemption.preempted} saved step "
          f"{preemption.saved_step}", flush=True)
    record(model, preemption.saved_step)
print(f"host {host} attempt {attempt} done", flush=True)
