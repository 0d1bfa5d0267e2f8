"""`StepWatchdog`: a training step that does not finish in time ends the job.

A TensorFlow collective has no timeout: a host that is alive (it answers
heartbeats) but never joins a step — stuck in its input pipeline, in a
deadlock of its own, or in a different branch of the program — leaves the
others waiting forever. Under `StepWatchdog` each host tells the others,
through its heartbeat answers (`tfpar.host_watch`), how many steps it has
begun; a step still running after `timeout` seconds ends every host with
status 70 and an error naming the hosts that have not begun it (or that
exited cleanly), like PyTorch's collective watchdog.

Limit: it watches `fit`'s steps, which run as `tf.function`s (TF
releases Python's lock while they wait); an eager DTensor collective
outside a step (a weight assignment, `get_weights`) holds the lock while
it waits, so no tfpar thread runs until it returns.

The default timeout is generous (`TFPAR_STEP_TIMEOUT`, else 1800 s: the
first step also compiles), and the watchdog is off in an interactive
session (a Python prompt or notebook) unless `timeout` is given. On one
host (no `connect_hosts`) it does nothing.

Example:

>>> model.fit(x, y, callbacks=[tfpar.StepWatchdog()])  # doctest: +SKIP
>>> tfpar.StepWatchdog(timeout=600)  # doctest: +ELLIPSIS
<...StepWatchdog object at ...>
"""

import os
import sys

import keras

from tfpar import host_watch

DEFAULT_TIMEOUT = 1800.0


def _interactive():
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or (
        "ipykernel" in sys.modules)


class StepWatchdog(keras.callbacks.Callback):
    """Ends every host when a training step exceeds `timeout` seconds.

    Args:
        timeout: seconds a step may take; None: `TFPAR_STEP_TIMEOUT`, else
            1800, and off in an interactive session.
    """

    def __init__(self, timeout=None):
        super().__init__()
        if timeout is None:
            setting = os.environ.get("TFPAR_STEP_TIMEOUT")
            timeout = None if _interactive() and setting is None else float(
                setting or DEFAULT_TIMEOUT)
        elif isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or not timeout > 0:
            raise ValueError(
                "StepWatchdog(timeout) needs a number of seconds > 0 (or "
                f"None for the default). Received: timeout={timeout!r}")
        self.timeout = timeout

    def on_train_begin(self, logs=None):
        watch = host_watch.current()
        if watch is not None:
            watch.step_timeout = self.timeout

    def on_train_batch_begin(self, batch, logs=None):
        watch = host_watch.current()
        if watch is not None:
            watch.begin_step()

    def on_train_batch_end(self, batch, logs=None):
        watch = host_watch.current()
        if watch is not None:
            watch.end_step()

    def on_train_end(self, logs=None):
        watch = host_watch.current()
        if watch is not None:
            watch.step_timeout = None
