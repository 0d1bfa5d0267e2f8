"""What TF's profiler saw run: the op events behind an executed timeline.

`PipelineModel(record_timeline=True)` records each training step inside
`OpEvents` and turns the events into the timeline that
`tfpar/pipeline/timeline.py` renders (`format_timeline`, `plot_schedule`).

Example:

>>> import tensorflow as tf
>>> from tfpar.pipeline.profiler import OpEvents
>>> with OpEvents() as trace:
...     _ = tf.linalg.matmul(tf.ones((4, 4)), tf.ones((4, 4)))
>>> any("MatMul" in name for name, _, _ in trace.events)
True
"""

import tensorflow as tf

from tfpar import _compat


class OpEvents:
    """Records the TF ops executed in its `with` block (TF's profiler, host
    tracer level 3: every op kernel, named by its name scope).

    After the block, `events` holds (op name, start seconds, end seconds)
    of every executed op (read by `_compat.profiled_op_events`).
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
            self.events.extend(_compat.profiled_op_events(self._directory))
        finally:
            shutil.rmtree(self._directory, ignore_errors=True)
        return False
