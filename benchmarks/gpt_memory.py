"""Per-device memory, activations, communication and step time of the GPT example.

    python benchmarks/gpt_memory.py [--layers 2 --dim 64 --rounds 3]

On 8 virtual CPUs, for each mesh data = 8/model x model (model = 1, 2, 4,
8), builds the GPT of examples/gpt.py, plans it with `tfpar.auto_rules`
(tensor parallel, "TP"; and with `sequence_parallel=True`, "TP+SP", for
model > 1) and prints:

1. memory per device: bytes of parameters and Adam state one device holds,
   next to the formula sharded/model + replicated; the activations the
   compiled training step keeps for its backward pass, per device
   (`CommunicationReport.saved_activation_bytes`: the distinct forward
   tensors that backward ops read, read from the SPMD-expanded step); and
   the median `fit` step time divided by single-device Keras (interleaved
   rounds in one process);
2. communication per step over the model axis, measured in the compiled
   step `fit` runs (`tfpar.communication.capture`): collectives forward /
   backward, message bytes, bytes each device sends in a ring
   implementation — next to Megatron-LM's formula for the same shapes
   (`tfpar.communication.megatron_tp_bytes`: per layer 2 all-reduces
   forward + 2 backward of b*s*h, ring all-reduce 2(n-1)/n of it; b is the
   batch of one data-parallel replica).
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
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    tfpar.use_virtual_cpus(8)
    import gpt  # noqa: PLC0415
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    config = dict(vocab=64, seq_len=args.seq_len, dim=args.dim, heads=8,
                  layers=args.layers)
    batch = 16
    x, y = gpt.toy_corpus(batch * args.steps, vocab=64, seq_len=args.seq_len)
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
        for sp in ((False, True) if model_axis > 1 else (False,)):
            mesh = tfpar.Mesh({"data": 8 // model_axis, "model": model_axis})
            strategy = tfpar.ParallelStrategy(mesh)
            with strategy.scope():
                model = gpt.build_gpt(**config)
                model.set_weights(weights)
                strategy.apply_rules(model, tfpar.auto_rules(
                    model, mesh=mesh, sequence_parallel=sp))
                gpt.compile_gpt(model)
            name = f"{8 // model_axis}x{model_axis} {'TP+SP' if sp else 'TP'}"
            runs[name] = (model, strategy)

    reports = {}
    for name, (model, strategy) in runs.items():
        with tfpar.communication.capture() as programs:
            model.fit(dataset, epochs=1, verbose=0)  # trace, build optimizer
        if strategy is not None:
            reports[name] = programs.train_report()
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, _) in runs.items():
            start = time.perf_counter()
            model.fit(dataset, epochs=1, verbose=0)
            times[name].append((time.perf_counter() - start) / args.steps)
    base = float(np.median(times["single device"]))

    print(f"GPT {config}, batch {batch}, Adam; 8 virtual CPUs on "
          f"{os.cpu_count()} cores (mesh data x model)")
    print(f"\n{'config':16s} {'params B/dev':>13s} {'optim B/dev':>12s} "
          f"{'formula':>10s} {'saved act B/dev':>16s} {'step ms':>8s} "
          f"{'ratio':>6s}")
    for name, (model, strategy) in runs.items():
        median = float(np.median(times[name])) * 1000
        if strategy is None:
            params = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
            print(f"{name:16s} {params:13d} {2 * params:12d} {'':>10s} "
                  f"{'':>16s} {median:8.1f} {1.0:6.2f}")
            continue
        memory = strategy.memory_per_device()[strategy.mesh.devices[0]]
        k = strategy.mesh.axis_size("model")
        sharded = {p for p, spec, _ in strategy.placements("params") if any(spec)}
        split = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights
                    if v.path in sharded)
        whole = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
        formula = (whole - split) + split // k  # replicated + sharded / k
        saved = reports[name].saved_activation_bytes
        print(f"{name:16s} {memory['params']:13d} {memory['optimizer']:12d} "
              f"{formula:10d} {saved:16d} {median:8.1f} "
              f"{median / 1000 / base:6.2f}")

    print("\nCommunication per step over the model axis (collectives whose "
          "group spans it; measured in the compiled step) vs Megatron-LM's "
          "tensor-parallel formula; and over the data axis alone")
    print(f"{'config':16s} {'fwd':>4s} {'bwd':>4s} {'bytes':>9s} "
          f"{'ring B/dev':>10s} {'Megatron':>9s} {'ring':>9s} "
          f"{'data-axis bytes':>16s}")
    for name, report in reports.items():
        strategy = runs[name][1]
        n = strategy.mesh.axis_size("model")
        b = batch // strategy.mesh.axis_size("data")
        model_axis = dict(spans="model")
        megatron = tfpar.communication.megatron_tp_bytes(
            b, config["seq_len"], config["dim"], config["layers"], n)
        if n == 1:
            megatron = {"bytes": 0, "ring_bytes": 0.0}
        data_bytes = report.total_bytes(axes=("data",))
        print(f"{name:16s} "
              f"{report.count(phase='forward', **model_axis):4d} "
              f"{report.count(phase='backward', **model_axis):4d} "
              f"{report.total_bytes(**model_axis):9d} "
              f"{report.total_ring_bytes(**model_axis):10.0f} "
              f"{megatron['bytes']:9d} {megatron['ring_bytes']:9.0f} "
              f"{data_bytes:16d}")
    print("\nMessage bytes: all-reduce B = the tensor; ring all-reduce sends "
          "2(n-1)/n * B per device, all-gather/reduce-scatter/all-to-all "
          "(n-1)/n * B. DTensor on CPU runs SP's all-gathers and "
          "reduce-scatters as all-reduces (see tfpar.communication).")


if __name__ == "__main__":
    main()
