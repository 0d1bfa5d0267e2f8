"""The runtime's fixed costs on this machine, and how the planner models them.

A tiny Dense stack (`--layers` hidden layers of width 16, batch 64) has
almost no compute: what its step costs is the runtime's fixed cost per op,
per device, per micro-batch and per stage. For twelve layouts of it (data,
model, pipelines of 2, 4 and 8 stages with 1–8 micro-batches) this builds
and compiles each, then times them round after round (interleaved: other
jobs' load falls on all alike; per round the fastest of 3 steps, then the
median over rounds), and prints the measured step time next to the
planner's prediction with `Cluster.local()` as measured (with the fixed
costs) and without them (`op_time`, `send_time`, `conv_flops` and
`conv_time` 0: the model before),
with Spearman's rho of each. `--count` prints the traced step's ops by
kind (the counts `tfpar/planner/cost.py` and `profile.layer_ops` use).

    python benchmarks/planner_fixed.py [--layers 8] [--rounds 5] [--count]
    python benchmarks/planner_fixed.py --model gpt [--rounds 3]

`--model mlp|cnn|gpt` does the same for `benchmarks/planner.py`'s wide
MLP, CNN or GPT on eight of its layouts (`MODEL_LAYOUTS`: the data, model
and pipeline extremes and the best predicted with and without the fixed
costs on 2026-12-02) plus the plan `tfpar.plan` chooses when it is not
one of them, interleaved likewise; each row shows the predicted parts
(ms). `--save FILE` writes the measured and predicted times as JSON.
"""

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Its siblings (planner.py), for a process that imports this module.
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import tfpar  # noqa: E402

LAYOUTS = [({"data": 8}, 1), ({"model": 8}, 1), ({"data": 2, "model": 4}, 1),
           ({"pipe": 8}, 1), ({"pipe": 8}, 4), ({"pipe": 8}, 8),
           ({"data": 2, "pipe": 4}, 1), ({"data": 2, "pipe": 4}, 4),
           ({"data": 4, "pipe": 2}, 1), ({"data": 4, "pipe": 2}, 8),
           ({"pipe": 2, "model": 4}, 1), ({"pipe": 2, "model": 4}, 4)]
BATCH = 64
MODEL_LAYOUTS = {
    "mlp": [({"data": 2, "model": 4}, 1), ({"model": 8}, 1), ({"data": 8}, 1),
            ({"pipe": 2, "model": 4}, 1), ({"pipe": 4, "model": 2}, 1),
            ({"pipe": 4, "model": 2}, 4), ({"pipe": 2, "model": 4}, 4),
            ({"data": 2, "pipe": 4}, 2)],
    "cnn": [({"pipe": 8}, 1), ({"data": 2, "pipe": 4}, 1), ({"data": 8}, 1),
            ({"model": 8}, 1), ({"pipe": 4, "model": 2}, 1), ({"pipe": 8}, 8),
            ({"data": 4, "pipe": 2}, 2), ({"data": 2, "model": 4}, 1)],
    "gpt": [({"pipe": 8}, 1), ({"pipe": 2, "model": 4}, 1),
            ({"data": 2, "pipe": 4}, 1), ({"model": 8}, 1), ({"data": 8}, 1),
            ({"data": 2, "pipe": 2, "model": 2}, 1),
            ({"pipe": 4, "model": 2}, 1), ({"pipe": 2, "model": 4}, 4)]}


def dense_stack(layers=8, width=16):
    import keras  # noqa: PLC0415
    x = keras.Input((width,), name="x")
    h = x
    for i in range(layers):
        h = keras.layers.Dense(width, activation="relu", name=f"d{i}")(h)
    return keras.Model(x, keras.layers.Dense(8, name="head")(h), name="stack")


def pick(plan, axes, m):
    """The plain (no fsdp, recomputation or sequence parallelism; 1F1B)
    candidate of `axes` with `m` micro-batches."""
    full = {"data": 1, "pipe": 1, "model": 1, **axes}
    return next(c for c in plan.candidates if c.axes == full
                and c.rejected is None and not (c.fsdp or c.recompute)
                and not c.sequence_parallel and c.num_microbatches == m
                and (full["pipe"] == 1 or c.schedule == "1f1b"))


def build(candidate, builder, batch=BATCH):
    from tfpar.planner import measure  # noqa: PLC0415
    plan = measure.candidate_plan(candidate, builder, batch)
    model = measure.build_and_apply(plan, builder)
    with plan.strategy().scope():
        model.compile(optimizer="adam", loss="mse")
    return model, plan


def interleaved(models, x, y, rounds):
    """{label: median over rounds of the fastest of 3 steps}."""
    for model in models.values():  # trace and warm up
        model.train_on_batch(x, y)
        model.train_on_batch(x, y)
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for label, model in models.items():
            steps = []
            for _ in range(3):
                start = time.perf_counter()
                model.train_on_batch(x, y)
                steps.append(time.perf_counter() - start)
            times[label].append(min(steps))
    return {label: float(np.median(t)) for label, t in times.items()}


def count_ops(model, plan, x, y):
    """The traced step's ops by kind (pipeline actions per part, moves,
    optimizer, the rest)."""
    import tensorflow as tf  # noqa: PLC0415

    extended = plan.strategy().extended
    runner = extended.make_runner(model, "train")
    if hasattr(runner, "traced_step"):
        concrete = runner.traced_step(
            tf.nest.map_structure(tf.convert_to_tensor, (x, y)))
    else:
        runner.run([(x, y)])
        concrete = runner._functions["train"]._list_all_concrete_functions()[0]  # noqa: SLF001
    kinds = collections.Counter()
    for op in concrete.graph.get_operations():
        action = re.search(r"tfpar_pipeline_action_(\d+)[FBW]\d+/", op.name)
        kinds["part " + action.group(1) if action else
              "send" if "send_" in op.name else
              "optimizer" if "adam" in op.name.lower() else "other"] += 1
    return dict(kinds)


def workload(args):
    """(source, global batch, layouts) of `--model`."""
    if args.model == "stack":
        return (lambda: dense_stack(args.layers)), BATCH, LAYOUTS
    import planner  # noqa: PLC0415
    return (planner._source(args.model), planner.MODELS[args.model][1],  # noqa: SLF001
            MODEL_LAYOUTS[args.model])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--model", default="stack",
                        choices=["stack", "mlp", "cnn", "gpt"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", action="store_true")
    parser.add_argument("--save", help="write the table to this JSON file")
    args = parser.parse_args()
    tfpar.use_virtual_cpus(8)
    from planner import spearman  # noqa: PLC0415
    from tfpar.planner import measure  # noqa: PLC0415

    local = tfpar.Cluster.local()
    before = dataclasses.replace(local, op_time=0.0, send_time=0.0,
                                 conv_flops=0.0, conv_time=0.0)
    print(f"op_time {local.op_time * 1e6:.2f} µs, send_time "
          f"{local.send_time * 1e6:.1f} µs, α {local.intra_host_latency * 1e3:.2f}"
          f" ms; load {os.getloadavg()[0]:.1f}")
    source, batch, layouts = workload(args)
    plans = {name: tfpar.plan(source, batch, cluster=c)
             for name, c in (("after", local), ("before", before))}
    x, y = measure.synthetic_batch(measure._shapes(source), batch)  # noqa: SLF001
    before_by_label = {c.label: c for c in plans["before"].candidates}
    chosen = min((c for c in plans["after"].candidates if c.rejected is None),
                 key=lambda c: c.estimate.step_time_s)
    picked = [pick(plans["after"], axes, m) for axes, m in layouts]
    models, rows = {}, []
    for c in picked + ([chosen] if chosen not in picked else []):
        models[c.label], plan = build(c, source, batch)
        rows.append((c.label, c.estimate.step_time_s,
                     before_by_label[c.label].estimate.step_time_s,
                     c.estimate.time_s))
        if args.count:
            print(c.label, count_ops(models[c.label], plan, x, y), flush=True)
    measured = interleaved(models, x, y, args.rounds)
    report(rows, measured, spearman)
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"load": os.getloadavg()[0], "rows": [
                {"label": label, "measured_s": measured[label],
                 "after_s": after, "before_s": old, "parts": parts}
                for label, after, old, parts in rows]}, f, indent=1)


def report(rows, measured, spearman):
    """The table, then rho, chosen ÷ best and k of each model."""
    print(f"{'layout':36s} {'measured':>9s} {'after':>9s} {'before':>9s} (ms)")
    for label, after, old, parts in rows:
        print(f"{label:36s} {measured[label] * 1e3:9.2f} {after * 1e3:9.2f} "
              f"{old * 1e3:9.2f}  " + ", ".join(
                  f"{k} {v * 1e3:.1f}" for k, v in parts.items() if v))
    meas = [measured[r[0]] for r in rows]
    for i, name in ((1, "after"), (2, "before")):
        order = np.argsort([r[i] for r in rows], kind="stable")
        k = next(j + 1 for j, o in enumerate(order)
                 if meas[o] <= 1.1 * min(meas))
        print(f"{name}: rho {spearman([r[i] for r in rows], meas):.2f}, "
              f"chosen ÷ best measured {meas[order[0]] / min(meas):.2f}, "
              f"measure=k needs k = {k}")
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
