"""Step time and per-device bytes of `offload="optimizer+master"` next to
`offload="optimizer"` and no offload, under mixed_bfloat16.

    python benchmarks/offload_master.py [--width 256 --steps 8 --rounds 3]
    python benchmarks/offload_master.py --pipeline   # a PipelineModel

On 8 virtual CPUs (of 16: CPU:8-15 the offload "host"), data=8 fsdp, the
benchmark MLP shape (two Dense layers of `width`), Adam: the median `fit`
step time of each configuration (interleaved rounds in one process) and
`memory_per_device()` of mesh device CPU:0 and host device CPU:8. With
`--pipeline`: the same MLP as a 1F1B `PipelineModel` on pipe=2 x data=4
(one Dense layer per stage, 4 micro-batches), CPU:0 and CPU:8 holding
stage 0's weights and their host copies. Here the
"host" is other virtual CPUs of the same process (the same memory and two
cores): the rows show placement and the round trip's cost, not saved RAM.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CONFIGS = {"no offload": None, "optimizer": "optimizer",
           "optimizer+master": "optimizer+master"}


def _model(keras, tfpar, offload, width, pipeline):
    host = {} if offload is None else {
        "offload": offload, "offload_devices": [f"CPU:{i}"
                                                for i in range(8, 16)]}
    axes = {"pipe": 2, "data": 4} if pipeline else {"data": 8}
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh(axes, devices=[f"CPU:{i}" for i in range(8)]),
        fsdp=not pipeline, **host)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((width,)),
            keras.layers.Dense(width * 4, activation="relu"),
            keras.layers.Dense(width)])
        if pipeline:
            model = tfpar.PipelineModel(model, num_microbatches=4)
        model.compile(optimizer="adam", loss="mse")
    return strategy, model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pipeline", action="store_true")
    args = parser.parse_args()
    import numpy as np  # noqa: PLC0415

    import tfpar  # noqa: PLC0415

    tfpar.use_virtual_cpus(16)
    import keras  # noqa: PLC0415

    keras.config.set_dtype_policy("mixed_bfloat16")
    x = np.random.default_rng(0).standard_normal(
        (64 * args.steps, args.width)).astype("float32")
    runs = {name: _model(keras, tfpar, offload, args.width, args.pipeline)
            for name, offload in CONFIGS.items()}
    times = {name: [] for name in runs}
    for name, (_, model) in runs.items():  # compile and warm up
        model.fit(x[:128], x[:128], batch_size=64, verbose=0)
    for _ in range(args.rounds):
        for name, (_, model) in runs.items():
            start = time.perf_counter()
            model.fit(x, x, batch_size=64, verbose=0)
            times[name].append((time.perf_counter() - start) / args.steps)
    mesh = ("pipe=2 x data=4, 1F1B, 4 micro-batches" if args.pipeline
            else "data=8 fsdp")
    print(f"{mesh}, MLP width {args.width}, Adam, mixed_bfloat16")
    print(f"{'config':18} {'ms/step':>8} {'CPU:0 params':>13} "
          f"{'CPU:0 opt':>10} {'CPU:8 params':>13} {'CPU:8 opt':>10}")
    for name, (strategy, _) in runs.items():
        memory = strategy.memory_per_device()
        host = memory.get("CPU:8", {"params": 0, "optimizer": 0})
        print(f"{name:18} {1000 * np.median(times[name]):8.1f} "
              f"{memory['CPU:0']['params']:13d} "
              f"{memory['CPU:0']['optimizer']:10d} "
              f"{host['params']:13d} {host['optimizer']:10d}")


if __name__ == "__main__":
    main()
