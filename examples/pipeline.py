"""Pipeline parallelism: a deep MLP cut into stages, micro-batches streamed.

Builds a Sequential MLP, wraps it in `tfpar.PipelineModel` on a pipe x data
mesh of virtual CPUs, trains it with the chosen schedule next to the same
model on one device from the same weights, prints the split, both loss
curves and the peak micro-batches in flight per stage, and saves the
executed timeline of the last step as a Gantt chart.

    python examples/pipeline.py [--pipe 4 --data 2 --microbatches 8
                                 --schedule 1f1b --virtual-stages 1
                                 --gantt pipeline.png]

`--virtual-stages 2` interleaves: the MLP is cut into 2 x pipe parts, part k
on stage k mod pipe (Megatron-LM's virtual pipeline stages).
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                    argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default and keeps the epilog's lines."""


def build_mlp(depth=8, width=128):
    import keras  # noqa: PLC0415

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((32,))]
        + [keras.layers.Dense(width, activation="relu", name=f"dense{i}")
           for i in range(depth)]
        + [keras.layers.Dense(4, name="head")], name="mlp")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--pipe", type=int, default=4, help="stages")
    parser.add_argument("--data", type=int, default=2,
                        help="data-parallel replicas inside every stage")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="micro-batches per global batch")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"],
                        help="pipeline schedule")
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="model parts per stage (> 1: interleaved)")
    parser.add_argument("--depth", type=int, default=8, help="hidden layers")
    parser.add_argument("--epochs", type=int, default=2, help="epochs")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global batch size")
    parser.add_argument("--gantt", default="pipeline.png",
                        help="where to save the executed timeline (PNG)")
    args = parser.parse_args()
    import tfpar  # noqa: PLC0415  (after argparse: --help is fast)

    tfpar.use_virtual_cpus(args.pipe * args.data)
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 32)).astype("float32")
    y = np.stack([x[:, :8].sum(1), np.sin(x[:, 8]), x[:, 9] * x[:, 10],
                  np.abs(x[:, 11])], 1).astype("float32")

    single = build_mlp(args.depth)
    weights = single.get_weights()
    single.compile(optimizer="adam", loss="mse")
    reference = single.fit(x, y, batch_size=args.batch_size,
                           epochs=args.epochs, shuffle=False, verbose=0)

    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"pipe": args.pipe, "data": args.data}))
    with strategy.scope():
        pipe = tfpar.PipelineModel(
            build_mlp(args.depth), num_microbatches=args.microbatches,
            schedule=args.schedule, virtual_stages=args.virtual_stages,
            record_timeline=True)
        pipe.set_weights(weights)
        pipe.compile(optimizer="adam", loss="mse")
    interleaved = (f", interleaved: {args.virtual_stages} parts per stage"
                   if args.virtual_stages > 1 else "")
    print(f"{args.schedule} pipeline on {strategy.mesh}, "
          f"{args.microbatches} micro-batches per batch{interleaved}:")
    print(pipe.split_report())
    history = pipe.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
                       shuffle=False, verbose=1)

    print("\nepoch  single-device loss  pipeline loss")
    for i, (a, b) in enumerate(zip(reference.history["loss"],
                                   history.history["loss"])):
        print(f"{i:5d}  {a:18.6f}  {b:13.6f}")
    worst = max(
        float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12))
        for a, b in zip(single.get_weights(), pipe.get_weights()))
    print(f"largest relative weight difference: {worst:.2e}")
    timeline = pipe.last_timeline
    print(f"{args.schedule} keeps at most these micro-batches' activations "
          "per stage (part × micro-batch pairs when interleaved):",
          [pipe.schedule.peak_in_flight(s) for s in range(args.pipe)])
    bubble = tfpar.pipeline.bubble_fraction(timeline)
    theory = tfpar.pipeline.theoretical_bubble_fraction(
        args.pipe, args.microbatches, args.virtual_stages)
    print(f"measured bubble {bubble:.0%} (theory (p-1)/(v·m+p-1) = "
          f"{theory:.0%}; the stages share this host's cores)")
    path = tfpar.plot_schedule(timeline, args.gantt,
                               title=f"executed {args.schedule}, "
                                     f"pipe={args.pipe} x data={args.data}")
    print(f"executed timeline saved to {path}")


if __name__ == "__main__":
    main()
