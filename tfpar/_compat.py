"""Every private TensorFlow or Keras hook tfpar uses, in one place.

A TensorFlow upgrade that moves one of these touches only this file.
Checked against tensorflow 2.21. What is here: one-line shims named for the
private attribute or module they reach (e.g. `functional_of`,
`inbound_nodes`, `optimizer_strategy`), short helpers that encode a TF 2.21
internal (the names DTensor gives its ops, absl's log level), and the patch
registry (`Patch`, `install_group`, `install`, `uninstall`) with its
factories. The features built on them live in the modules that own them
(`keras_graph`, `styles`, `strategy`, `recompute`, `pipeline.profiler`);
`tests/test_architecture.py` checks that no function here but a patch
factory is over 15 lines.
"""

import collections
import contextlib
import functools
import threading
import types
import weakref

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.dtensor.python import d_variable
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.eager import record

# The base classes tf.distribute strategies are built from.
StrategyExtendedV2 = distribute_lib.StrategyExtendedV2
DVariable = d_variable.DVariable


def require_cross_replica_or_default_context(extended):
    """Raises unless called outside `strategy.run` (as `run` itself must be)."""
    distribute_lib._require_cross_replica_or_default_context_extended(extended)  # noqa: SLF001


# -- tfpar's patches of Keras and TF: data, installed on first use ------------
#
# Each patch is a `Patch`: the object to change (a function returning it, so
# nothing is imported before it is needed), the attribute, and a factory
# `make(original, hooks)` of the replacement, `hooks` being what the
# replacement asks tfpar (`_strategy_hooks`). `install()` applies the
# strategy's patches once, when the first `ParallelStrategy` is made (so
# `import tfpar` alone changes nothing); `uninstall()` restores every
# original, in reverse order (for tests).


class Patch(collections.namedtuple("Patch", "name owner attribute make")):
    """`owner().attribute = make(original, hooks)`, undone by `uninstall`."""


_ABSENT = object()  # the attribute was inherited, not set on the owner
_originals = {}  # (id(owner), attribute) -> (owner, attribute, own value)
_installed = set()  # names of the patch groups installed


def _replace(owner, attribute, make):
    """Sets `owner.attribute = make(current value, None if it has none)`
    unless tfpar did already, recording the owner's own value (or its
    absence) for `uninstall`."""
    key = (id(owner), attribute)
    if key in _originals:
        return
    _originals[key] = (owner, attribute, vars(owner).get(attribute, _ABSENT))
    setattr(owner, attribute, make(getattr(owner, attribute, None)))


def unpatched(owner, attribute):
    """`owner.attribute` as it was before tfpar replaced it (the current
    value when tfpar did not)."""
    record = _originals.get((id(owner), attribute))
    if record is None or record[2] is _ABSENT:
        return getattr(owner, attribute)
    return record[2]


def install_group(group, patches, hooks):
    """Applies `patches` (Patch tuples) as the group named `group`, their
    factories given `hooks`; once per group (undone by `uninstall`)."""
    if group in _installed:
        return
    _installed.add(group)
    for patch in patches:
        _replace(patch.owner(), patch.attribute,
                 lambda original, p=patch: p.make(original, hooks))


def install():
    """Installs tfpar's Keras/TF hooks (`_STRATEGY_PATCHES`, asking
    `tfpar.strategy.compat_hooks`, and `REMAT_PATCHES`, by `tfpar.recompute.install`); idempotent.
    `ParallelStrategy()` calls it."""
    from tfpar import recompute  # noqa: PLC0415 (tfpar's modules import this one)
    from tfpar import strategy  # noqa: PLC0415

    install_group("strategy", _STRATEGY_PATCHES, strategy.compat_hooks())
    recompute.install()


def uninstall():
    """Restores every Keras/TF attribute tfpar replaced (all groups, and
    the keras-hub `make_generate_function`s routed since)."""
    for owner, attribute, value in reversed(list(_originals.values())):
        if value is _ABSENT:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, value)
    _originals.clear()
    _installed.clear()


def _base_trainer():
    from keras.src.trainers import trainer  # noqa: PLC0415

    return trainer.Trainer


def _tf_trainer():
    from keras.src.backend.tensorflow import trainer  # noqa: PLC0415

    return trainer.TensorFlowTrainer


def _tf_core():
    from keras.src.backend.tensorflow import core  # noqa: PLC0415

    return core


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
            bind_model_strategy(self, strategy)
            result = original(self, *args, **kwargs)
            hooks.adopt_optimizer(self, strategy)
            if self.built:
                strategy.extended.registry.check_rules_used()
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
    `tfpar.training.eager_model_call`; other models (and every layer) keep
    theirs."""
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
        install_group(f"generate:{cls.__module__}.{cls.__qualname__}", (Patch(
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


def _dense_slice_update_in_step(original, hooks):
    """`keras.ops.slice_update` as `spmd_ops.dense_slice_update` in a step:
    Keras' TF backend writes it with XLA's DynamicUpdateSlice, which
    DTensor 2.21 cannot lay out ("'tf.XlaDynamicUpdateSlice' op does not
    implement layout propagation"): keras-hub's KV cache updates failed in
    `generate()` (tests/test_generate.py). Elsewhere Keras' op runs."""
    from tfpar import spmd_ops  # noqa: PLC0415

    def slice_update(inputs, start_indices, updates):
        if hooks.in_step():
            return spmd_ops.dense_slice_update(inputs, start_indices, updates)
        return original(inputs, start_indices, updates)

    return slice_update


def _indexing_keeping_dims_in_step(original, hooks):
    """`tensor[key]` as `spmd_ops.index_keeping_dims` in a step (when it
    applies); elsewhere TF's indexing runs."""
    from tfpar import spmd_ops  # noqa: PLC0415

    def __getitem__(self, key):
        if hooks.in_step():
            result = spmd_ops.index_keeping_dims(self, key)
            if result is not None:
                return result
        return original(self, key)

    return __getitem__


def _gumbel_categorical_in_step(original, hooks):
    """`keras.random.categorical` as `spmd_ops.gumbel_categorical` in a
    step: Keras' TF op is StatelessMultinomial, which DTensor 2.21 cannot
    lay out ("'tf.StatelessMultinomial' op does not implement layout
    propagation"): keras-hub's top-k, top-p and random samplers failed.
    Elsewhere Keras' op runs."""
    from keras.src.backend.tensorflow import random as tf_random  # noqa: PLC0415

    from tfpar import spmd_ops  # noqa: PLC0415

    def categorical(logits, num_samples, dtype="int64", seed=None):
        replicate = hooks.replicate_in_step()
        if replicate is None:
            return original(logits, num_samples, dtype=dtype, seed=seed)
        seed = tf_random._cast_seed(tf_random.draw_seed(seed))  # noqa: SLF001
        return tf.cast(spmd_ops.gumbel_categorical(
            logits, num_samples, seed, replicate), dtype)

    return categorical


def _one_device_dropout_in_step(original, hooks):
    """Keras' TF `random.dropout` in a step, with the mask one device draws.

    DTensor draws a split tensor's random numbers block by block, from the
    seed and the device's place in the mesh, so on a data mesh Dropout
    kept other elements than one device (tests/test_fuzz_models.py). Here
    the uniform numbers u are laid out whole on every device (`replicate`)
    and the mask is cut to the input's blocks where it is used, so element
    i is kept iff u_i >= rate as on one device, and the kept ones are
    scaled by 1 / (1 - rate) (TF's `stateless_dropout`, the same op Keras
    calls). Each device draws every number of the tensor (not only its
    block's): the cost of the parity. The mask no longer depends on the
    layout, so recomputing the layer (which replays its seed) is allowed on
    any mesh. Outside a step Keras' op runs."""
    from keras.src.backend.tensorflow import random as tf_random  # noqa: PLC0415

    @functools.wraps(original)
    def dropout(inputs, rate, noise_shape=None, seed=None):
        replicate = hooks.replicate_in_step()
        if replicate is None or rate in (0.0, 1.0):
            return original(inputs, rate, noise_shape=noise_shape, seed=seed)
        with hooks.layout_free_draw():  # a recomputation may replay it
            seed = tf_random._cast_seed(tf_random.draw_seed(seed))  # noqa: SLF001
        noise_shape = tf_random._get_concrete_noise_shape(  # noqa: SLF001
            inputs, noise_shape)

        def whole_uniform(shape, dtype):
            return replicate(tf.random.stateless_uniform(shape, seed=seed,
                                                         dtype=dtype))

        return tf.nn.experimental.general_dropout(
            inputs, rate, whole_uniform, noise_shape=noise_shape)

    return dropout


# Keras' TF random ops that draw numbers of a given shape (no tensor input
# but the shape and the seed): GaussianNoise, GaussianDropout (normal),
# AlphaDropout, RandomFlip and the other preprocessing layers (uniform),
# and layers of one's own with a SeedGenerator.
SHAPED_DRAWS = ("normal", "uniform", "truncated_normal", "randint")


def _one_device_draw_in_step(original, hooks):
    """A Keras TF random op of `SHAPED_DRAWS` in a step, drawing the numbers
    one device draws.

    DTensor draws a split tensor's random numbers block by block, from the
    seed and the device's place in the mesh, so GaussianNoise on a data
    mesh added other noise than one device. Here the draw's only consumer
    is `replicate`, so DTensor lays it out whole on every device: each
    number n_i is TF's stateless draw at index i of the global shape from
    Keras' seed, as on one device, and the ops using it cut it to their
    operands' blocks. Each device draws every number of the tensor (not
    only its block's): the cost of the parity. The numbers no longer depend
    on the layout, so recomputing the layer (which replays its seed) is
    allowed on any mesh. Outside a step Keras' op runs."""

    @functools.wraps(original)
    def draw(*args, **kwargs):
        replicate = hooks.replicate_in_step()
        if replicate is None:
            return original(*args, **kwargs)
        with hooks.layout_free_draw():  # a recomputation may replay it
            return replicate(original(*args, **kwargs))

    return draw


def _one_device_shuffle_in_step(original, hooks):
    """Keras' TF `random.shuffle` in a step, with one device's permutation:
    Keras' own code (the argsort of uniform numbers, one per element along
    `axis`, and a gather) with the uniform numbers laid out whole on every
    device (`replicate`), as `_one_device_draw_in_step` draws them; DTensor
    would otherwise draw them per block where the gather's operand is split.
    Outside a step Keras' op runs."""
    from keras.src.backend.tensorflow import random as tf_random  # noqa: PLC0415

    @functools.wraps(original)
    def shuffle(x, axis=0, seed=None):
        replicate = hooks.replicate_in_step()
        if replicate is None:
            return original(x, axis=axis, seed=seed)
        with hooks.layout_free_draw():  # a recomputation may replay it
            seed = tf_random._cast_seed(tf_random.draw_seed(seed))  # noqa: SLF001
        x = tf.convert_to_tensor(x)
        numbers = replicate(tf.random.stateless_uniform(
            shape=[tf.shape(x)[axis]], seed=seed))
        # Whole too: DTensor asked TopKV2 for a split output when recomputed
        # under tensor parallelism ("The last dimensions of TopKV2Op
        # outputs should be UNSHARDED").
        return tf.gather(x, replicate(tf.argsort(numbers)), axis=axis)

    return shuffle


# Keras' TF random ops whose TF op DTensor 2.21 cannot lay out at all, not
# even replicated ("does not implement layout propagation",
# tests/dtensor_random_gamma_repro.py): refused when a step is traced.
REFUSED_DRAWS = {"gamma": "StatelessRandomGammaV3",
                 "beta": "StatelessRandomGammaV3",
                 "binomial": "StatelessRandomBinomial"}


def _refused_draw_in_step(name):
    """The factory of a Keras random op of `REFUSED_DRAWS` that raises a
    ValueError in a step (before the step runs: no weight changes), naming
    the op, where it was called and what to do instead; elsewhere Keras'
    op runs."""

    def make(original, hooks):
        @functools.wraps(original)
        def draw(*args, **kwargs):
            if not hooks.in_step():
                return original(*args, **kwargs)
            raise ValueError(
                f"keras.random.{name} cannot run in a tfpar step: DTensor "
                f"(TF 2.21) cannot lay out TF's {REFUSED_DRAWS[name]} op, "
                "not even replicated (tests/dtensor_random_gamma_repro.py). "
                "Draw these numbers outside the model, e.g. in the input "
                "pipeline (tf.data .map with tf.random.stateless_"
                f"{'binomial' if name == 'binomial' else 'gamma'}) and pass "
                "them in as an input, or draw with an op tfpar runs as one "
                "device (keras.random.normal, uniform, truncated_normal, "
                "randint, dropout, shuffle). Received: keras.random."
                f"{name} called under {tf.get_current_name_scope()!r}.")

        return draw

    return make


def _gathered_flip_in_step(original, hooks):
    """Keras' TF `numpy.flip` as `spmd_ops.reverse_by_gather` in a step
    (DTensor cannot lay out TF's ReverseV2: RandomFlip failed); elsewhere
    Keras' op runs."""
    from tfpar import spmd_ops  # noqa: PLC0415

    @functools.wraps(original)
    def flip(x, axis=None):
        if not hooks.in_step():
            return original(x, axis=axis)
        x = tf.convert_to_tensor(x)
        return spmd_ops.reverse_by_gather(
            x, range(x.shape.rank) if axis is None else axis)

    return flip


def _concat_whole_along_axis_in_step(original, hooks):
    """TF's `ConcatV2` (`tf.concat`, Keras' `concatenate`, a user layer's
    own `tf.concat(..., axis=-1)`) as `spmd_ops.concat_whole_along_axis` in
    a graph step: DTensor 2.21 concatenated each device's blocks when a
    consumer split the joined dimension and the axis was negative (a silent
    wrong result found by the fuzzing, tests/dtensor_concat_axis_repro.py).
    Elsewhere TF's op runs."""
    from tfpar import spmd_ops  # noqa: PLC0415

    @functools.wraps(original)
    def concat_v2(values, axis, name=None):
        if not hooks.in_graph_step():
            return original(values, axis, name=name)
        return spmd_ops.concat_whole_along_axis(
            values, axis, functools.partial(original, name=name))

    return concat_v2


def _random_crop_under_tfpar(original, hooks):
    """Keras' `RandomCrop.transform_images` under a tfpar strategy.

    At inference (training=False): the largest centred window of the target
    aspect ratio, resized to (height, width), as Keras' docstring says.
    Keras 3.15 returns the image uncropped there (keras-team/keras#21868),
    and under any tf.distribute strategy (tfpar's, MirroredStrategy) Keras
    builds the model before `fit` with an inference call, so the next
    layer, built for 6x6 images, saw 8x8 ones: a Keras shape error before
    training (one device's `predict` fails the same way).
    In training, in a step: the drawn window cut by
    `spmd_ops.crop_by_gather` (the same values as Keras' slice, which
    DTensor lays out wrongly). Elsewhere Keras' runs. (Bounding boxes and
    segmentation masks are Keras' own: untested under tfpar.)"""
    from tfpar import spmd_ops  # noqa: PLC0415

    @functools.wraps(original)
    def transform_images(self, images, transformation, training=True):
        if not hooks.owns(tf.distribute.get_strategy()):
            return original(self, images, transformation, training=training)
        if not training:
            images = self.backend.image.resize(
                self.backend.cast(images, self.compute_dtype),
                size=(self.height, self.width), crop_to_aspect_ratio=True,
                data_format=self.data_format)
        elif hooks.in_step() and all(
                isinstance(s, tf.Tensor) for s in transformation):
            images = spmd_ops.crop_by_gather(
                images, transformation, (self.height, self.width),
                (self.height_axis, self.width_axis))
        else:
            return original(self, images, transformation, training=training)
        return self.backend.cast(images, self.compute_dtype)

    return transform_images


def _replicated_batch_moments_in_step(original, hooks):
    """BatchNormalization's batch mean and variance (one number per
    feature) laid out whole on every device in a step.

    With `moving_mean` split by a rule (over any axis), DTensor 2.21 asks
    the tf.Mean of a Dense's output for the moving mean's layout and fails
    in its SPMD expansion ("EmitAllScatter was passed a desired_layout ...
    not more sharded"; found by the fuzzing on extra=2 × model=2 × data=2,
    minimal on model=2: Dense -> BatchNormalization,
    tests/test_batch_normalization_rules.py). Replicated, the statistics are the same
    numbers and the ops using them cut them to their operands' blocks: an
    all-gather of a vector per feature at most. Only when `moving_mean` is
    split (a split `moving_variance` alone trains as it is; with this
    relayout some of those cases fail compiling, and DTensor's own errors
    for gamma/beta rules stand); elsewhere Keras' runs."""

    def split(variable):
        place = getattr(backing_variable(variable), "placement", None)
        return place is not None and any(place.spec)

    @functools.wraps(original)
    def _moments(self, inputs, mask):
        mean, variance = original(self, inputs, mask)
        replicate = hooks.replicate_in_step()
        if replicate is None or not split(self.moving_mean):
            return mean, variance
        return replicate(mean), replicate(variance)

    return _moments


def _activation_einsum_in_step(original, hooks):
    """Keras' TF `ops.einsum` of two activations (rank >= 4) as
    `spmd_ops.activation_einsum` in a step: Keras' transposes of an operand
    failed in keras-hub's cached Gemma attention split by heads ("TransposeOp
    SPMD needs communication is not supported yet", tests/test_generate.py).
    Elsewhere, and for weights (EinsumDense), Keras' einsum runs."""
    from tfpar import spmd_ops  # noqa: PLC0415

    @functools.wraps(original)
    def einsum(subscripts, *operands, **kwargs):
        if hooks.in_step() and len(operands) == 2 and not kwargs:
            result = spmd_ops.activation_einsum(subscripts, *operands)
            if result is not None:
                return result
        return original(subscripts, *operands, **kwargs)

    return einsum


def _static_sparse_division(original, hooks):
    """Keras' TF `ops.divide(sparse, dense)` with static shapes in a graph
    step.

    Keras divides an IndexedSlices gradient by a dense tensor (Adagrad,
    RMSprop, Adadelta: lr * g / sqrt(accumulator + eps)) inside a `tf.cond`
    whose one branch adds the rows where the divisor is zero or NaN: a
    dynamic number of rows, which DTensor 2.21 mis-expands when the table
    is split over a model axis ("SPMD expansion resulted in op output
    inconsistent with the provided layout"). `spmd_ops.sparse_quotient`
    gives the same slices without the branch.
    """
    from tfpar import spmd_ops  # noqa: PLC0415

    @functools.wraps(original)
    def divide(x1, x2):
        if (isinstance(x1, tf.IndexedSlices) and isinstance(x2, tf.Tensor)
                and x2.shape.rank and x2.dtype.is_floating
                and hooks.in_graph_step()):
            return spmd_ops.sparse_quotient(x1, x2, original)
        return original(x1, x2)

    return divide


def _seed_generator():
    from keras.src.random import seed_generator  # noqa: PLC0415

    return seed_generator.SeedGenerator


def _function_class():
    from tensorflow.python.eager.polymorphic_function import (  # noqa: PLC0415
        polymorphic_function)

    return polymorphic_function.Function


def _keras_numpy():
    from keras.src.backend.tensorflow import numpy as tf_numpy  # noqa: PLC0415

    return tf_numpy


def _gen_array_ops():
    from tensorflow.python.ops import gen_array_ops  # noqa: PLC0415

    return gen_array_ops


def _keras_random():
    from keras.src.backend.tensorflow import random as tf_random  # noqa: PLC0415

    return tf_random


def _batch_normalization():
    from keras.src.layers.normalization import batch_normalization  # noqa: PLC0415

    return batch_normalization.BatchNormalization


def _random_crop():
    from keras.src.layers.preprocessing.image_preprocessing import (  # noqa: PLC0415
        random_crop)

    return random_crop.RandomCrop


def _keras_layer():
    from keras.src.layers import layer  # noqa: PLC0415

    return layer.Layer


_STRATEGY_PATCHES = (
    Patch("compile", _base_trainer, "compile", _routed_compile),
    Patch("symbolic_build", _tf_trainer, "_maybe_symbolic_build",
          _symbolic_build_from_spec),
    Patch("model_call", _tf_trainer, "__call__", _eager_model_call),
    *(Patch(f"make_{mode}_function", _tf_trainer, f"make_{mode}_function",
            _routed_make_function(mode))
      for mode in ("train", "test", "predict")),
    Patch("divide", _keras_numpy, "divide", _static_sparse_division),
    Patch("einsum", _keras_numpy, "einsum", _activation_einsum_in_step),
    Patch("flip", _keras_numpy, "flip", _gathered_flip_in_step),
    Patch("concat_v2", _gen_array_ops, "concat_v2",
          _concat_whole_along_axis_in_step),
    Patch("function_call", _function_class, "__call__", _host_inputs_placed),
    Patch("slice_update", _tf_core, "slice_update",
          _dense_slice_update_in_step),
    Patch("tensor_getitem", lambda: tf.Tensor, "__getitem__",
          _indexing_keeping_dims_in_step),
    Patch("categorical", _keras_random, "categorical",
          _gumbel_categorical_in_step),
    Patch("dropout", _keras_random, "dropout", _one_device_dropout_in_step),
    *(Patch(name, _keras_random, name, _one_device_draw_in_step)
      for name in SHAPED_DRAWS),
    Patch("random_crop", _random_crop, "transform_images",
          _random_crop_under_tfpar),
    Patch("shuffle", _keras_random, "shuffle", _one_device_shuffle_in_step),
    *(Patch(name, _keras_random, name, _refused_draw_in_step(name))
      for name in REFUSED_DRAWS),
    Patch("batch_moments", _batch_normalization, "_moments",
          _replicated_batch_moments_in_step),
    Patch("add_weight", _keras_layer, "add_weight",
          lambda original, _: _publishing_adding_layer(original)),
    Patch("variable_initialize", lambda: _tf_core().Variable, "_initialize",
          lambda original, _: _publishing_variable(original)),
)


# Keras' TF Variable casts every value it assigns to its tf.Variable's
# dtype (`_direct_assign`). Under `offload="optimizer+master"` a weight's
# tf.Variable is its compute-dtype copy (`tfpar.offload_master`), which
# takes the float32 value whole into its host master and stores the cast;
# the Keras cast would round the master first (installed by
# `tfpar.offload_master.install`).
def _master_direct_assign(original, _):
    def direct_assign(self, value):
        if getattr(self._value, "master", None) is not None:  # noqa: SLF001
            return self._value.assign(value)  # noqa: SLF001
        return original(self, value)

    return direct_assign


MASTER_PATCHES = (
    Patch("master_assign", lambda: _tf_core().Variable, "_direct_assign",
          _master_direct_assign),
)


# Keras 3.15 rematerializes (`keras.RematScope`, `keras.remat`) with
# `tf.recompute_grad(call)` called with the layer's keyword arguments, which
# `tf.custom_gradient` refuses in graph mode: `RematScope(mode="full")` fails
# in any `fit`, even on one device (tests/test_recompute.py), and new Dropout
# masks would be drawn. `tfpar.recompute.recompute` replaces Keras' TF
# `remat`, and `SeedGenerator.next` replays seeds inside a recomputation
# (installed by `tfpar.recompute.install`, with its hooks).
REMAT_PATCHES = (
    Patch("remat", _tf_core, "remat", lambda _, hooks: hooks.recompute),
    Patch("seed_next", _seed_generator, "next",
          lambda original, hooks: functools.partialmethod(
              hooks.next_seed, original, hooks.check_replay)),
)


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
    from keras.src.trainers.data_adapters import array_data_adapter  # noqa: PLC0415

    return array_data_adapter.ArrayDataAdapter


def count_array_batches():
    """Makes the tf.data datasets Keras builds from arrays state their
    batch count (`_counted_array_dataset`).

    Per-host input needs it: Keras stops each host after its own count, so
    hosts must compare counts before the first step (`inputs`). Installed
    once, by the first strategy with per-host input; the datasets are
    unchanged but for their stated cardinality.
    """
    install_group("per_host_input", (Patch("get_tf_dataset", _array_adapter,
                                    "get_tf_dataset", _counted_array_dataset),),
           None)


# -- recomputation (tfpar/recompute.py): Keras' per-thread state, TF's tape --


def keras_global(name):
    """Keras' per-thread global attribute `name` (e.g. "current_call_ctx")."""
    return _global_state().get_global_attribute(name)


@contextlib.contextmanager
def keras_globals(values):
    """Keras' per-thread global attributes set to `values` ({name: value})
    inside the block, restored after it."""
    global_state = _global_state()
    saved = {name: global_state.get_global_attribute(name) for name in values}
    for name, value in values.items():
        global_state.set_global_attribute(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            global_state.set_global_attribute(name, value)


def could_record():
    """Whether a gradient tape may record the ops run now."""
    return record.could_possibly_record()


def stop_recording():
    """A block in which no gradient tape records."""
    return record.stop_recording()


def bind_model_strategy(model, strategy):
    """Makes `strategy` the one `model` was built under (Keras records it
    at construction; a model built outside any scope has none)."""
    model._distribute_strategy = strategy  # noqa: SLF001


def all_layers(layer, include_self=True):
    """`layer` and every layer nested in it, outermost first."""
    return list(layer._flatten_layers(include_self=include_self,  # noqa: SLF001
                                      recursive=True))


def backing_variable(variable):
    """The tf.Variable behind a Keras Variable (or `variable` itself)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def keras_autocasts(variable):
    """Whether Keras casts `variable` to a layer's compute dtype in use
    (its `autocast`, Keras' default for a layer's weights)."""
    return bool(getattr(variable, "_autocast", False))


def rebind_keras_variable(keras_variable, tf_variable):
    """Makes `keras_variable` store its value in `tf_variable` from now on."""
    keras_variable._value = tf_variable  # noqa: SLF001


_initializing = threading.local()


def keras_variable_being_created():
    """The Keras Variable whose backing tf.Variable is being created, or None.

    A strategy's variable creator sees only tf.Variable kwargs; the Keras
    path (`variable.path`, e.g. "model/dense/kernel") lives on the Keras
    Variable, which Keras' TensorFlow backend wraps around the tf.Variable in
    `Variable._initialize`. That method is wrapped (`install`) to publish
    `self`.
    """
    stack = getattr(_initializing, "stack", None)
    return stack[-1] if stack else None


def keras_variable_layout(path):
    """The spec of the layout given to the Keras Variable at `path` being
    created (`keras.Variable(..., layout=TensorLayout(axes))`, stored as
    its private `_layout`, which Keras' TF backend ignores), or None."""
    variable = keras_variable_being_created()
    layout = getattr(variable, "_layout", None)
    if layout is None or variable.path != path:
        return None
    if isinstance(layout, dtensor.Layout):
        return tuple(None if s == dtensor.UNSHARDED else s
                     for s in layout.sharding_specs)
    return tuple(layout.axes)


def keras_layer_adding_weight():
    """The Keras layer whose `add_weight` is running, or None. When Keras
    defers a weight's initialisation (layers built by a symbolic call of a
    subclassed model), the layer that added the weight being initialised."""
    stack = getattr(_initializing, "layers", None)
    if stack:
        return stack[-1]
    owner = getattr(keras_variable_being_created(), "_tfpar_owner", None)
    return owner() if owner is not None else None


def _publishing_adding_layer(original):
    """`Layer.add_weight` that publishes the layer adding the weight
    (`keras_layer_adding_weight`) and notes it on the variable."""

    def add_weight(self, *args, **kwargs):
        stack = _initializing.__dict__.setdefault("layers", [])
        stack.append(self)
        try:
            variable = original(self, *args, **kwargs)
        finally:
            stack.pop()
        variable._tfpar_owner = weakref.ref(self)  # noqa: SLF001
        return variable

    return add_weight


def _publishing_variable(original):
    """Keras' TF `Variable._initialize` that publishes the Keras Variable
    whose tf.Variable is being created (`keras_variable_being_created`)."""

    def _initialize(self, value):
        stack = _initializing.__dict__.setdefault("stack", [])
        stack.append(self)
        try:
            return original(self, value)
        finally:
            stack.pop()

    return _initialize


def tf_initialized():
    """Whether TensorFlow's eager context (devices, cluster) is set up."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return context.context()._context_handle is not None  # noqa: SLF001


def eager_context_token():
    """An object standing for TF's current eager context; a new one after
    `context._reset_context()` (what TF's, Keras' and DTensor's test classes
    call between tests)."""
    return eager_context_state("token", object)


def eager_context_state(name, factory):
    """A value kept as an attribute of TF's current eager context (made by
    `factory()` on first use), so it dies with the context: a fresh one
    after `context._reset_context()`."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    ctx = context.context()
    attribute = f"_tfpar_{name}"
    value = getattr(ctx, attribute, None)
    if value is None:
        value = factory()
        setattr(ctx, attribute, value)
    return value


def ensure_dtensor_device():
    """Makes DTensor's process-wide custom device belong to the current
    eager context.

    DTensor creates one device per process (`api._dtensor_singleton`) and
    registers it with the context current at that time. After a context
    reset the new context does not know it, and every DTensor op fails
    ("CUSTOM:0 unknown device", "Could not find device for node
    Relayout"). Dropping it makes DTensor create and register a new one
    on its next use, as in a fresh process (DTensor's own test utilities
    do the same with `reset_dtensor()`).
    """
    from tensorflow.dtensor.python import api  # noqa: PLC0415
    from tensorflow.python.eager import context  # noqa: PLC0415

    device = api._dtensor_singleton  # noqa: SLF001
    if device is not None and not context.context().is_custom_device(
            device.name):
        api._reset()  # noqa: SLF001


# -- Keras' layer graph (tfpar/keras_graph.py) ---------------------------------


def functional_of(model):
    """The functional graph of `model`: itself, or a Sequential's inner
    Functional (None when the Sequential was never given an input shape)."""
    return getattr(model, "_functional", None) if isinstance(
        model, keras.Sequential) else model


def nodes_by_depth(graph):
    """{depth: [Node]} of a functional graph (None for a subclassed model)."""
    return getattr(graph, "_nodes_by_depth", None)


def inputs_struct(graph):
    """The nested structure of a functional graph's inputs, or None."""
    return getattr(graph, "_inputs_struct", None)


def outputs_struct(graph):
    """The nested structure of a functional graph's outputs."""
    return graph._outputs_struct  # noqa: SLF001


def inbound_nodes(layer):
    """The graph nodes of `layer`'s symbolic calls."""
    return getattr(layer, "_inbound_nodes", [])


def operation_fn(operation, training):
    """`operation` as Keras' Functional.call calls it (`training` passed
    to layers that take it)."""
    from keras.src.models import functional  # noqa: PLC0415

    return functional.operation_fn(operation, training=training)


def optimizer_strategy(optimizer):
    """The tf.distribute strategy a Keras TF optimizer was created under
    (None when it records none)."""
    return getattr(optimizer, "_distribution_strategy", None)


def optimizer_learning_rate_variable(optimizer):
    """The variable holding a Keras optimizer's learning rate, or None when
    it is a schedule (computed from `iterations`)."""
    value = getattr(optimizer, "_learning_rate", None)
    return value if hasattr(value, "assign") else None


# -- DTensor's compiled programs (tfpar/communication.py) -----------------


def runtime_function_names():
    """Names of every function in the eager context's function library."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return context.context().list_function_names()


def runtime_function_def(name):
    """The FunctionDef named `name` in the eager context's library."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return context.context().get_function_def(name)


def traced_function_name(concrete_function):
    """The library name of a traced `tf.function` (a ConcreteFunction)."""
    name = concrete_function.function_def.signature.name
    return name.decode() if isinstance(name, bytes) else name


def dtensor_expanded_wrappers(traced_name):
    """Names of the functions DTensor made by SPMD-expanding `traced_name`.

    TF 2.21's DTensor device, the first time it runs a traced function on a
    mesh, registers in the eager context a wrapper named
    `<traced name>__func_<fingerprint>_<n>` that calls the expanded
    per-device program (`_func_<fingerprint>`, every collective in it).
    """
    prefix = traced_name + "__func_"
    return [n for n in runtime_function_names() if n.startswith(prefix)]


def _op_def(node):
    from tensorflow.python.framework import op_def_registry  # noqa: PLC0415

    return op_def_registry.get(node.op)


def op_output_offsets(node):
    """{output argument name: flat index of its first tensor} of a NodeDef
    (FunctionDef bodies reference outputs as "node:argument:i")."""
    op_def = _op_def(node)
    offsets, index = {}, 0
    for arg in (op_def.output_arg if op_def else []):
        offsets[arg.name] = index
        if arg.number_attr:
            index += node.attr[arg.number_attr].i
        elif arg.type_list_attr:
            index += len(node.attr[arg.type_list_attr].list.type)
        else:
            index += 1
    return offsets


def op_output_dtypes(node):
    """The dtypes of a NodeDef's outputs, flat ([] for unknown ops)."""
    op_def = _op_def(node)
    types = []
    for arg in (op_def.output_arg if op_def else []):
        if arg.type_list_attr:
            types.extend(node.attr[arg.type_list_attr].list.type)
            continue
        single = node.attr[arg.type_attr].type if arg.type_attr else arg.type
        count = node.attr[arg.number_attr].i if arg.number_attr else 1
        types.extend([single] * count)
    return [tf.as_dtype(t) for t in types]


def profiler_xspaces(directory):
    """The XSpace protobufs (TF-private `xplane_pb2`) TF's profiler wrote
    under `directory`, parsed (`tfpar.pipeline.profiler` reads their
    events)."""
    import glob  # noqa: PLC0415

    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415

    spaces = []
    for path in glob.glob(f"{directory}/**/*.xplane.pb", recursive=True):
        with open(path, "rb") as f:
            spaces.append(xplane_pb2.XSpace.FromString(f.read()))
    return spaces


# Names in TF 2.21's DTensor-expanded programs (tfpar/communication.py):
# tf.GradientTape puts gradient ops under this name scope; DTensor names the
# nodes it inserts "<op>/DTensor<Collective>Op_<n>" and their group-key
# lookups ".../group_key"; a zero-padded all-gather's blocks are written by
# nodes named "...DTensorAllGatherOp...". The expanded function's first
# argument is the device id, "device_id" (none on a mesh of one device).
GRADIENT_SCOPE = "gradient_tape/"
DTENSOR_ALL_GATHER_NODE = "DTensorAllGatherOp"
DTENSOR_INSERTED_NODE = r"DTensor\w*Op|group_key"
DTENSOR_DEVICE_ID_ARG = "device_id"


def backward_uses(tensor):
    """[(op, input index)] of the gradient ops (under tf.GradientTape's name
    scope) of `tensor`'s graph that read it."""
    return [(op, i) for op in tensor.consumers() if GRADIENT_SCOPE in op.name
            for i, t in enumerate(op.inputs) if t is tensor]


def forward_readers(tensor):
    """The ops of `tensor`'s graph that read it, gradient ops left out."""
    return [op for op in tensor.consumers() if GRADIENT_SCOPE not in op.name]


def relayout_op(gathered):
    """The DTensor Relayout op whose result `gathered`, the output of a
    `tf.custom_gradient` function (an IdentityN of it), forwards."""
    tensor = gathered
    while tensor.op.type in ("IdentityN", "Identity"):
        tensor = tensor.op.inputs[tensor.value_index
                                  if tensor.op.type == "IdentityN" else 0]
    op = tensor.op
    if op.type != "Relayout":
        raise RuntimeError(
            f"Expected a DTensor Relayout op behind {gathered.name!r}; "
            f"found {op.type!r} ({op.name!r}). This TensorFlow builds "
            "custom gradients or relayouts differently than 2.21.")
    return op


def depends_on(tensor, op):
    """Whether graph tensor `tensor` is computed from graph op `op`. Ops are
    numbered as they are made (TF-private `Operation._id`), and an op only
    reads older ones, so the search stops at ops older than `op`."""
    seen, stack = set(), [tensor.op]
    while stack:
        current = stack.pop()
        if current is op:
            return True
        if current._id < op._id or current in seen:  # noqa: SLF001
            continue
        seen.add(current)
        stack.extend(t.op for t in current.inputs)
        stack.extend(current.control_inputs)
    return False


def rewire_input(op, index, tensor):
    """Makes graph op `op` read `tensor` as its input `index` (TF-private
    `Operation._update_input`: the op is already built)."""
    op._update_input(index, tensor)  # noqa: SLF001


# Read by DTensor's MLIR lowering each time it compiles a function: an
# all-gather then compiles to a CollectiveGatherV2 instead of an all-reduce
# of zero-padded blocks (sends (n-1)/n of the tensor instead of 2(n-1)/n).
# TF 2.21 then fails to compile a relayout that gathers over two mesh axes at
# once (tests/dtensor_sp_collectives_repro.py), so tfpar turns it on only
# while it runs a step that may compile (a new input signature) on a mesh
# with a single axis of size > 1. The variable is process-wide: a DTensor
# function another thread compiles at that moment gets it too.
_GATHER_LOWERING = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"


@contextlib.contextmanager
def collective_all_gathers(enabled):
    """All-gathers compiled in this block are CollectiveGatherV2 ops."""
    import os  # noqa: PLC0415

    if not enabled or os.environ.get(_GATHER_LOWERING) == "1":
        yield
        return
    outer = os.environ.get(_GATHER_LOWERING)
    os.environ[_GATHER_LOWERING] = "1"
    try:
        yield
    finally:
        if outer is None:
            del os.environ[_GATHER_LOWERING]
        else:
            os.environ[_GATHER_LOWERING] = outer


# -- Keras' distribution API (keras.distribution) on TensorFlow --------------


def _global_state():
    from keras.src.backend.common import global_state  # noqa: PLC0415

    return global_state


def _tf_distribution_lib():
    from keras.src.backend.tensorflow import distribution_lib  # noqa: PLC0415

    return distribution_lib


def _announcing_distribution(original, hooks):
    def set_global_attribute(name, value):
        if name == "distribution":
            hooks.on_set(value)
        original(name, value)

    return set_global_attribute


def _device_count(_, hooks):
    """Keras' `distribution_lib.get_device_count`, which Keras 3.15's TF
    backend lacks: the devices its `list_devices` finds."""
    library = _tf_distribution_lib()
    return lambda device_type=None: len(library.list_devices(device_type))


_KERAS_DISTRIBUTION_PATCHES = (
    Patch("set_global_attribute", _global_state, "set_global_attribute",
          _announcing_distribution),
    Patch("distribute_tensor", _tf_distribution_lib, "distribute_tensor",
          lambda _, hooks: hooks.distribute_tensor),
    Patch("initialize", _tf_distribution_lib, "initialize",
          lambda _, hooks: hooks.initialize),
    Patch("get_device_count", _tf_distribution_lib, "get_device_count",
          _device_count),
)


def hook_keras_distribution(on_set, distribute_tensor, initialize):
    """Makes Keras' distribution API reach tfpar on the TF backend; once
    (`import tfpar.keras_distribution` calls it; `uninstall` undoes it).

    Keras keeps the current distribution in its global attribute
    "distribution", written only by `keras.distribution.set_distribution`
    (which `Distribution.scope()` calls on entry and exit) through
    `global_state.set_global_attribute`: that writer is wrapped so that
    `on_set(value)` runs first (and may refuse by raising), whichever
    binding of `set_distribution` the user imported. Keras 3.15's TF
    `distribution_lib` (a "DO NOT USE" prototype) lacks `distribute_tensor`,
    `get_device_count` and `initialize`, which `keras.distribution` calls:
    they are supplied (`_KERAS_DISTRIBUTION_PATCHES`). A distribution set
    before this hook is installed is handed to `on_set` now.
    """
    if "keras_distribution" in _installed:
        return
    install_group("keras_distribution", _KERAS_DISTRIBUTION_PATCHES,
                  types.SimpleNamespace(on_set=on_set, initialize=initialize,
                                        distribute_tensor=distribute_tensor))
    current = _global_state().get_global_attribute("distribution")
    if current is not None:
        on_set(current)


def forget_uninitialized_variables(variables):
    """Drops `variables` from Keras' list of variables that a
    `StatelessScope(initialize_variables=False)` left uninitialised (the
    planner's shape-only models), so nothing ever allocates them."""
    from keras.src.backend.common import global_state  # noqa: PLC0415

    pending = global_state.get_global_attribute("uninitialized_variables")
    if pending:
        gone = {id(v) for v in variables}
        global_state.set_global_attribute(
            "uninitialized_variables", [v for v in pending if id(v) not in gone])


def set_remat_mode(layer, mode):
    """Makes `layer` recompute in the backward pass as if it had been built
    inside `keras.RematScope(mode=mode)` (Keras reads `_remat_mode` at call
    time)."""
    from keras.src.backend.common import remat  # noqa: PLC0415

    layer._remat_mode = (  # noqa: SLF001
        remat.RematMode(mode, 1024, None) if mode else None)


@contextlib.contextmanager
def remat_off():
    """Keras' rematerialization off for the block: its TF `remat(f)` (what
    `keras.RematScope` layers and `keras.remat` call, at call time) is `f`
    itself; restored after, whichever `remat` (TF's or tfpar's) it was."""
    core = _tf_core()
    current = core.remat
    core.remat = lambda f: f
    try:
        yield
    finally:
        core.remat = current


def remat_mode(layer):
    """The `keras.RematScope` mode `layer` was built in (a RematMode
    namedtuple: mode, output size threshold, layer names), or None."""
    return getattr(layer, "_remat_mode", None)

# -- log noise -----------------------------------------------------------------

# TF 2.21 logs through absl: each time DTensor SPMD-expands a step for a new
# input shape or layout it logs two INFO lines ("DTensor cache key lookup
# missed for __inference__in_replica_... (re-)computing its SPMD
# transformation") straight to stderr, into Keras' progress bar. Nothing in
# them is actionable. The level that filters them, TF_CPP_MIN_LOG_LEVEL, is
# read once when TensorFlow loads (before tfpar, when `import keras` comes
# first), so tfpar raises absl's minimum level from INFO to WARNING while its
# steps run, through absl's exported C++ API. Warnings and errors still show.
_ABSL_SET_MIN = rb"_ZN4absl\d+lts_\d+14SetMinLogLevelENS0_18LogSeverityAtLeastE"
_ABSL_GET_MIN = rb"_ZN4absl\d+lts_\d+11MinLogLevelEv"
_absl_log_level = []  # [(get, set)] once looked up; [None] if unavailable


def _absl_symbol_names(path):
    """The mangled names of absl's (MinLogLevel, SetMinLogLevel) in the
    library file at `path` (the absl version is part of them), or None."""
    import mmap  # noqa: PLC0415
    import re  # noqa: PLC0415

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                          access=mmap.ACCESS_READ) as m:
        found = [re.search(p, m) for p in (_ABSL_GET_MIN, _ABSL_SET_MIN)]
        names = [n.group().decode() for n in found if n is not None]
    return names if len(names) == 2 else None


def _absl_min_log_level_functions():
    """absl's (MinLogLevel, SetMinLogLevel) in TensorFlow's C++ library, or
    None (looked up once)."""
    if _absl_log_level:
        return _absl_log_level[0]
    import os  # noqa: PLC0415

    functions = None
    path = os.path.join(tf.sysconfig.get_lib(), "libtensorflow_framework.so.2")
    try:
        names = _absl_symbol_names(path)
        functions = _absl_functions(path, names) if names else None
    except (OSError, AttributeError):
        pass  # another TF build: its INFO lines stay
    _absl_log_level.append(functions)
    return functions


def _absl_functions(path, names):
    """(get, set) of the C functions `names` (getter, setter of an int) in
    the library at `path`, through ctypes."""
    import ctypes  # noqa: PLC0415

    library = ctypes.CDLL(path)  # already loaded: the same handle
    get, set_ = (getattr(library, name) for name in names)
    get.restype, get.argtypes = ctypes.c_int, []
    set_.restype, set_.argtypes = None, [ctypes.c_int]
    return get, set_


_ABSL_WARNING = 1  # absl::LogSeverityAtLeast::kWarning (kInfo is 0)


@contextlib.contextmanager
def quiet_cpp_info_logs():
    """TensorFlow's C++ INFO lines are dropped inside the block (WARNING
    and above still print), unless the user set TF_CPP_MIN_LOG_LEVEL or
    TF_CPP_MAX_VLOG_LEVEL: then the logging is theirs to choose."""
    import os  # noqa: PLC0415

    user_chose = any(v in os.environ for v in ("TF_CPP_MIN_LOG_LEVEL",
                                               "TF_CPP_MAX_VLOG_LEVEL"))
    functions = None if user_chose else _absl_min_log_level_functions()
    if functions is None:
        yield
        return
    get, set_ = functions
    before = get()
    set_(max(before, _ABSL_WARNING))
    try:
        yield
    finally:
        set_(before)
