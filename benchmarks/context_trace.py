"""What the first training step of context parallelism costs to trace and
compile, as the sequence grows.

    python benchmarks/context_trace.py [--lengths 512,1024,2048,4096]
        [--mesh data=2,context=4] [--layers 2] [--loop-tiles both|off|on]

Blockwise attention (tfpar/blockwise_attention.py) computes every visible
key block in tiles of at most TILE_KEYS keys, one after another. Unrolled,
the traced step holds a copy of the tile's ops per tile, forward and
backward: about s / TILE_KEYS copies per attention layer, so the graph, and
the time to trace it, run DTensor's SPMD expansion and Grappler on it, grow
with the sequence and the layer count. With --loop-tiles on the tiles run
as a `tf.while_loop` (`blockwise_attention.LOOP_TILES_ABOVE` = 0): one copy
of the tile's ops whatever s.

For the context tests' causal transformer (tests/context_models.py, MLPs of
4 x dim, Adam, fp32) on the mesh, at each length, in one process:

- ops: nodes of the traced step (`tf.function` graph and every function of
  its library, before DTensor's expansion);
- trace s: tracing the step (`get_concrete_function`, Python + graph
  building);
- compile s: the first call minus a steady call (DTensor's SPMD expansion,
  Grappler, executor set-up);
- step ms: the median of --steps further calls (each fetched), the
  two forms' calls interleaved;
- first step s: trace + first call, what `fit` pays before its first step.

Per layer: (ops, trace, compile) of the longest length minus those of the
shortest, over (layers x the tiles added): the cost of one more tile per
attention layer, to extrapolate to other lengths and depths.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "tests"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar  # noqa: E402
from tfpar import blockwise_attention  # noqa: E402
from tfpar import placement  # noqa: E402
import context_models  # noqa: E402

VOCAB = 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--mesh", default="data=2,context=4")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--loop-tiles", choices=("off", "on", "both"),
                        default="both",
                        help="unrolled tiles (off), a tf.while_loop over "
                        "them (on), or both side by side")
    return parser.parse_args(argv)


def mesh_axes(text):
    return {name: int(size) for name, size in
            (part.split("=") for part in text.split(","))}


def graph_ops(concrete):
    """Nodes of the traced step and of every function in its library."""
    graph = concrete.graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def)
                                 for f in graph.library.function)


def compiled_step(seq_len, args, loop):
    """(row {ops, trace, compile, first}, a function running one step) of
    one length, tiles looped or not (module doc): traced, compiled and run
    once; `compile` is completed by `interleave`."""
    import keras  # noqa: PLC0415
    axes = mesh_axes(args.mesh)
    blockwise_attention.LOOP_TILES_ABOVE = 0 if loop else None
    keras.utils.set_random_seed(0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes))
    with strategy.scope():
        model = context_models.causal_transformer(
            vocab=VOCAB, seq_len=seq_len, dim=args.dim, heads=args.heads,
            layers=args.layers, mlp_ratio=4)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        model.optimizer.build(model.trainable_variables)
    x, y = context_models.corpus(axes.get("data", 1), vocab=VOCAB,
                                 seq_len=seq_len)
    host = tf.nest.map_structure(tf.convert_to_tensor, (x, y))
    runner = strategy.extended.make_runner(model, "train")
    placed = runner._placer.place(host)
    start = time.perf_counter()
    concrete = runner._one_step.get_concrete_function(placed)
    traced = time.perf_counter() - start

    def call():
        begin = time.perf_counter()
        outputs = runner._one_step(placed)
        tf.nest.map_structure(placement.fetch, outputs)
        return time.perf_counter() - begin

    first = call()
    return dict(ops=graph_ops(concrete), trace=traced, compile=first,
                first=traced + first), call


def interleave(runs, args):
    """Steady step seconds of each run, median of --steps rounds, the
    runs' steps interleaved (the machine's load shared alike); the first
    call's excess over it is the row's compile time."""
    times = [[] for _ in runs]
    for _ in range(args.steps):
        for i, (_, call) in enumerate(runs):
            times[i].append(call())
    for (row, _), seconds in zip(runs, times):
        row["step"] = float(np.median(seconds))
        row["compile"] -= row["step"]
    return [row for row, _ in runs]


def tiles_per_layer(seq_len, args):
    """Key tiles one attention computes per pass (all blocks visible: the
    SPMD program's queries hold every position)."""
    cp = mesh_axes(args.mesh).get("context", 1)
    block = seq_len // cp
    return cp * -(-block // blockwise_attention.TILE_KEYS)


def main(args):
    tfpar.use_virtual_cpus(8)
    lengths = [int(s) for s in args.lengths.split(",")]
    modes = {"off": [False], "on": [True], "both": [False, True]}[
        args.loop_tiles]
    print(f"causal transformer: {args.layers} layers, dim {args.dim}, "
          f"{args.heads} heads, Adam fp32, mesh {args.mesh}, TILE_KEYS "
          f"{blockwise_attention.TILE_KEYS}; 8 virtual CPUs on "
          f"{os.cpu_count()} cores; tf {tf.__version__}")
    print(f"{'tiles':9s} {'seq':>6s} {'tiles/l':>8s} {'ops':>8s} "
          f"{'trace s':>8s} {'compile s':>10s} {'first s':>8s} "
          f"{'step ms':>8s}")
    saved = blockwise_attention.LOOP_TILES_ABOVE
    rows = {loop: {} for loop in modes}
    try:
        for seq_len in lengths:
            runs = [compiled_step(seq_len, args, loop) for loop in modes]
            for loop, row in zip(modes, interleave(runs, args)):
                rows[loop][seq_len] = row
                print(f"{'loop' if loop else 'unrolled':9s} {seq_len:6d} "
                      f"{tiles_per_layer(seq_len, args):8d} "
                      f"{row['ops']:8d} {row['trace']:8.1f} "
                      f"{row['compile']:10.1f} {row['first']:8.1f} "
                      f"{row['step'] * 1000:8.0f}", flush=True)
    finally:
        blockwise_attention.LOOP_TILES_ABOVE = saved
    for loop in modes:
        print(f"{'loop' if loop else 'unrolled'}:", end="")
        print_per_tile(rows[loop], lengths, args)


def print_per_tile(rows, lengths, args):
    short, long = lengths[0], lengths[-1]
    added = (tiles_per_layer(long, args) - tiles_per_layer(short, args)) * (
        args.layers)
    if added <= 0:
        return
    per = {k: (rows[long][k] - rows[short][k]) / added
           for k in ("ops", "trace", "compile")}
    print(f"  per added tile per layer: {per['ops']:.0f} ops, "
          f"{per['trace'] * 1000:.1f} ms trace, "
          f"{per['compile'] * 1000:.1f} ms compile")


if __name__ == "__main__":
    main(parse_args())
