"""TF 2.21's profiler aborts the process when a collective group forms while
it runs; collective groups formed before it starts are safe.

This is the native abort behind the `pipeline_schedules` notebook's kernel
death and examples/pipeline.py's "munmap_chunk(): invalid pointer"
(docs/guides/robustness.md, "The native abort, found"). A group of devices
forms when its first collective runs: each member's
`CollectiveExecutor::CompleteParams` opens a profiler event
(`TraceMe::ActivityStart`) and waits for the last member, whose thread
closes them all (`ActivityEnd`). At `tf.profiler.experimental.stop()`,
`TraceMeRecorder::Consume` merges such cross-thread events through pointers
into per-thread event queues that it has by then copied and freed (its
vector of queues is not reserved), and glibc aborts ("double free or
corruption", "free(): invalid pointer") or the process segfaults.

    python tests/tf_profiler_crash_repro.py --mode collectives
        [--same-group] [--no-profiler] [--sessions 100] [--per-session 10]

Modes, each session a profiler started, `--per-session` units run, stopped:
- collectives (TF alone): a unit is one all-reduce of a fresh group of the
  8 virtual CPUs (eager `all_reduce_v2` from 8 threads). On 2026-12-03 it
  aborted in 3 runs of 3, after 4, 8 and 26 sessions (a scratch version:
  4 of 4 within 20); without the profiler 100 sessions ran clean, and with
  `--same-group` (one group, fresh instances) 3 runs of 100 sessions.
- dtensor: a unit is a fresh DTensor mesh over a random device order (new
  groups) and the first run of a step on it (a matmul split over one axis,
  gathered over the other). 4 units per session aborted in 7 runs of 7,
  after 2-19 sessions; with `--form-first` (each mesh's groups formed first
  by `tfpar.pipeline.profiler.form_collective_groups`, unprofiled) 8 runs
  of 8 clean, 1,360 fresh meshes.
- pipeline: a unit is a fresh `tfpar.PipelineModel(record_timeline=True)`
  on a mesh over a random device order, trained one step (the recorder
  forms its groups first); `--no-form` turns that off.
"""

import argparse
import itertools
import os
import random
import shutil
import tempfile
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
DEVICES = 8


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="collectives",
                        choices=["collectives", "dtensor", "pipeline"])
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--per-session", type=int, default=10)
    parser.add_argument("--no-profiler", action="store_true")
    parser.add_argument("--same-group", action="store_true")
    parser.add_argument("--form-first", action="store_true")
    parser.add_argument("--no-form", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    units = {"collectives": fresh_groups, "dtensor": fresh_meshes,
             "pipeline": fresh_pipelines}[args.mode](args)
    for session in range(args.sessions):
        batch = [next(units) for _ in range(args.per_session)]
        profiled(args, lambda: [run() for run in batch])
        print("session", session, flush=True)
    print("done")


def profiled(args, body):
    """Runs `body()` between the profiler's start and stop, as
    `tfpar.pipeline.profiler.OpEvents` does."""
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


def fresh_groups(args):
    """Units: one all-reduce over the 8 CPUs, a fresh group key each (one
    key with `--same-group`), from one thread per device."""
    import tensorflow as tf  # noqa: PLC0415
    from tensorflow.python.ops import collective_ops  # noqa: PLC0415

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * DEVICES)
    keys = itertools.count(1)

    def unit():
        key = next(keys)
        group = 1 if args.same_group else key

        def member(d):
            with tf.device(f"/device:CPU:{d}"):
                collective_ops.all_reduce_v2(tf.ones((4,)) * d, DEVICES,
                                             group, key)

        threads = [threading.Thread(target=member, args=(d,))
                   for d in range(DEVICES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    while True:
        yield unit


def fresh_meshes(args):
    """Units: a step's first run on a fresh 2 x 4 mesh over a random device
    order (its groups formed first with `--form-first`)."""
    import numpy as np  # noqa: PLC0415

    import tfpar  # noqa: PLC0415

    tfpar.use_virtual_cpus(DEVICES)
    import tensorflow as tf  # noqa: PLC0415

    from tfpar import placement  # noqa: PLC0415
    from tfpar.pipeline import profiler  # noqa: PLC0415

    order = random.Random(args.seed)
    devices = tfpar.mesh.default_devices()
    while True:
        mesh = tfpar.Mesh({"x": 2, "y": 4},
                          devices=order.sample(devices, DEVICES))
        if args.form_first:
            profiler.form_collective_groups([mesh])
        a = placement.put(np.ones((8, 64), np.float32), ("x", "y"), mesh)
        w = placement.put(np.ones((64, 32), np.float32), ("y", None), mesh)

        @tf.function
        def step(a, w, mesh=mesh):
            product = tf.matmul(a, w)  # all-reduce over y
            return placement.relayout(product, (None, None), mesh)  # gather x

        concrete = step.get_concrete_function(a, w)
        yield lambda concrete=concrete, a=a, w=w: concrete(a, w)


def fresh_pipelines(args):
    """Units: a fresh pipe=2 x data=2 x model=2 `PipelineModel` with
    record_timeline on a random device order, trained one step."""
    import numpy as np  # noqa: PLC0415

    import tfpar  # noqa: PLC0415

    tfpar.use_virtual_cpus(DEVICES)
    import keras  # noqa: PLC0415

    from tfpar.pipeline import profiler  # noqa: PLC0415

    if args.no_form:
        profiler.form_collective_groups = lambda meshes: None
    args.no_profiler = True  # record_timeline profiles each step itself
    order = random.Random(args.seed)
    devices = tfpar.mesh.default_devices()
    x = np.random.default_rng(0).normal(size=(16, 32)).astype("float32")
    y = x[:, :4].copy()
    while True:
        strategy = tfpar.ParallelStrategy(tfpar.Mesh(
            {"pipe": 2, "data": 2, "model": 2},
            devices=order.sample(devices, DEVICES)))
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((32,))]
                + [keras.layers.Dense(64, activation="relu")
                   for _ in range(2)] + [keras.layers.Dense(4)])
            pipe = tfpar.PipelineModel(model, num_microbatches=2,
                                       record_timeline=True)
            pipe.compile(optimizer="sgd", loss="mse")
        yield lambda pipe=pipe: pipe.fit(x, y, batch_size=16, verbose=0)


if __name__ == "__main__":
    main()
