"""Sharded checkpoints: save on one mesh, resume on another, export to Keras.

Trains an MLP on data=2 x model=4, saves a sharded checkpoint (each device
writes its own block), restores it onto model=8 and continues training,
checks the losses against uninterrupted single-device training, then saves
a .keras file and loads it in a Python process that never imports tfpar.

    python examples/checkpoints.py [--directory ckpts --width 256]
"""

import argparse
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RULES = {r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
         r".*down/kernel": ("model", None)}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                    argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default and keeps the epilog's lines."""


def build(width):
    import keras  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(width, activation="relu", name="up"),
        keras.layers.Dense(32, name="down"),
        keras.layers.Dense(4, name="head")], name="net")


def on_mesh(axes, width):
    import tfpar  # noqa: PLC0415
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=RULES)
    with strategy.scope():
        model = build(width)
        model.compile(optimizer="adam", loss="mse")
    return model


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--directory", default=None,
                        help="checkpoint directory (None: a temporary one)")
    parser.add_argument("--width", type=int, default=256,
                        help="hidden width of the MLP")
    args = parser.parse_args()
    import tfpar  # noqa: PLC0415  (after argparse: --help is fast)
    tfpar.use_virtual_cpus(8)
    import numpy as np  # noqa: PLC0415

    directory = args.directory or tempfile.mkdtemp(prefix="tfpar_ckpts_")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 32)).astype("float32")
    y = rng.normal(size=(512, 4)).astype("float32")

    first = on_mesh({"data": 2, "model": 4}, args.width)
    h1 = first.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=1)
    path = tfpar.save_checkpoint(first, directory)
    print(f"saved {path} ({len(os.listdir(path))} files, one per distinct "
          "device block, plus the manifest)")

    second = on_mesh({"model": 8}, args.width)
    step = tfpar.restore_checkpoint(second, directory)
    print(f"restored step {step} onto {second.distribute_strategy.mesh}")
    h2 = second.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=1)

    single = build(args.width)
    single.compile(optimizer="adam", loss="mse")
    reference = single.fit(x, y, batch_size=64, epochs=2, shuffle=False,
                           verbose=0)
    resumed = h1.history["loss"] + h2.history["loss"]
    worst = max(abs(a - b) / abs(a)
                for a, b in zip(reference.history["loss"], resumed))
    print(f"epoch losses, resumed on another mesh: {np.round(resumed, 6)}")
    print(f"epoch losses, one device, no stop:     "
          f"{np.round(reference.history['loss'], 6)}")
    print(f"largest relative loss difference: {worst:.2e}")

    keras_file = os.path.join(directory, "model.keras")
    second.save(keras_file)
    np.save(os.path.join(directory, "x.npy"), x[:8])
    code = (
        "import sys, numpy as np, keras\n"
        "assert 'tfpar' not in sys.modules\n"
        f"m = keras.models.load_model({keras_file!r})\n"
        f"np.save({os.path.join(directory, 'y.npy')!r}, "
        f"m.predict(np.load({os.path.join(directory, 'x.npy')!r}), verbose=0))\n")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                            KERAS_BACKEND="tensorflow"))
    served = np.load(os.path.join(directory, "y.npy"))
    difference = float(np.abs(served - second.predict(x[:8], verbose=0)).max())
    print(f"{keras_file} loaded without tfpar; largest prediction "
          f"difference: {difference:.2e}")


if __name__ == "__main__":
    main()
