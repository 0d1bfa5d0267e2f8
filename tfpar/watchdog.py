"""The step watchdog: a step that does not finish in time ends the job.

A TensorFlow collective has no timeout: a host that is alive (it answers
heartbeats) but never joins a step — stuck in its input pipeline, in a
deadlock of its own, or in a different branch of the program — leaves the
others waiting forever. On several hosts (`tfpar.connect_hosts`) every
step tfpar runs for `fit`, `evaluate` and `predict` is watched
(`run_watched`, around each call of the step function): each host tells
the others, through its heartbeat answers (`tfpar.host_watch`), how many
steps it has begun; a step still running after the timeout ends every
host with status 70 and an error naming the hosts that have not begun it
(or that exited cleanly), like PyTorch's collective watchdog.

The timeout is generous by default (`TFPAR_STEP_TIMEOUT`, else 1800 s:
the first step also compiles), and off in an interactive session (a
Python prompt or notebook) unless set; `StepWatchdog(timeout)`, a Keras
callback, sets another one for a `fit`. On one host nothing is watched.

Limit: steps run as `tf.function`s (TF releases Python's lock while they
wait); an eager DTensor collective outside a step (a weight assignment,
`get_weights`) holds the lock while it waits, so no tfpar thread runs
until it returns, and such a wait is not watched.

Example:

>>> model.fit(x, y, callbacks=[tfpar.StepWatchdog(600)])  # doctest: +SKIP
>>> tfpar.StepWatchdog(timeout=600)  # doctest: +ELLIPSIS
<...StepWatchdog object at ...>
"""

import os
import sys

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import host_watch

DEFAULT_TIMEOUT = 1800.0


def _interactive():
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or (
        "ipykernel" in sys.modules)


def default_timeout():
    """Seconds a step may take: `TFPAR_STEP_TIMEOUT`, else 1800; None (not
    watched) in an interactive session without the variable."""
    setting = os.environ.get("TFPAR_STEP_TIMEOUT")
    if setting is None and _interactive():
        return None
    return float(setting or DEFAULT_TIMEOUT)


def run_watched(step):
    """`step()` (one call of a step function), begun and ended on the host
    watch (several hosts only) under its timeout: a `StepWatchdog`'s, else
    `default_timeout()`. TF runs a step asynchronously — the call returns
    before its collectives complete — so the step ends when its first
    output is computed (`_wait_for`), not when it is dispatched.

    This waits on the training thread: one sync per step on several hosts.
    Waiting from a thread of tfpar's instead, so that the next step is
    dispatched first, was tried (2026-12-05): on two hosts a peer's step
    then failed ("CompleteGroup is cancelled before it starts") — reads of
    DTensors from two threads are not ordered alike on every host."""
    watch = host_watch.current()
    if watch is None:
        return step()
    if watch.step_timeout is None:
        watch.step_timeout = default_timeout()
    watch.begin_step()
    try:
        outputs = step()
        _wait_for(outputs)
        return outputs
    finally:
        watch.end_step()


def _wait_for(outputs):
    """Blocks until the first replicated tensor of `outputs` (a step's
    logs: its loss) is computed — the outputs of one step's program are
    computed together — by reading it to the host as Keras reads its logs
    (`numpy()` of the global tensor, which lets tfpar's threads run while
    it waits; `dtensor.unpack` would hold Python's lock)."""
    for leaf in tf.nest.flatten(outputs):
        if not isinstance(leaf, tf.Tensor):
            continue
        if dtensor.is_dtensor(leaf) and not dtensor.fetch_layout(
                leaf).is_fully_replicated():
            continue
        leaf.numpy()
        return


class StepWatchdog(keras.callbacks.Callback):
    """Sets the step timeout of a `fit` (every step on several hosts is
    watched, see the module docstring): a step over `timeout` seconds ends
    every host, naming the hosts that did not arrive.

    Args:
        timeout: seconds a step may take; None: `default_timeout()`
            (`TFPAR_STEP_TIMEOUT`, else 1800, off in an interactive
            session).
    """

    def __init__(self, timeout=None):
        super().__init__()
        if timeout is None:
            timeout = default_timeout()
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

    def on_train_end(self, logs=None):
        watch = host_watch.current()
        if watch is not None:
            watch.step_timeout = None
