"""Pipeline parallelism on 8 virtual CPUs: step time, bubble, activations.

    python benchmarks/pipeline.py [--batch 256] [--microbatches 8]
                                  [--rounds 3] [--steps 8] [--quick]
                                  [--gantt docs/pipeline_1f1b.png]

Trains the benchmark MLP of benchmarks/step_time.py (512 -> 1024 -> 512 ->
1024 -> 512 -> 10, Adam; global batch 256 by default) as a
`tfpar.PipelineModel` with m micro-batches, for p = 2 and 4 stages and both
schedules, on

- `Mesh({"pipe": p})` over p of the CPUs (pipeline only), and
- `Mesh({"pipe": p, "data": 8 // p})` (pipeline × data on all 8);
- plus interleaved 1F1B with v = 2 parts per stage on pipe=2 × data=4
  (the MLP's 5 layers allow 4 parts, not 8), the zero-bubble ZB-H1
  and ZB-H2 (backward split into B and W) on pipe × data for p = 2, 4,
  and ZB-V (two parts per stage in a V) on pipe=2 × data=4.

It prints, side by side in one process (interleaved rounds, medians):

- step time ÷ single-device Keras (the stages share the host's cores, so
  no wall-clock speed-up is possible here; this measures the overhead),
  and ÷ the same gradient-accumulation step on one device (m micro-batch
  forward/backward passes in one tf.function, summed, one Adam update):
  the part of the cost that is micro-batching itself;
- the bubble measured from an executed timeline (`record_timeline=True`,
  TF's profiler) next to the theory: (p - 1) / (v m + p - 1), ZB-H1
  (p - 1) / (3 m + p - 1), ZB-V (p - 1) / (6 m + p - 1), ZB-H2 the
  paper's 0 (no optimizer
  synchronisation; `bubble/stage` measures that: idle time inside each
  stage's own span);
- per stage, the peak number of micro-batches in flight (forward started,
  backward — W for zero-bubble — not finished; interleaved: per part) in
  the executed timeline,
  and the activation bytes that implies: the bytes of the parts' layer
  outputs for one micro-batch, summed over what is in flight (1F1B keeps
  at most p - s, GPipe all m; interleaved 1F1B counts part × micro-batch
  pairs, up to (p - s - 1) * 2 + (v - 1) * p + 1).

`--gantt PATH` saves the executed 1F1B timeline of the pipe=4 × data=2 run
as a PNG Gantt chart.
"""

import argparse
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpar  # noqa: E402
from step_time import build_model, compile_model  # noqa: E402  (its MLP)


class AccumulatingModel:
    """The single-device baseline with m micro-batches: m forward/backward
    passes in one tf.function, gradients summed, one Adam update (what a
    pipeline computes, without stages)."""

    def __init__(self, m):
        import keras  # noqa: PLC0415
        import tensorflow as tf  # noqa: PLC0415

        keras.utils.set_random_seed(0)
        self.model = build_model()
        self.optimizer = keras.optimizers.Adam(1e-3)
        self.optimizer.build(self.model.trainable_variables)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        weights = self.model.trainable_variables

        @tf.function
        def step(x, y):
            xs, ys = tf.split(x, m), tf.split(y, m)
            total = None
            for xi, yi in zip(xs, ys):
                with tf.GradientTape() as tape:
                    value = loss(yi, self.model(xi, training=True)) / m
                grads = tape.gradient(value, weights)
                total = grads if total is None else [
                    a + b for a, b in zip(total, grads)]
            self.optimizer.apply(total, weights)
            return value

        self.step = step

    def fit(self, dataset, epochs=1, verbose=0):
        del epochs, verbose
        for x, y in dataset:
            value = self.step(x, y)
        float(value)  # wait for the last step


def in_flight_peaks(timeline, schedule, part_bytes, last="B"):
    """Per stage: the most (part, micro-batch) pairs between F start and
    the end of their `last` action (B, or W when backwards are split), and
    the most activation bytes alive (`part_bytes[k]` per pair of part k =
    `schedule.part(action)`)."""
    from tfpar.pipeline import Action  # noqa: PLC0415

    peaks = []
    for s in range(schedule.num_stages):
        events = []
        for e in timeline:
            if e.stage == s and e.kind in ("F", last):
                sign = 1 if e.kind == "F" else -1
                part = schedule.part(Action(s, e.kind, e.microbatch, e.chunk))
                events.append((e.start if e.kind == "F" else e.end, sign,
                               sign * part_bytes[part]))
        alive = peak = alive_bytes = peak_bytes = 0
        for _, delta, size in sorted(events, key=lambda t: (t[0], t[1])):
            alive += delta
            alive_bytes += size
            peak = max(peak, alive)
            peak_bytes = max(peak_bytes, alive_bytes)
        peaks.append((peak, peak_bytes))
    return peaks


def activation_bytes(stage, microbatch_size):
    """Bytes of the stage's layer outputs for one micro-batch (fp32)."""
    return sum(microbatch_size * math.prod(layer.output.shape[1:]) * 4
               for layer in stage.layers)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256,
                        help="global batch size (default 256)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 round of 2 steps")
    parser.add_argument("--gantt", default=None,
                        help="save the pipe=4 x data=2 1F1B timeline here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 2
    tfpar.use_virtual_cpus(8)
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415
    from tfpar.pipeline import bubble_fraction, theoretical_bubble_fraction  # noqa: PLC0415

    m = args.microbatches
    batch = args.batch
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * args.steps, 512)).astype("float32")
    y = rng.integers(0, 10, size=(batch * args.steps,)).astype("int32")
    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch).with_options(options)

    configs = {}
    keras.utils.set_random_seed(0)
    single = build_model()
    compile_model(single, 1)
    configs["single device"] = single
    configs["1 device, m grad. accum."] = AccumulatingModel(m)
    cpus = [f"CPU:{i}" for i in range(8)]
    for p in (2, 4):
        for axes, devices in (({"pipe": p}, cpus[:p]),
                              ({"pipe": p, "data": 8 // p}, cpus)):
            for schedule in ("gpipe", "1f1b"):
                strategy = tfpar.ParallelStrategy(
                    tfpar.Mesh(axes, devices=devices))
                with strategy.scope():
                    keras.utils.set_random_seed(0)
                    pipe = tfpar.PipelineModel(
                        build_model(), num_microbatches=m, schedule=schedule)
                    compile_model(pipe, 1)
                name = " x ".join(f"{k}={v}" for k, v in axes.items())
                configs[f"{name} {schedule}"] = pipe
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        keras.utils.set_random_seed(0)
        pipe = tfpar.PipelineModel(build_model(), num_microbatches=m,
                                   schedule="1f1b", virtual_stages=2)
        compile_model(pipe, 1)
    configs["pipe=2 x data=4 1f1b v=2"] = pipe
    for p in (2, 4):
        for schedule in ("zb-h1", "zb-h2"):
            strategy = tfpar.ParallelStrategy(
                tfpar.Mesh({"pipe": p, "data": 8 // p}))
            with strategy.scope():
                keras.utils.set_random_seed(0)
                pipe = tfpar.PipelineModel(build_model(), num_microbatches=m,
                                           schedule=schedule)
                compile_model(pipe, 1)
            configs[f"pipe={p} x data={8 // p} {schedule}"] = pipe
    # ZB-V cuts 2p parts: the MLP's 5 layers allow p = 2 only.
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        keras.utils.set_random_seed(0)
        pipe = tfpar.PipelineModel(build_model(), num_microbatches=m,
                                   schedule="zbv")
        compile_model(pipe, 1)
    configs["pipe=2 x data=4 zbv"] = pipe
    for model in configs.values():  # warm-up: tracing is not timed
        model.fit(dataset.take(1), epochs=1, verbose=0)
    times = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, model in configs.items():
            start = time.perf_counter()
            model.fit(dataset, epochs=1, verbose=0)
            times[name].append((time.perf_counter() - start) / args.steps)
    base = float(np.median(times["single device"]))
    accumulated = float(np.median(times["1 device, m grad. accum."]))
    load = os.getloadavg()[0]
    print(f"benchmark MLP, batch {batch}, m = {m} micro-batches, Adam; "
          f"median of {args.rounds} rounds x {args.steps} steps; load "
          f"{load:.1f}")
    print(f"{'config':<26}{'ms/step':>9}{'÷ single':>10}{'÷ accum.':>10}"
          f"{'bubble':>8}{'/stage':>8}{'theory':>8}  peak in flight per "
          "stage (activation MiB)")
    for name, model in configs.items():
        median = float(np.median(times[name])) * 1e3
        line = (f"{name:<26}{median:>9.1f}{median / base / 1e3:>10.2f}"
                f"{median / accumulated / 1e3:>10.2f}")
        if not isinstance(model, tfpar.PipelineModel):
            print(line)
            continue
        model.record_timeline = True
        model.fit(dataset.take(1), epochs=1, verbose=0)
        model.record_timeline = False
        timeline = model.last_timeline
        p, v = model.schedule.num_stages, model.virtual_stages
        split = model.schedule.split_backward
        peaks = in_flight_peaks(
            timeline, model.schedule,
            [activation_bytes(part, batch // m) for part in model.stages],
            last="W" if split else "B")
        theory = theoretical_bubble_fraction(p, m, v, model.schedule.name)
        line += (f"{bubble_fraction(timeline):>8.2f}"
                 f"{bubble_fraction(timeline, per_stage=True):>8.2f}"
                 f"{theory:>8.2f}  "
                 + " ".join(f"{k} ({b / 2**20:.1f})" for k, b in peaks))
        print(line)
        if args.gantt and name == "pipe=4 x data=2 1f1b":
            tfpar.plot_schedule(timeline, args.gantt,
                                title=f"executed 1F1B, pipe=4 x data=2, m={m}")
            print(f"  Gantt chart of this step: {args.gantt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
