"""Quickstart: train an MLP data x model parallel on 8 virtual CPU devices.

Trains the same Keras model twice from the same initial weights — once on a
single device, once under `tfpar.ParallelStrategy` on a data=2 x model=4 mesh
with the Megatron column/row split of the MLP — then prints the per-epoch
losses side by side, the largest weight difference, and where each weight
lives, with an OK/MISMATCH verdict.

    python examples/quickstart.py [--data 2 --model 4 --epochs 3]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

def build_model():
    import keras  # noqa: PLC0415

    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu", name="up0"),
            keras.layers.Dense(64, name="down0"),
            keras.layers.Dense(256, activation="relu", name="up1"),
            keras.layers.Dense(64, name="down1"),
            keras.layers.Dense(10, name="head"),
        ],
        name="mlp",
    )


RULES = {
    r".*up\d/kernel": (None, "model"),  # column-parallel: split outputs
    r".*up\d/bias": ("model",),
    r".*down\d/kernel": ("model", None),  # row-parallel: split inputs
}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", type=int, default=2, help="data axis size")
    parser.add_argument("--model", type=int, default=4, help="model axis size")
    parser.add_argument("--epochs", type=int, default=3, help="epochs")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global batch size")
    args = parser.parse_args()
    import tfpar  # noqa: PLC0415  (after argparse: --help is fast)

    tfpar.use_virtual_cpus(args.data * args.model)
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    rng = np.random.RandomState(0)
    x = rng.normal(size=(1024, 64)).astype("float32")
    y = rng.randint(0, 10, size=(1024,))

    keras.utils.set_random_seed(0)
    reference = build_model()
    initial = reference.get_weights()

    def compile_(model):
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    compile_(reference)
    print("single device ...")
    single = reference.fit(x, y, batch_size=args.batch_size,
                           epochs=args.epochs, shuffle=False, verbose=2)

    mesh = tfpar.Mesh({"data": args.data, "model": args.model})
    strategy = tfpar.ParallelStrategy(mesh, rules=tfpar.LayoutRules(RULES))
    with strategy.scope():
        model = build_model()
        model.set_weights(initial)
        compile_(model)
    print(f"tfpar on {mesh} ...")
    parallel = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
                         shuffle=False, verbose=2)

    print("\nepoch  single-device loss  tfpar loss")
    for epoch, (a, b) in enumerate(
        zip(single.history["loss"], parallel.history["loss"])
    ):
        print(f"{epoch:5d}  {a:18.6f}  {b:10.6f}")
    worst = max(
        float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
        for a, b in zip(reference.get_weights(), model.get_weights())
    )
    print(f"largest relative weight difference: {worst:.2e}")
    losses = max(abs(a - b) / abs(a) for a, b in zip(
        single.history["loss"], parallel.history["loss"]))
    verdict = "OK" if max(worst, losses) < 1e-4 else "MISMATCH"
    print(f"parity with one device (losses and weights within 1e-4): "
          f"{verdict}")

    print("\nwhere each weight lives (spec per dimension; None = replicated):")
    for path, spec, block in strategy.placements("params"):
        print(f"  {path:32s} {str(spec):22s} per-device block {block}")
    print("\nbytes per device:")
    print(f"  {'device':8s} {'params':>8s} {'optimizer':>10s} {'other':>6s} "
          f"{'total':>8s}")
    for device, kinds in strategy.memory_per_device().items():
        print(f"  {device:8s} {kinds['params']:8,d} {kinds['optimizer']:10,d} "
              f"{kinds['other']:6,d} {sum(kinds.values()):8,d}")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    raise SystemExit(main())
