"""How good are tfpar.plan's predictions on this machine?

For three model shapes — a wide MLP, a GPT-style transformer and a CNN —
plans with `tfpar.Cluster.local()` (FLOP/s and bandwidth measured by a
micro-benchmark, latency looked up), then trains the candidates on the
virtual CPUs for a few steps each and prints the whole table: predicted
and measured step time, predicted and measured per-device bytes of
weights and optimizer state (`strategy.memory_per_device()`); then the
chosen plan's measured time vs the best measured, and Spearman's rho of
predicted vs measured step times.

By default every feasible candidate with at most 8 micro-batches is
measured; `--quick` measures the best-predicted candidate of each mesh
shape (a few minutes).

    python benchmarks/planner.py [--quick] [--steps 3]
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import tfpar  # noqa: E402


def wide_mlp():
    import keras  # noqa: PLC0415
    x = keras.Input((512,), name="x")
    h = x
    for i in range(2):
        h = keras.layers.Dense(2048, activation="relu", name=f"up{i}")(h)
        h = keras.layers.Dense(512, name=f"down{i}")(h)
    return keras.Model(x, keras.layers.Dense(10, name="head")(h), name="mlp")


def gpt():
    from gpt import build_gpt  # noqa: PLC0415
    return build_gpt(layers=2)


def cnn():
    import keras  # noqa: PLC0415
    x = keras.Input((32, 32, 3), name="image")
    h = x
    for i, filters in enumerate((16, 32, 32)):
        h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu",
                                name=f"conv{i}")(h)
        h = keras.layers.MaxPooling2D(name=f"pool{i}")(h)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(256, activation="relu", name="fc_up")(h)
    h = keras.layers.Dense(64, name="fc_down")(h)
    return keras.Model(x, keras.layers.Dense(10, name="head")(h), name="cnn")


MODELS = {"mlp": (wide_mlp, 256), "gpt": (gpt, 16), "cnn": (cnn, 64)}


def spearman(a, b):
    """Spearman's rank correlation (average ranks for ties)."""
    import numpy as np  # noqa: PLC0415

    def ranks(v):
        v = np.asarray(v, float)
        order = v.argsort()
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for value in np.unique(v):
            r[v == value] = r[v == value].mean()
        return r
    if len(a) < 2:
        return float("nan")
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="measure the best-predicted candidate of each "
                             "mesh shape only")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", default="mlp,gpt,cnn")
    args = parser.parse_args()
    tfpar.use_virtual_cpus(8)
    from tfpar.planner import measure  # noqa: PLC0415

    cluster = tfpar.Cluster.local()
    print(f"cluster: {cluster}")
    for name in args.models.split(","):
        build, batch = MODELS[name]
        plan = tfpar.plan(build, batch, cluster=cluster)
        feasible = [c for c in plan.candidates if c.rejected is None
                    and c.num_microbatches <= 8]
        if args.quick:
            seen, chosen = set(), []
            for c in feasible:
                key = tuple(c.axes.values())
                if key not in seen:
                    seen.add(key)
                    chosen.append(c)
            feasible = chosen
        print(f"\n{name}: global batch {batch}, {len(plan.candidates)} "
              f"candidates, searched in {plan.info['search_s']:.2f} s; "
              f"measuring {len(feasible)}")
        print(f"{'candidate':36s} {'pred ms':>8s} {'meas ms':>8s} "
              f"{'pred B/dev':>11s} {'meas B/dev':>11s}")
        rows = []
        for c in feasible:
            seconds, _, p = measure.time_candidate(
                c, build, batch, steps=args.steps, return_model=True)
            used = max(sum(v.values()) for v in
                       p.strategy().memory_per_device().values())
            m = c.estimate.memory_per_device
            predicted = m["params"] + m["optimizer"]
            rows.append((c, seconds, predicted, used))
            print(f"{c.label:36s} {c.estimate.step_time_s * 1e3:8.2f} "
                  f"{seconds * 1e3:8.2f} {predicted:11,.0f} {used:11,}",
                  flush=True)
        best = min(rows, key=lambda r: r[1])
        first = rows[0]  # the planner's choice (best predicted)
        rho = spearman([r[0].estimate.step_time_s for r in rows],
                       [r[1] for r in rows])
        worst_bytes = max(abs(r[2] - r[3]) / r[3] for r in rows)
        print(f"chosen {first[0].label}: measured {first[1] * 1e3:.2f} ms; "
              f"best measured {best[0].label}: {best[1] * 1e3:.2f} ms "
              f"(chosen/best = {first[1] / best[1]:.2f}, target <= 1.10); "
              f"Spearman rho predicted vs measured = {rho:.2f}; per-device "
              f"bytes: largest relative difference {worst_bytes:.1%}")


if __name__ == "__main__":
    main()
