"""Training step time of tfpar vs single-device Keras, MirroredStrategy and raw DTensor.

Run it with

    python3 dev.py bench [options]          # runs benchmarks/step_time.py
    python benchmarks/step_time.py [--steps-per-execution K] [--rounds R]
                                   [--threads INTRA,INTER] [--quick]

On 8 virtual CPU devices it trains the benchmark MLP
(512 -> 1024 -> 512 -> 1024 -> 512 -> 10, ReLU on hidden layers, layers up0,
down0, up1, down1, head; batch 256, Adam, sparse CE from logits) under each
configuration:

- single     : plain Keras, no strategy (the baseline)
- model=8    : tfpar, Mesh({"model": 8}), Megatron column/row rules
- data=8     : tfpar, Mesh({"data": 8}), no rules (all weights replicated)
- data=8 fsdp: the same with fsdp=True (weights and Adam slots split over
               the data axis, gathered per step; ZeRO-3)
- data2xmod4 : tfpar, Mesh({"data": 2, "model": 4}), same rules
- mirrored   : tf.distribute.MirroredStrategy over /cpu:0../cpu:7
- raw ...    : one hand-written tf.function (forward, tape.gradient, plain
               SGD assign_sub) on DVariables with the same layouts, no Keras,
               no tfpar, batches placed on the mesh once before timing; its
               baseline is the same step on plain tf.Variables on one device.
               "raw DTensor data=8 fsdp" stores weights split over data and
               gathers them in the step (what fsdp compiles, minus Adam).
               "raw DTensor data=8, no communication": each device trains
               its own weight copy on its 32 samples, nothing exchanged:
               the floor of any data=8 step on DTensor here.

Keras configs are timed as `model.fit(dataset, epochs=1, verbose=0)` over a
fixed in-memory tf.data dataset (batch 256, tf.data autotuning off for all
configs alike, see KerasConfig) after a
warm-up fit (so tracing is excluded); the raw configs as a Python loop of
step calls over the same number of batches. Configs are measured side by
side in one process, round-robin over several rounds; the table shows each
config's median ms/step and its ratio to the single-device median (raw
configs: to the raw single-device median). `--steps-per-execution K` is
passed to `compile` of every Keras config alike.

The host has few cores and other processes (e.g. test runs) may compete for
them: the load average is printed before and after; compare ratios from the
same run only. To compare two commits' tfpar on this MLP (alternated runs,
paired ratios, op counts of the compiled step), see
benchmarks/compare_commits.py.
"""

import argparse
import os
import re
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

NUM_DEVICES = 8
BATCH = 256
RULES = {
    r".*up\d/kernel": (None, "model"),  # column-parallel: split outputs
    r".*up\d/bias": ("model",),
    r".*down\d/kernel": ("model", None),  # row-parallel: split inputs
}
TARGETS = {  # config -> max ratio vs single device (from the issue)
    "tfpar model=8": 1.5,
    "tfpar data=2xmodel=4": 2.0,
    "tfpar data=8": 3.5,
    "tfpar data=8 fsdp": 3.5,  # the same devices and batch, fsdp=True
}
MIRRORED_SPEEDUP = 2.0  # data=8 must be this many times faster than mirrored
ENV_VARS = (
    "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS",
    "TF_ENABLE_ONEDNN_OPTS", "TF_CPP_MIN_LOG_LEVEL", "TF_XLA_FLAGS",
    "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION", "CUDA_VISIBLE_DEVICES",
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Ratios are medians over interleaved rounds in one process.",
    )
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        metavar="K",
                        help="compile(steps_per_execution=K) for every Keras "
                             "config (default 1)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed round-robin rounds (default 5; 2 with "
                             "--quick)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per timed fit (default 24; 8 "
                             "with --quick)")
    parser.add_argument("--threads", default=None, metavar="INTRA,INTER",
                        help="tf.config.threading intra/inter-op thread "
                             "counts, set before TF initialises (default: "
                             "TF's own defaults)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: fewer steps and rounds")
    parser.add_argument("--only", default=None, metavar="SUBSTR[,SUBSTR]",
                        help="run only configs whose name contains one of "
                             "these substrings (baselines always run)")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.steps is None:
        args.steps = 8 if args.quick else 24
    if args.steps_per_execution < 1 or args.rounds < 1 or args.steps < 1:
        parser.error("--steps-per-execution, --rounds and --steps must be >= 1")
    if args.threads is not None:
        try:
            intra, inter = (int(v) for v in args.threads.split(","))
        except ValueError:
            parser.error(f"--threads needs INTRA,INTER ints, got {args.threads!r}")
        args.threads = (intra, inter)
    return args


args = parse_args() if __name__ == "__main__" else None

import tfpar  # noqa: E402  (imports TensorFlow, does not initialise it)
from tfpar import _compat  # noqa: E402

if __name__ == "__main__":
    tfpar.use_virtual_cpus(NUM_DEVICES)  # first thing, before any TF op
    if args.threads is not None:  # also before TF initialises its context
        import tensorflow as _tf  # noqa: PLC0415

        _tf.config.threading.set_intra_op_parallelism_threads(args.threads[0])
        _tf.config.threading.set_inter_op_parallelism_threads(args.threads[1])

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

# ---------------------------------------------------------------------------
# Keras configurations
# ---------------------------------------------------------------------------


def build_model():
    return keras.Sequential(
        [
            keras.Input((512,)),
            keras.layers.Dense(1024, activation="relu", name="up0"),
            keras.layers.Dense(512, activation="relu", name="down0"),
            keras.layers.Dense(1024, activation="relu", name="up1"),
            keras.layers.Dense(512, activation="relu", name="down1"),
            keras.layers.Dense(10, name="head"),
        ],
        name="mlp",
    )


def compile_model(model, steps_per_execution):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )


class KerasConfig:
    def __init__(self, name, make_strategy, data, steps_per_execution):
        self.name = name
        self.x, self.y = data
        self.steps = len(self.x) // BATCH
        # Every Keras config reads the same tf.data pipeline with tf.data's
        # autotuner off: with 8 virtual devices on the host's cores the
        # autotuner makes whole fits ~50% slower at random (plain Keras
        # included), which would swamp the step time being compared.
        options = tf.data.Options()
        options.autotune.enabled = False
        self.dataset = tf.data.Dataset.from_tensor_slices(
            (self.x, self.y)).batch(BATCH).with_options(options)
        strategy = make_strategy()
        keras.utils.set_random_seed(0)
        if strategy is None:
            self.model = build_model()
            compile_model(self.model, steps_per_execution)
        else:
            with strategy.scope():
                self.model = build_model()
                compile_model(self.model, steps_per_execution)

    def fit(self):
        self.model.fit(self.dataset, epochs=1, verbose=0)

    def time_step(self):
        start = time.perf_counter()
        self.fit()
        return (time.perf_counter() - start) / self.steps


def tfpar_strategy(axes, fsdp=False):
    def make():
        mesh = tfpar.Mesh(axes)
        rules = tfpar.LayoutRules(RULES) if "model" in axes else None
        return tfpar.ParallelStrategy(mesh, rules=rules, fsdp=fsdp)
    return make


def mirrored_strategy():
    return tf.distribute.MirroredStrategy(
        devices=[f"/cpu:{i}" for i in range(NUM_DEVICES)])


# ---------------------------------------------------------------------------
# Raw DTensor step (no Keras, no tfpar)
# ---------------------------------------------------------------------------

SIZES = [512, 1024, 512, 1024, 512, 10]
NAMES = ["up0", "down0", "up1", "down1", "head"]


def _spec(name, kind):
    """The same specs the tfpar rules give (None entries = replicated)."""
    if name.startswith("up"):
        return (None, "model") if kind == "kernel" else ("model",)
    if name.startswith("down") and kind == "kernel":
        return ("model", None)
    return (None, None) if kind == "kernel" else (None,)


class RawConfig:
    """A single tf.function: forward, tape.gradient, SGD assign_sub.

    With `fsdp`, each weight is stored split over "data" on dimension 0
    (where 8 divides it) and relaid out to its compute layout inside the
    step, as tfpar's fsdp does (an all-gather; its gradient a
    reduce-scatter).

    With `local` (on Mesh({"data": 8})), every device trains its own copy
    of the weights on its 32 samples: weights and batches get a leading
    device dimension split over "data", so the step has no collective at
    all. It is the floor of any data=8 step on DTensor: eight device
    programs at batch 32 sharing the host's cores, nothing exchanged.
    """

    def __init__(self, name, axes, data, fsdp=False, local=False):
        self.name = name
        self.fsdp = fsdp
        self.local = local
        x, y = data
        self.steps = len(x) // BATCH
        rng = np.random.RandomState(0)
        self.mesh = None
        if axes is not None:
            self.mesh = dtensor.create_mesh(
                list(axes.items()),
                devices=[f"CPU:{i}" for i in range(NUM_DEVICES)])
        self.variables = []
        copies = NUM_DEVICES if local else None
        for name_, fan_in, fan_out in zip(NAMES, SIZES[:-1], SIZES[1:]):
            kernel = rng.uniform(-1, 1, (fan_in, fan_out)).astype("float32")
            kernel *= np.sqrt(6.0 / (fan_in + fan_out))
            bias = np.zeros((fan_out,), "float32")
            if local:  # one copy per device: (8, in, out) and (8, 1, out)
                kernel = np.broadcast_to(kernel, (copies,) + kernel.shape)
                bias = np.broadcast_to(bias, (copies, 1, fan_out))
            self.variables.append(
                (self._variable(kernel, self._stored(_spec(name_, "kernel"),
                                                     kernel.shape), axes),
                 self._variable(bias, self._stored(_spec(name_, "bias"),
                                                   bias.shape), axes)))
        data_axis = "data" if axes and "data" in axes else None
        self.batches = []
        for i in range(self.steps):
            xb = x[i * BATCH:(i + 1) * BATCH]
            yb = y[i * BATCH:(i + 1) * BATCH].astype("int32")
            if local:  # (8, 32, 512): device d's samples at [d]
                xb = xb.reshape(copies, BATCH // copies, -1)
                yb = yb.reshape(copies, BATCH // copies)
            split = (data_axis,) + (None,) * (xb.ndim - 1)
            self.batches.append((self._tensor(xb, split),
                                 self._tensor(yb, split[:yb.ndim])))
        self.step = tf.function(self._step)

    def _stored(self, spec, shape):
        if self.local:
            return ("data",) + (None,) * (len(shape) - 1)
        if (self.fsdp and spec[0] is None
                and shape[0] % self.mesh.dim_size("data") == 0):
            return ("data",) + spec[1:]
        return spec

    def _compute(self, variable):
        """The value a layer computes with: gathered under fsdp."""
        if not self.fsdp:
            return variable
        return dtensor.relayout(
            variable, self._layout((None,) * variable.shape.rank))

    def _layout(self, spec):
        return dtensor.Layout(
            [dtensor.UNSHARDED if a is None else a for a in spec], self.mesh)

    def _tensor(self, array, spec):
        if self.mesh is None:
            with tf.device("CPU:0"):
                return tf.constant(array)
        if any(a is not None and a not in self.mesh.dim_names for a in spec):
            spec = tuple(None if a not in self.mesh.dim_names else a
                         for a in spec)
        replicated = dtensor.copy_to_mesh(
            tf.constant(array), dtensor.Layout.replicated(self.mesh, len(spec)))
        return dtensor.relayout(replicated, self._layout(spec))

    def _variable(self, array, spec, axes):
        if self.mesh is None:
            with tf.device("CPU:0"):
                return tf.Variable(array)
        spec = tuple(a if (axes and a in axes) else None for a in spec)
        return dtensor.DVariable(self._tensor(array, spec))

    def _step(self, x, y):
        flat = [v for pair in self.variables for v in pair]
        with tf.GradientTape() as tape:
            h = x
            for i, (kernel, bias) in enumerate(self.variables):
                h = (tf.matmul(h, self._compute(kernel))
                     + self._compute(bias))
                if i < len(self.variables) - 1:
                    h = tf.nn.relu(h)
            # local: one mean per device ((8,) split over "data"); the
            # gradient of their sum reaches each copy from its own only.
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(y, h),
                axis=-1 if self.local else None)
        grads = tape.gradient(loss, flat)
        for v, g in zip(flat, grads):
            v.assign_sub(1e-3 * g)
        return loss

    def fit(self):
        loss = None
        # fsdp: compile real all-gathers, as tfpar does on one-axis meshes.
        with _compat.collective_all_gathers(self.fsdp):
            for xb, yb in self.batches:
                loss = self.step(xb, yb)
        # Block until done (like Keras reading the logs of the last step).
        if self.mesh is None:
            loss.numpy()
        else:
            dtensor.unpack(loss)[0].numpy()

    def time_step(self):
        start = time.perf_counter()
        self.fit()
        return (time.perf_counter() - start) / self.steps


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------

BASELINE = "single device (Keras)"
RAW_BASELINE = "raw single device"
RAW_FLOOR = "raw DTensor data=8, no communication"


def config_specs(args, data):
    k = args.steps_per_execution
    return [
        (BASELINE, lambda: KerasConfig(BASELINE, lambda: None, data, k)),
        ("tfpar model=8", lambda: KerasConfig(
            "tfpar model=8", tfpar_strategy({"model": 8}), data, k)),
        ("tfpar data=8", lambda: KerasConfig(
            "tfpar data=8", tfpar_strategy({"data": 8}), data, k)),
        ("tfpar data=8 fsdp", lambda: KerasConfig(
            "tfpar data=8 fsdp", tfpar_strategy({"data": 8}, fsdp=True),
            data, k)),
        ("tfpar data=2xmodel=4", lambda: KerasConfig(
            "tfpar data=2xmodel=4", tfpar_strategy({"data": 2, "model": 4}),
            data, k)),
        ("MirroredStrategy x8", lambda: KerasConfig(
            "MirroredStrategy x8", mirrored_strategy, data, k)),
        (RAW_BASELINE, lambda: RawConfig(RAW_BASELINE, None, data)),
        ("raw DTensor model=8", lambda: RawConfig(
            "raw DTensor model=8", {"model": 8}, data)),
        ("raw DTensor data=2xmodel=4", lambda: RawConfig(
            "raw DTensor data=2xmodel=4", {"data": 2, "model": 4}, data)),
        ("raw DTensor data=8", lambda: RawConfig(
            "raw DTensor data=8", {"data": 8}, data)),
        ("raw DTensor data=8 fsdp", lambda: RawConfig(
            "raw DTensor data=8 fsdp", {"data": 8}, data, fsdp=True)),
        (RAW_FLOOR, lambda: RawConfig(RAW_FLOOR, {"data": 8}, data,
                                      local=True)),
    ]


def first_line(error):
    """The error's first informative line (skips TF's generic headers)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = lines[0] if lines else ""
    if line.startswith(("Graph execution error", "Detected at node")):
        for candidate in lines[1:]:
            if re.match(r"(\(\d+\) )?[A-Z_]{5,}:", candidate):
                line = candidate
                break
    return f"{type(error).__name__}: {line}"[:160]


def settings_report(args):
    lines = [
        f"python {sys.version.split()[0]}  tensorflow {tf.__version__}  "
        f"keras {keras.__version__}  tfpar {tfpar.__version__}",
        f"host cpus: {os.cpu_count()}  logical TF CPU devices: "
        f"{len(tf.config.list_logical_devices('CPU'))}",
        f"tf.config.threading: intra_op="
        f"{tf.config.threading.get_intra_op_parallelism_threads()} "
        f"inter_op={tf.config.threading.get_inter_op_parallelism_threads()} "
        f"(0 = TF default){'  [set by --threads]' if args.threads else ''}",
        "env: " + "  ".join(
            f"{v}={os.environ[v]}" for v in ENV_VARS if v in os.environ)
        + ("" if any(v in os.environ for v in ENV_VARS) else "(none set)"),
        f"steps/fit={args.steps} batch={BATCH} rounds={args.rounds} "
        f"steps_per_execution={args.steps_per_execution} (Keras configs; "
        "raw configs: one call per step)",
    ]
    return lines


def main(args):
    rng = np.random.RandomState(0)
    x = rng.normal(size=(BATCH * args.steps, 512)).astype("float32")
    y = rng.randint(0, 10, size=(BATCH * args.steps,))
    data = (x, y)
    print("\n".join(settings_report(args)))
    print(f"load average at start: {os.getloadavg()}", flush=True)

    only = args.only.split(",") if args.only else None
    configs, failed = {}, {}
    for name, make in config_specs(args, data):
        if only and name not in (BASELINE, RAW_BASELINE) and not any(
                s in name for s in only):
            continue
        try:
            config = make()
            config.fit()  # warm-up: traces and compiles
            config.fit()
            configs[name] = config
        except Exception as error:  # noqa: BLE001 (report and continue)
            failed[name] = first_line(error)
            print(f"{name}: FAILED in setup/warm-up: {failed[name]}",
                  flush=True)

    times = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name, config in configs.items():
            if name in failed:
                continue
            try:
                times[name].append(config.time_step())
            except Exception as error:  # noqa: BLE001
                failed[name] = first_line(error)
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"load average at end:   {os.getloadavg()}")

    medians = {n: float(np.median(t)) for n, t in times.items()
               if t and n not in failed}
    print_table(config_specs(args, data), medians, failed, times, only)


def print_table(specs, medians, failed, times, only):
    def ratio(name, base):
        if name in medians and base in medians:
            return medians[name] / medians[base]
        return None

    rows = []
    for name, _ in specs:
        if name not in medians and name not in failed:
            continue
        base = RAW_BASELINE if name.startswith("raw") else BASELINE
        if name in failed:
            rows.append((name, "FAILED", "", "", failed[name]))
            continue
        r = ratio(name, base)
        spread = f"{1e3 * min(times[name]):.1f}-{1e3 * max(times[name]):.1f}"
        notes = []
        if name in TARGETS and r is not None:
            ok = r <= TARGETS[name]
            notes.append(f"target <= {TARGETS[name]}: "
                         f"{'PASS' if ok else 'MISS'}")
        if name.startswith("tfpar data=8") and "MirroredStrategy x8" in medians:
            speedup = medians["MirroredStrategy x8"] / medians[name]
            notes.append(f"{speedup:.2f}x vs mirrored (target >= "
                         f"{MIRRORED_SPEEDUP}: "
                         f"{'PASS' if speedup >= MIRRORED_SPEEDUP else 'MISS'})")
        elif (name.startswith("raw DTensor data=8")
              and "MirroredStrategy x8" in medians):
            # The raw step does less than any Keras Adam step (SGD, no
            # optimizer state, batches already on the mesh), so its speed-up
            # over MirroredStrategy's Keras Adam step bounds tfpar's.
            speedup = medians["MirroredStrategy x8"] / medians[name]
            notes.append(f"{speedup:.2f}x vs mirrored (bounds tfpar data=8)")
        raw = {"tfpar model=8": "raw DTensor model=8",
               "tfpar data=2xmodel=4": "raw DTensor data=2xmodel=4"}.get(name)
        if raw in medians:
            notes.append(f"{medians[name] / medians[raw]:.2f}x raw DTensor")
        rows.append((name, f"{1e3 * medians[name]:.1f}", spread,
                     f"{r:.2f}" if r is not None else "-", "; ".join(notes)))

    print()
    header = ("config", "ms/step", "min-max", "ratio", "notes")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(4)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}"
                    for i, w in enumerate(widths)) + "  {}"
    print(fmt.format(*header))
    for row in rows:
        print(fmt.format(*row))
    print("(ratio: median ÷ single-device median; raw rows ÷ raw single "
          "device)")


if __name__ == "__main__":
    main(args)
