"""The widest GPT each memory configuration trains within a per-device budget.

    python benchmarks/largest_gpt.py [--budget-mib 40] [--layers 8]

For the configurations of benchmarks/memory.py whose step is one program
(one device, data=8, fsdp with and without freeing the gathered weights,
fsdp + recomputation, data=2 x model=4, model=8) it measures
`tfpar.memory_report`'s peak (the largest device's) for the GPT of
examples/gpt.py (vocab 64, 16 tokens, 8 heads, batch 16, Adam, fp32) at five
small sizes and fits, per configuration,

    peak(L, d) = a * psi(L, d) + b * L * d + e * L + f * d^2 + c

psi being the parameter count (12 L d^2 + 13 L d + d (vocab + tokens + 2)
+ d vocab + vocab, checked against Keras' count at every measured size): a
is the stored bytes per parameter (16 replicated, 16/8 with fsdp, ...), b
the kept activations per layer and unit of width, e what a layer keeps that
does not grow with the width (attention scores: heads x tokens^2), f what
one layer holds whole at a time (fsdp's gathered weights and whole
gradients of the layer in flight, 12 d^2 parameters), c the rest. The fit
predicts the widest GPT of --layers layers (width a multiple of 64) whose
peak is within the budget; from there the width is stepped by 64 and
measured until it fits and the next one does not, so the table's answer
is measured ("fit" is the fit's prediction, "err" its largest relative
residual on the five sizes it was fitted to).

The budget is per virtual device at this toy batch; what transfers to a
real accelerator is the ranking and the ratios between rows, not the
widths (a GPU's budget also holds the framework's workspace).
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory  # noqa: E402

VOCAB, TOKENS, HEADS, BATCH = 64, 16, 8, 16
FIT_SIZES = [(2, 64), (4, 64), (2, 128), (4, 128), (2, 192), (4, 192)]  # (L, d)
# benchmarks/memory.py's configurations whose step is one program (no
# pipeline; offload's host rows are not the devices' peak), and model=8.
CONFIGS = [config for config in memory.CONFIGS
           if "pipe" not in config[1] and "offload" not in config[2]] + [
    ("model=8", {"model": 8}, {}, False)]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=40.0,
                        help="per-device budget in MiB (default 40)")
    parser.add_argument("--layers", type=int, default=8,
                        help="layers of the GPTs the table sizes (default 8)")
    parser.add_argument("--only", default="",
                        help="comma-separated configuration names")
    return parser.parse_args(argv)


def parameters(layers, dim):
    """psi(L, d) of examples/gpt.py's GPT: per block attention 4d^2 + 4d,
    two norms 4d, MLP 8d^2 + 5d; embeddings (vocab + tokens) d, final norm
    2d, head d vocab + vocab."""
    return (12 * layers * dim ** 2 + 13 * layers * dim
            + dim * (VOCAB + TOKENS + 2) + dim * VOCAB + VOCAB)


def measure(config, layers, dim):
    """Peak bytes (largest device) of one step, and Keras' parameter count."""
    import gpt  # noqa: PLC0415

    _, axes, options, recompute = config
    mesh = (tfpar.Mesh(axes, devices=tfpar.Mesh({"data": 8}).devices[:1])
            if axes == {"data": 1} else tfpar.Mesh(axes))
    strategy = tfpar.ParallelStrategy(mesh, **options)
    with strategy.scope():
        model = gpt.build_gpt(vocab=VOCAB, seq_len=TOKENS, dim=dim,
                              heads=HEADS, layers=layers, recompute=recompute)
        if "model" in axes:
            strategy.apply_rules(model, tfpar.auto_rules(model, mesh=mesh))
        gpt.compile_gpt(model)
    x, y = gpt.toy_corpus(BATCH, vocab=VOCAB, seq_len=TOKENS)
    report = tfpar.memory_report(model, x, y)
    peak = max(kinds["peak"] for kinds in report.values())
    return peak, model.count_params()


def fit(points):
    """Least squares of peak = a psi + b L d + e L + f d^2 + c; returns
    the coefficients and the largest relative residual."""
    import numpy as np  # noqa: PLC0415
    rows = [[parameters(L, d), L * d, L, d * d, 1.0] for L, d, _ in points]
    peaks = np.array([p for *_, p in points], dtype="float64")
    coefficients, *_ = np.linalg.lstsq(np.array(rows, "float64"), peaks,
                                       rcond=None)
    predicted = np.array(rows, "float64") @ coefficients
    return coefficients, float(np.max(np.abs(predicted - peaks) / peaks))


def widest(coefficients, layers, budget):
    """The largest width (multiple of 64) whose predicted peak fits."""
    a, b, e, f, c = coefficients
    dim = 64
    while (a * parameters(layers, dim + 64) + b * layers * (dim + 64)
           + e * layers + f * (dim + 64) ** 2 + c) <= budget:
        dim += 64
    return dim


def measured_widest(config, layers, dim, budget):
    """Steps the width by 64 from the fit's `dim` until it fits and the
    next does not; returns (width, its peak, the next width's peak)."""
    peaks = {}

    def peak(width):
        if width not in peaks:
            peaks[width] = measure(config, layers, width)[0]
        return peaks[width]
    while dim > 64 and peak(dim) > budget:
        dim -= 64
    while peak(dim + 64) <= budget:
        dim += 64
    return dim, peak(dim), peak(dim + 64)


def main(args):
    tfpar.use_virtual_cpus(8)
    budget = args.budget_mib * 2**20
    only = set(filter(None, args.only.split(",")))
    print(f"GPT vocab {VOCAB}, {TOKENS} tokens, {HEADS} heads, batch {BATCH}, "
          f"Adam fp32, 8 virtual CPUs; budget {args.budget_mib:g} MiB per "
          f"device; {args.layers} layers")
    print(f"{'config':23s} {'B/param':>7s} {'fit':>4s} {'err':>6s} "
          f"{'width':>6s} {'params':>11s} {'peak MiB':>9s} {'next MiB':>9s}")
    for config in CONFIGS:
        if only and config[0] not in only:
            continue
        points = []
        for layers, dim in FIT_SIZES:
            peak, counted = measure(config, layers, dim)
            assert counted == parameters(layers, dim), (counted, layers, dim)
            points.append((layers, dim, peak))
        coefficients, error = fit(points)
        predicted = widest(coefficients, args.layers, budget)
        dim, fits, over = measured_widest(config, args.layers, predicted,
                                          budget)
        print(f"{config[0]:23s} {coefficients[0]:7.2f} {predicted:4d} "
              f"{error:6.1%} {dim:6d} {parameters(args.layers, dim):11,d} "
              f"{fits / 2**20:9.1f} {over / 2**20:9.1f}", flush=True)


if __name__ == "__main__":
    main(parse_args())
