"""Per-device memory and step time of the GPT example at model = 1, 2, 4, 8.

    python benchmarks/gpt_memory.py [--layers 2 --dim 64 --rounds 3]

On 8 virtual CPUs, for each mesh data = 8/model x model, builds the GPT of
examples/gpt.py, plans it with `tfpar.auto_rules`, and prints the bytes of
parameters and optimizer state (Adam) that one device holds, next to the
formula sharded/model + replicated, and the median `fit` step time divided
by single-device Keras (interleaved rounds in one process). Sequence
parallelism is not implemented yet, so no activation figures are printed.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    tfpar.use_virtual_cpus(8)
    import gpt  # noqa: PLC0415
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    config = dict(vocab=64, seq_len=16, dim=args.dim, heads=8,
                  layers=args.layers)
    batch = 16
    x, y = gpt.toy_corpus(batch * args.steps, vocab=64, seq_len=16)
    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    dataset = dataset.with_options(options)

    keras.utils.set_random_seed(0)
    weights = gpt.build_gpt(**config).get_weights()
    runs = {}
    single = gpt.build_gpt(**config)
    single.set_weights(weights)
    gpt.compile_gpt(single)
    runs["single device"] = (single, None)
    for model_axis in (1, 2, 4, 8):
        mesh = tfpar.Mesh({"data": 8 // model_axis, "model": model_axis})
        strategy = tfpar.ParallelStrategy(mesh)
        with strategy.scope():
            model = gpt.build_gpt(**config)
            model.set_weights(weights)
            strategy.apply_rules(model, tfpar.auto_rules(model, mesh=mesh))
            gpt.compile_gpt(model)
        runs[f"data={8 // model_axis} x model={model_axis}"] = (model, strategy)

    for model, _ in runs.values():
        model.fit(dataset, epochs=1, verbose=0)  # trace, build optimizer
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, _) in runs.items():
            start = time.perf_counter()
            model.fit(dataset, epochs=1, verbose=0)
            times[name].append((time.perf_counter() - start) / args.steps)
    base = float(np.median(times["single device"]))

    print(f"GPT {config}, batch {batch}, Adam; 8 virtual CPUs on "
          f"{os.cpu_count()} cores")
    print(f"{'config':24s} {'params B/dev':>13s} {'optim B/dev':>12s} "
          f"{'formula':>10s} {'step ms':>8s} {'ratio':>6s}")
    for name, (model, strategy) in runs.items():
        median = float(np.median(times[name])) * 1000
        if strategy is None:
            params = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
            print(f"{name:24s} {params:13d} {2 * params:12d} {'':>10s} "
                  f"{median:8.1f} {1.0:6.2f}")
            continue
        memory = strategy.memory_per_device()[strategy.mesh.devices[0]]
        k = strategy.mesh.axis_size("model")
        sharded = {p for p, spec, _ in strategy.placements("params") if any(spec)}
        split = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights
                    if v.path in sharded)
        whole = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
        formula = (whole - split) + split // k  # replicated + sharded / k
        print(f"{name:24s} {memory['params']:13d} {memory['optimizer']:12d} "
              f"{formula:10d} {median:8.1f} {median / 1000 / base:6.2f}")


if __name__ == "__main__":
    main()
