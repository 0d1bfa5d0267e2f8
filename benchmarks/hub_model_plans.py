"""keras-hub models under three tensor-parallel plans, side by side.

Run it with

    python benchmarks/hub_model_plans.py [--quick] [--mesh DATAxMODEL] [--steps N]

On 8 virtual CPU devices it trains the small keras-hub models of
tests/hub_models.py (GPT-2, Llama, Llama with grouped-query attention,
Gemma, Mistral, BERT, ViT; batch 16, Adam) with `fit` on
Mesh({"data": D, "model": M}) (default 2x4) under each plan:

- auto       : `tfpar.auto_rules(model, mesh=mesh)`, no hand-written rule
- keras-hub  : keras-hub's own `Backbone.get_layout_map(device_mesh)` (Llama
               and Gemma only), its `TensorLayout` axes turned into a
               `tfpar.LayoutRules` spec per key ("batch" -> "data"); these
               layouts also split weights over the batch axis (2-D)
- megatron   : the hand-written Megatron plans of tests/hub_models.py
               (attention by heads, MLP column -> row)

and reports each plan's median ms/step divided by the single-device median
(same model, weights and data; tracing excluded by a warm-up fit) and the
largest per-device bytes of parameters + optimizer slots (and the
single-device total). A plan that fails (e.g. DTensor cannot compile it) is
reported with the first line of its error. `--quick` runs Llama-GQA, Gemma
and BERT with fewer steps. The host has few cores shared with other
processes: compare ratios from the same run only.
"""

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = Path(__file__).resolve().parent

BATCH = 16
QUICK = ("llama_gqa", "gemma", "bert")
PLANS = ("auto", "keras-hub", "megatron")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"only {', '.join(QUICK)}, fewer steps")
    parser.add_argument("--mesh", default="2x4",
                        help="DATAxMODEL, product 8 (default 2x4)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per round (default 6, quick 3)")
    args = parser.parse_args(argv)
    data, model = (int(n) for n in args.mesh.split("x"))
    if data * model != 8:
        parser.error(f"--mesh needs DATAxMODEL with product 8. Received: "
                     f"--mesh {args.mesh}")
    args.axes = {"data": data, "model": model}
    args.steps = args.steps or (3 if args.quick else 6)
    return args


def keras_hub_rules(model, mesh):
    """keras-hub's own layout map for `model` as LayoutRules.

    `LayoutMap` keys are `re.fullmatch`ed against variable paths, as
    `LayoutRules` keys are; each `TensorLayout`'s axes become a spec, the
    layout map's batch axis our data axis. LookupError for a backbone
    without one.
    """
    import keras  # noqa: PLC0415
    import tfpar  # noqa: PLC0415

    backbone = type(model.backbone)
    if "get_layout_map" not in vars(backbone):
        raise LookupError(f"{backbone.__name__} has no get_layout_map")
    device_mesh = keras.distribution.DeviceMesh(
        shape=(mesh.axis_size("data"), mesh.axis_size("model")),
        axis_names=("batch", "model"),
        devices=[f"cpu:{i}" for i in range(8)])
    layout_map = backbone.get_layout_map(device_mesh)
    rename = {"batch": "data"}
    return tfpar.LayoutRules({
        key: tuple(rename.get(a, a) for a in layout_map[key].axes)
        for key in layout_map})


def plans(name, mesh):
    import tfpar  # noqa: PLC0415

    import hub_models  # noqa: PLC0415

    return {
        "auto": lambda model: tfpar.auto_rules(model, mesh=mesh),
        "keras-hub": lambda model: keras_hub_rules(model, mesh),
        "megatron": lambda model: hub_models.megatron_rules(name),
    }


class Run:
    """One model trained under one plan (or on one device), timed by fit."""

    def __init__(self, name, weights, x, y, strategy=None, make_plan=None):
        import keras  # noqa: PLC0415
        import tensorflow as tf  # noqa: PLC0415

        import hub_models  # noqa: PLC0415

        self.strategy = strategy

        def build():
            model = hub_models.build(name)
            model.set_weights(weights)
            if make_plan is not None:
                strategy.apply_rules(model, make_plan(model))
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=hub_models.loss(name), weighted_metrics=[])
            return model

        if strategy is None:
            self.model = build()
        else:
            with strategy.scope():
                self.model = build()
        self.data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        self.steps = len(self.data)
        self.model.fit(self.data, epochs=1, verbose=0)  # trace and warm up

    def time_step(self):
        start = time.perf_counter()
        self.model.fit(self.data, epochs=1, verbose=0)
        return (time.perf_counter() - start) / self.steps

    def bytes_per_device(self):
        if self.strategy is None:
            params = sum(w.numpy().nbytes for w in self.model.weights)
            slots = sum(v.numpy().nbytes for v in self.model.optimizer.variables)
            return params + slots
        return max(kinds["params"] + kinds["optimizer"]
                   for kinds in self.strategy.memory_per_device().values())


def first_line(error):
    """The error's type and first line, without MLIR's location prefix."""
    text = (str(error).strip().splitlines() or [""])[0]
    text = re.sub(r"^\S+:\d+:\d+: error: ", "", text)
    return f"{type(error).__name__}: {text}"[:120]


def main(argv=None):
    args = parse_args(argv)
    root = HERE.parent
    sys.path[:0] = [str(root), str(root / "tests")]
    import tfpar  # noqa: PLC0415

    tfpar.use_virtual_cpus(8)
    import warnings  # noqa: PLC0415

    import hub_models  # noqa: PLC0415

    warnings.simplefilter("ignore")  # auto_rules' list of whole layers
    names = QUICK if args.quick else tuple(hub_models.BUILDERS)
    mesh_name = "x".join(str(n) for n in args.axes.values())
    print(f"load average {os.getloadavg()[0]:.1f}; mesh data x model = "
          f"{mesh_name}; batch {BATCH}, Adam; {args.steps} steps per round")
    header = (f"{'model':<10} {'plan':<10} {'step ÷ single':>13} "
              f"{'params+opt bytes/device':>24}")
    print(header)
    print("-" * len(header))
    for name in names:
        weights = hub_models.build(name).get_weights()
        x, y = hub_models.data(name, batch=BATCH * args.steps)
        single = Run(name, weights, x, y)
        runs, failed = {}, {}
        for plan_name, make_plan in plans(name, tfpar.Mesh(args.axes)).items():
            strategy = tfpar.ParallelStrategy(tfpar.Mesh(args.axes))
            try:
                runs[plan_name] = Run(name, weights, x, y, strategy,
                                      make_plan)
            except LookupError as error:
                failed[plan_name] = f"n/a ({error})"
            except Exception as error:  # noqa: BLE001 (reported, not raised)
                failed[plan_name] = "failed: " + first_line(error)
        times = {key: [] for key in ["single", *runs]}
        for _ in range(3):  # rounds, interleaved
            times["single"].append(single.time_step())
            for key, run in runs.items():
                times[key].append(run.time_step())
        base = statistics.median(times["single"])
        print(f"{name:<10} {'single':<10} {base * 1e3:>10.1f} ms "
              f"{single.bytes_per_device():>24,}")
        for plan_name in PLANS:
            if plan_name in runs:
                ratio = statistics.median(times[plan_name]) / base
                size = runs[plan_name].bytes_per_device()
                print(f"{'':<10} {plan_name:<10} {ratio:>13.2f} {size:>24,}")
            else:
                print(f"{'':<10} {plan_name:<10} {failed[plan_name]}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
