"""Child process for the crash-safety test of tfpar.checkpoint.

usage: checkpoint_crash_child.py DIRECTORY OUT.npz

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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
