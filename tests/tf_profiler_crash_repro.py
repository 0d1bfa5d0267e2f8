"""Looks for the native abort (glibc "munmap_chunk(): invalid pointer") seen
twice in examples/pipeline.py's first training step, which
`PipelineModel(record_timeline=True)` traces and compiles while TF's
profiler runs (`tfpar.pipeline.profiler.OpEvents`, host tracer level 3).

Not part of the test run. The abort was caught on 2026-12-03 in the
`pipeline_schedules` notebook (2 of 40 runs under load), not by this script
(no abort here, even under glibc's perturbed frees). The core dump puts it
inside TF's profiler: `tf.profiler.experimental.stop()` →
`tsl::profiler::TraceMeRecorder::Consume` →
`SplitEventTracker::FindStartAndMerge` → free() of a corrupted heap
(docs/guides/robustness.md, "The native abort, found"). To catch another:
run the notebook's test in a loop under load with `PYTHONFAULTHANDLER=1`,
`ulimit -c unlimited` and a kept `--basetemp` (the kernel's working
directory, where the core lands).

    python tests/tf_profiler_crash_repro.py [--mode dtensor] [--steps 150]
        [--no-profiler] [--trace-first]

Modes, each step under a freshly started profiler, stopped after it:
- dtensor: a fresh `tf.function` (a new input shape: a new trace and a new
  DTensor SPMD expansion) of a forward and gradient on each of the 4 stage
  meshes (data=2 each) of 8 virtual CPUs, as examples/pipeline.py's
  pipe=4 x data=2; plain: the same without DTensor;
- pipeline: a fresh `tfpar.PipelineModel(record_timeline=True)` (the
  example's, depth 4, 4 micro-batches) trained one step;
- threads: eager ops on 16 short-lived threads that exit while the
  profiler runs.
--no-profiler: the same without the profiler; --trace-first: trace the
function (`get_concrete_function`) before the profiler starts.
"""

import argparse
import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--mode", default="dtensor",
                        choices=["dtensor", "plain", "pipeline", "threads"])
    parser.add_argument("--no-profiler", action="store_true")
    parser.add_argument("--trace-first", action="store_true")
    args = parser.parse_args()
    run = {"pipeline": pipeline_fits, "threads": exiting_threads}.get(
        args.mode, stage_functions)
    run(args)
    print("done")


def profiled(args, body):
    """Runs `body()` between the profiler's start and stop, as OpEvents."""
    import tensorflow as tf  # noqa: PLC0415

    directory = tempfile.mkdtemp(prefix="repro_trace_")
    if not args.no_profiler:
        options = tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=3)
        tf.profiler.experimental.start(directory, options=options)
    try:
        body()
    finally:
        if not args.no_profiler:
            tf.profiler.experimental.stop()
        shutil.rmtree(directory, ignore_errors=True)


def stage_functions(args):
    """Each step a fresh function of new shapes on the 4 stage meshes."""
    import tensorflow as tf  # noqa: PLC0415
    from tensorflow.experimental import dtensor  # noqa: PLC0415

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
    stages = [dtensor.create_mesh([("data", 2)],
                                  devices=[f"CPU:{2 * s}", f"CPU:{2 * s + 1}"])
              for s in range(4)]

    def on_stage(x, s):
        if args.mode == "plain":
            return x
        return dtensor.copy_to_mesh(x, dtensor.Layout.replicated(stages[s],
                                                                 x.ndim))

    def make_step():
        @tf.function
        def step(xs, ws):
            totals = []  # one per stage mesh
            for x, w in zip(xs, ws):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    loss = tf.reduce_sum(tf.nn.relu(tf.linalg.matmul(x, w)))
                totals.append(tf.reduce_sum(tape.gradient(loss, x)))
            return totals
        return step

    ws = [on_stage(tf.ones((32, 32)) * 0.01, s) for s in range(4)]
    for i in range(args.steps):
        xs = [on_stage(tf.ones((2 * (i + 1), 32)), s) for s in range(4)]
        step = make_step()
        if args.trace_first:
            step.get_concrete_function(xs, ws)
        profiled(args, lambda: [step(xs, ws) for _ in range(4)])
        print("step", i, flush=True)


def exiting_threads(args):
    """Each step runs eager ops on 16 threads, which exit while the profiler
    runs (each thread's TraceMe events are recorded)."""
    import threading  # noqa: PLC0415

    import tensorflow as tf  # noqa: PLC0415

    def work():
        x = tf.ones((8, 8))
        for _ in range(20):
            x = tf.linalg.matmul(x, x) * 0.1

    def threads():
        started = [threading.Thread(target=work) for _ in range(16)]
        for t in started:
            t.start()
        for t in started:
            t.join()

    for i in range(args.steps):
        profiled(args, threads)
        print("step", i, flush=True)


def pipeline_fits(args):
    """Each step a fresh `tfpar.PipelineModel(record_timeline=True)`
    (examples/pipeline.py's, depth 4, 4 micro-batches) trained one step:
    its step is traced and compiled under the profiler."""
    import numpy as np  # noqa: PLC0415

    import tfpar  # noqa: PLC0415

    tfpar.use_virtual_cpus(8)
    import keras  # noqa: PLC0415

    x = np.random.default_rng(0).normal(size=(64, 32)).astype("float32")
    y = x[:, :4].copy()
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 4, "data": 2}))
    for i in range(args.steps):
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((32,))]
                + [keras.layers.Dense(64, activation="relu")
                   for _ in range(4)] + [keras.layers.Dense(4)])
            pipe = tfpar.PipelineModel(model, num_microbatches=4,
                                       record_timeline=not args.no_profiler)
            pipe.compile(optimizer="adam", loss="mse")
        pipe.fit(x, y, batch_size=64, epochs=1, verbose=0)
        print("step", i, len(pipe.last_timeline or []), flush=True)


if __name__ == "__main__":
    main()
