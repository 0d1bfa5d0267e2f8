"""What TF's profiler saw run: the op events behind an executed timeline.

`PipelineModel(record_timeline=True)` records each training step inside
`OpEvents` and turns the events into the timeline that
`tfpar/pipeline/timeline.py` renders (`format_timeline`, `plot_schedule`)
with `executed_timeline`: each pipeline action's ops run under the name
scope `ACTION_SCOPE` + "<part><kind><micro-batch>" (e.g. "...3F0").

Example:

>>> import tensorflow as tf
>>> from tfpar.pipeline.profiler import OpEvents
>>> with OpEvents() as trace:
...     _ = tf.linalg.matmul(tf.ones((4, 4)), tf.ones((4, 4)))
>>> any("MatMul" in name for name, _, _ in trace.events)
True
"""

import itertools
import re

import numpy as np
import tensorflow as tf

from tfpar import _compat
from tfpar import placement
from tfpar.pipeline.schedules import BACKWARD, TimelineEntry

ACTION_SCOPE = "tfpar_pipeline_action_"


class OpEvents:
    """Records the TF ops executed in its `with` block (TF's profiler, host
    tracer level 3: every op kernel, named by its name scope).

    After the block, `events` holds (op name, start seconds, end seconds)
    of every executed op (read by `op_events`). The collective groups of
    `meshes` (the meshes the block's steps run on) are formed before the
    profiler starts (`form_collective_groups`: TF 2.21's profiler corrupts
    its heap when a group forms while it runs).
    """

    def __init__(self, meshes=()):
        self.events = []
        self._meshes = meshes
        self._directory = None

    def __enter__(self):
        import tempfile  # noqa: PLC0415

        form_collective_groups(self._meshes)
        self._directory = tempfile.mkdtemp(prefix="tfpar_trace_")
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=3)
        try:
            tf.profiler.experimental.start(self._directory, options=options)
        except Exception as error:  # noqa: BLE001 (already profiling, ...)
            raise RuntimeError(
                "record_timeline needs TF's profiler, which would not start "
                f"({error}). Stop any other profiler session first."
            ) from error
        return self

    def __exit__(self, *exc):
        import shutil  # noqa: PLC0415

        tf.profiler.experimental.stop()
        try:
            self.events.extend(op_events(self._directory))
        finally:
            shutil.rmtree(self._directory, ignore_errors=True)
        return False


def form_collective_groups(meshes):
    """Runs, unprofiled, an all-reduce, an all-gather, a reduce-scatter and
    an all-to-all over every group of axes of each mesh in `meshes` (once
    per mesh and TF context), so that a step profiled after it forms no
    collective group.

    Why: a group of devices forms when its first collective runs. Each
    member's `CollectiveExecutor::CompleteParams` opens a profiler event
    and waits for the last member, whose thread closes them all; TF 2.21's
    profiler merges such cross-thread events at `stop()` through pointers
    into per-thread queues that it has already copied and freed
    (`TraceMeRecorder::Consume`), and now and then aborts the process
    ("double free or corruption"). Groups are kept per process and keyed by
    their devices, so once formed no later function forms them again.
    `tests/tf_profiler_crash_repro.py` shows both halves: collectives of
    fresh groups under the profiler abort within seconds; the same groups
    formed first, by other functions, never did.

    Example:

    >>> import tfpar
    >>> form_collective_groups([tfpar.Mesh({"data": 2, "model": 4})])
    """
    formed = _compat.eager_context_state("formed_collective_groups", set)
    for mesh in meshes:
        key = (tuple(mesh.devices), tuple(mesh.shape.items()))
        if key in formed:
            continue
        groups = [axes for k in range(1, len(mesh.axis_names) + 1)
                  for axes in itertools.combinations(mesh.axis_names, k)
                  if np.prod([mesh.axis_size(a) for a in axes]) > 1]
        if groups:
            _run_collectives(mesh, groups)
        formed.add(key)  # only once its collectives ran


def _run_collectives(mesh, groups):
    """One DTensor step on `mesh` with each collective over each group of
    axes: a block split over the group's axes (one dimension per axis)
    summed (all-reduce) and gathered (all-gather); for one axis, the block
    (axis, None) also contracted over its split dimension into a result
    split the same way (reduce-scatter) and re-split as (None, axis)
    (all-to-all)."""
    specs = [axes + (None,) * (2 - len(axes)) for axes in groups]
    inputs = [placement.put(np.ones((mesh.size,) * len(spec), np.float32),
                            spec, mesh) for spec in specs]

    @tf.function
    def step(blocks):
        outputs = []
        for axes, spec, block in zip(groups, specs, blocks):
            outputs.append(tf.reduce_sum(block))
            outputs.append(placement.relayout(block, (None,) * len(spec),
                                              mesh))
            if len(axes) == 1:  # block split (axis, None)
                product = tf.matmul(block, block, transpose_a=True)
                outputs.append(placement.relayout(product, spec, mesh))
                outputs.append(placement.relayout(block, (None,) + axes,
                                                  mesh))
        return outputs

    for output in step(inputs):
        placement.fetch(output)


def op_events(directory):
    """[(op name, start seconds, end seconds)] of every event TF's profiler
    wrote under `directory`: each plane's lines hold events at picosecond
    offsets from the line's nanosecond timestamp."""
    events = []
    for space in _compat.profiler_xspaces(directory):
        for plane in space.planes:
            names = plane.event_metadata
            for line in plane.lines:
                base = line.timestamp_ns * 1e-9
                for event in line.events:
                    start = base + event.offset_ps * 1e-12
                    events.append((names[event.metadata_id].name, start,
                                   start + event.duration_ps * 1e-12))
    return events


_COMPUTE_OPS = re.compile(r"MatMul|Conv|Einsum")
_LAYOUT_OPS = re.compile(r"Relayout|DTensorAll|CopyToMesh")


def executed_timeline(events, num_stages, stage_and_chunk=None):
    """The executed timeline from profiled op events (TF's profiler names
    every executed op "<scope>/<name>:<type>"); part k is reported as
    `stage_and_chunk(k)` (`Schedule.stage_and_chunk`), by default stage
    k mod p, chunk k // p.

    Only ops run by the step's function call count (their names start with
    the call's, e.g. "tf.StatefulPartitionedCall/"), not ops TF evaluates
    while compiling it. An action spans from the start of its first to the
    end of its last matrix multiply or convolution on its stage's devices (ops that do not
    wait for the action's inputs, such as weight reads, run whenever the
    executor gets to them and would blur the picture); an action with no
    such op spans all of its ops. Seconds from the first action's start.

    Example:

    >>> executed_timeline([
    ...     ("call/tfpar_pipeline_action_1F0/d/MatMul:MatMul", 3.0, 4.0),
    ...     ("call/gradient_tape/tfpar_pipeline_action_1F0/d/MatMul:MatMul",
    ...      5.0, 7.0)], num_stages=2)  # doctest: +NORMALIZE_WHITESPACE
    [TimelineEntry(stage=1, kind='F', microbatch=0, start=0.0, end=1.0,
                   chunk=0),
     TimelineEntry(stage=1, kind='B', microbatch=0, start=2.0, end=4.0,
                   chunk=0)]
    """
    # Gradient ops are named after their forward op: "gradient_tape/<F>".
    # Executed ops carry the name of the function call running them
    # ("tf.StatefulPartitionedCall.../"); ops TF evaluates while it compiles
    # the step (constant folding on the calling thread, e.g. a Range or a
    # shape's FloorDiv) carry the bare name and are left out.
    pattern = re.compile("/(" + re.escape(_compat.GRADIENT_SCOPE) + ")?"
                         + ACTION_SCOPE + r"(\d+)([FBW])(\d+)/")
    spans, compute = {}, {}
    for name, start, end in events:
        match = pattern.search(name)
        if match:
            kind = BACKWARD if match[1] else match[3]
            key = (int(match[2]), kind, int(match[4]))
            op_name, _, op_type = name.rpartition(":")
            # DTensor's layout changes (named "Relayout"/"DTensorAll...")
            # include small ops on constants that run at any time (even
            # before the step's first forward): never part of a span.
            if _LAYOUT_OPS.search(op_name):
                continue
            target = compute if _COMPUTE_OPS.search(op_type) else spans
            low, high = target.get(key, (start, end))
            target[key] = (min(low, start), max(high, end))
    spans.update(compute)
    if not spans:
        return []
    origin = min(low for low, _ in spans.values())
    where_is = stage_and_chunk or (lambda k: (k % num_stages,
                                              k // num_stages))
    return sorted((TimelineEntry(where_is(k)[0], kind, i, low - origin,
                                 high - origin, where_is(k)[1])
                   for (k, kind, i), (low, high) in spans.items()),
                  key=lambda e: (e.start, e.stage))
