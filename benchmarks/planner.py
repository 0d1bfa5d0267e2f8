"""How good are tfpar.plan's predictions on this machine?

For three model shapes — a wide MLP, a GPT-style transformer and a CNN —
plans with `tfpar.Cluster.local()`, then trains the candidates on the
virtual CPUs and prints the whole table: predicted and measured step time,
predicted and measured per-device bytes of weights and optimizer state
(`strategy.memory_per_device()`); then the chosen plan's measured time vs
the best measured, Spearman's rho of predicted vs measured step times, and
the k `tfpar.plan(measure=k)` would need to pick a plan within 10% of the
best measured.

Measured: every feasible candidate with at most `--max-microbatches` (8)
micro-batches (`--quick`: the best-predicted of each mesh shape), each
distinct program once (with one micro-batch GPipe and 1F1B are the same
schedule: the twin's row is a copy, `same_as`). Interleaved: candidates
are built and warmed up (`--warmup` steps) in a shuffled order by
`tier` (no recomputation and 1F1B first, then GPipe, then recomputation:
a run cut short has measured whole tiers), as many at once as `--chunk` and `--memory-gb`
of host memory allow (a chunk), then each chunk is
timed over `--rounds` rounds, every candidate once per round in a shuffled
order, the fastest of `--steps` steps kept, medians over rounds. Two
anchors (the predicted best and the best-predicted without a pipeline)
run in every chunk's rounds, so chunks timed under different loads
compare through them (the "anchor-normalised" summary). `--save DIR`
appends each chunk's rows to `DIR/<model>.jsonl` (every round's time, the
anchors', build seconds, load); `--resume` measures only what DIR lacks;
`--rerank DIR` ranks saved tables with the current cost model and
`Cluster.local()` without measuring (to compare cost models on the same
measurements).

    python benchmarks/planner.py --save DIR [--rounds 5] [--steps 2]
    python benchmarks/planner.py --rerank DIR
    python benchmarks/planner.py --recheck DIR [--top 3] [--rounds 3]

`--recheck` measures the `--top` best-predicted and best-measured (CPU
time, wall clock) candidates of saved tables again, interleaved over `--rounds`
rounds (a second measurement of the contenders). `--rerank DIR
--from-chunk N` ranks only the rows of chunk N and later.
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


def candidates(name, cluster, quick=False, max_microbatches=8):
    """(plan, the feasible candidates with at most `max_microbatches`
    micro-batches in predicted order)."""
    build, batch = MODELS[name]
    plan = tfpar.plan(_source(name), batch, cluster=cluster)
    feasible = [c for c in plan.candidates if c.rejected is None
                and c.num_microbatches <= max_microbatches]
    if quick:
        seen, chosen = set(), []
        for c in feasible:
            if tuple(c.axes.values()) not in seen:
                seen.add(tuple(c.axes.values()))
                chosen.append(c)
        feasible = chosen
    return plan, feasible


def program_key(c):
    """What makes two candidates different programs: with one micro-batch
    GPipe and 1F1B are the same schedule (measured once, the twin's row
    copied with `same_as`)."""
    return (tuple(c.axes.items()), c.num_microbatches, c.fsdp, c.recompute,
            c.sequence_parallel, tuple(c.stage_starts or ()),
            c.schedule if c.num_microbatches > 1 else None)


def tier(c):
    """0: no recomputation, 1F1B or no pipeline; 1: GPipe with more than
    one micro-batch; 2: recomputation."""
    if c.recompute:
        return 2
    return int(c.schedule == "gpipe" and c.num_microbatches > 1)


def _rss_gb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _load_rows(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _build(c, name, x, y, warmup):
    """(stepper, measured per-device state bytes, build seconds) of a
    candidate: built, compiled and run `warmup` steps."""
    import time  # noqa: PLC0415

    from tfpar.planner import measure  # noqa: PLC0415
    start = time.perf_counter()
    model, p = measure.build_candidate(c, _source(name), MODELS[name][1])
    for _ in range(warmup):
        model.train_on_batch(x, y)
    used = max(sum(v.values()) for v in
               p.strategy().memory_per_device().values())
    return ((lambda: model.train_on_batch(x, y)), used,
            time.perf_counter() - start)


def measure_model(name, cluster, args):
    """Measures every candidate (`candidates`), interleaved: in chunks of
    what `--memory-gb` holds built at once (all of them when it fits),
    each chunk built, warmed up, then timed over `--rounds` rounds (every
    candidate of the chunk and the anchors once per round, shuffled; the
    fastest of `--steps` steps; medians over rounds). The anchors — the
    predicted best and the best-predicted candidate without a pipeline —
    stay built and run in every chunk's rounds, so chunks measured under
    different loads compare through them (`relative`: each round's time
    over the anchors' geometric mean in that round; `anchors`: each
    anchor's wall and CPU seconds per round, the plan's first, so a row
    compares with the plan timed beside it, `over_the_plan`). Rows are
    saved after each chunk (`--save`, resumable with `--resume`); returns
    the rows."""
    import gc  # noqa: PLC0415
    import random  # noqa: PLC0415

    from tfpar.planner import measure  # noqa: PLC0415
    batch = MODELS[name][1]
    plan, feasible = candidates(name, cluster, args.quick,
                                args.max_microbatches)
    path = os.path.join(args.save, f"{name}.jsonl") if args.save else None
    saved = _load_rows(path) if args.resume else []
    if path and not args.resume:
        open(path, "w").close()
    done = {r["label"] for r in saved}
    twins, distinct = {}, {}
    for c in feasible:
        twins.setdefault(program_key(c), []).append(c)
    distinct = [group[0] for group in twins.values()]
    # In tiers — first without recomputation, 1F1B; then GPipe with several
    # micro-batches (on a shared host the same actions in another order);
    # recomputation last (it only adds a forward pass, for memory this host
    # does not lack) — each by micro-batch count (the cheapest to build
    # first: a run cut short has measured a stated rule), shuffled within.
    todo = [c for c in distinct if c.label not in done]
    random.Random(args.seed).shuffle(todo)
    todo.sort(key=lambda c: (tier(c), c.num_microbatches))
    pipeless = next(c for c in distinct if c.axes["pipe"] == 1)
    anchors = [distinct[0]] + ([pipeless] if pipeless is not distinct[0] else [])
    print(f"\n{name}: global batch {batch}, {len(plan.candidates)} candidates"
          f" ({sum(c.rejected is None for c in plan.candidates)} feasible), "
          f"searched in {plan.info['search_s']:.2f} s; measuring the "
          f"{len(feasible)} with <= {args.max_microbatches} micro-batches, "
          f"{len(distinct)} distinct programs, {len(distinct) - len(todo)} "
          f"measured before; anchors {[a.label for a in anchors]}",
          flush=True)
    x, y = measure.synthetic_batch(measure._shapes(_source(name)), batch)  # noqa: SLF001
    built = {a.label: _build(a, name, x, y, args.warmup) for a in anchors}
    chunk_id = max([r.get("chunk", -1) for r in saved], default=-1) + 1
    while todo:
        base, chunk = _rss_gb(), []
        while (todo and _rss_gb() - base < args.memory_gb
               and len(chunk) < args.chunk):
            c = todo.pop(0)
            if c.label in built:
                chunk.append(c)
                continue
            try:
                built[c.label] = _build(c, name, x, y, args.warmup)
                chunk.append(c)
                print(f"  built {c.label} in {built[c.label][2]:.1f} s "
                      f"({len(todo)} to go, {_rss_gb():.1f} GB, load "
                      f"{os.getloadavg()[0]:.0f})", flush=True)
            except Exception as e:  # a plan that does not run: say so, go on
                print(f"{c.label:40s} FAILED: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]}", flush=True)
        rows = _time_chunk(chunk, anchors, built, twins, args, chunk_id)
        _write(path, rows)
        saved += rows
        for c in chunk:
            if c not in anchors:
                del built[c.label]
        gc.collect()
        chunk_id += 1
    return saved


def _time_chunk(chunk, anchors, built, twins, args, chunk_id):
    """Rows of `chunk` (and its twins) timed over interleaved rounds with
    the anchors."""
    import numpy as np  # noqa: PLC0415

    from tfpar.planner import measure  # noqa: PLC0415
    timed = list(dict.fromkeys([c.label for c in chunk]
                               + [a.label for a in anchors]))
    times, cpu = measure.interleaved(
        {label: built[label][0] for label in timed}, rounds=args.rounds,
        steps=args.steps, seed=args.seed + chunk_id)
    anchor_gm = np.exp(np.mean([np.log(times[a.label]) for a in anchors],
                               axis=0))
    load = os.getloadavg()[0]
    rows = []
    for c in chunk:
        seconds = float(np.median(times[c.label]))
        relative = float(np.median(np.asarray(times[c.label]) / anchor_gm))
        for twin in twins[program_key(c)]:
            rows.append({
                "label": twin.label, "measured_s": seconds,
                "relative": relative, "rounds": times[c.label],
                "cpu_s": float(np.median(cpu[c.label])),
                "cpu_rounds": cpu[c.label],
                "chunk": chunk_id, "anchor_rounds": anchor_gm.tolist(),
                "anchors": {a.label: [times[a.label], cpu[a.label]]
                            for a in anchors},
                "predicted_s": twin.estimate.step_time_s,
                "predicted_bytes": _state_bytes(twin),
                "measured_bytes": built[c.label][1],
                "build_s": built[c.label][2], "load": load,
                "tier": tier(twin),
                **({"same_as": c.label} if twin is not c else {})})
            print(f"{twin.label:44s} {twin.estimate.step_time_s * 1e3:8.2f} "
                  f"{seconds * 1e3:8.2f} {relative:6.3f} "
                  f"cpu {float(np.median(cpu[c.label])) * 1e3:8.2f} "
                  f"{_state_bytes(twin):11,.0f} {built[c.label][1]:11,} "
                  f"chunk {chunk_id}", flush=True)
    return rows


def _write(path, rows):
    if path:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def measured_rows(name, cluster, directory, kind="wall", max_microbatches=8,
                  from_chunk=0):
    """[(predicted now, measured, label)] of a saved table in predicted
    order. `kind`: "wall" (median over rounds of the fastest step), "cpu"
    (the same of this process' CPU seconds per step) or "normalised" (each
    row's wall time relative to its chunk's anchors, times the anchors'
    median over all chunks); `from_chunk`: only rows of that chunk and
    later (those measured after a change of the cost model)."""
    import numpy as np  # noqa: PLC0415
    rows = [r for r in _load_rows(os.path.join(directory, f"{name}.jsonl"))
            if r.get("chunk", 0) >= from_chunk]
    measured = {r["label"]: r["measured_s"] for r in rows}
    if kind == "cpu":
        measured = {r["label"]: r["cpu_s"] for r in rows if "cpu_s" in r}
    if kind == "normalised" and any("relative" in r for r in rows):
        chunks = {r["chunk"]: r["anchor_rounds"] for r in rows if "chunk" in r}
        reference = float(np.median(np.concatenate(list(chunks.values()))))
        measured.update({r["label"]: r["relative"] * reference
                         for r in rows if "relative" in r})
    _, feasible = candidates(name, cluster,
                             max_microbatches=max_microbatches)
    return [(c.estimate.step_time_s, measured[c.label], c.label)
            for c in feasible if c.label in measured]


def rerank(name, cluster, directory):
    """[(predicted now, measured then)] of a saved table, in predicted order."""
    return measured_rows(name, cluster, directory)


def bytes_agreement(name, cluster, directory, max_microbatches=8):
    """(rows, rows within 10%, the largest relative difference) of the
    predicted vs the saved measured per-device bytes."""
    measured = {r["label"]: r["measured_bytes"] for r in _load_rows(
        os.path.join(directory, f"{name}.jsonl"))}
    _, feasible = candidates(name, cluster, max_microbatches=max_microbatches)
    diffs = [abs(_state_bytes(c) - measured[c.label]) / measured[c.label]
             for c in feasible if c.label in measured]
    return len(diffs), sum(d <= 0.1 for d in diffs), max(diffs)


def recheck(name, cluster, directory, top, rounds, steps, warmup=2,
            max_microbatches=8, from_chunk=0):
    """The `top` best-predicted and `top` best-measured (by CPU time and by
    the wall clock; of the rows of chunk `from_chunk` and later, e.g. those
    measured on another host) candidates of a saved table measured again:
    all built first, then interleaved over `rounds` rounds; {"wall"|"cpu":
    [(predicted, median of the rounds, label)] in predicted order}."""
    import numpy as np  # noqa: PLC0415

    from tfpar.planner import measure  # noqa: PLC0415
    saved, walls = ({r[2]: r[1] for r in measured_rows(
        name, cluster, directory, kind, max_microbatches, from_chunk)}
        for kind in ("cpu", "wall"))
    _, feasible = candidates(name, cluster,
                             max_microbatches=max_microbatches)
    by_measured = sorted((c for c in feasible if c.label in saved),
                         key=lambda c: saved[c.label])
    by_wall = sorted((c for c in feasible if c.label in walls),
                     key=lambda c: walls[c.label])
    chosen = list({c.label: c for c in feasible[:top] + by_measured[:top]
                   + by_wall[:top]}.values())
    x, y = measure.synthetic_batch(measure._shapes(_source(name)),  # noqa: SLF001
                                   MODELS[name][1])
    steppers = {c.label: _build(c, name, x, y, warmup)[0] for c in chosen}
    wall, cpu = measure.interleaved(steppers, rounds=rounds, steps=steps)
    out = {}
    for kind, times in (("wall", wall), ("cpu", cpu)):
        out[kind] = [(c.estimate.step_time_s,
                      float(np.median(times[c.label])), c.label)
                     for c in chosen]
    for c in chosen:
        print(f"{c.label:44s} {c.estimate.step_time_s * 1e3:8.2f} wall "
              f"{np.median(wall[c.label]) * 1e3:8.2f} cpu "
              f"{np.median(cpu[c.label]) * 1e3:8.2f} (table: cpu "
              f"{saved.get(c.label, float('nan')) * 1e3:8.2f})", flush=True)
    return out


def _clusters(name, cluster, directory):
    """[(which, Cluster)]: this process' `Cluster.local()` and, when the
    table saved one, the calibration it was measured with."""
    out = [("this calibration", cluster)]
    path = os.path.join(directory, f"{name}.cluster.json")
    if os.path.exists(path):
        with open(path) as f:
            out.append(("the run's calibration", tfpar.Cluster(**json.load(f))))
    return out


def over_the_plan(row):
    """A saved row's CPU seconds per step over the plan's in the same
    rounds (the first anchor, the predicted best when it was measured; rows
    saved since 2026-12-04 keep the anchors' times), or NaN."""
    import numpy as np  # noqa: PLC0415
    if "anchors" not in row:
        return float("nan")
    plan_wall_and_cpu = next(iter(row["anchors"].values()))
    return row["cpu_s"] / float(np.median(plan_wall_and_cpu[1]))


def report_beside_the_plan(name, cluster, directory, max_microbatches):
    """Prints how the rows timed beside the plan compare with it."""
    _, feasible = candidates(name, cluster, max_microbatches=max_microbatches)
    labels = {c.label for c in feasible}
    rows = [r for r in _load_rows(os.path.join(directory, f"{name}.jsonl"))
            if "anchors" in r and r["label"] in labels]
    if rows:
        best = min(rows, key=over_the_plan)
        print(f"{name}: {len(rows)} rows timed beside the plan "
              f"({next(iter(best['anchors']))}); the fastest of them, "
              f"{best['label']}, takes {over_the_plan(best):.2f}x the plan's "
              "CPU time per step")


def markdown(name, cluster, directory, max_microbatches=8):
    """`DIR/<model>.md`: the saved table, one row per candidate in order of
    measured CPU time, with the current cost model's prediction
    (`cluster`)."""
    import numpy as np  # noqa: PLC0415
    saved = {r["label"]: r for r in _load_rows(
        os.path.join(directory, f"{name}.jsonl"))}
    normalised = {label: m for _, m, label in measured_rows(
        name, cluster, directory, "normalised", max_microbatches)}
    _, feasible = candidates(name, cluster, max_microbatches=max_microbatches)
    rows = sorted((c for c in feasible if c.label in saved),
                  key=lambda c: saved[c.label].get("cpu_s",
                                                   saved[c.label]["measured_s"]))
    lines = [f"# {name}: {len(rows)} measured of {len(feasible)} feasible "
             f"candidates with <= {max_microbatches} micro-batches", "",
             "In order of measured CPU time per step; predicted with "
             "`markdown.cluster.json` (a CPU-time `Cluster.local()`).", "",
             "| candidate | tier | predicted ms | measured ms (median) | "
             "anchor-normalised ms | rounds ms (min–max) | CPU ms | "
             "CPU ÷ the plan's in the same rounds | chunk | "
             "predicted B/dev | measured B/dev |", "|" + "---|" * 11]
    for c in rows:
        r = saved[c.label]
        lines.append(
            f"| {c.label} | {r.get('tier', '')} | "
            f"{c.estimate.step_time_s * 1e3:.1f} | {r['measured_s'] * 1e3:.1f}"
            f" | {normalised[c.label] * 1e3:.1f} | "
            f"{np.min(r['rounds']) * 1e3:.1f}–{np.max(r['rounds']) * 1e3:.1f}"
            f" | {r.get('cpu_s', float('nan')) * 1e3:.1f} | "
            f"{over_the_plan(r):.2f} | {r['chunk']} | "
            f"{r['predicted_bytes']:,.0f} | "
            f"{r['measured_bytes']:,} |")
    with open(os.path.join(directory, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def report(name, rows, what):
    ratio, rho, k, chosen, best = summary(rows)
    print(f"{name} ({what}): {len(rows)} candidates; chosen/best measured = "
          f"{ratio:.2f} (target <= 1.10; chosen {chosen}, best {best}); "
          f"Spearman rho predicted vs measured = {rho:.2f}; measure=k "
          f"needs k = {k}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="measure the best-predicted candidate of each "
                             "mesh shape only")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2,
                        help="steps per candidate per round (the fastest "
                             "is kept)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-microbatches", type=int, default=8)
    parser.add_argument("--memory-gb", type=float, default=4.0,
                        help="host memory the built candidates of one chunk "
                             "may take (RSS growth)")
    parser.add_argument("--chunk", type=int, default=24,
                        help="at most this many candidates built at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default="mlp,gpt,cnn")
    parser.add_argument("--save", help="directory for the measured tables")
    parser.add_argument("--resume", action="store_true",
                        help="with --save: keep the candidates DIR already "
                             "holds and measure the others")
    parser.add_argument("--rerank", help="rank saved tables, measure nothing")
    parser.add_argument("--recheck", help="measure again, interleaved, the "
                        "--top best predicted and best measured of saved "
                        "tables")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--from-chunk", type=int, default=0,
                        help="with --rerank: only the rows of this chunk "
                             "and later; with --recheck: the best measured "
                             "among them")
    parser.add_argument("--markdown", action="store_true",
                        help="with --rerank: write DIR/<model>.md, the "
                             "table with the current model's predictions")
    args = parser.parse_args()
    tfpar.use_virtual_cpus(8)
    cluster = tfpar.Cluster.local()
    print(f"cluster: {cluster}")
    for name in args.models.split(","):
        if args.recheck:
            rows = recheck(name, cluster, args.recheck, args.top,
                           args.rounds, args.steps, args.warmup,
                           args.max_microbatches, args.from_chunk)
            for kind, kind_rows in rows.items():
                report(name, kind_rows, f"recheck, {kind}")
            continue
        directory = args.rerank or args.save
        if not args.rerank:
            if args.save:  # the calibration the run was predicted with
                with open(os.path.join(args.save, f"{name}.cluster.json"),
                          "w") as f:
                    json.dump(cluster.to_dict(), f)
            saved = measure_model(name, cluster, args)
        if not directory:
            report(name, sorted((r["predicted_s"], r["measured_s"],
                                 r["label"]) for r in saved), "wall")
            continue
        for which, c in _clusters(name, cluster, directory):
            for kind in ("wall", "normalised", "cpu"):
                rows = measured_rows(name, c, directory, kind,
                                     args.max_microbatches, args.from_chunk)
                if rows:
                    report(name, rows, f"{kind}, {which}")
        if args.markdown:  # with the calibration it was predicted with
            markdown(name, cluster, directory, args.max_microbatches)
            with open(os.path.join(directory, "markdown.cluster.json"),
                      "w") as f:
                json.dump(cluster.to_dict(), f)
        report_beside_the_plan(name, cluster, directory,
                               args.max_microbatches)
        n, close, worst = bytes_agreement(name, cluster, directory,
                                         args.max_microbatches)
        print(f"{name}: per-device bytes of weights and optimizer state "
              f"within 10% for {close} of {n} (largest difference "
              f"{worst * 100:.2g}%)")


if __name__ == "__main__":
    main()
