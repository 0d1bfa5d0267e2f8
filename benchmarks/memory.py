"""Per-device memory and step time of the GPT example and the benchmark MLP.

    python benchmarks/memory.py [--layers 2 --dim 64 --rounds 2 --steps 4]

On 8 virtual CPUs (of 16: CPU:8-15 are the offload row's "host"), for each configuration — one device (a mesh of one),
replicated data parallelism (data=8), fsdp with and without freeing the
gathered weights (`reshard_after_forward`), fsdp + recomputation (GPT:
every block under `keras.RematScope`), fsdp + offload, data=2 × model=4
(GPT: `tfpar.auto_rules`; MLP: the step-time benchmark's rules) and
data=2 × pipe=2 × model=2 (a `PipelineModel`, 4 micro-batches) — prints
from `tfpar.memory_report` the per-device bytes of parameters + gradients
+ Adam state next to the formula it should meet, the saved activations,
the gathered weights kept for the backward pass and the peak of the
compiled step, and the median `fit` step time ÷ one device (interleaved
rounds in one process).

Formulas (fp32 Adam: 4 bytes of weight, 4 of gradient, 8 of moments per
parameter, Ψ parameters): replicated 16Ψ per device; fsdp (ZeRO-3) 16Ψ/d;
tensor parallel 16(Ψ_split/m + Ψ_whole); pipeline the same per stage.
Megatron's mixed-precision table (2 + 4 + 12 = 18 bytes per parameter; its
distributed optimizer 6 + 12/d) and ZeRO-Offload's device share (the
weights alone, 2Ψ in fp16 / 4Ψ here) are printed for reference. The
offload row (`offload="optimizer"`, `tfpar.offload`) keeps the slots on
CPU:8-15, so a device holds weights + gradients, 8Ψ/d under fsdp; its step
time is also given ÷ fsdp without offload (the eager block copies to the
"host" and back and the host update, not overlapped). Here that "host" is
other virtual CPUs of the same process, the same memory and the same two
cores: the row shows placement and the round trip's cost, not saved RAM;
a GPU run would show the device bytes drop and a PCIe round trip.
`memory_report` reads one SPMD program, so the pipeline row gives
the variables (`strategy.memory_per_device()`) of the first stage's
devices and no activations or peak.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--models", default="gpt,mlp",
                        help="comma-separated: gpt, mlp")
    return parser.parse_args(argv)


CONFIGS = [  # name, mesh axes, strategy options, recompute
    ("1 device", {"data": 1}, {}, False),
    ("data=8", {"data": 8}, {}, False),
    ("data=8 fsdp", {"data": 8}, {"fsdp": True}, False),
    ("data=8 fsdp freed", {"data": 8},
     {"fsdp": True, "reshard_after_forward": True}, False),
    ("data=8 fsdp recompute", {"data": 8}, {"fsdp": True}, True),
    ("data=8 fsdp offload", {"data": 8},
     {"fsdp": True, "offload": "optimizer",
      "offload_devices": [f"CPU:{i}" for i in range(8, 16)]}, False),
    ("data=2 x model=4", {"data": 2, "model": 4}, {}, False),
    ("data=2 x pipe=2 x model=2", {"data": 2, "pipe": 2, "model": 2}, {},
     False),
]


DEVICES = [f"CPU:{i}" for i in range(8)]  # the mesh; CPU:8-15 the host


def main(args):
    tfpar.use_virtual_cpus(16)
    import gpt  # noqa: PLC0415
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import step_time  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    gpt_config = dict(vocab=64, seq_len=16, dim=args.dim, heads=8,
                      layers=args.layers)

    def gpt_case():
        batch = 16
        x, y = gpt.toy_corpus(batch * args.steps, vocab=64, seq_len=16)

        def build(strategy, recompute):
            model = gpt.build_gpt(recompute=recompute, **gpt_config)
            if strategy is not None and strategy.mesh.axis_size("model") > 1:
                strategy.apply_rules(model, tfpar.auto_rules(
                    model, mesh=strategy.mesh))
            return model
        return "GPT " + str(gpt_config), build, gpt.compile_gpt, x, y, batch

    def mlp_case():
        batch = step_time.BATCH
        rng = np.random.RandomState(0)
        x = rng.normal(size=(batch * args.steps, 512)).astype("float32")
        y = rng.randint(0, 10, size=(batch * args.steps,)).astype("int32")

        def build(strategy, recompute):
            if recompute:
                return None
            return step_time.build_model()
        return ("benchmark MLP 512-1024-512-1024-512-10", build,
                lambda m: step_time.compile_model(m, 1), x, y, batch)

    cases = {"gpt": gpt_case, "mlp": mlp_case}
    for name in args.models.split(","):
        title, build, compile_model, x, y, batch = cases[name]()
        run_case(title, build, compile_model, x, y, batch, args, keras, np,
                 tf, rules=None if name == "gpt" else step_time.RULES)


def run_case(title, build, compile_model, x, y, batch, args, keras, np, tf,
             rules):
    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    dataset = dataset.with_options(options)
    keras.utils.set_random_seed(0)
    weights = build(None, False).get_weights()
    runs, notes = {}, {}
    for name, axes, options_, recompute in CONFIGS:
        try:
            mesh = tfpar.Mesh(axes, devices=DEVICES[:1] if axes == {
                "data": 1} else DEVICES)
            use_rules = rules if "model" in axes else None
            strategy = tfpar.ParallelStrategy(mesh, rules=use_rules,
                                              **options_)
        except (ValueError, NotImplementedError) as error:
            notes[name] = f"refused: {str(error).split('.')[0]}"
            continue
        with strategy.scope():
            model = build(strategy, recompute)
            if model is None:
                notes[name] = "not run (no recomputed layers in this model)"
                continue
            model.set_weights(weights)
            if strategy.num_stages > 1:
                model = tfpar.PipelineModel(model, num_microbatches=4)
            compile_model(model)
        runs[name] = (strategy, model)
    reports, times = {}, {name: [] for name in runs}
    for name, (strategy, model) in runs.items():
        model.fit(dataset, epochs=1, verbose=0)  # compile, build optimizer
        if strategy.num_stages == 1:
            reports[name] = tfpar.memory_report(model, x[:batch], y[:batch])
    for _ in range(args.rounds):
        for name, (_, model) in runs.items():
            start = time.perf_counter()
            model.fit(dataset, epochs=1, verbose=0)
            times[name].append((time.perf_counter() - start) / args.steps)
    base = float(np.median(times["1 device"]))
    psi = sum(int(np.prod(v.shape)) for v in runs["1 device"][1].trainable_weights)

    print(f"\n{title}, batch {batch}, Adam, fp32; {psi} parameters; 8 virtual "
          f"CPUs on {os.cpu_count()} cores. KiB per device (first device).")
    print(f"{'config':27s} {'p+g+opt':>9s} {'formula':>9s} {'act':>8s} "
          f"{'gathered':>9s} {'peak':>9s} {'ms/step':>8s} {'÷1 dev':>7s}")
    kib = lambda n: f"{n / 1024:9.1f}"  # noqa: E731
    for name, *_ in CONFIGS:
        if name in notes:
            print(f"{name:27s} {notes[name]}")
            continue
        strategy, model = runs[name]
        device = strategy.stage_meshes[0].devices[0]
        held = strategy.memory_per_device()[device]
        states = 2 * held["params"] + held["optimizer"]
        formula = _formula(strategy, psi, np)
        median = float(np.median(times[name])) * 1000
        report = reports.get(name)
        cells = ([kib(report[device][k]) for k in
                  ("activations", "gathered", "peak")] if report
                 else [f"{'-':>8s}", f"{'-':>9s}", f"{'-':>9s}"])
        print(f"{name:27s} {kib(states)} {kib(formula)} {cells[0][1:]} "
              f"{cells[1]} {cells[2]} {median:8.1f} {median / 1000 / base:7.2f}")
    print(f"Megatron mixed precision: 18Ψ = {kib(18 * psi).strip()} KiB "
          f"replicated, distributed optimizer 6Ψ + 12Ψ/d = "
          f"{kib(6 * psi + 12 * psi / 8).strip()} KiB at d=8. ZeRO-Offload "
          f"device share: the weights, 2Ψ fp16 = {kib(2 * psi).strip()} KiB "
          f"(4Ψ = {kib(4 * psi).strip()} KiB in fp32; /d with fsdp).")
    _offload_line(runs, times, reports, kib, np)


def _offload_line(runs, times, reports, kib, np):
    """The offload row's host side and its step time ÷ fsdp."""
    name = "data=8 fsdp offload"
    if name not in runs or "data=8 fsdp" not in times:
        return
    ratio = (float(np.median(times[name]))
             / float(np.median(times["data=8 fsdp"])))
    host = runs[name][0].dims.offload_devices[0]
    held = reports[name][host]
    print(f"offload: step time ÷ data=8 fsdp = {ratio:.2f}; host device "
          f"{host} holds weights' copy {kib(held['params']).strip()} + "
          f"slots {kib(held['optimizer']).strip()} KiB (the same physical "
          "memory as the devices on this machine).")


def _formula(strategy, psi, np):
    """16 bytes per parameter a device holds by the formula: Ψ, Ψ/d under
    fsdp (8 with offload), Ψ_split/m + Ψ_whole under tensor parallelism, divided by p for a
    pipeline (even stages assumed)."""
    if strategy.fsdp:  # offload: no slots (8 of the 16 bytes) on a device
        per_param = 8 if strategy.offload else 16
        return per_param * psi / strategy.data_parallel_size
    m = strategy.mesh.axis_size("model")
    split = sum(int(np.prod(shape)) * (m if "model" in spec else 1)
                for _, spec, shape in strategy.placements("params")
                if "model" in spec)
    return 16 * ((psi - split) + split / m) / strategy.num_stages


if __name__ == "__main__":
    main(parse_args())
