"""Every private TensorFlow or Keras hook tfpar uses, in one place.

A TensorFlow upgrade that moves one of these touches only this file.
Checked against tensorflow 2.21.
"""

import contextlib
import functools
import threading
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


def route_keras_step_functions(make_function_for, owns, eager_call):
    """Lets a strategy build a Keras model's train/test/predict functions.

    Patches Keras' TensorFlow trainer once: for a model whose
    `distribute_strategy` answers `make_function_for(model, mode)` with a
    function, `make_{train,test,predict}_function` use that function; for
    every other model Keras' own code runs unchanged. `compile` of a model
    whose strategy `owns(strategy)` enters that strategy's scope, so the
    optimizer is created under it even when `compile` is called outside;
    such a model's keras-hub `generate_function` is routed the same way
    (mode "generate", see `route_generate_function`). An eager call of such
    a model runs `eager_call(strategy, call, model, args, kwargs)`.
    """
    from keras.src.backend.tensorflow import trainer  # noqa: PLC0415
    from keras.src.trainers import trainer as base_trainer  # noqa: PLC0415

    cls = trainer.TensorFlowTrainer
    if getattr(cls, "_tfpar_routed", False):
        return
    original_compile = base_trainer.Trainer.compile

    def compile(self, *args, **kwargs):  # noqa: A001
        strategy = self.distribute_strategy
        if not owns(strategy):
            return original_compile(self, *args, **kwargs)
        with strategy.scope():
            strategy.extended.adopt_model(self)  # a model built outside
            result = original_compile(self, *args, **kwargs)
            _optimizer_under(self, strategy)
            if self.built:
                strategy.extended.check_rules_used()
        route_generate_function(self, make_function_for)
        return result

    # Patched on the base class: Keras' `compile_from_config` (what
    # `load_model` compiles with) skips compiling, with a warning, any model
    # whose `type(model).compile` is not `Trainer.compile`.
    base_trainer.Trainer.compile = compile
    original_symbolic_build = cls._maybe_symbolic_build  # noqa: SLF001

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras builds a model under a strategy from `next()` of a fresh
        # iterator, which for a one-shot generator silently drops a batch.
        # Only shapes and dtypes are used: take them from the dataset spec.
        dataset = getattr(iterator, "_distributed_dataset", None)
        if owns(self.distribute_strategy) and dataset is not None:
            data_batch = tf.nest.map_structure(
                lambda s: s if isinstance(s, tf.TensorSpec) else None,
                dataset.element_spec)
            iterator = None
        return original_symbolic_build(self, iterator=iterator,
                                       data_batch=data_batch)

    cls._maybe_symbolic_build = _maybe_symbolic_build  # noqa: SLF001

    def original_call(self, *args, **kwargs):
        # Next in the MRO of keras.Model after the trainer: Layer.__call__.
        return super(cls, self).__call__(*args, **kwargs)

    def __call__(self, *args, **kwargs):  # models only: layers keep theirs
        # The strategy the model was built under, not merely the current one.
        strategy = getattr(self, "_distribute_strategy", None)
        if tf.executing_eagerly() and owns(strategy):
            return eager_call(strategy, original_call, self, args, kwargs)
        return original_call(self, *args, **kwargs)

    cls.__call__ = __call__
    for mode in ("train", "test", "predict"):
        attribute = f"{mode}_function"
        original = getattr(cls, f"make_{attribute}")

        def make(self, force=False, _mode=mode, _attr=attribute,
                 _original=original):
            if getattr(self, _attr) is not None and not force:
                return getattr(self, _attr)
            function = make_function_for(self, _mode)
            if function is None:
                return _original(self, force=force)
            setattr(self, _attr, function)
            return function

        setattr(cls, f"make_{attribute}", make)
    cls._tfpar_routed = True  # noqa: SLF001


def route_generate_function(model, make_function_for):
    """Lets a strategy build keras-hub's `generate_function` for `model`.

    keras-hub's `CausalLM` (and `TextToImage`) compile their own generation
    step: `make_generate_function` wraps `generate_step` in a `tf.function`
    that `generate()` calls with host tensors. The class defining
    `make_generate_function` is patched once so that it uses
    `make_function_for(model, "generate")` when that returns a function
    (models under a strategy), Keras-hub's own code otherwise. A model
    without `make_generate_function` is left alone.
    """
    cls = next((c for c in type(model).__mro__
                if "make_generate_function" in c.__dict__), None)
    if cls is None or getattr(cls.__dict__["make_generate_function"],
                              "_tfpar_routed", False):
        return
    original = cls.__dict__["make_generate_function"]

    def make_generate_function(self):
        if self.generate_function is not None:
            return self.generate_function
        function = make_function_for(self, "generate")
        if function is None:
            return original(self)
        self.generate_function = function
        return function

    make_generate_function._tfpar_routed = True  # noqa: SLF001
    cls.make_generate_function = make_generate_function


def place_host_inputs_of_methods(strategy_of):
    """Lets any `tf.function` of a model's own method take host arrays.

    A Keras or keras-hub model may compile its methods itself (e.g.
    `tf.function(self.generate_step)`); called with host arrays while its
    weights live on a mesh, DTensor refuses the call ("got a regular tensor
    for input 0 ... but was expecting a DTensor"). Patches tf.function's
    call once: when a function of a bound method of `owner` is called
    eagerly with host arrays (numpy, or tensors that are not DTensors,
    scalars excepted: DTensor broadcasts those) and `strategy_of(owner)` is
    a strategy, the arrays are placed on its mesh (split over the data
    axis when it divides them) and the call runs in its replica context
    (where tfpar's DTensor-friendly ops apply). Every other call, including
    every call DTensor accepted before, runs unchanged.
    """
    from tensorflow.python.eager.polymorphic_function import (  # noqa: PLC0415
        polymorphic_function)

    cls = polymorphic_function.Function
    original = cls.__call__
    if getattr(original, "_tfpar_wrapped", False):
        return

    def is_host_array(x):
        return isinstance(x, np.ndarray) and x.ndim > 0 or (
            isinstance(x, tf.Tensor) and hasattr(x, "numpy")
            and x.shape.rank and not dtensor.is_dtensor(x))

    def __call__(self, *args, **kwargs):
        owner = getattr(self._python_function, "__self__", None)  # noqa: SLF001
        if owner is None or not tf.executing_eagerly() or not any(
                is_host_array(x) for x in tf.nest.flatten((args, kwargs))):
            return original(self, *args, **kwargs)
        strategy = strategy_of(owner)
        if strategy is None:
            return original(self, *args, **kwargs)
        extended = strategy.extended
        args, kwargs = extended.input_placer.place_arrays((args, kwargs))
        with extended.replica_scope():
            return original(self, *args, **kwargs)

    __call__._tfpar_wrapped = True  # noqa: SLF001
    cls.__call__ = __call__


def dense_slice_update(inputs, start_indices, updates):
    """`inputs` with `updates` written at `start_indices`, like XLA's
    DynamicUpdateSlice, from ops DTensor lays out (a gather and a select).

    Along each dimension d where the update is shorter (m_d < n_d), the
    start is clamped as XLA does, s_d = clip(start_d, 0, n_d - m_d), and
    position i takes update row i - s_d when 0 <= i - s_d < m_d:
    expanded = gather(updates, clip(i - s_d, 0, m_d - 1), axis=d), and the
    result is where(inside, expanded, inputs). Values are copied, not
    computed: bit-for-bit the same as DynamicUpdateSlice.
    """
    inputs = tf.convert_to_tensor(inputs)
    updates = tf.convert_to_tensor(updates, inputs.dtype)
    rank = inputs.shape.rank
    full, part = tf.shape(inputs), tf.shape(updates)
    inside = tf.ones([1] * rank, tf.bool)
    expanded = updates
    for d in range(rank):
        n, m = inputs.shape[d], updates.shape[d]
        if n is not None and n == m:
            continue  # the whole dimension: XLA clamps its start to 0
        start = tf.clip_by_value(
            tf.cast(start_indices[d], tf.int32), 0, full[d] - part[d])
        offset = tf.range(full[d]) - start
        expanded = tf.gather(
            expanded, tf.clip_by_value(offset, 0, part[d] - 1), axis=d)
        shape = [1] * rank
        shape[d] = -1
        inside = tf.logical_and(inside, tf.reshape(
            tf.logical_and(offset >= 0, offset < part[d]), shape))
    return tf.where(inside, expanded, inputs)


def patch_keras_slice_update(use_dense):
    """Makes `keras.ops.slice_update` use `dense_slice_update` while
    `use_dense()` (inside a strategy's step), once.

    Keras' TF backend writes it with XLA's DynamicUpdateSlice, which
    DTensor 2.21 cannot lay out ("'tf.XlaDynamicUpdateSlice' op does not
    implement layout propagation"): keras-hub's KV cache updates failed in
    `generate()` (tests/test_generate.py). Elsewhere Keras' op runs.
    """
    from keras.src.backend.tensorflow import core  # noqa: PLC0415

    original = core.slice_update
    if getattr(original, "_tfpar_wrapped", False):
        return

    def slice_update(inputs, start_indices, updates):
        if use_dense():
            return dense_slice_update(inputs, start_indices, updates)
        return original(inputs, start_indices, updates)

    slice_update._tfpar_wrapped = True  # noqa: SLF001
    core.slice_update = slice_update


def _is_scalar_index(item):
    """A Python int or a scalar integer tensor: an index that drops its
    dimension in `tensor[key]`."""
    if isinstance(item, (bool, np.bool_)):
        return False
    if isinstance(item, (int, np.integer)):
        return True
    return (isinstance(item, tf.Tensor) and item.shape.rank == 0
            and item.dtype.is_integer)


def index_keeping_dims(tensor, key):
    """`tensor[key]` with no StridedSlice that drops a dimension: a Python
    integer index i is taken as the slice i:i+1 and that dimension squeezed
    after, a tensor index is a `tf.gather` along its dimension. The same
    values. None when `key` needs the plain path (no integer index,
    boolean or list indices, unknown rank).

    DTensor 2.21 lays out a StridedSlice that drops a dimension d wrongly
    when a later dimension is sharded: the output keeps the sharding at the
    old position (dimension + 1), so `cache[:, i, ...]` of a cache split by
    heads comes out split by head size, with wrong values or a failed
    compile (tests/dtensor_shrink_slice_repro.py). This is keras-hub's
    KV-cache indexing.
    """
    items = key if isinstance(key, tuple) else (key,)
    rank = tensor.shape.rank
    if rank is None or not any(_is_scalar_index(i) for i in items) or not all(
            i is None or i is Ellipsis or isinstance(i, slice)
            or _is_scalar_index(i) for i in items):
        return None
    used = sum(i is not None and i is not Ellipsis for i in items)
    new_key, squeeze, gathers, in_axis, out_axis = [], [], [], 0, 0
    for item in items:
        if item is Ellipsis or item is None:
            skipped = rank - used if item is Ellipsis else 0
            in_axis += skipped
            out_axis += skipped if item is Ellipsis else 1
            new_key.append(item)
            continue
        if isinstance(item, tf.Tensor):  # gathered below (negative: from
            size = tf.shape(tensor, out_type=item.dtype)[in_axis]  # the end)
            gathers.append((out_axis, tf.where(item < 0, item + size, item)))
            item = slice(None)
        elif _is_scalar_index(item):
            item = int(item)  # -1 is the slice -1: (to the end)
            item = slice(item, item + 1 if item != -1 else None)
            squeeze.append(out_axis)
        new_key.append(item)
        in_axis += 1
        out_axis += 1
    result = _original_getitem(tensor, tuple(new_key))
    for axis, index in reversed(gathers):  # later axes first: positions hold
        result = tf.gather(result, index, axis=axis)
    # A gather at an axis before a squeezed one moved it down by one.
    squeeze = [a - sum(g < a for g, _ in gathers) for a in squeeze]
    return tf.squeeze(result, squeeze) if squeeze else result


def gumbel_categorical(logits, num_samples, seed, replicate):
    """`num_samples` draws per row from softmax(`logits`), by Gumbel-max:
    argmax_j(logits_j - log(-log u_j)) with u uniform in (0, 1) is class j
    with probability softmax(logits)_j. `seed` is a stateless seed (2,);
    `replicate(u)` lays the uniform numbers out whole on every device, so
    they do not depend on how the mesh splits the logits. Ops DTensor
    lays out, unlike TF's StatelessMultinomial (a different draw from it:
    the same distribution, not the same numbers).
    """
    logits = tf.convert_to_tensor(logits, tf.float32)
    shape = tf.concat([tf.shape(logits)[:1], [num_samples],
                       tf.shape(logits)[1:]], 0)
    u = replicate(tf.random.stateless_uniform(
        shape, seed, minval=np.finfo(np.float32).tiny, maxval=1.0))
    return tf.argmax(logits[:, None, :] - tf.math.log(-tf.math.log(u)),
                     axis=-1)


def patch_keras_categorical(replicate_in_step):
    """Makes `keras.random.categorical` use `gumbel_categorical` inside a
    strategy's step, once: `replicate_in_step()` returns there the function
    that replicates a tensor over the step's mesh, None elsewhere (Keras'
    own op runs). Keras' TF op is StatelessMultinomial, which DTensor 2.21
    cannot lay out ("'tf.StatelessMultinomial' op does not implement layout
    propagation"): keras-hub's top-k, top-p and random samplers failed.
    """
    from keras.src.backend.tensorflow import random as tf_random  # noqa: PLC0415

    original = tf_random.categorical
    if getattr(original, "_tfpar_wrapped", False):
        return

    def categorical(logits, num_samples, dtype="int64", seed=None):
        replicate = replicate_in_step()
        if replicate is None:
            return original(logits, num_samples, dtype=dtype, seed=seed)
        seed = tf_random._cast_seed(tf_random.draw_seed(seed))  # noqa: SLF001
        return tf.cast(gumbel_categorical(logits, num_samples, seed,
                                          replicate), dtype)

    categorical._tfpar_wrapped = True  # noqa: SLF001
    tf_random.categorical = categorical


_original_getitem = None


def patch_tensor_indexing(use_kept_dims):
    """Makes `tensor[key]` use `index_keeping_dims` while `use_kept_dims()`
    (inside a strategy's step), once. Elsewhere TF's indexing runs."""
    global _original_getitem  # noqa: PLW0603 (TF's method, kept once)
    from tensorflow.python.framework import tensor as tensor_lib  # noqa: PLC0415

    original = tensor_lib.Tensor.__getitem__
    if getattr(original, "_tfpar_wrapped", False):
        return
    _original_getitem = original

    def __getitem__(self, key):
        if use_kept_dims():
            result = index_keeping_dims(self, key)
            if result is not None:
                return result
        return original(self, key)

    __getitem__._tfpar_wrapped = True  # noqa: SLF001
    tensor_lib.Tensor.__getitem__ = __getitem__


_RECOMPUTING = threading.local()


def _stack(name):
    return _RECOMPUTING.__dict__.setdefault(name, [])


@contextlib.contextmanager
def _pushed(name, value):
    """`value` on top of this thread's stack `name` inside the block."""
    stack = _stack(name)
    stack.append(value)
    try:
        yield value
    finally:
        stack.pop()


@contextlib.contextmanager
def _keras_globals(values):
    """Keras' per-thread global attributes set to `values` ({name: value})
    inside the block, restored after it."""
    from keras.src.backend.common import global_state  # noqa: PLC0415

    saved = {name: global_state.get_global_attribute(name) for name in values}
    for name, value in values.items():
        global_state.set_global_attribute(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            global_state.set_global_attribute(name, value)


def recompute_dependency():
    """While a layer is recomputed in the backward pass (see `recompute`):
    a scalar 0.0 computed from the upstream gradient. A variable read that
    must run again there adds it to its value. None at any other time."""
    stack = _stack("dependencies")
    return stack[-1] if stack else None


class _Seeds:
    """The Keras random seeds a checkpointed call drew in its forward pass,
    handed out again in the same order when it is recomputed (`replaying`),
    so Dropout applies the same mask twice."""

    def __init__(self, values=(), replaying=False):
        self.values = list(values)
        self.replaying = replaying


def _next_seed(generator, original, check_replay, ordered=True):
    """`keras.random.SeedGenerator.next`, replaying inside a recomputation
    (after `check_replay(generator)`, which may refuse)."""
    frames = _stack("seeds")
    if frames and frames[-1].replaying:
        check_replay(generator)
        if not frames[-1].values:
            raise RuntimeError(
                "A recomputed layer drew more random seeds in the backward "
                "pass than in its forward pass (e.g. a random op inside "
                "keras.ops.cond/while_loop, or a branch on a Python value "
                "that changed), so its recomputation cannot reproduce the "
                f"forward pass. Received: seed generator {generator.name!r}. "
                "Leave this layer out of keras.RematScope.")
        return frames[-1].values.pop(0)
    value = original(generator, ordered)
    if frames:
        frames[-1].values.append(value)
    return value


def recompute(f):
    """`f` whose gradient recomputes `f` from its inputs instead of keeping
    its intermediate results (activation checkpointing).

    Like `tf.recompute_grad`, except that: keyword arguments are accepted
    (tensor ones get gradients); the recomputation runs in the Keras
    context of the forward pass (its `training` value and mixed-precision
    autocast) with state updates discarded (BatchNormalization's moving
    statistics, seed generators, losses: the forward pass made them) and
    the Keras random seeds of the forward pass replayed (the same Dropout
    mask); it waits for the upstream gradient through one all-reduced
    scalar, 0.0 (NaN if that gradient is NaN), where `tf.recompute_grad`
    takes the upstream gradient's first element, which DTensor turns into
    an all-gather of the whole tensor; and `recompute_dependency()` hands
    that scalar to variable reads, so an fsdp weight is gathered again in
    the backward pass instead of the forward gather being kept (the
    compiler merges identical reads). A checkpointed call inside another
    (a recomputed layer's sublayers) runs plainly: the outer checkpoint
    recomputes it once. Without a gradient tape (predict, evaluate) `f`
    just runs.
    """
    from keras.src.backend import StatelessScope  # noqa: PLC0415
    from keras.src.backend.common import global_state  # noqa: PLC0415

    keras_context = ("current_call_ctx", "autocast_scope")

    def call(*args, **kwargs):
        if not record.could_possibly_record() or _stack("checkpoints"):
            return f(*args, **kwargs)
        layer = getattr(f, "__self__", None)  # a Layer's call (or an op's)
        if not hasattr(layer, "losses"):
            layer = None
        losses_before = len(layer.losses) if layer is not None else 0
        context = [global_state.get_global_attribute(name)
                   for name in keras_context]
        leaves = tf.nest.flatten((args, kwargs))
        at = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)]

        def run(*tensors):
            filled = list(leaves)
            for i, tensor in zip(at, tensors):
                filled[i] = tensor
            args_, kwargs_ = tf.nest.pack_sequence_as((args, kwargs), filled)
            with _pushed("checkpoints", f):
                return f(*args_, **kwargs_)

        @tf.custom_gradient
        def checkpointed(*tensors):
            # Keep no intermediate results; note the seeds drawn.
            with record.stop_recording(), _pushed("seeds", _Seeds()) as seeds:
                result = run(*tensors)

            def grad(*upstream, variables=None):
                first = upstream[0]
                if isinstance(first, tf.IndexedSlices):
                    first = first.values
                first = tf.reduce_sum(tf.cast(first, tf.float32))
                zero = tf.where(tf.equal(first, first), 0.0, float("nan"))
                again = [t + tf.cast(zero, t.dtype) if t.dtype.is_floating
                         else t for t in tensors]
                variables = list(variables or ())
                with _keras_globals(dict(zip(keras_context, context))), \
                        tf.GradientTape() as tape:
                    tape.watch([t for t in again if t.dtype.is_floating])
                    tape.watch(variables)
                    with _pushed("dependencies", zero), \
                            _pushed("seeds", _Seeds(seeds.values, True)) \
                            as replay, StatelessScope():
                        recomputed = run(*again)
                if replay.values:
                    raise RuntimeError(
                        "A recomputed layer drew fewer random seeds in the "
                        "backward pass than in its forward pass, so its "
                        "recomputation does not reproduce it. Leave it out "
                        "of keras.RematScope.")
                grads = tape.gradient(
                    recomputed, again + variables, output_gradients=upstream,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO)
                return grads[:len(again)], grads[len(again):]

            return result, grad

        result = checkpointed(*(leaves[i] for i in at))
        if layer is not None and len(layer.losses) > losses_before:
            raise ValueError(
                f"Layer {layer.name!r} adds a loss in call() (add_loss) and "
                "is recomputed (keras.RematScope): its forward pass runs "
                "without recording gradients, so that loss would get none. "
                "Leave this layer out of the RematScope (e.g. mode="
                "'list_of_layers' with the other layers' names).")
        return result

    return call


def patch_keras_remat(check_replay):
    """Makes Keras' rematerialization (`keras.RematScope`, `keras.remat`)
    work on the TF backend.

    Keras 3.15 rematerializes with `tf.recompute_grad(call)` called with the
    layer's keyword arguments (every layer gets `training=`), which
    `tf.custom_gradient` refuses in graph mode ("supports keywords arguments
    only when eager execution is enabled"): `RematScope(mode="full")` fails
    in any `fit`, even on one device (tests/test_recompute.py). And
    `tf.recompute_grad` would draw new Dropout masks in the recomputation.
    This replaces Keras' TF `remat` with `recompute` and lets
    `SeedGenerator.next` replay seeds inside a recomputation (calling
    `check_replay(generator)` first), once.
    """
    from keras.src.backend.tensorflow import core  # noqa: PLC0415
    from keras.src.random import seed_generator  # noqa: PLC0415

    if core.remat is recompute:
        return
    core.remat = recompute
    generator = seed_generator.SeedGenerator
    generator.next = functools.partialmethod(_next_seed, generator.next,
                                             check_replay)


def static_sparse_division(active):
    """Makes Keras' TF `ops.divide(sparse, dense)` keep static shapes while
    `active()`.

    Keras divides an IndexedSlices gradient by a dense tensor (Adagrad,
    RMSprop, Adadelta: lr * g / sqrt(accumulator + eps)) inside a `tf.cond`
    whose one branch adds the rows where the divisor is zero or NaN: a
    dynamic number of rows, which DTensor 2.21 mis-expands when the table
    is split over a model axis ("SPMD expansion resulted in op output
    inconsistent with the provided layout"). `_sparse_quotient` gives the
    same slices without the branch. Installed once; other backends and
    models outside a strategy are unchanged.
    """
    from keras.src.backend.tensorflow import numpy as tf_numpy  # noqa: PLC0415

    original = tf_numpy.divide
    if getattr(original, "_tfpar_static", False):
        return

    @functools.wraps(original)
    def divide(x1, x2):
        if (isinstance(x1, tf.IndexedSlices) and isinstance(x2, tf.Tensor)
                and x2.shape.rank and x2.dtype.is_floating and active()):
            return _sparse_quotient(x1, x2, original)
        return original(x1, x2)

    divide._tfpar_static = True  # noqa: SLF001
    tf_numpy.divide = divide


def _sparse_quotient(x1, x2, divide):
    """x1 / x2 for IndexedSlices x1 and dense x2, as Keras computes it.

    Each slice j of x1 (row i_j) becomes v_j / x2[i_j]. Keras also adds the
    rows no slice touches where x2 has a zero or NaN, with 0 / x2[i] (NaN or
    +-inf there, 0 elsewhere in the row). Here every row r of x2 gets one
    extra slice: 0 / x2[r] for those rows, zeros for all others. Zeros add
    nothing wherever the slices are summed (scatter_add, densifying) and
    square to zero, so every update equals Keras', with a static number of
    slices (len(x1.indices) + rows).
    """
    rows = x2.shape[0]
    indices = x1.indices
    quotient = divide(x1.values, tf.gather(x2, indices))
    zero_or_nan = tf.reduce_any(
        tf.logical_or(tf.equal(x2, 0), tf.math.is_nan(x2)),
        axis=list(range(1, x2.shape.rank)))
    touched = tf.math.unsorted_segment_sum(  # (DTensor has no segment max)
        tf.ones_like(indices), indices, rows) > 0
    extra_rows = tf.logical_and(zero_or_nan, tf.logical_not(touched))
    mask = tf.reshape(extra_rows, [rows] + [1] * (x2.shape.rank - 1))
    extra = tf.where(mask, divide(tf.zeros_like(x2), x2), tf.zeros_like(x2))
    return tf.IndexedSlices(
        tf.concat([quotient, tf.cast(extra, quotient.dtype)], axis=0),
        tf.concat([indices, tf.range(rows, dtype=indices.dtype)], axis=0),
        x1.dense_shape)


def count_array_batches():
    """Makes the tf.data datasets Keras builds from arrays state their
    batch count (Keras knows it: `ArrayDataAdapter.num_batches`; its
    flat_map pipeline hides it from `dataset.cardinality()`).

    Per-host input needs it: Keras stops each host after its own count, so
    hosts must compare counts before the first step (`inputs`). Installed
    once, by the first strategy with per-host input; the datasets are
    unchanged but for their stated cardinality.
    """
    from keras.src.trainers.data_adapters import array_data_adapter  # noqa: PLC0415

    adapter = array_data_adapter.ArrayDataAdapter
    original = adapter.get_tf_dataset
    if getattr(original, "_tfpar_counted", False):
        return

    @functools.wraps(original)
    def get_tf_dataset(self):
        dataset = original(self)
        if self.num_batches is None:
            return dataset
        return dataset.apply(
            tf.data.experimental.assert_cardinality(self.num_batches))

    get_tf_dataset._tfpar_counted = True  # noqa: SLF001
    adapter.get_tf_dataset = get_tf_dataset


def _optimizer_under(model, strategy):
    """Makes sure `model.optimizer` was created under `strategy`.

    Keras' TF optimizer remembers the strategy current at construction and
    creates its `iterations` and `learning_rate` variables right away. One
    built outside `strategy.scope()` therefore cannot train under it (Keras
    fails with "Mixing different tf.distribute.Strategy objects"). While it
    has no slots yet, an equal optimizer is rebuilt from its config under the
    scope and becomes `model.optimizer`.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or getattr(optimizer, "_distribution_strategy",
                                    strategy) is strategy:
        return
    if optimizer.built:
        raise ValueError(
            f"The optimizer {optimizer.name!r} was created and built outside "
            "the strategy's scope. Received: an optimizer bound to "
            f"{type(optimizer._distribution_strategy).__name__}. Create it "  # noqa: SLF001
            "inside `with strategy.scope():` or pass its name to compile()."
        )
    try:
        config = optimizer.get_config()
        with strategy.scope():
            model.optimizer = type(optimizer).from_config(config)
    except Exception as error:  # noqa: BLE001 (any failure: explain how to fix)
        raise ValueError(
            f"The optimizer {optimizer.name!r} was created outside the "
            "strategy's scope and could not be rebuilt from its config "
            f"({error}). Create it inside `with strategy.scope():`."
        ) from error


def bind_model_strategy(model, strategy):
    """Makes `strategy` the one `model` was built under (Keras records it
    at construction; a model built outside any scope has none)."""
    model._distribute_strategy = strategy  # noqa: SLF001


def all_layers(layer, include_self=True):
    """`layer` and every layer nested in it, outermost first."""
    return list(layer._flatten_layers(include_self=include_self,  # noqa: SLF001
                                      recursive=True))


def transform_layer_outputs(layer, name, transform):
    """Makes `layer` return `transform(outputs)`; once per `name`.

    Wraps this one layer object's `call` (not its class), keeping its
    signature for Keras' argument inspection.
    """
    applied = layer.__dict__.setdefault("_tfpar_output_transforms", set())
    if name in applied:
        return
    original_call = layer.call

    @functools.wraps(original_call)
    def call(*args, **kwargs):
        return transform(original_call(*args, **kwargs))

    layer.call = call
    applied.add(name)


def backing_variable(variable):
    """The tf.Variable behind a Keras Variable (or `variable` itself)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def rebind_keras_variable(keras_variable, tf_variable):
    """Makes `keras_variable` store its value in `tf_variable` from now on."""
    keras_variable._value = tf_variable  # noqa: SLF001


_initializing = threading.local()


def keras_variable_being_created():
    """The Keras Variable whose backing tf.Variable is being created, or None.

    A strategy's variable creator sees only tf.Variable kwargs; the Keras
    path (`variable.path`, e.g. "model/dense/kernel") lives on the Keras
    Variable, which Keras' TensorFlow backend wraps around the tf.Variable in
    `Variable._initialize`. That method is wrapped once to publish `self`.
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


def _publish_adding_layers():
    from keras.src.layers import layer as layer_module  # noqa: PLC0415

    original = layer_module.Layer.add_weight
    if getattr(original, "_tfpar_wrapped", False):
        return

    def add_weight(self, *args, **kwargs):
        stack = _initializing.__dict__.setdefault("layers", [])
        stack.append(self)
        try:
            variable = original(self, *args, **kwargs)
        finally:
            stack.pop()
        variable._tfpar_owner = weakref.ref(self)  # noqa: SLF001
        return variable

    add_weight._tfpar_wrapped = True  # noqa: SLF001
    layer_module.Layer.add_weight = add_weight


def _publish_keras_variables():
    from keras.src.backend.tensorflow import core  # noqa: PLC0415

    original = core.Variable._initialize  # noqa: SLF001
    if getattr(original, "_tfpar_wrapped", False):
        return

    def _initialize(self, value):
        stack = _initializing.__dict__.setdefault("stack", [])
        stack.append(self)
        try:
            return original(self, value)
        finally:
            stack.pop()

    _initialize._tfpar_wrapped = True  # noqa: SLF001
    core.Variable._initialize = _initialize  # noqa: SLF001


_publish_keras_variables()
_publish_adding_layers()


def tf_initialized():
    """Whether TensorFlow's eager context (devices, cluster) is set up."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return context.context()._context_handle is not None  # noqa: SLF001


def eager_context_token():
    """An object standing for TF's current eager context; a new one after
    `context._reset_context()` (what TF's, Keras' and DTensor's test classes
    call between tests). Kept as an attribute of the context object, so it
    dies with it."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    ctx = context.context()
    token = getattr(ctx, "_tfpar_token", None)
    if token is None:
        token = ctx._tfpar_token = object()  # noqa: SLF001
    return token


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


def functional_graph(model):
    """(nodes, inputs, outputs) of a functional or Sequential model.

    `nodes` are the graph's call nodes (input nodes excluded) in an order
    Keras itself executes them (deepest first); `inputs`/`outputs` are the
    model's flat lists of KerasTensors. Returns None for a model without a
    graph (subclassed, or a Sequential that was never given an input shape).
    """
    from keras.src.models import sequential  # noqa: PLC0415

    graph = model
    if isinstance(model, sequential.Sequential):
        graph = getattr(model, "_functional", None)
    nodes_by_depth = getattr(graph, "_nodes_by_depth", None)
    if graph is None or nodes_by_depth is None:
        return None
    nodes = [
        node
        for depth in sorted(nodes_by_depth, reverse=True)
        for node in nodes_by_depth[depth]
        if node.operation is not None and not node.is_input
    ]
    return nodes, list(graph.inputs), list(graph.outputs)


@contextlib.contextmanager
def reading_values(pairs, variables=()):
    """Keras weights read as the given tensors: `pairs` of (weight, value)
    (a tied weight's copy on another stage). Built on `keras.StatelessScope`,
    which also holds back the updates of other `variables` made inside it:
    those are applied when the block ends."""
    if not pairs:
        yield
        return
    with keras.StatelessScope(state_mapping=list(pairs)) as scope:
        yield
    replaced = {id(w) for w, _ in pairs}
    for variable in variables:
        value = scope.get_current_value(variable)
        if id(variable) not in replaced and value is not None:
            variable.assign(value)


def call_count(layer):
    """How many times `layer` was called on symbolic tensors (graph nodes)."""
    return len(getattr(layer, "_inbound_nodes", []))


def is_model(layer):
    from keras.src.models import model as model_lib  # noqa: PLC0415

    return isinstance(layer, model_lib.Model)


def has_keras_tensor(structure):
    from keras.src import tree  # noqa: PLC0415

    return any(isinstance(t, keras.KerasTensor) for t in tree.flatten(structure))


def flat_model_inputs(model, inputs):
    """Symbolic `inputs` of a call of functional `model`, flat in the order
    of `model.inputs` as `Functional._standardize_inputs` orders them (a
    dict by input name, else by structure); None when they do not map."""
    from keras.src import tree  # noqa: PLC0415
    from keras.src.models import sequential  # noqa: PLC0415

    graph = model._functional if isinstance(model, sequential.Sequential) else model  # noqa: SLF001
    struct = graph._inputs_struct  # noqa: SLF001
    if isinstance(inputs, dict) and not isinstance(struct, dict):
        names = [t.name for t in tree.flatten(struct)]
        if not set(names) <= set(inputs):
            return None
        inputs = [inputs[n] for n in names]
    flat = tree.flatten(inputs)
    if not all(isinstance(t, keras.KerasTensor) for t in flat):
        return None
    return flat


def node_inputs(node):
    """The KerasTensors a graph node reads."""
    return list(node.input_tensors)


def run_node(node, tensors, training):
    """Runs one functional graph node on concrete tensors.

    `tensors` maps id(KerasTensor) to a value; the node's outputs are added
    to it. `training` is passed to layers that take it, as Keras'
    Functional.call does.
    """
    from keras.src.models import functional  # noqa: PLC0415
    from keras.src import tree  # noqa: PLC0415

    args, kwargs = node.arguments.fill_in(tensors)
    if not tf.executing_eagerly():
        # A model built with an eager constant (e.g. `keras.ops.arange(n)`
        # added to a symbolic tensor) keeps that tensor in its graph; traced
        # into a DTensor function it would be captured and placed on
        # whatever mesh DTensor last defaulted to. Re-created in the graph,
        # it follows the mesh of the code being traced (a pipeline stage).
        args, kwargs = tree.map_structure(_as_graph_constant, (args, kwargs))
    outputs = functional.operation_fn(node.operation, training=training)(
        *args, **kwargs)
    for symbolic, value in zip(node.outputs, tree.flatten(outputs)):
        tensors[id(symbolic)] = value


def _as_graph_constant(value):
    """An eager, non-DTensor tensor as a constant of the graph being traced."""
    if not (isinstance(value, tf.Tensor) and hasattr(value, "numpy")):
        return value  # symbolic tensors and other values
    with tf.init_scope():
        if dtensor.is_dtensor(value):
            return value
        array = value.numpy()
    return tf.constant(array)


def model_output_structure(model, flat_outputs):
    """`flat_outputs` packed like a functional model's outputs."""
    from keras.src import tree  # noqa: PLC0415
    from keras.src.models import sequential  # noqa: PLC0415

    graph = model._functional if isinstance(model, sequential.Sequential) else model  # noqa: SLF001
    return tree.pack_sequence_as(graph._outputs_struct, flat_outputs)  # noqa: SLF001


def optimizer_learning_rate_variable(optimizer):
    """The variable holding a Keras optimizer's learning rate, or None when
    it is a schedule (computed from `iterations`)."""
    value = getattr(optimizer, "_learning_rate", None)
    return value if hasattr(value, "assign") else None


# -- tensor parallelism: layer inputs; DTensor's compiled programs -----------


def transform_layer_inputs(layer, name, transform):
    """Makes `layer` call its `call` on `transform(first input)`; once per
    `name`.

    Like `transform_layer_outputs`, wraps this one layer object's `call`
    (keeping its signature); the first input is the first positional
    argument, or the first parameter of `call` when passed by keyword.
    """
    import inspect  # noqa: PLC0415

    applied = layer.__dict__.setdefault("_tfpar_input_transforms", set())
    if name in applied:
        return
    original_call = layer.call
    first = next(iter(inspect.signature(original_call).parameters), None)

    @functools.wraps(original_call)
    def call(*args, **kwargs):
        if args:
            args = (transform(args[0]),) + tuple(args[1:])
        elif first in kwargs:
            kwargs[first] = transform(kwargs[first])
        return original_call(*args, **kwargs)

    layer.call = call
    applied.add(name)


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


class OpEvents:
    """Records the TF ops executed in its `with` block (TF's profiler, host
    tracer level 3: every op kernel, named by its name scope).

    After the block, `events` holds (op name, start seconds, end seconds)
    of every executed op. The xplane protobuf it reads is TF-private.
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
        import glob  # noqa: PLC0415
        import shutil  # noqa: PLC0415

        from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415

        tf.profiler.experimental.stop()
        try:
            for path in glob.glob(f"{self._directory}/**/*.xplane.pb",
                                  recursive=True):
                space = xplane_pb2.XSpace()
                with open(path, "rb") as f:
                    space.ParseFromString(f.read())
                for plane in space.planes:
                    names = plane.event_metadata
                    for line in plane.lines:
                        base = line.timestamp_ns * 1e-9
                        for event in line.events:
                            start = base + event.offset_ps * 1e-12
                            self.events.append((
                                names[event.metadata_id].name, start,
                                start + event.duration_ps * 1e-12))
        finally:
            shutil.rmtree(self._directory, ignore_errors=True)
        return False


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



def layer_transforms(layer):
    """Names of the input/output transforms tfpar applied to `layer`."""
    return (layer.__dict__.get("_tfpar_output_transforms", set())
            | layer.__dict__.get("_tfpar_input_transforms", set()))


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


def hook_keras_distribution(on_set, distribute_tensor, initialize):
    """Makes Keras' distribution API reach tfpar on the TF backend; once.

    Keras keeps the current distribution in its global attribute
    "distribution", written only by `keras.distribution.set_distribution`
    (which `Distribution.scope()` calls on entry and exit) through
    `global_state.set_global_attribute`: that writer is wrapped so that
    `on_set(value)` runs first (and may refuse by raising), whichever
    binding of `set_distribution` the user imported. Keras 3.15's TF
    `distribution_lib` (a "DO NOT USE" prototype) lacks `distribute_tensor`,
    `get_device_count` and `initialize`, which `keras.distribution` calls:
    they are supplied. A distribution set before this hook is installed is
    handed to `on_set` now.
    """
    from keras.src.backend.common import global_state  # noqa: PLC0415
    from keras.src.backend.tensorflow import distribution_lib  # noqa: PLC0415

    original = global_state.set_global_attribute
    if getattr(original, "_tfpar_wrapped", False):
        return

    def set_global_attribute(name, value):
        if name == "distribution":
            on_set(value)
        original(name, value)

    set_global_attribute._tfpar_wrapped = True  # noqa: SLF001
    global_state.set_global_attribute = set_global_attribute
    distribution_lib.distribute_tensor = distribute_tensor
    distribution_lib.initialize = initialize
    distribution_lib.get_device_count = (
        lambda device_type=None: len(distribution_lib.list_devices(device_type)))
    current = global_state.get_global_attribute("distribution")
    if current is not None:
        on_set(current)


# -- auto_rules: what each layer reads and returns in one symbolic trace ------


def trace_layer_calls(model, layers):
    """Traces `model` once and returns what each of `layers` read and made.

    The model is called on symbolic inputs of its own input signature in a
    `tf.function` graph (traced, never run: no values are computed or
    changed). Returns `({id(layer): [(inputs, outputs), ...]}, outputs)`:
    per call of each layer the flat graph tensors of its arguments and of
    its results, and the flat outputs of the model. Returns None for a model
    without an input signature (subclassed, or never given an input shape).
    """
    from keras.src.models import sequential  # noqa: PLC0415

    graph = model
    if isinstance(model, sequential.Sequential):
        graph = getattr(model, "_functional", None)
    struct = getattr(graph, "_inputs_struct", None)
    if struct is None:
        return None
    specs = tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype), struct)
    calls = {id(layer): [] for layer in layers}

    def recording(layer):
        original = layer.call

        @functools.wraps(original)
        def call(*args, **kwargs):
            outputs = original(*args, **kwargs)
            flat_in = [t for t in tf.nest.flatten((args, kwargs))
                       if isinstance(t, tf.Tensor)]
            flat_out = [t for t in tf.nest.flatten(outputs)
                        if isinstance(t, tf.Tensor)]
            calls[id(layer)].append((flat_in, flat_out))
            return outputs
        return call

    saved = [(layer, layer.__dict__.get("call")) for layer in layers]
    for layer in layers:
        layer.call = recording(layer)
    try:
        traced = tf.function(lambda x: model(x, training=False),
                             autograph=False).get_concrete_function(specs)
    finally:
        for layer, previous in saved:
            if previous is None:
                del layer.__dict__["call"]
            else:
                layer.call = previous
    outputs = [t for t in tf.nest.flatten(traced.structured_outputs)
               if isinstance(t, tf.Tensor)]
    return calls, outputs

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


def _absl_min_log_level_functions():
    """absl's (MinLogLevel, SetMinLogLevel) in TensorFlow's C++ library, or
    None. The absl version is part of the mangled names, so they are read
    from the library file."""
    if _absl_log_level:
        return _absl_log_level[0]
    import ctypes  # noqa: PLC0415
    import mmap  # noqa: PLC0415
    import os  # noqa: PLC0415
    import re  # noqa: PLC0415

    functions = None
    path = os.path.join(tf.sysconfig.get_lib(), "libtensorflow_framework.so.2")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                              access=mmap.ACCESS_READ) as m:
            found = [re.search(p, m) for p in (_ABSL_GET_MIN, _ABSL_SET_MIN)]
            names = [n.group().decode() for n in found if n is not None]
        if len(names) == 2:
            library = ctypes.CDLL(path)  # already loaded: the same handle
            get, set_ = (getattr(library, name) for name in names)
            get.restype, get.argtypes = ctypes.c_int, []
            set_.restype, set_.argtypes = None, [ctypes.c_int]
            functions = (get, set_)
    except (OSError, AttributeError):
        pass  # another TF build: its INFO lines stay
    _absl_log_level.append(functions)
    return functions


_ABSL_WARNING = 1  # absl::LogSeverityAtLeast::kWarning (kInfo is 0)


@contextlib.contextmanager
def quiet_cpp_info_logs():
    """TensorFlow's C++ INFO lines are dropped inside the block (WARNING
    and above still print), unless the user set TF_CPP_MIN_LOG_LEVEL or
    TF_CPP_MAX_VLOG_LEVEL: then the logging is theirs to choose."""
    import os  # noqa: PLC0415

    functions = None
    if not any(v in os.environ
               for v in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL")):
        functions = _absl_min_log_level_functions()
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
