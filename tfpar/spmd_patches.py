"""Keras and TF ops replaced inside a tfpar step (installed with the
strategy's patches, `tfpar.patches.install`).

Inside a step (`tfpar.step_context.in_spmd_step`) each of these runs
instead of Keras' or TF's op: ops DTensor 2.21 cannot lay out, or lays out
wrongly, become the `tfpar.spmd_ops` that give the same values, and
Keras' random draws give the numbers one device draws (convolutions,
pooling and image ops: `tfpar.spmd_image_patches`). Outside a step the
original op runs, after one check (the fast path every Keras op takes).
One acts in an eager call instead: Keras' causal attention mask is made on
the mesh (`_eager_causal_mask_on_mesh`).
The factories' `hooks` are the strategy's (`tfpar.patches`): `owns` and
`in_graph_step`.
"""

import functools
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import placement
from tfpar import spmd_ops
from tfpar.step_context import in_spmd_step
from tfpar.step_context import step_extended
from tfpar.step_context import layout_free_draw
from tfpar.step_context import replicate_in_step


def _func_graph():
    return _compat.tf_python_module("framework.func_graph").FuncGraph


# Host tensors a step captured, replicated: {id(tensor): (mesh, DTensor)}.
# An entry leaves with its tensor (a finalizer), so the cache neither grows
# for the life of the process nor answers for a reused id.
_REPLICATED_CAPTURES = {}


def _eager_captures_replicated(original, hooks):
    """`FuncGraph.capture` in a step: an eager tensor made outside it — a
    Keras functional model's constant argument, e.g. `keras.ops.arange(
    seq_len)` in examples/gpt.py's position embedding — is captured as a
    DTensor replicated on the step's mesh. DTensor 2.21 auto-broadcasts only
    scalars and small integer tensors: the GPT's [32] positions failed every
    step ("got a regular tensor for input 2 (shape [32]) but was expecting a
    DTensor"). One copy per tensor and mesh."""

    @functools.wraps(original)
    def capture(self, tensor, name=None, shape=None):
        if in_spmd_step() and isinstance(tensor, _eager_tensor()) and (
                tensor.dtype != tf.resource):
            tensor = _replicated_on_step_mesh(tensor)
        return original(self, tensor, name, shape)

    return capture


def _eager_tensor():
    return _compat.tf_python_module("framework.ops").EagerTensor


def _replicated_on_step_mesh(tensor):
    """`tensor` (eager) as a DTensor replicated on the step's mesh; itself
    when it is a DTensor already."""
    extended = step_extended()
    mesh = extended.registry.placement_mesh or extended.mesh
    cached = _REPLICATED_CAPTURES.get(id(tensor))
    if cached is not None and cached[0] == mesh:
        return cached[1]
    with tf.init_scope():
        if dtensor.is_dtensor(tensor):
            return tensor
        replicated = placement.put(tensor, (None,) * tensor.shape.rank, mesh,
                                   dtype=tensor.dtype)
    if cached is None:
        weakref.finalize(tensor, _REPLICATED_CAPTURES.pop, id(tensor), None)
    _REPLICATED_CAPTURES[id(tensor)] = (mesh, replicated)
    return replicated


def _keras_random():
    return _compat.keras_module("backend.tensorflow.random")


def _keras_numpy():
    return _compat.keras_module("backend.tensorflow.numpy")


def _gen_manip_ops():
    return _compat.tf_python_module("ops.gen_manip_ops")


def _gen_array_ops():
    return _compat.tf_python_module("ops.gen_array_ops")


def _gen_nn_ops():
    return _compat.tf_python_module("ops.gen_nn_ops")


def _gen_math_ops():
    return _compat.tf_python_module("ops.gen_math_ops")


def _batch_normalization():
    return _compat.keras_module(
        "layers.normalization.batch_normalization").BatchNormalization


def _random_crop():
    return _compat.keras_module(
        "layers.preprocessing.image_preprocessing.random_crop").RandomCrop


def _dense_slice_update_in_step(original, hooks):
    """`keras.ops.slice_update` as `spmd_ops.dense_slice_update` in a step:
    Keras' TF backend writes it with XLA's DynamicUpdateSlice, which
    DTensor 2.21 cannot lay out ("'tf.XlaDynamicUpdateSlice' op does not
    implement layout propagation"): keras-hub's KV cache updates failed in
    `generate()` (tests/test_generate.py). Elsewhere Keras' op runs."""
    def slice_update(inputs, start_indices, updates):
        if in_spmd_step():
            return spmd_ops.dense_slice_update(inputs, start_indices, updates)
        return original(inputs, start_indices, updates)

    return slice_update


def _indexing_keeping_dims_in_step(original, hooks):
    """`tensor[key]` as `spmd_ops.index_keeping_dims` in a step (when it
    applies); elsewhere TF's indexing runs."""
    def __getitem__(self, key):
        if in_spmd_step():
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
    tf_random = _keras_random()

    def categorical(logits, num_samples, dtype="int64", seed=None):
        replicate = replicate_in_step()
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
    tf_random = _keras_random()

    @functools.wraps(original)
    def dropout(inputs, rate, noise_shape=None, seed=None):
        replicate = replicate_in_step()
        if replicate is None or rate in (0.0, 1.0):
            return original(inputs, rate, noise_shape=noise_shape, seed=seed)
        with layout_free_draw():  # a recomputation may replay it
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
        replicate = replicate_in_step()
        if replicate is None:
            return original(*args, **kwargs)
        with layout_free_draw():  # a recomputation may replay it
            return replicate(original(*args, **kwargs))

    return draw


def _one_device_shuffle_in_step(original, hooks):
    """Keras' TF `random.shuffle` in a step, with one device's permutation:
    Keras' own code (the argsort of uniform numbers, one per element along
    `axis`, and a gather) with the uniform numbers laid out whole on every
    device (`replicate`), as `_one_device_draw_in_step` draws them; DTensor
    would otherwise draw them per block where the gather's operand is split.
    Outside a step Keras' op runs."""
    tf_random = _keras_random()

    @functools.wraps(original)
    def shuffle(x, axis=0, seed=None):
        replicate = replicate_in_step()
        if replicate is None:
            return original(x, axis=axis, seed=seed)
        with layout_free_draw():  # a recomputation may replay it
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
            if not in_spmd_step():
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
    @functools.wraps(original)
    def flip(x, axis=None):
        if not in_spmd_step():
            return original(x, axis=axis)
        x = tf.convert_to_tensor(x)
        return spmd_ops.reverse_by_gather(
            x, range(x.shape.rank) if axis is None else axis)

    return flip


def _stack_by_concat_in_step(original, hooks):
    """TF's `Pack` (`tf.stack`, Keras' `stack`: keras-hub's rotate-half) as
    `spmd_ops.stack_by_concat` in a graph step: DTensor 2.21 cannot lay out
    the `Unpack` of its gradient when the unstacked values' dimensions are
    split more than the gradient's (tests/dtensor_unpack_layout_repro.py:
    Qwen3.5's attention over "model" did not compile). Elsewhere TF's op
    runs."""
    @functools.wraps(original)
    def pack(values, axis=0, name=None):
        if not hooks.in_graph_step():
            return original(values, axis=axis, name=name)
        return spmd_ops.stack_by_concat(
            values, axis, functools.partial(original, name=name))

    return pack


def _new_axes_by_expand_dims_in_step(original, hooks):
    """TF's `StridedSlice` wrapper with a new-axis mask (`x[:, None]`,
    `tf.newaxis`, a raw `tf.strided_slice`) as
    `spmd_ops.slice_adding_axes_by_expand_dims` in a graph step: DTensor
    2.21 cannot lay out the new axis of a split tensor (a compile error or
    a segfault). Elsewhere, and for any other slice, TF's op runs."""
    @functools.wraps(original)
    def strided_slice(input, begin, end, strides, begin_mask=0,  # noqa: A002
                      end_mask=0, ellipsis_mask=0, new_axis_mask=0,
                      shrink_axis_mask=0, name=None):
        masks = (begin_mask, end_mask, ellipsis_mask, new_axis_mask,
                 shrink_axis_mask)
        if not new_axis_mask or not hooks.in_graph_step():
            return original(input, begin, end, strides, *masks, name=name)
        return spmd_ops.slice_adding_axes_by_expand_dims(
            original, input, begin, end, strides, *masks, name=name)

    return strided_slice


def _loop_unrolled_in_step(unrolled):
    """Keras' TF `map` / `scan` as `unrolled(original, ...)` in a step:
    both loop over TensorArrays, which DTensor 2.21 cannot lay out."""
    def make(original, hooks):
        @functools.wraps(original)
        def loop(*args, **kwargs):
            if not in_spmd_step():
                return original(*args, **kwargs)
            return unrolled(original, *args, **kwargs)

        return loop

    return make


def _keras_core():
    return _compat.keras_module("backend.tensorflow.core")


def _top_k_read_by_gather_in_step(original, hooks):
    """TF's `TopKV2` wrapper (`tf.math.top_k`, Keras' `ops.top_k`) in a
    training step's forward pass (a tape recording) as
    `spmd_ops.top_k_read_by_gather`: DTensor 2.21 fails TopKV2's own
    gradient on a batch-split tensor. Inference steps (samplers) and
    everything else run TF's op."""
    @functools.wraps(original)
    def top_kv2(input, k, *args, **kwargs):  # noqa: A002 (TF's names)
        if not (hooks.in_graph_step() and _compat.tape_recording()):
            return original(input, k, *args, **kwargs)
        return spmd_ops.top_k_read_by_gather(original, input, k, *args,
                                             **kwargs)

    return top_kv2


def _concat_whole_along_axis_in_step(original, hooks):
    """TF's `ConcatV2` (`tf.concat`, Keras' `concatenate`, a user layer's
    own `tf.concat(..., axis=-1)`) as `spmd_ops.concat_whole_along_axis` in
    a graph step: DTensor 2.21 concatenated each device's blocks when a
    consumer split the joined dimension and the axis was negative (a silent
    wrong result found by the fuzzing, tests/dtensor_concat_axis_repro.py).
    Elsewhere TF's op runs."""
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
    @functools.wraps(original)
    def transform_images(self, images, transformation, training=True):
        if not hooks.owns(tf.distribute.get_strategy()):
            return original(self, images, transformation, training=training)
        if not training:
            images = self.backend.image.resize(
                self.backend.cast(images, self.compute_dtype),
                size=(self.height, self.width), crop_to_aspect_ratio=True,
                data_format=self.data_format)
        elif in_spmd_step() and all(
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
        place = getattr(_compat.backing_variable(variable), "placement", None)
        return place is not None and any(place.spec)

    @functools.wraps(original)
    def _moments(self, inputs, mask):
        mean, variance = original(self, inputs, mask)
        replicate = replicate_in_step()
        if replicate is None or not split(self.moving_mean):
            return mean, variance
        return replicate(mean), replicate(variance)

    return _moments


def _activation_einsum_in_step(original, hooks):
    """Keras' TF `ops.einsum` of two activations (rank >= 4) as
    `spmd_ops.activation_einsum` in a step: Keras' transposes of an operand
    failed in keras-hub's cached Gemma attention split by heads ("TransposeOp
    SPMD needs communication is not supported yet", tests/test_generate.py).
    In a step "..." is written out as letters first
    (`spmd_ops.subscripts_without_ellipsis`: DTensor refuses it, keras-hub's
    Flux). Elsewhere, and for weights (EinsumDense), Keras' einsum runs."""
    @functools.wraps(original)
    def einsum(subscripts, *operands, **kwargs):
        if not in_spmd_step():
            return original(subscripts, *operands, **kwargs)
        if "..." in subscripts:
            subscripts = spmd_ops.subscripts_without_ellipsis(
                subscripts, operands) or subscripts
        if len(operands) == 2 and not kwargs:
            result = spmd_ops.activation_einsum(subscripts, *operands)
            if result is not None:
                return result
        return original(subscripts, *operands, **kwargs)

    return einsum


def _einsum_dense():
    return _compat.keras_module("layers.core.einsum_dense").EinsumDense


def _lora_kernel_as_einsum_in_step(original, hooks):
    """`EinsumDense.kernel` with LoRA in a step: W + (alpha / r) · A @ B,
    with A: W's shape but the last dimension, then r; B: (r, W's last),
    contracted over r as an einsum. Keras writes A @ B as `ops.matmul`, a
    `tf.tensordot` that flattens A to 2-D: for a kernel split on a middle
    dimension (Llama's (hidden, heads, head_dim) query/key/value split on
    the heads) DTensor 2.21 then gathered A forward and the kernel-sized
    gradient of A @ B backward, every step. Quantized kernels and
    everything outside a step keep Keras' property."""
    @functools.wraps(original.fget)
    def kernel(self):
        if not (in_spmd_step() and self.built and self.lora_enabled
                and self.quantization_mode is None):
            return original.fget(self)
        a, b = self.lora_kernel_a, self.lora_kernel_b
        dims = "abcdefgh"[:len(a.shape) - 1]
        update = tf.einsum(f"{dims}r,ro->{dims}o", a.value, b.value)
        merged = self._kernel.value + (self.lora_alpha / self.lora_rank) * (
            update)
        return tf.cast(merged, self.compute_dtype)

    return property(kernel)


def _scale_reshaped_in_step(original, hooks):
    """`EinsumDense._adjust_scale_for_dequant` in a step (the int8 kernel
    scale brought to the kernel's shape: Keras' backward pass of a
    quantized EinsumDense) with its expand and squeeze as one reshape
    (`spmd_ops.expand_then_squeeze_by_reshape`), then Keras' transpose:
    DTensor 2.21's Squeeze of the replicated scale failed for a kernel
    split on its heads (keras-hub GPT-2, Gemma)."""
    @functools.wraps(original)
    def adjust(self, scale):
        if not hooks.in_graph_step():
            return original(self, scale)
        scale = spmd_ops.expand_then_squeeze_by_reshape(
            tf.convert_to_tensor(scale), self._kernel_squeeze_axes or (),
            self._kernel_expand_axes or ())
        if self._kernel_transpose_axes:
            inverse = np.argsort(self._kernel_transpose_axes).tolist()
            scale = _keras_numpy().transpose(scale, axes=inverse)
        return scale

    return adjust


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
    @functools.wraps(original)
    def divide(x1, x2):
        if (isinstance(x1, tf.IndexedSlices) and isinstance(x2, tf.Tensor)
                and x2.shape.rank and x2.dtype.is_floating
                and hooks.in_graph_step()):
            return spmd_ops.sparse_quotient(x1, x2, original)
        return original(x1, x2)

    return divide


def _keras_nn():
    return _compat.keras_module("backend.tensorflow.nn")


def _keras_tf_utils():
    return _compat.keras_module("utils.tf_utils")


def _portable_encoding_in_step(original, hooks):
    """Keras' TF fast path of CategoryEncoding's "count" and "multi_hot"
    (`tf.math.bincount`, a `DenseBincount` DTensor 2.21 cannot lay out) in
    a step: refused with the ValueError on which Keras' own encoder falls
    back to its portable path (one-hot vectors summed or maxed over the
    tokens, which lay out; the same counts). Elsewhere the fast path."""
    @functools.wraps(original)
    def tf_encode_categorical_inputs(*args, **kwargs):
        if hooks.in_graph_step():
            raise ValueError("tfpar: bincount has no DTensor layout; "
                             "Keras' portable encoding instead")
        return original(*args, **kwargs)

    return tf_encode_categorical_inputs


def _diag_part_on_mesh(original, hooks):
    """TF's `MatrixDiagPartV3` as `spmd_ops.diag_part_by_selection` in a
    step. Eagerly on a DTensor (a metric's `result()` read after the step:
    Keras' IoU metrics) TF's op returns a regular tensor, which the next
    op with a DTensor refuses: there the diagonal of the value fetched to
    the host, put back on the mesh replicated. Elsewhere TF's op."""
    @functools.wraps(original)
    def matrix_diag_part_v3(input, k, padding_value,  # noqa: A002
                            align="RIGHT_LEFT", name=None):
        if hooks.in_graph_step():
            return spmd_ops.diag_part_by_selection(
                original, input, k, padding_value, align=align, name=name)
        if not tf.executing_eagerly():  # another strategy's graph
            return original(input, k, padding_value, align=align, name=name)
        # (A Keras variable reaches TF's op as itself: read its value.)
        value = tf.convert_to_tensor(input)
        if not dtensor.is_dtensor(value):
            return original(value, k, padding_value, align=align, name=name)
        diagonal = original(tf.constant(placement.fetch(value)), k,
                            padding_value, align=align, name=name)
        return dtensor.copy_to_mesh(diagonal, dtensor.Layout.replicated(
            dtensor.fetch_layout(value).mesh, diagonal.shape.rank))

    return matrix_diag_part_v3


def _eye_by_comparison_in_step(original, hooks):
    """Keras' TF `numpy.eye` of the main diagonal (k=0) as
    `spmd_ops.eye_by_comparison` in a step: TF's `tf.eye` is a
    `MatrixDiagV3`, which DTensor 2.21 cannot lay out (Qwen3.5's gated
    delta net failed to compile). Keras pads a smaller eye for k != 0 (to
    another shape than NumPy's when N != M): that, and everything outside a
    step, runs Keras' op."""
    @functools.wraps(original)
    def eye(N, M=None, k=0, dtype=None):
        if not (in_spmd_step() and isinstance(k, int) and k == 0):
            return original(N, M=M, k=k, dtype=dtype)
        return spmd_ops.eye_by_comparison(
            N, M, k, dtype or _compat.keras_module("backend").floatx())

    return eye


def _eager_causal_mask_on_mesh(original, hooks):
    """Keras' TF `nn._apply_masks` (its `dot_product_attention`, which
    `MultiHeadAttention` calls) on a DTensor run eagerly — `model(x)` under
    a strategy: Keras builds the causal mask from `tf.ones((T, S))`, a
    regular tensor that DTensor refuses to mix with the DTensor logits
    ("StridedSlice got a regular tensor ... expecting a DTensor"), so a
    model with `use_causal_mask=True` failed its eager call (and TF's
    band_part of a DTensor returns a regular tensor). There the same lower
    triangle is made on the host and copied to the logits' mesh,
    replicated. Traced steps and everything else run Keras'
    function."""
    @functools.wraps(original)
    def apply_masks(logits, mask, is_causal):
        if not (is_causal and tf.executing_eagerly()
                and dtensor.is_dtensor(logits)):
            return original(logits, mask, is_causal)
        logits = original(logits, mask, False)
        rows, columns = logits.shape[2], logits.shape[3]
        causal = dtensor.copy_to_mesh(
            tf.constant(np.tril(np.ones((1, 1, rows, columns), bool))),
            dtensor.Layout.replicated(dtensor.fetch_layout(logits).mesh, 4))
        return tf.where(causal, logits,
                        _keras_nn()._get_large_negative(logits.dtype))

    return apply_masks


PATCHES = (
    _compat.Patch("func_graph_capture", _func_graph, "capture",
                  _eager_captures_replicated),
    _compat.Patch("divide", _keras_numpy, "divide", _static_sparse_division),
    _compat.Patch("einsum", _keras_numpy, "einsum", _activation_einsum_in_step),
    _compat.Patch("lora_kernel", _einsum_dense, "kernel",
                  _lora_kernel_as_einsum_in_step),
    _compat.Patch("flip", _keras_numpy, "flip", _gathered_flip_in_step),
    # DTensor 2.21 refuses a transpose whose consumer wants another layout
    # (keras-hub's CLIP head on data=2 x model=4).
    _compat.Patch("transpose", _keras_numpy, "transpose",
                  _compat.in_graph_step_instead(spmd_ops.transpose_by_einsum)),
    _compat.Patch("eye", _keras_numpy, "eye", _eye_by_comparison_in_step),
    _compat.Patch("apply_masks", _keras_nn, "_apply_masks",
                  _eager_causal_mask_on_mesh),
    _compat.Patch("concat_v2", _gen_array_ops, "concat_v2",
                  _concat_whole_along_axis_in_step),
    _compat.Patch("pack", _gen_array_ops, "pack", _stack_by_concat_in_step),
    # DTensor 2.21 cannot lay out `Bucketize` (Keras' Discretization) nor
    # `DenseBincount` (CategoryEncoding's TF fast path, which Keras leaves
    # for its portable one on a ValueError).
    _compat.Patch("digitize", _keras_numpy, "digitize",
                  _compat.in_graph_step_instead(
                      spmd_ops.digitize_by_comparison)),
    _compat.Patch("encode_categorical", _keras_tf_utils,
                  "tf_encode_categorical_inputs",
                  _portable_encoding_in_step),
    # DTensor 2.21 cannot lay out `MatrixDiagPartV3`, and its `ScatterNd`
    # fails at run time (both in Keras' IoU metrics' confusion matrix).
    _compat.Patch("scatter", _compat.keras_tf_core, "scatter",
                  _compat.in_graph_step_instead(
                      spmd_ops.scatter_by_segment_sum)),
    _compat.Patch("matrix_diag_part_v3", _gen_array_ops,
                  "matrix_diag_part_v3", _diag_part_on_mesh),
    # Keras' int8 layers (`model.quantize("int8")`): DTensor 2.21 cannot
    # lay out `BatchMatMulV3` (their int8 x int8 -> int32 matmul), nor an
    # EinsumDense's scale squeezed into a kernel split by heads.
    _compat.Patch("scale_for_dequant", _einsum_dense,
                  "_adjust_scale_for_dequant", _scale_reshaped_in_step),
    _compat.Patch("batch_mat_mul_v3", _gen_math_ops, "batch_mat_mul_v3",
                  _compat.in_graph_step_instead(
                      spmd_ops.integer_matmul_in_float)),
    # DTensor 2.21 cannot lay out `Roll` (Swin's shifted windows),
    # `MirrorPad` (a reflecting `tf.pad`; Keras' centred `ops.stft`, so
    # MelSpectrogram) nor `Cumprod`.
    _compat.Patch("roll", _gen_manip_ops, "roll",
                  _compat.in_graph_step_instead(spmd_ops.roll_by_slices)),
    _compat.Patch("mirror_pad", _gen_array_ops, "mirror_pad",
                  _compat.in_graph_step_instead(
                      spmd_ops.mirror_pad_by_gather)),
    _compat.Patch("map", _keras_core, "map",
                  _loop_unrolled_in_step(spmd_ops.unrolled_map)),
    _compat.Patch("scan", _keras_core, "scan",
                  _loop_unrolled_in_step(spmd_ops.unrolled_scan)),
    _compat.Patch("top_k", _gen_nn_ops, "top_kv2",
                  _top_k_read_by_gather_in_step),
    _compat.Patch("cumprod", _gen_math_ops, "cumprod",
                  _compat.in_graph_step_instead(spmd_ops.cumprod_by_shifts)),
    _compat.Patch("strided_slice", _gen_array_ops, "strided_slice",
                  _new_axes_by_expand_dims_in_step),
    _compat.Patch("slice_update", _compat.keras_tf_core, "slice_update",
                  _dense_slice_update_in_step),
    _compat.Patch("tensor_getitem", lambda: tf.Tensor, "__getitem__",
                  _indexing_keeping_dims_in_step),
    _compat.Patch("categorical", _keras_random, "categorical",
                  _gumbel_categorical_in_step),
    _compat.Patch("dropout", _keras_random, "dropout",
                  _one_device_dropout_in_step),
    *(_compat.Patch(name, _keras_random, name, _one_device_draw_in_step)
      for name in SHAPED_DRAWS),
    _compat.Patch("random_crop", _random_crop, "transform_images",
                  _random_crop_under_tfpar),
    _compat.Patch("shuffle", _keras_random, "shuffle",
                  _one_device_shuffle_in_step),
    *(_compat.Patch(name, _keras_random, name, _refused_draw_in_step(name))
      for name in REFUSED_DRAWS),
    _compat.Patch("batch_moments", _batch_normalization, "_moments",
                  _replicated_batch_moments_in_step),
)
