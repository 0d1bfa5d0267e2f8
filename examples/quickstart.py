"""Quickstart: train an MLP data x model parallel on 8 virtual CPU devices.

Trains the same Keras model twice from the same initial weights — once on a
single device, once under `tfpar.ParallelStrategy` on a data=2 x model=4 mesh
with the Megatron column/row split of the MLP — then prints the per-epoch
losses side by side, the largest weight difference, and where each weight
lives.

    python examples/quickstart.py [--data 2 --model 4 --epochs 3]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=int, default=2, help="data axis size")
    parser.add_argument("--model", type=int, default=4, help="model axis size")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

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

    print("\nwhere each weight lives (spec per dimension; None = replicated):")
    for path, spec, block in strategy.placements("params"):
        print(f"  {path:32s} {str(spec):22s} per-device block {block}")
    memory = strategy.memory_per_device()
    first = mesh.devices[0]
    print(f"\nbytes on {first}: {memory[first]}")


if __name__ == "__main__":
    main()
