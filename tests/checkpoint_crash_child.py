"""Child processes for tfpar.checkpoint's crash-safety and multi-host tests.

usage: checkpoint_crash_child.py DIRECTORY OUT.npz
       checkpoint_crash_child.py hosts HOST_ID ADDR0,ADDR1 WORKDIR

The second form is one host of a two-host job (tests/
test_checkpoint_hardening.py, `two_views`): see `hosts_main`.

The first form:

Trains a small MLP on data=2 x model=4, saves checkpoint 1 completely
(step 4), dumps its weights and optimizer state to OUT.npz, trains one more
epoch and starts saving checkpoint 2 (step 8), killing itself with SIGKILL
right after half of the block files are written (deterministic: the block
writer is wrapped to count). It never returns normally.
"""

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfpar  # noqa: E402
from tfpar import checkpoint  # noqa: E402
from tfpar.checkpoint import files as checkpoint_files  # noqa: E402

RULES = {r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
         r".*down/kernel": ("model", None)}


def main(directory, out):
    tfpar.use_virtual_cpus(8)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=RULES)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((16,)),
             keras.layers.Dense(32, activation="relu", name="up"),
             keras.layers.Dense(16, name="down"),
             keras.layers.Dense(3, name="out")], name="mlp")
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    rng = np.random.RandomState(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = x[:, :3] * 2.0
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    checkpoint.save_checkpoint(model, directory)          # ckpt-4, complete
    np.savez(out, *model.get_weights(),
             *[np.asarray(v) for v in model.optimizer.variables])
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)

    total = len(os.listdir(os.path.join(directory, "ckpt-4"))) - 1  # - manifest
    written = []
    original = checkpoint_files.write_npy

    def write_then_maybe_die(path, array):
        original(path, array)
        written.append(path)
        if len(written) == total // 2:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_files.write_npy = write_then_maybe_die
    checkpoint.save_checkpoint(model, directory)          # ckpt-8: killed
    raise SystemExit("unreachable: the child should have been killed")


def hosts_main(host_id, addresses, workdir):
    """Both hosts save steps 4 and 8 into WORKDIR/shared. Host 1 then sees
    its own stale copy, WORKDIR/view1 (both checkpoints, but its pointer
    names step 4), and restores from it while host 0 restores from
    WORKDIR/shared: both must restore host 0's choice, step 8. Then host
    1's copy loses ckpt-8: both must raise. Results go to
    WORKDIR/host<HOST_ID>.json."""
    import json
    import shutil

    tfpar.use_virtual_cpus(4)
    tfpar.connect_hosts(addresses.split(","), host_id, timeout=120)
    import models

    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=models.HOST_RULES)
    with strategy.scope():
        model = models.host_mlp()

    def version(v):
        return [1000.0 * v + np.arange(int(np.prod(w.shape)), dtype="float32"
                                       ).reshape(w.shape)
                for w in model.weights]

    shared, view = f"{workdir}/shared", f"{workdir}/view1"
    for step, v in ((4, 1), (8, 2)):
        model.set_weights(version(v))
        checkpoint.save_checkpoint(model, shared, optimizer=False, step=step)
    if host_id == 1:
        shutil.copytree(shared, view)
        with open(f"{view}/checkpoint", "w") as f:
            json.dump({"latest": "ckpt-4", "step": 4}, f)
    out = {"own_latest": checkpoint.latest_checkpoint(
        shared if host_id == 0 else view)}
    model.set_weights(version(0))
    out["step"] = checkpoint.restore_checkpoint(
        model, shared if host_id == 0 else view, optimizer=False)
    out["weights_are_v2"] = all(
        np.array_equal(a, b) for a, b in zip(model.get_weights(), version(2)))
    if host_id == 1:
        shutil.rmtree(f"{view}/ckpt-8")
    model.set_weights(version(0))
    try:
        checkpoint.restore_checkpoint(
            model, shared if host_id == 0 else view, optimizer=False)
        out["failed"] = ""
    except Exception as error:  # noqa: BLE001
        out["failed"] = f"{type(error).__name__}: {error}"
    out["unchanged"] = all(
        np.array_equal(a, b) for a, b in zip(model.get_weights(), version(0)))
    with open(f"{workdir}/host{host_id}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if sys.argv[1] == "hosts":
        hosts_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        main(sys.argv[1], sys.argv[2])
