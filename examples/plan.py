"""tfpar.plan chooses how to split a model: plan, explain, train, compare.

Plans a small GPT (examples/gpt.py) for this machine's devices (8 virtual
CPUs by default) with a memory limit per device that rules out plain data
parallelism, prints `plan.explain()`, trains the chosen plan and the same
model on one device from the same weights, and prints both losses. Then
prints — without running — the plan for a described cluster of 64 GPUs
(8 hosts of 8 A100s) and a 175 B-parameter GPT (GPT-3's shape), built
without allocating a single weight.

    python examples/plan.py [--memory-fraction 0.6 --epochs 2]
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tfpar  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--memory-fraction", type=float, default=0.6,
                        help="memory limit per device as a fraction of what "
                             "replicated data parallelism needs")
    args = parser.parse_args()

    tfpar.use_virtual_cpus(args.devices)
    import keras  # noqa: PLC0415

    from gpt import build_gpt, compile_gpt, toy_corpus  # noqa: PLC0415

    def build():
        return build_gpt(layers=2)

    local = tfpar.Cluster.local()
    print(f"this machine: {local}")
    free = tfpar.plan(build, args.batch_size, cluster=local)
    replicated = next(c for c in free.candidates
                      if c.axes == {"data": args.devices, "pipe": 1,
                                    "model": 1} and not c.fsdp)
    limit = args.memory_fraction * replicated.estimate.total_memory
    plan = tfpar.plan(build, args.batch_size, cluster=local,
                      memory_per_device=limit)
    print(plan.explain())

    x, y = toy_corpus(64)
    keras.utils.set_random_seed(0)
    reference = build()
    weights = reference.get_weights()
    compile_gpt(reference)
    single = reference.fit(x, y, batch_size=args.batch_size,
                           epochs=args.epochs, shuffle=False,
                           verbose=0).history["loss"]
    with plan.strategy().scope():
        model = build()
        model.set_weights(weights)
        model = plan.apply(model)
        compile_gpt(model)
    parallel = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
                         shuffle=False, verbose=0).history["loss"]
    print(f"\ntrained {plan}:")
    print("epoch  single-device loss  planned loss")
    for i, (a, b) in enumerate(zip(single, parallel)):
        print(f"{i:5d}  {a:18.5f}  {b:12.5f}")
    worst = max(abs(a - b) / abs(a) for a, b in zip(single, parallel))
    print(f"largest relative loss difference: {worst:.2e}")
    used = max(sum(v.values())
               for v in plan.strategy().memory_per_device().values())
    print(f"weights + optimizer state per device: {used:,} bytes "
          f"(limit {limit:,.0f})")

    # On paper: GPT-3 175 B (96 layers, hidden 12288, 96 heads, sequence
    # 2048) in bfloat16 on 8 DGX A100 hosts.
    gpus = tfpar.Cluster(num_hosts=8, devices_per_host=8, device_memory=80e9,
                         device_flops=312e12, intra_host_bandwidth=300e9,
                         inter_host_bandwidth=25e9)

    def gpt3():
        keras.config.set_dtype_policy("mixed_bfloat16")
        try:
            return build_gpt(vocab=51200, seq_len=2048, dim=12288, heads=96,
                             layers=96, name="gpt3_175b")
        finally:
            keras.config.set_dtype_policy("float32")

    print("\nOn paper (not run): GPT-3 175 B on 8 hosts x 8 A100 = 64 devices,"
          " global batch 1536")
    try:
        print(tfpar.plan(gpt3, 1536, cluster=gpus).explain(top=8))
    except ValueError as e:  # 175 B may simply not fit 64 GPUs
        print(f"no plan: {e}")


if __name__ == "__main__":
    main()
