"""Keras train/test/predict (and keras-hub generate) functions for models
under a ParallelStrategy: the step runners and the routing to them.

Keras builds its step functions for per-replica strategies. Under a
`ParallelStrategy` tfpar builds them instead (`tfpar.patches` routes
`make_train_function` and friends to `keras_function` here), because
one SPMD program needs its inputs placed on the mesh before the
`tf.function` is entered, and because running several steps per call is the
main lever on speed. One `Runner` base compiles the step (`tf.function`, or
eagerly under `run_eagerly`), and assembles predictions on the host; its two
cases are

- `StepRunner`, the plain SPMD step (`model.train_step` in the strategy's
  replica context on the whole mesh): `steps_per_execution = k` stacks k
  equal global batches on the host into one (k, batch, ...) tensor, places
  it split along the data axis on dimension 1, and runs the k steps in one
  `tf.function` call (a `tf.while_loop`); Keras only reads the logs of the
  last step. A batch the data axis does not divide (the last, partial batch
  of an epoch; any evaluate/predict batch) runs alone, replicated over the
  data axis (see `inputs`).
- the pipeline step of a `StagedModel` (`tfpar.PipelineModel`,
  `tfpar.pipeline.runner.PipelineRunner`).

Which runner a model gets (those two, the pipeline's host-driven form
across hosts, and each one's offload form) is one table,
`tfpar.runners.RUNNERS`, that the strategy consults
(`ParallelExtended.make_runner`).

Example (what `model.fit` calls under a strategy):

>>> runner = strategy.extended.make_runner(model, "train")  # doctest: +SKIP
>>> logs = runner.run([(x, y)])                             # doctest: +SKIP
"""

import abc
import functools

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import compile_errors
from tfpar import context_keras_hub
from tfpar import inputs as inputs_lib
from tfpar import logs
from tfpar import placement
from tfpar import recurrent
from tfpar import watchdog


def _named_partial(method):
    """`functools.partial(method)` keeping `method`'s name, which names the
    traced function ("__inference__in_replica_..."; a bare partial would
    be "function"), as profiles and dumped graphs show it."""
    partial = functools.partial(method)
    partial.__name__ = method.__name__
    return partial


class StagedModel(abc.ABC):
    """A Keras model whose steps run over pipeline stages (the protocol
    `tfpar.PipelineModel` implements): its steps run on the pipeline's
    runners (the table of step runners, `tfpar.runners`, picks them for
    it), it runs eager calls itself, and keeps one optimizer per model
    part. The runner table, the strategy and checkpoints (optimizer state)
    check for it with `isinstance`.

    >>> issubclass(tfpar.PipelineModel, StagedModel)  # doctest: +SKIP
    True
    """

    @abc.abstractmethod
    def eager_call(self, args, kwargs):
        """`model(*args, **kwargs)` on concrete inputs, outside any step."""

    @property
    @abc.abstractmethod
    def stage_optimizers(self):
        """One built optimizer per model part, `model.optimizer` last."""

    @abc.abstractmethod
    def sync_stage_optimizers(self, iterations=False):
        """Copies `model.optimizer`'s learning rate (and, with
        `iterations`, its step counter) into the other parts' optimizers."""

    def tied_copy_state(self):
        """Variables that mirror the model's own (persistent copies of
        weights tied across stages, their optimizer slots): checkpoints
        skip them."""
        return []

    def sync_tied_copies(self, optimizer=True):
        """Refills those mirrors from what they mirror (after a restore)."""


class Runner(abc.ABC):
    """Runs one kind of Keras step (train, test or predict) on the mesh:
    compiles it (`compiled`) and assembles predictions (`run`); the two
    cases say how a batch runs (`run_steps`, `predict_batch`)."""

    eager_training_error = (
        "compile(run_eagerly=True) cannot train under "
        "ParallelStrategy: DTensor does not support eager gradients. "
        "Received: run_eagerly=True. Compile with run_eagerly=False "
        "(the default) to train; evaluate/predict may run eagerly.")

    def __init__(self, model, extended, mode):
        if model.run_eagerly and mode == "train":
            raise ValueError(self.eager_training_error)
        self._model = model
        self._extended = extended
        self._mode = mode

    def compiled(self, step, reduce_retracing=True):
        """`step` as the function to call: itself under `run_eagerly`, else
        a `tf.function`. (Of a `functools.partial`: TF counts retracings per
        Python function (per code object), so the steps of every model and
        mode, traced once each, would add up to "triggered tf.function
        retracing" warnings; a partial makes each runner's count its own.)
        A model with recurrent layers traces each input shape exactly: a
        step unrolls its recurrences, so it needs their sequence length
        (`tfpar.recurrent`), which relaxing a shape to None would lose."""
        if self._model.run_eagerly:
            return step
        return tf.function(_named_partial(step), reduce_retracing=(
            reduce_retracing and not recurrent.has_recurrent_layers(
                self._model)))

    def run(self, host_batches):
        """Runs the step over `host_batches` (a list).

        Train and test return the logs of the last step (replicated
        DTensors); predict returns every batch's outputs concatenated, as
        host tensors.
        """
        batches = list(host_batches)
        if self._mode == "predict":
            outputs = [self.predict_batch(b) for b in batches]
            return tf.nest.map_structure(
                lambda *xs: tf.constant(np.concatenate(xs)), *outputs)
        return self.run_steps(batches)

    @abc.abstractmethod
    def run_steps(self, host_batches):
        """Train or test steps over the batches; the last step's logs."""

    @abc.abstractmethod
    def predict_batch(self, host_batch):
        """The model's outputs on one batch, as host arrays."""


class StepRunner(Runner):
    """The plain SPMD step: `model.{train,test,predict}_step` on the whole
    mesh (see module doc)."""

    def __init__(self, model, extended, mode):
        super().__init__(model, extended, mode)
        extended.registry.adopt_state_variables(model)
        self._placer = extended.input_placer
        self._step_fn = {
            "train": model.train_step,
            "test": model.test_step,
            "predict": model.predict_step,
        }[mode]
        self._one_step = self.compiled(self._in_replica)
        self._many_steps = self.compiled(self._loop)
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

    def predict_batch(self, host_batch):
        return self._placer.restore(_fetch_all(self._call(
            self._one_step, self._placer.place(host_batch))))

    def run_steps(self, host_batches):
        outputs = None
        for group in self._stackable_runs(host_batches):
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

    def traced_step(self, host_batch):
        """Runs one step on `host_batch` (as `fit` does) and returns its
        concrete function, whose compiled program `tfpar.communication`
        reads."""
        placed = self._placer.place(host_batch)
        self._call(self._one_step, placed)
        return self._one_step.get_concrete_function(placed)

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

    `runner` (default: the one the strategy chooses, `extended.make_runner`,
    from the table of step runners `tfpar.runners.RUNNERS`) is a `Runner`.
    """
    runner = runner or extended.make_runner(model, mode)

    if mode == "predict":

        def predict_function(data):
            # Keras passes a list of up to steps_per_execution batches.
            with logs.quiet_steps():
                return watchdog.run_watched(lambda: runner.run(
                    [extended.input_placer.host_batch_of(b) for b in data]))

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
        # quiet: no DTensor INFO lines, no cost-model errors; watched: on
        # several hosts a step over its timeout ends the job
        with logs.quiet_steps():
            return watchdog.run_watched(lambda: runner.run(batches))

    return function


def _next_host_batch(iterator, check):
    next_host = getattr(iterator, "next_host_batch", None)
    if next_host is None:
        return inputs_lib.host_batch(next(iterator))
    return next_host(check=check)


def keras_function(extended, model, mode):
    """Builds `model.{mode}_function` under the strategy of `extended` (see
    module doc). DTensor's compile errors in it name the layers
    (`tfpar.compile_errors`)."""
    extended.check_context()
    if model.built:  # else its weights come in the first step
        extended.registry.check_rules_used()
    if mode == "generate":  # unsplit over the context axis
        return make_generate_function(model, extended)
    context_keras_hub.check_load_balance(model, extended.input_placer.context)
    return compile_errors.explaining(
        make_function(model, extended, mode), model, extended, mode)


def eager_model_call(strategy, call, model, args, kwargs):
    """`model(x)` run eagerly under `strategy`: host arrays go to the mesh
    (split over the data axis when it divides them) and outputs come back
    replicated, so `.numpy()` works on them. (Eager gradients through
    DTensor ops are not supported by DTensor itself; train with `fit` or
    `strategy.run` inside a `tf.function`.) A `StagedModel` runs the call
    itself."""
    extended = strategy.extended
    extended.check_context()
    if isinstance(model, StagedModel):
        return model.eager_call(args, kwargs)
    context_keras_hub.check_load_balance(model, extended.input_placer.context)
    if extended.registry.placement_mesh is None:  # weights still on the host
        return call(model, *args, **kwargs)
    args, kwargs = extended.input_placer.place_arrays((args, kwargs))
    # Tensors the model makes from no input (keras-hub's causal masks
    # from `ops.arange`) are made on the mesh, replicated, instead of on
    # the host, where DTensor refuses to mix them with DTensors. In the
    # strategy's scope: layer styles read it (`model(x)` after the scope
    # was left failed in a split embedding).
    with strategy.scope(), dtensor.default_mesh(extended.mesh.dtensor_mesh):
        outputs = call(model, *args, **kwargs)
    return tf.nest.map_structure(extended.replicate, outputs)


def make_generate_function(model, extended):
    """keras-hub's `model.generate_function` under a ParallelStrategy.

    keras-hub's `CausalLM.generate()` calls it with one batch of host
    tensors (token ids and padding mask) and the stop token ids. Here the
    batch is placed on the mesh (split along the data axis when it divides
    the batch, otherwise whole on every device, as for a partial batch in
    `fit`; whole along the sequence on a context axis),
    `model.generate_step` (prefill, the KV-cache loop, the sampler)
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
    extended.registry.adopt_state_variables(model, getattr(sampler, "variables", ()))

    @tf.function(reduce_retracing=True)
    def step(inputs, *args, **kwargs):
        with extended.replica_scope():
            return model.generate_step(inputs, *args, **kwargs)

    def generate_function(inputs, *args, **kwargs):
        # Unsplit over a context axis (`context_keras_hub`'s docstring).
        with context_keras_hub.sequences_unsplit(extended.input_placer):
            placed = extended.input_placer.place(
                inputs_lib.host_batch(inputs))
            with logs.quiet_steps():
                outputs = step(placed, *args, **kwargs)
        return tf.nest.map_structure(
            lambda t: tf.constant(placement.fetch(t)), outputs)

    return generate_function
