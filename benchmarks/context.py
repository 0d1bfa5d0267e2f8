"""The longest sequence each mesh trains within a per-device memory budget.

    python benchmarks/context.py [--budget-mib 16] [--time-seq 256]
                                 [--budget-of rss|report]

On 8 virtual CPUs, for a causal transformer (Keras MultiHeadAttention,
positions an input; --layers, --dim, --heads) and the meshes

    data=8                     (context = 1: each device a whole sequence)
    data=4 x context=2, data=2 x context=4, context=8
    data=2 x model=4 TP+SP     (tfpar's sequence parallelism, auto_rules
                                sequence_parallel=True, for comparison)

each data-parallel replica trains --per-replica sequences (the global batch
is data x per-replica), Adam, fp32. The budget bounds, per device:

- --budget-of rss (default): the measured PEAK of a training step. Each
  (mesh, length) runs in a fresh child process: one step to trace and
  compile, the peak resident set reset (Linux /proc/self/clear_refs), a
  second step; its peak above the resident set before it, divided by the
  8 virtual devices sharing the process (their mean peak). Tensors are
  allocated with malloc, large ones with mmap (TF_ONEDNN_USE_SYSTEM_
  ALLOCATOR=1, MALLOC_MMAP_THRESHOLD_), so the resident set follows the
  live tensors. "peak MiB" is the same figure.
- --budget-of report: the compiled step's saved activations
  (`tfpar.memory_report`'s "activations": the forward tensors the backward
  pass reads, largest device); "peak MiB" is the same report's model of
  the peak.

The sequence length: a quadratic a s^2 + b s + c fitted to the budgeted
bytes at --start, 2x and 4x predicts the longest multiple of --granule
within the budget, which is then measured and stepped by a granule until
it fits and the next does not: the table's "longest" is measured.

Expected: with context parallelism both the saved activations and the peak
of one sequence are linear in s per device (blockwise attention keeps Q, K,
V, O and the row statistics, recomputes each probability tile in the
backward pass, and computes the tiles of at most TILE_KEYS keys one after
another, so one (s/cp x TILE_KEYS) score tile per head is live), once
s/cp >= TILE_KEYS; data=8 holds (heads x s x s) scores per layer, so the
longest sequence grows more than cp-fold against data=8.

Step time: at --time-seq tokens, every mesh and one device (the same
per-replica batch) run --steps steps per round, rounds interleaved in one
process (--rounds), median; ratios to one device and to data=8. On virtual
CPUs sharing a few cores the ratios show overheads (gathers, blockwise
loop), not real speedups.
"""

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The model is the context tests' (as benchmarks/hub_model_plans.py uses
# theirs).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "tests"))

import tfpar  # noqa: E402
import context_models  # noqa: E402

MESHES = [
    ("data=8", {"data": 8}, False),
    ("data=4 x context=2", {"data": 4, "context": 2}, False),
    ("data=2 x context=4", {"data": 2, "context": 4}, False),
    ("context=8", {"data": 1, "context": 8}, False),
    ("data=2 x model=4 TP+SP", {"data": 2, "model": 4}, True),
]
VOCAB = 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=16.0,
                        help="per-device activation budget (default 16)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--per-replica", type=int, default=1,
                        help="sequences per data-parallel replica")
    parser.add_argument("--start", type=int, default=128)
    parser.add_argument("--granule", type=int, default=128)
    parser.add_argument("--time-seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--part", choices=("all", "longest", "time"),
                        default="all", help="both tables, or one of them")
    parser.add_argument("--only", default="",
                        help="comma-separated mesh names")
    parser.add_argument("--budget-of", choices=("rss", "report"),
                        default="rss",
                        help="rss: the budget bounds a step's measured peak "
                        "(resident set of a fresh child process, per "
                        "device); report: the compiled step's saved "
                        "activations (tfpar.memory_report)")
    parser.add_argument("--child", nargs=2, metavar=("MESH", "SEQ"),
                        help=argparse.SUPPRESS)  # one rss measurement
    return parser.parse_args(argv)


def causal_transformer(seq_len, layers, dim, heads):
    """The context tests' pre-norm causal transformer
    (`tests/context_models.py`; positions are an input, so a load balanced
    sequence carries its own) with MLPs of 4 × dim."""
    return context_models.causal_transformer(
        vocab=VOCAB, seq_len=seq_len, dim=dim, heads=heads, layers=layers,
        mlp_ratio=4)


def corpus(n, seq_len):
    import numpy as np  # noqa: PLC0415
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, VOCAB, size=(n, seq_len + 1)).astype("int32")
    positions = np.tile(np.arange(seq_len, dtype="int32"), (n, 1))
    return ({"tokens": tokens[:, :-1], "positions": positions},
            tokens[:, 1:])


def build(mesh_entry, seq_len, args):
    """(model compiled on its strategy or one device, global batch)."""
    import keras  # noqa: PLC0415
    name, axes, sequence_parallel = mesh_entry
    keras.utils.set_random_seed(0)
    if axes is None:
        model, batch = causal_transformer(seq_len, args.layers, args.dim,
                                          args.heads), args.per_replica
    else:
        strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes))
        with strategy.scope():
            model = causal_transformer(seq_len, args.layers, args.dim,
                                       args.heads)
            if "model" in axes:
                strategy.apply_rules(model, tfpar.auto_rules(
                    model, mesh=strategy.mesh,
                    sequence_parallel=sequence_parallel))
        batch = axes["data"] * args.per_replica
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model, batch


def activations(mesh_entry, seq_len, args):
    """(saved activation bytes, peak bytes) of the largest device."""
    model, batch = build(mesh_entry, seq_len, args)
    x, y = corpus(batch, seq_len)
    report = tfpar.memory_report(model, x, y)
    return (max(row["activations"] for row in report.values()),
            max(row["peak"] for row in report.values()))


def _resident(field):
    """Bytes of /proc/self/status's `field` (VmRSS, VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def step_peak(mesh_entry, seq_len, args):
    """Bytes a training step adds to the resident set at its peak (in
    this process, run as a fresh child by `measured_peak`): one step to
    trace and compile, VmHWM reset to VmRSS ("5" into /proc/self/
    clear_refs), a second step, VmHWM minus the resident set before it."""
    model, batch = build(mesh_entry, seq_len, args)
    x, y = corpus(batch, seq_len)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # free heap pages: RSS = live bytes
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = _resident("VmRSS")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    return _resident("VmHWM") - before


def measured_peak(mesh_entry, seq_len, args):
    """(step peak per device, the same) of `step_peak` in a fresh child
    process: the process's peak over the 8 virtual devices / 8. Tensors
    are allocated with malloc (TF_ONEDNN_USE_SYSTEM_ALLOCATOR: oneDNN's
    allocator keeps a pool), large ones with mmap, so the resident set
    follows the live tensors."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
               TF_ONEDNN_USE_SYSTEM_ALLOCATOR="1", TF_CPP_MIN_LOG_LEVEL="2")
    model = [f"--{name.replace('_', '-')}={getattr(args, name)}"
             for name in ("layers", "dim", "heads", "per_replica")]
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *model, "--child",
         mesh_entry[0], str(seq_len)],
        env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{mesh_entry[0]} at {seq_len}: "
                           f"{done.stderr[-2000:]}")
    per_device = json.loads(done.stdout.strip().splitlines()[-1]) / 8
    return per_device, per_device


def measure(mesh_entry, seq_len, args):
    """(the budgeted bytes, the peak bytes) per device: `--budget-of`."""
    if args.budget_of == "rss":
        return measured_peak(mesh_entry, seq_len, args)
    return activations(mesh_entry, seq_len, args)


def longest(mesh_entry, args, budget):
    """(longest measured length within budget, its activations, its peak,
    the next granule's activations): activations(s) = a s^2 + b s + c
    fitted to --start, 2x and 4x, the longest granule the fit allows
    measured, then stepped by a granule until it fits and the next does
    not."""
    import numpy as np  # noqa: PLC0415
    measured = {}

    def saved(seq_len):
        if seq_len not in measured:
            measured[seq_len] = measure(mesh_entry, seq_len, args)
        return measured[seq_len][0]

    lengths = [args.start, 2 * args.start, 4 * args.start]
    a, b, c = np.polyfit(lengths, [saved(s) for s in lengths], 2)
    seq_len = args.granule
    while a * (seq_len + args.granule) ** 2 + b * (
            seq_len + args.granule) + c <= budget:
        seq_len += args.granule
    while seq_len > args.granule and saved(seq_len) > budget:
        seq_len -= args.granule
    while saved(seq_len + args.granule) <= budget:
        seq_len += args.granule
    return (seq_len, *measured[seq_len], measured[seq_len + args.granule][0])


def step_times(entries, args):
    """{name: median seconds per step} at --time-seq, rounds interleaved."""
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415
    runs = {}
    for entry in entries:
        model, batch = build(entry, args.time_seq, args)
        x, y = corpus(batch * args.steps, args.time_seq)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        model.fit(dataset, epochs=1, verbose=0)  # trace, build optimizer
        runs[entry[0]] = (model, dataset)
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, dataset) in runs.items():
            start = time.perf_counter()
            model.fit(dataset, epochs=1, verbose=0)
            times[name].append((time.perf_counter() - start) / args.steps)
    return {name: float(np.median(t)) for name, t in times.items()}


def main(args):
    tfpar.use_virtual_cpus(8)
    if args.child:
        entry = next(m for m in MESHES if m[0] == args.child[0])
        print(json.dumps(step_peak(entry, int(args.child[1]), args)))
        return
    only = set(filter(None, args.only.split(",")))
    entries = [m for m in MESHES if not only or m[0] in only]
    budget = args.budget_mib * 2**20
    print(f"causal transformer: {args.layers} layers, dim {args.dim}, "
          f"{args.heads} heads, vocab {VOCAB}, Adam fp32; "
          f"{args.per_replica} sequence(s) per data replica; 8 virtual CPUs "
          f"on {os.cpu_count()} cores; budget ({args.budget_of}) "
          f"{args.budget_mib:g} MiB per device")
    if args.part != "time":
        print_longest(entries, args, budget)
    if args.part != "longest":
        print_step_times(entries, args)


def print_longest(entries, args, budget):
    print(f"{'mesh':24s} {'longest':>8s} {'x first':>8s} {'bud MiB':>8s} "
          f"{'peak MiB':>9s} {'next bud MiB':>13s}")
    base = None
    for entry in entries:
        seq_len, saved, peak, over = longest(entry, args, budget)
        base = base or seq_len
        print(f"{entry[0]:24s} {seq_len:8d} {seq_len / base:8.2f} "
              f"{saved / 2**20:8.1f} {peak / 2**20:9.1f} "
              f"{over / 2**20:13.1f}", flush=True)


def print_step_times(entries, args):
    times = step_times([("one device", None, False)] + entries, args)
    one, data8 = times["one device"], times.get("data=8")
    print(f"\nstep time at {args.time_seq} tokens (median of {args.rounds} "
          f"interleaved rounds of {args.steps} steps)")
    print(f"{'mesh':24s} {'ms/step':>8s} {'/ one dev':>10s} {'/ data=8':>9s}")
    for name, seconds in times.items():
        ratio = f"{seconds / data8:9.2f}" if data8 else f"{'':>9s}"
        print(f"{name:24s} {seconds * 1000:8.1f} {seconds / one:10.2f} "
              f"{ratio}")


if __name__ == "__main__":
    main(parse_args())
