"""Keras train/test/predict (and keras-hub generate) functions for models
under a ParallelStrategy.

Keras builds its step functions for per-replica strategies. Under a
`ParallelStrategy` tfpar builds them instead (`_compat` routes
`make_train_function` and friends here), because one SPMD program needs its
inputs placed on the mesh before the `tf.function` is entered, and because
running several steps per call is the main lever on speed:

- `steps_per_execution = k` stacks k equal global batches on the host into
  one (k, batch, ...) tensor, places it split along the data axis on
  dimension 1, and runs the k steps in one `tf.function` call (a
  `tf.while_loop`); Keras only reads the logs of the last step.
- A batch the data axis does not divide (the last, partial batch of an
  epoch; any evaluate/predict batch) runs alone, replicated over the data
  axis (see `inputs`).
"""

import functools

import numpy as np
import tensorflow as tf

from tfpar import _compat
from tfpar import placement


def _named_partial(method):
    """`functools.partial(method)` keeping `method`'s name, which names the
    traced function ("__inference__in_replica_..."; a bare partial would
    be "function"), as profiles and dumped graphs show it."""
    partial = functools.partial(method)
    partial.__name__ = method.__name__
    return partial


class StepRunner:
    """Runs one kind of Keras step (train, test or predict) on the mesh."""

    def __init__(self, model, extended, mode):
        if model.run_eagerly and mode == "train":
            raise ValueError(
                "compile(run_eagerly=True) cannot train under "
                "ParallelStrategy: DTensor does not support eager gradients. "
                "Received: run_eagerly=True. Compile with run_eagerly=False "
                "(the default) to train; evaluate/predict may run eagerly."
            )
        extended.adopt_state_variables(model)
        self._extended = extended
        self._placer = extended.input_placer
        self._mode = mode
        self._step_fn = {
            "train": model.train_step,
            "test": model.test_step,
            "predict": model.predict_step,
        }[mode]
        # tf.function of a functools.partial: TF counts retracings per
        # Python function (per code object), so the steps of every model and
        # mode, traced once each, would add up to "triggered tf.function
        # retracing" warnings; a partial makes each runner's count its own.
        wrap = (lambda f: f) if model.run_eagerly else (
            lambda f: tf.function(_named_partial(f), reduce_retracing=True))
        self._one_step = wrap(self._in_replica)
        self._many_steps = wrap(self._loop)
        self._compiled = set()  # input signatures already run (see _call)

    def _in_replica(self, batch):
        with self._extended.replica_scope():
            outputs = self._step_fn(batch)
        if self._mode == "predict":
            return outputs  # assembled on the host from the blocks
        # Logs go back to Keras as DTensors held whole by every device (a
        # no-op for the usual scalar metrics); nothing waits for the step
        # until Keras reads a value, so the host runs ahead.
        return tf.nest.map_structure(self._extended.replicate, outputs)

    def _loop(self, stacked):
        """Runs the step on stacked[0], ..., stacked[k-1]; last outputs."""
        # tf.gather, not t[i]: DTensor mis-propagates the layout of a strided
        # slice that drops dimension 0 of a (k, batch, ...) tensor.
        steps = tf.shape(tf.nest.flatten(stacked)[0])[0]

        def step(i):
            return self._in_replica(
                tf.nest.map_structure(lambda t: tf.gather(t, i), stacked))

        outputs = step(0)

        def body(i, _):
            return i + 1, step(i)

        _, outputs = tf.while_loop(
            lambda i, _: i < steps, body, (tf.constant(1), outputs)
        )
        return outputs

    def run(self, host_batches):
        """Runs the step over `host_batches` (a list).

        Train and test return the logs of the last step (replicated
        DTensors); predict returns every batch's outputs concatenated, as
        host tensors.
        """
        batches = list(host_batches)
        if self._mode == "predict":
            outputs = [
                _fetch_all(self._call(self._one_step, self._placer.place(b)))
                for b in batches
            ]
            return tf.nest.map_structure(
                lambda *xs: tf.constant(np.concatenate(xs)), *outputs)
        outputs = None
        for group in self._stackable_runs(batches):
            if len(group) == 1:
                outputs = self._call(self._one_step,
                                     self._placer.place(group[0]))
            else:
                stacked = tf.nest.map_structure(
                    lambda *ts: None if ts[0] is None else tf.stack(ts), *group
                )
                outputs = self._call(self._many_steps,
                                     self._placer.place(stacked, batch_dim=1))
        return outputs

    def _call(self, function, placed):
        """`function(placed)`; a call with inputs of a new signature (one
        that may trace and compile) compiles all-gathers as real ones when
        the strategy asks for it (`_compat.collective_all_gathers`)."""
        if not self._extended.real_all_gathers:
            return function(placed)
        key = (function is self._many_steps,) + tuple(
            (tuple(t.shape.as_list()), t.dtype)
            for t in tf.nest.flatten(placed) if t is not None)
        if key in self._compiled:
            return function(placed)
        with _compat.collective_all_gathers(True):
            outputs = function(placed)
        self._compiled.add(key)
        return outputs

    def _stackable_runs(self, batches):
        """Consecutive batches of one shape that the data axis splits."""
        runs = []
        for batch in batches:
            key = tuple(
                None if t is None else tuple(t.shape.as_list())
                for t in tf.nest.flatten(batch)
            )
            if runs and runs[-1][0] == key and self._placer.splits_evenly(batch):
                runs[-1][1].append(batch)
            else:
                runs.append((key, [batch]))
        return [run for _, run in runs]


def _fetch_all(outputs):
    return tf.nest.map_structure(placement.fetch, outputs)


def make_function(model, extended, mode, runner=None):
    """The function Keras calls as `model.{train,test,predict}_function`.

    `runner` (default: a `StepRunner`) has `run(host_batches)`.
    """
    runner = runner or StepRunner(model, extended, mode)

    if mode == "predict":

        def predict_function(data):
            # Keras passes a list of up to steps_per_execution batches.
            with _compat.quiet_cpp_info_logs():
                return runner.run([_as_batch(b) for b in data])

        return predict_function

    def function(iterator):
        batches = []
        for _ in range(model.steps_per_execution):
            try:
                batches.append(_next_host_batch(iterator,
                                                check=mode == "train"))
            except (StopIteration, tf.errors.OutOfRangeError):
                break
        if not batches:
            raise StopIteration
        with _compat.quiet_cpp_info_logs():  # DTensor's per-shape INFO lines
            return runner.run(batches)

    return function


def _as_batch(data):
    """Host tensors for a batch; Keras' `Optional` stand-ins become None."""
    return tf.nest.map_structure(
        lambda t: None if t is None or isinstance(t, tf.experimental.Optional)
        else tf.convert_to_tensor(t), data)


def _next_host_batch(iterator, check):
    next_host = getattr(iterator, "next_host_batch", None)
    if next_host is None:
        return _as_batch(next(iterator))
    return next_host(check=check)


def make_generate_function(model, extended):
    """keras-hub's `model.generate_function` under a ParallelStrategy.

    keras-hub's `CausalLM.generate()` calls it with one batch of host
    tensors (token ids and padding mask) and the stop token ids. Here the
    batch is placed on the mesh (split along the data axis when it divides
    the batch, otherwise whole on every device, as for a partial batch in
    `fit`), `model.generate_step` (prefill, the KV-cache loop, the sampler)
    runs as one SPMD `tf.function` in the strategy's replica context, and
    the generated tokens come back as host tensors. The step is traced even
    when the model runs eagerly and never XLA-compiled (`jit_compile` is
    ignored): DTensor runs it.

    >>> import keras_hub, numpy as np, tfpar
    >>> tfpar.use_virtual_cpus(8)
    >>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    >>> with strategy.scope():
    ...     lm = keras_hub.models.GPT2CausalLM(keras_hub.models.GPT2Backbone(
    ...         vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=8,
    ...         intermediate_dim=16, max_sequence_length=8),
    ...         preprocessor=None)
    ...     lm.compile(sampler="greedy")
    >>> mask = np.broadcast_to(np.arange(8) < 3, (8, 8))  # 3-token prompts
    >>> out = lm.generate({"token_ids": np.ones((8, 8), "int32"),
    ...                    "padding_mask": mask}, stop_token_ids=None)
    >>> out["token_ids"].shape
    (8, 8)
    """
    sampler = getattr(model, "sampler", None)
    extended.adopt_state_variables(model, getattr(sampler, "variables", ()))

    @tf.function(reduce_retracing=True)
    def step(inputs, *args, **kwargs):
        with extended.replica_scope():
            return model.generate_step(inputs, *args, **kwargs)

    def generate_function(inputs, *args, **kwargs):
        placed = extended.input_placer.place(_as_batch(inputs))
        outputs = step(placed, *args, **kwargs)
        return tf.nest.map_structure(
            lambda t: tf.constant(placement.fetch(t)), outputs)

    return generate_function
