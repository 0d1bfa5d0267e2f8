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

import re

import tensorflow as tf

from tfpar import _compat
from tfpar.pipeline.schedules import BACKWARD, TimelineEntry

ACTION_SCOPE = "tfpar_pipeline_action_"


class OpEvents:
    """Records the TF ops executed in its `with` block (TF's profiler, host
    tracer level 3: every op kernel, named by its name scope).

    After the block, `events` holds (op name, start seconds, end seconds)
    of every executed op (read by `op_events`).
    """

    def __init__(self):
        self.events = []
        self._directory = None

    def __enter__(self):
        import tempfile  # noqa: PLC0415

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
