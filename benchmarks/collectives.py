"""DTensor's collectives on 8 virtual CPUs: the gradient bytes of a data=8 step.

    python benchmarks/collectives.py [--rounds 30] [--elements 2100000]

Times, side by side in one process (median of interleaved rounds), the
collectives a data=8 step of the benchmark MLP (2.1M float32 parameters,
8.4 MB) runs, each on one tensor of that size on Mesh({"data": 8}):

- all-reduce       : every device holds its own partial sum (N,), all get
                     the total (replicated weights: the gradient sum);
- reduce-scatter   : the same, each device keeping 1/8 of the total
                     (fsdp's gradient; DTensor's CPU lowering is an
                     all-reduce then a slice);
- all-to-all + sum : a true reduce-scatter (device d receives block d of
                     every partial sum and adds them up); since tfpar turns
                     DTensor's all-to-all off (wrong on rank-4 tensors,
                     tfpar/__init__.py) the relayout is a gather and a
                     slice: the figure in docs/benchmarks.md was measured
                     with the all-to-all;
- all-gather       : every device holds 1/8, all get the whole (fsdp's
                     weight read; real CollectiveGatherV2, as tfpar compiles);
- local pass       : x * 2 on each device's (N,) block, no communication:
                     one read and one write of the same bytes.

Each time is also printed as a multiple of the local pass: how much more
than touching the bytes once a collective costs on this host.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402

DEVICES = 8


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--elements", type=int, default=2_100_000,
                        help="float32 elements per device (default: the "
                             "benchmark MLP's parameter count)")
    args = parser.parse_args()
    tfpar.use_virtual_cpus(DEVICES)
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415
    from tensorflow.experimental import dtensor  # noqa: PLC0415

    from tfpar import _compat  # noqa: PLC0415

    mesh = tfpar.Mesh({"data": DEVICES})
    unsharded = dtensor.UNSHARDED

    def layout(*spec):
        return dtensor.Layout(list(spec), mesh.dtensor_mesh)

    n = args.elements // DEVICES * DEVICES
    rng = np.random.default_rng(0)
    # Row d of (8, N) is device d's partial sum; (8, 8, N/8) the same cut
    # into the blocks each device ends up owning.
    partials = tfpar.placement.put(
        rng.random((DEVICES, n), dtype=np.float32), ("data", None), mesh)
    blocks = tfpar.placement.put(
        rng.random((DEVICES, DEVICES, n // DEVICES), dtype=np.float32),
        ("data", None, None), mesh)
    shards = tfpar.placement.put(
        rng.random((DEVICES, n // DEVICES), dtype=np.float32),
        ("data", None), mesh)

    cases = {
        "all-reduce": (tf.function(lambda p: tf.reduce_sum(p, 0)), partials),
        "reduce-scatter": (tf.function(lambda p: dtensor.relayout(
            tf.reduce_sum(p, 0), layout("data"))), partials),
        "all-to-all + sum": (tf.function(lambda b: tf.reduce_sum(
            dtensor.relayout(b, layout(unsharded, "data", unsharded)), 0)),
            blocks),
        "all-gather": (tf.function(lambda s: dtensor.relayout(
            s, layout(unsharded, unsharded))), shards),
        "local pass": (tf.function(lambda p: p * 2.0), partials),
    }
    times = {name: [] for name in cases}
    with _compat.collective_all_gathers(True):
        for function, value in cases.values():  # trace and warm up
            tfpar.placement.fetch(function(value))
        for _ in range(args.rounds):
            for name, (function, value) in cases.items():
                start = time.perf_counter()
                result = function(value)
                dtensor.unpack(result)[0].numpy()  # wait for it
                times[name].append(time.perf_counter() - start)
    local = float(np.median(times["local pass"]))
    print(f"{n * 4 / 1e6:.1f} MB float32 per device, {DEVICES} virtual CPUs "
          f"on {os.cpu_count()} cores, median of {args.rounds} rounds")
    print(f"{'collective':<18}{'ms':>8}{'÷ local pass':>14}")
    for name, samples in times.items():
        median = float(np.median(samples))
        print(f"{name:<18}{median * 1e3:>8.1f}{median / local:>14.2f}")


if __name__ == "__main__":
    main()
