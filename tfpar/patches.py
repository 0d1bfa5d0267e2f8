"""tfpar's patches of Keras and TF that a `ParallelStrategy` installs.

Two kinds, in one group (`install`, called by `ParallelStrategy()`, once
per process; `tfpar._compat.uninstall()` undoes it):

- routing (here): Keras' entry points reach the strategy a model belongs to
  (`compile` in its scope, `make_train_function` and friends,
  keras-hub's `make_generate_function`, an eager `model(x)`, a
  `tf.function` of a model's own method given host arrays), and Keras'
  symbolic build reads a dataset's spec instead of drawing a batch;
- the SPMD stand-ins of `tfpar.spmd_patches` (ops DTensor cannot lay out,
  and draws made as one device makes them), with the two patches that
  publish the Keras variable being created
  (`variable_creation.VARIABLE_CREATION_PATCHES`);
- context parallelism's (`context_parallel.PATCHES`: attention computed
  blockwise across the sequence split; inert without a context axis);
- Keras' recurrent layers unrolled in a step (`recurrent.PATCHES`).

What the routing asks tfpar is passed down as `hooks` (the strategy's
`compat_hooks()`): `owns(strategy)`, whether a strategy is a
`ParallelStrategy`; `function_for(model, mode)`, the step function of a
model under one (None: Keras' own); `eager_call(strategy, call, model,
args, kwargs)`; `strategy_of_layer(layer)`; `adopt_optimizer(model,
strategy)`; `in_graph_step()`, whether a graph is traced under a tfpar
strategy; `warn_if_never_entered(model)`, called when a model of no tfpar
strategy starts training; `ema_optimizers(model)`, the optimizers holding
its moving averages (Keras' `SwapEMAWeights`). Nothing here imports the
strategy.
"""

import functools
import types

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import compile_errors
from tfpar import context_keras_hub
from tfpar import context_parallel
from tfpar import hub_positions
from tfpar import moe_keras_hub
from tfpar import placement
from tfpar import quantization
from tfpar import recurrent
from tfpar import spmd_image_patches
from tfpar import spmd_patches
from tfpar import variable_creation
from tfpar import vocab_parallel


def _base_trainer():
    return _compat.keras_module("trainers.trainer").Trainer


def _tf_trainer():
    return _compat.keras_module("backend.tensorflow.trainer").TensorFlowTrainer


def _function_class():
    return _compat.tf_python_module(
        "eager.polymorphic_function.polymorphic_function").Function


def _routed_compile(original, hooks):
    """`compile` of a model whose strategy `hooks.owns` enters that
    strategy's scope, so the optimizer is created under it even when
    `compile` is called outside; such a model's keras-hub
    `generate_function` is routed too (`route_generate_function`). Set on
    the base class: Keras' `compile_from_config` (what `load_model`
    compiles with) skips compiling, with a warning, any model whose
    `type(model).compile` is not `Trainer.compile`."""

    def compile(self, *args, **kwargs):  # noqa: A001
        strategy = self.distribute_strategy
        if not hooks.owns(strategy):
            return original(self, *args, **kwargs)
        with strategy.scope():
            strategy.extended.registry.adopt_model(self)  # built outside
            _compat.bind_model_strategy(self, strategy)
            result = original(self, *args, **kwargs)
            hooks.adopt_optimizer(self, strategy)
            if self.built:
                strategy.extended.registry.check_rules_used(expert_axis=False)
        route_generate_function(self, hooks.function_for)
        return result

    return compile


def _symbolic_build_from_spec(original, hooks):
    """Keras builds a model under a strategy from `next()` of a fresh
    iterator, which for a one-shot generator silently drops a batch. Only
    shapes and dtypes are used: under tfpar they come from the dataset
    spec."""

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        dataset = getattr(iterator, "_distributed_dataset", None)
        if hooks.owns(self.distribute_strategy) and dataset is not None:
            data_batch = tf.nest.map_structure(
                lambda s: s if isinstance(s, tf.TensorSpec) else None,
                dataset.element_spec)
            iterator = None
        return original(self, iterator=iterator, data_batch=data_batch)

    return _maybe_symbolic_build


def _eager_model_call(_, hooks):
    """An eager call of a model built under a tfpar strategy runs through
    `hooks.eager_call` (`tfpar.training.eager_model_call`); other models
    (and every layer) keep theirs."""
    cls = _tf_trainer()

    def original_call(self, *args, **kwargs):
        # Next in the MRO of keras.Model after the trainer: Layer.__call__.
        return super(cls, self).__call__(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        # The strategy the model was built under, not merely the current one.
        strategy = getattr(self, "_distribute_strategy", None)
        if tf.executing_eagerly() and hooks.owns(strategy):
            return hooks.eager_call(strategy, original_call, self, args,
                                    kwargs)
        return original_call(self, *args, **kwargs)

    return __call__


def _routed_make_function(mode):
    """The factory of `make_<mode>_function`: the function
    `hooks.function_for(model, mode)` returns, when it returns one, else
    Keras' own."""
    attribute = f"{mode}_function"

    def make_factory(original, hooks):
        def make(self, force=False):
            if getattr(self, attribute) is not None and not force:
                return getattr(self, attribute)
            function = hooks.function_for(self, mode)
            if function is None:
                if mode == "train":  # a model of no ParallelStrategy
                    hooks.warn_if_never_entered(self)
                return original(self, force=force)
            setattr(self, attribute, function)
            return function

        return make

    return make_factory


def _routed_generate_function(original, hooks):
    """keras-hub's `make_generate_function` using
    `hooks.function_for(model, "generate")` when that returns a function
    (models under a strategy), keras-hub's own code otherwise."""

    def make_generate_function(self):
        if self.generate_function is not None:
            return self.generate_function
        function = hooks.function_for(self, "generate")
        if function is None:
            return original(self)
        self.generate_function = function
        return function

    return make_generate_function


def route_generate_function(model, make_function_for):
    """Lets a strategy build keras-hub's `generate_function` for `model`.

    keras-hub's `CausalLM` (and `TextToImage`) compile their own generation
    step: `make_generate_function` wraps `generate_step` in a `tf.function`
    that `generate()` calls with host tensors. The class defining
    `make_generate_function` is patched once (`_routed_generate_function`,
    undone by `uninstall`). A model without `make_generate_function` is
    left alone.
    """
    cls = next((c for c in type(model).__mro__
                if "make_generate_function" in c.__dict__), None)
    if cls is not None:
        _compat.install_group(
            f"generate:{cls.__module__}.{cls.__qualname__}", (_compat.Patch(
                "make_generate_function", lambda: cls, "make_generate_function",
                _routed_generate_function),), types.SimpleNamespace(
                    function_for=make_function_for))


def _is_host_array(x):
    """A numpy array or eager tensor that is not a DTensor (scalars
    excepted: DTensor broadcasts those)."""
    return isinstance(x, np.ndarray) and x.ndim > 0 or (
        isinstance(x, tf.Tensor) and hasattr(x, "numpy")
        and x.shape.rank and not dtensor.is_dtensor(x))


def _host_inputs_placed(original, hooks):
    """Lets any `tf.function` of a model's own method take host arrays.

    A Keras or keras-hub model may compile its methods itself (e.g.
    `tf.function(self.generate_step)`); called with host arrays while its
    weights live on a mesh, DTensor refuses the call ("got a regular tensor
    for input 0 ... but was expecting a DTensor"). When a function of a
    bound method of `owner` is called eagerly with host arrays and
    `hooks.strategy_of_layer(owner)` is a strategy, the arrays are placed
    on its mesh (split over the data axis when it divides them) and the
    call runs in its replica context (where tfpar's DTensor-friendly ops
    apply). Every other call, including every call DTensor accepted
    before, runs unchanged.
    """

    def __call__(self, *args, **kwargs):
        owner = getattr(self._python_function, "__self__", None)  # noqa: SLF001
        if owner is None or not tf.executing_eagerly() or not any(
                _is_host_array(x) for x in tf.nest.flatten((args, kwargs))):
            return original(self, *args, **kwargs)
        strategy = hooks.strategy_of_layer(owner)
        if strategy is None:
            return original(self, *args, **kwargs)
        extended = strategy.extended
        args, kwargs = extended.input_placer.place_arrays((args, kwargs))
        with extended.replica_scope():
            return original(self, *args, **kwargs)

    return __call__


_ROUTING_PATCHES = (
    _compat.Patch("compile", _base_trainer, "compile", _routed_compile),
    _compat.Patch("symbolic_build", _tf_trainer, "_maybe_symbolic_build",
                  _symbolic_build_from_spec),
    _compat.Patch("model_call", _tf_trainer, "__call__", _eager_model_call),
    *(_compat.Patch(f"make_{mode}_function", _tf_trainer,
                    f"make_{mode}_function", _routed_make_function(mode))
      for mode in ("train", "test", "predict")),
    _compat.Patch("function_call", _function_class, "__call__",
                  _host_inputs_placed),
)


def _host_gradients_placed(original, hooks):
    """`TFOptimizer.apply` whose gradients the strategy lays out first
    (`hooks.place_host_gradients`: host gradients given eagerly in the
    scope, as Keras' tf.distribute tests give them)."""

    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        targets = (trainable_variables if trainable_variables is not None
                   else getattr(self, "_trainable_variables", None))
        grads = hooks.place_host_gradients(self, grads, targets)
        return original(self, grads, trainable_variables)

    return apply


_HOST_GRADIENT_PATCHES = (_compat.Patch(
    "optimizer_host_gradients",
    lambda: _compat.keras_module("backend.tensorflow.optimizer").TFOptimizer,
    "apply", _host_gradients_placed),)


def _every_ema_swapped(original, hooks):
    """Keras' `SwapEMAWeights` swaps the weights with the moving averages
    of `model.optimizer` alone; under a ParallelStrategy they also live in
    each pipeline stage's optimizer, and an offloaded optimizer's beside
    its host copies of the weights: it swaps each optimizer
    `hooks.ema_optimizers(model)` lists and moves what the swap wrote to
    the devices (Keras' own, with its errors, for the others)."""

    @functools.wraps(original)
    def apply_to_ema_optimizers(self, tf_fn, backend_fn):
        found = hooks.ema_optimizers(self.model)
        if not found:
            return original(self, tf_fn, backend_fn)
        for optimizer, written in found:
            tf_fn(optimizer)
            written()
        return None

    return apply_to_ema_optimizers


class _HostSummaries:
    """`tf.summary` whose histograms are of host copies of their tensors
    (`placement.fetch`): TensorBoard buckets a histogram with regular
    tensors, which eager DTensor ops refuse ("got a regular tensor ... but
    was expecting a DTensor")."""

    def __init__(self, summary):
        self._summary = summary

    def __getattr__(self, name):
        return getattr(self._summary, name)

    def histogram(self, name, data, *args, **kwargs):
        return self._summary.histogram(name, _on_host(data), *args, **kwargs)


def _on_host(value):
    """`value` (a variable read) as a host copy when it is a DTensor."""
    value = tf.convert_to_tensor(value)
    return (tf.constant(placement.fetch(value)) if dtensor.is_dtensor(value)
            else value)


def _weights_logged_from_host(original, hooks):
    """Keras' `TensorBoard(histogram_freq=n)` logs each weight's
    histogram eagerly from the weight itself; a weight of a
    ParallelStrategy is a DTensor, whose histogram TensorBoard cannot
    compute: such a model's weights are logged from host copies
    (`_HostSummaries`), one weight at a time."""

    @functools.wraps(original)
    def _log_weights(self, epoch):
        if hooks.strategy_of_layer(self.model) is None:
            return original(self, epoch)
        summary = self.summary
        self._summary_module = _HostSummaries(summary)
        try:
            return original(self, epoch)
        finally:
            self._summary_module = summary

    return _log_weights


def _image_from_host(original, hooks):
    """`TensorBoard(write_images=True)` reshapes each weight into an image
    eagerly; a weight split over a mesh cannot be reshaped there ("Trying
    to copy a non-single-device and non-replicated DTensor"): a
    ParallelStrategy model's weight is drawn from its host copy."""

    @functools.wraps(original)
    def _log_weight_as_image(self, weight, weight_name, epoch):
        if hooks.strategy_of_layer(self.model) is not None:
            weight = _on_host(weight)
        return original(self, weight, weight_name, epoch)

    return _log_weight_as_image


def _dtensors_fetched_to_numpy(original, hooks):
    """Keras' `ops.convert_to_numpy` of an eager DTensor: its global value
    (`placement.fetch`). TF's `numpy()` refuses a split one ("Trying to
    copy a non-single-device and non-replicated DTensor"): Keras'
    `quantize("int4")` reads a split table's transpose so, in the
    strategy's scope."""

    @functools.wraps(original)
    def convert_to_numpy(x):
        if isinstance(x, tf.Tensor) and dtensor.is_dtensor(x):
            return placement.fetch(x)
        return original(x)

    return convert_to_numpy


_CALLBACK_PATCHES = (
    _compat.Patch(
        "swap_ema_weights",
        lambda: _compat.keras_module(
            "callbacks.swap_ema_weights").SwapEMAWeights,
        "_apply_to_ema_optimizers", _every_ema_swapped),
    _compat.Patch(
        "tensorboard_weights",
        lambda: _compat.keras_module("callbacks.tensorboard").TensorBoard,
        "_log_weights", _weights_logged_from_host),
    _compat.Patch(
        "tensorboard_images",
        lambda: _compat.keras_module("callbacks.tensorboard").TensorBoard,
        "_log_weight_as_image", _image_from_host),
)


_HOST_READ_PATCHES = (
    _compat.Patch("convert_to_numpy", lambda: _compat.keras_module(
        "backend"), "convert_to_numpy", _dtensors_fetched_to_numpy),
)


def install(hooks):
    """Installs the strategy's patches (routing, host gradients, Keras'
    callbacks' EMA swaps and TensorBoard weight histograms, Keras'
    `convert_to_numpy` of a split DTensor,
    `spmd_patches.PATCHES`, `spmd_image_patches.PATCHES`,
    `compile_errors.PATCHES`,
    `variable_creation.VARIABLE_CREATION_PATCHES`,
    `context_parallel.PATCHES`, `context_keras_hub.PATCHES`,
    `hub_positions.PATCHES`, `vocab_parallel.PATCHES`,
    `recurrent.PATCHES`, `quantization.PATCHES`) with `hooks`, and
    keras-hub's MoE blocks' (`moe_keras_hub.install`, a group of their
    own, also installed by `dispatch_experts` without a strategy); once per
    process."""
    _compat.install_group("strategy", (
        *_ROUTING_PATCHES, *_HOST_GRADIENT_PATCHES, *_CALLBACK_PATCHES,
        *_HOST_READ_PATCHES,
        *spmd_patches.PATCHES,
        *spmd_image_patches.PATCHES, *compile_errors.PATCHES,
        *variable_creation.VARIABLE_CREATION_PATCHES,
        *context_parallel.PATCHES, *context_keras_hub.PATCHES,
        *hub_positions.PATCHES, *vocab_parallel.PATCHES,
        *recurrent.PATCHES, *quantization.PATCHES), hooks)
    moe_keras_hub.install()


# -- per-host input: Keras' array datasets state their batch count --------


def _counted_array_dataset(original, _):
    """The tf.data dataset Keras builds from arrays, stating its batch
    count (Keras knows it, `ArrayDataAdapter.num_batches`; its flat_map
    pipeline hides it from `dataset.cardinality()`)."""

    @functools.wraps(original)
    def get_tf_dataset(self):
        dataset = original(self)
        if self.num_batches is None:
            return dataset
        return dataset.apply(
            tf.data.experimental.assert_cardinality(self.num_batches))

    return get_tf_dataset


def _array_adapter():
    return _compat.keras_module(
        "trainers.data_adapters.array_data_adapter").ArrayDataAdapter


def count_array_batches():
    """Makes the tf.data datasets Keras builds from arrays state their
    batch count (`_counted_array_dataset`).

    Per-host input needs it: Keras stops each host after its own count, so
    hosts must compare counts before the first step (`inputs`). Installed
    once, by the first strategy with per-host input; the datasets are
    unchanged but for their stated cardinality.
    """
    _compat.install_group("per_host_input", (_compat.Patch(
        "get_tf_dataset", _array_adapter, "get_tf_dataset",
        _counted_array_dataset),), None)
