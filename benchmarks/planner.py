"""How good are tfpar.plan's predictions on this machine?

For three model shapes — a wide MLP, a GPT-style transformer and a CNN —
plans with `tfpar.Cluster.local()`, then trains the candidates on the
virtual CPUs for a few steps each and prints the whole table: predicted
and measured step time, predicted and measured per-device bytes of
weights and optimizer state (`strategy.memory_per_device()`); then the
chosen plan's measured time vs the best measured, Spearman's rho of
predicted vs measured step times, and the k `tfpar.plan(measure=k)` would
need to pick a plan within 10% of the best measured.

By default every feasible candidate with at most 8 micro-batches is
measured (each: built, compiled, `--warmup` untimed then `--steps` timed
steps, the median kept); `--quick` measures the best-predicted candidate
of each mesh shape. `--save DIR` writes each model's measured table
(`DIR/<model>.jsonl`, one line per candidate, as it is measured);
`--rerank DIR` reads such tables back and ranks them with the current
cost model and `Cluster.local()` without measuring again (to compare cost
models on the same measurements).

    python benchmarks/planner.py [--quick] [--steps 5] [--save DIR]
    python benchmarks/planner.py --rerank DIR
    python benchmarks/planner.py --recheck DIR [--top 3] [--rounds 3]

`--recheck` measures the `--top` best-predicted and best-measured
candidates of saved tables again, interleaved over `--rounds` rounds
(medians): on a loaded host a single pass measures early and late
candidates under different loads.
"""

import argparse
import json
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
    """Built once and cloned per candidate: build_gpt leaves its residual
    adds unnamed, so every build would name them anew (add_1, add_2, ...)
    and a plan's stage cut names the first build's layers."""
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


def summary(rows):
    """(chosen ÷ best measured, Spearman's rho, the smallest k whose k
    best-predicted include one within 10% of the best measured, the chosen
    label, the best measured label) of rows (predicted s, measured s,
    label) in predicted order."""
    best = min(rows, key=lambda r: r[1])
    k = next(i + 1 for i, r in enumerate(rows) if r[1] <= 1.1 * best[1])
    rho = spearman([r[0] for r in rows], [r[1] for r in rows])
    return rows[0][1] / best[1], rho, k, rows[0][2], best[2]


def _state_bytes(candidate):
    """Predicted bytes of weights and optimizer state on the device holding
    the most of them (what `memory_per_device()` reports the largest of)."""
    stages = (candidate.estimate.memory_by_stage
              or [candidate.estimate.memory_per_device])
    return max(m["params"] + m["optimizer"] for m in stages)


_BUILT = {}


def _source(name):
    """What plan and measure get: the builder, or for the GPT one built
    model (see `gpt`)."""
    if name != "gpt":
        return MODELS[name][0]
    if name not in _BUILT:
        _BUILT[name] = gpt()
    return _BUILT[name]


def candidates(name, cluster, quick=False):
    """(plan, the feasible candidates to measure in predicted order)."""
    build, batch = MODELS[name]
    plan = tfpar.plan(_source(name), batch, cluster=cluster)
    feasible = [c for c in plan.candidates if c.rejected is None
                and c.num_microbatches <= 8]
    if quick:
        seen, chosen = set(), []
        for c in feasible:
            if tuple(c.axes.values()) not in seen:
                seen.add(tuple(c.axes.values()))
                chosen.append(c)
        feasible = chosen
    return plan, feasible


def measure_model(name, cluster, args):
    """Measures and prints every candidate; returns [(predicted, measured,
    label)] in predicted order."""
    from tfpar.planner import measure  # noqa: PLC0415

    batch = MODELS[name][1]
    build = _source(name)
    plan, feasible = candidates(name, cluster, args.quick)
    if args.shuffle:
        import random  # noqa: PLC0415
        random.Random(0).shuffle(feasible)
    path = os.path.join(args.save, f"{name}.jsonl") if args.save else None
    done = set()
    if args.resume and path and os.path.exists(path):
        with open(path) as f:  # measured before: keep, measure the rest
            done = {json.loads(line)["label"] for line in f}
    out = open(path, "a" if args.resume else "w") if path else None
    print(f"\n{name}: global batch {batch}, {len(plan.candidates)} "
          f"candidates, searched in {plan.info['search_s']:.2f} s; "
          f"{len(feasible)} to measure, {len(done)} of them measured before")
    print(f"{'candidate':40s} {'pred ms':>8s} {'meas ms':>8s} "
          f"{'pred B/dev':>11s} {'meas B/dev':>11s}")
    rows = []
    for c in [c for c in feasible if c.label not in done]:
        try:
            seconds, _, p = measure.time_candidate(
                c, build, batch, steps=args.steps, warmup=args.warmup,
                return_model=True)
        except Exception as e:  # a plan that does not run: say so, go on
            print(f"{c.label:40s} FAILED: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200]}", flush=True)
            continue
        used = max(sum(v.values()) for v in
                   p.strategy().memory_per_device().values())
        predicted = _state_bytes(c)
        rows.append((c.estimate.step_time_s, seconds, c.label,
                     plan.candidates.index(c)))
        print(f"{c.label:40s} {c.estimate.step_time_s * 1e3:8.2f} "
              f"{seconds * 1e3:8.2f} {predicted:11,.0f} {used:11,}",
              flush=True)
        if out:
            out.write(json.dumps({"label": c.label, "measured_s": seconds,
                                  "predicted_s": c.estimate.step_time_s,
                                  "predicted_bytes": predicted,
                                  "measured_bytes": used}) + "\n")
            out.flush()
    return [r[:3] for r in sorted(rows, key=lambda r: r[3])]


def rerank(name, cluster, directory):
    """[(predicted now, measured then)] of a saved table, in predicted order."""
    with open(os.path.join(directory, f"{name}.jsonl")) as f:
        measured = {r["label"]: r["measured_s"] for r in map(json.loads, f)}
    _, feasible = candidates(name, cluster)
    return [(c.estimate.step_time_s, measured[c.label], c.label)
            for c in feasible if c.label in measured]


def bytes_agreement(name, cluster, directory):
    """(rows, rows within 10%, the largest relative difference) of the
    predicted vs the saved measured per-device bytes."""
    with open(os.path.join(directory, f"{name}.jsonl")) as f:
        measured = {r["label"]: r["measured_bytes"] for r in map(json.loads, f)}
    _, feasible = candidates(name, cluster)
    diffs = [abs(_state_bytes(c) - measured[c.label]) / measured[c.label]
             for c in feasible if c.label in measured]
    return len(diffs), sum(d <= 0.1 for d in diffs), max(diffs)


def recheck(name, cluster, directory, top, rounds, steps):
    """The `top` best-predicted and `top` best-measured candidates of a saved
    table measured again, round after round (each round times each once,
    so load from other jobs falls on all of them alike); [(predicted,
    median of the rounds, label)] in predicted order."""
    import numpy as np  # noqa: PLC0415

    from tfpar.planner import measure  # noqa: PLC0415

    saved = {r[2]: r[1] for r in rerank(name, cluster, directory)}
    _, feasible = candidates(name, cluster)
    feasible = [c for c in feasible if c.label in saved]
    by_measured = sorted(feasible, key=lambda c: saved[c.label])
    chosen = feasible[:top] + [c for c in by_measured[:top]
                               if c not in feasible[:top]]
    times = {c.label: [] for c in chosen}
    for r in range(rounds):
        for c in chosen:
            times[c.label].append(measure.time_candidate(
                c, _source(name), MODELS[name][1], steps=steps))
            print(f"round {r}: {c.label:40s} "
                  f"{c.estimate.step_time_s * 1e3:8.2f} "
                  f"{times[c.label][-1] * 1e3:8.2f}", flush=True)
    return [(c.estimate.step_time_s, float(np.median(times[c.label])),
             c.label) for c in chosen]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="measure the best-predicted candidate of each "
                             "mesh shape only")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--models", default="mlp,gpt,cnn")
    parser.add_argument("--save", help="directory for the measured tables")
    parser.add_argument("--resume", action="store_true",
                        help="with --save: keep the candidates DIR already "
                             "holds and measure the others")
    parser.add_argument("--shuffle", action="store_true",
                        help="measure in a fixed random order (a table cut "
                             "short is then a fair sample)")
    parser.add_argument("--rerank", help="rank saved tables, measure nothing")
    parser.add_argument("--recheck", help="measure again, interleaved, the "
                        "--top best predicted and best measured of saved "
                        "tables")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tfpar.use_virtual_cpus(8)
    cluster = tfpar.Cluster.local()
    print(f"cluster: {cluster}")
    for name in args.models.split(","):
        if args.recheck:
            rows = recheck(name, cluster, args.recheck, args.top, args.rounds,
                           args.steps)
        elif args.rerank:
            rows = rerank(name, cluster, args.rerank)
            n, close, worst = bytes_agreement(name, cluster, args.rerank)
            print(f"{name}: per-device bytes of weights and optimizer state "
                  f"within 10% for {close} of {n} (largest difference "
                  f"{worst:.1%})")
        else:
            rows = measure_model(name, cluster, args)
        if not rows:
            continue
        ratio, rho, k, chosen, best = summary(rows)
        print(f"{name}: {len(rows)} candidates; chosen/best measured = "
              f"{ratio:.2f} (target <= 1.10; chosen {chosen}, best {best}); "
              f"Spearman rho predicted vs measured = {rho:.2f}; measure=k "
              f"needs k = {k}", flush=True)


if __name__ == "__main__":
    main()
