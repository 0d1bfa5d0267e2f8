"""Ops DTensor 2.21 can lay out, standing in for Keras/TF ones in a step.

Inside a tfpar step (`tfpar.spmd_patches`, installed when the first
`ParallelStrategy` is made) Keras' `slice_update`, `random.categorical`,
`ops.divide(sparse, dense)`, `ops.einsum` of two activations, `numpy.flip`,
`numpy.eye`, `nn.depthwise_conv`, `nn.separable_conv`, `nn.average_pool`,
`nn.conv` (dilated or grouped), `core.map`/`scan`,
`image.affine_transform`, `image.perspective_transform`,
`image.rgb_to_hsv`/`hsv_to_rgb`, TF's `image.resize` (bicubic, lanczos,
area, antialiased), `linalg.solve`, `ConcatV2`, `Pack`, `Roll`, `Cumprod`,
`TopKV2`, `MirrorPad`, channels-first `BiasAdd`, Keras' `transpose`, RandomCrop's drawn window and TF's `tensor[key]` use these instead of ops DTensor cannot lay out or lays out
wrongly. Each gives the same values as the op it replaces (the sampler:
the same distribution).

Example:

>>> import numpy as np
>>> from tfpar.spmd_ops import dense_slice_update
>>> dense_slice_update(np.zeros((2, 4), "float32"), [0, 1],
...                    np.ones((2, 2), "float32")).numpy()
array([[0., 1., 1., 0.],
       [0., 1., 1., 0.]], dtype=float32)
"""

import functools
import itertools
import string
import numpy as np
import tensorflow as tf
from keras import tree

from tfpar import _compat
from tfpar import collectives


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


def activation_einsum(subscripts, x, y):
    """`einsum(subscripts, x, y)` of two activations of rank >= 4 (attention
    scores and context) as one TF Einsum op, or None for other operands
    (Keras' own path then runs).

    Keras' TF backend writes such equations as transposes and a matmul
    (e.g. "btkgh,bskh->bkgts": k transposed bskh -> bkhs). DTensor 2.21
    cannot lay out a transpose whose consumer wants a layout the permuted
    operand does not have ("TransposeOp SPMD needs communication is not
    supported yet"): in keras-hub's cached Gemma attention the key and
    value read from the KV cache are split over the batch only, the
    queries by heads too (tests/dtensor_transpose_repro.py). DTensor's
    Einsum expander relayouts its operands itself. The same contraction,
    sum_contracted x * y: equal values up to float rounding.
    """
    x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
    if (x.shape.rank is None or y.shape.rank is None
            or min(x.shape.rank, y.shape.rank) < 4 or x.dtype != y.dtype
            or not x.dtype.is_floating):
        return None
    return tf.einsum(subscripts, x, y)


def transpose_by_einsum(transpose, x, axes=None):
    """Keras' `ops.transpose(x, axes)` of a floating tensor as one
    one-operand TF Einsum op ("abc->cab" for axes (2, 0, 1); reversed axes
    when `axes` is None). Anything else (sparse, integer, unknown rank,
    axes that are no permutation): `transpose` itself.

    DTensor 2.21 cannot lay out a transpose whose consumer wants a layout
    the permuted operand does not have ("TransposeOp SPMD needs
    communication is not supported yet", tests/dtensor_transpose_repro.py):
    keras-hub's CLIP head transposes its text-by-image logits, split over
    the data axis, and its step on data=2 x model=4 did not compile. Its
    Einsum expander relayouts the operand itself. Values are the
    transpose's exactly (a permutation moves no bits).

    >>> transpose_by_einsum(tf.transpose, tf.reshape(tf.range(6.), (2, 3))
    ...                     ).numpy()
    array([[0., 3.],
           [1., 4.],
           [2., 5.]], dtype=float32)
    """
    if isinstance(x, tf.SparseTensor):
        return transpose(x, axes)
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    if rank is None or not 0 < rank <= len(string.ascii_lowercase) or not (
            x.dtype.is_floating):
        return transpose(x, axes)
    order = list(reversed(range(rank))) if axes is None else [
        int(axis) % rank if -rank <= int(axis) < rank else -1
        for axis in axes]
    if sorted(order) != list(range(rank)):
        return transpose(x, axes)
    letters = string.ascii_lowercase[:rank]
    return tf.einsum(
        f"{letters}->{''.join(letters[axis] for axis in order)}", x)


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
    boolean or list indices, unknown rank or rank below 2).

    DTensor 2.21 lays out a StridedSlice that drops a dimension d wrongly
    when a later dimension is sharded: the output keeps the sharding at the
    old position (dimension + 1), so `cache[:, i, ...]` of a cache split by
    heads comes out split by head size, with wrong values or a failed
    compile (tests/dtensor_shrink_slice_repro.py). This is keras-hub's
    KV-cache indexing.
    """
    items = key if isinstance(key, tuple) else (key,)
    rank = tensor.shape.rank
    # A tensor of rank 1 has no later dimension to mislay: the plain path
    # (e.g. Keras' `tf.shape(y)[0]` in every step's metrics, no Squeeze).
    if rank is None or rank < 2 or not any(_is_scalar_index(i) for i in items) or not all(
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
    result = _compat.unpatched(tf.Tensor, "__getitem__")(
        tensor, tuple(new_key))
    for axis, index in reversed(gathers):  # later axes first: positions hold
        result = tf.gather(result, index, axis=axis)
    # A gather at an axis before a squeezed one moved it down by one.
    squeeze = [a - sum(g < a for g, _ in gathers) for a in squeeze]
    return tf.squeeze(result, squeeze) if squeeze else result


def slice_adding_axes_by_expand_dims(strided_slice, input_, begin, end,
                                     strides, begin_mask=0, end_mask=0,
                                     ellipsis_mask=0, new_axis_mask=0,
                                     shrink_axis_mask=0, name=None):
    """TF's `StridedSlice` op (`strided_slice`, its generated wrapper) with
    a `new_axis_mask`: the same slice without the new axes, then each new
    axis added by `tf.expand_dims` at its place in the result. The same
    values. Anything else (no new axis, an unknown rank or spec length, a
    position both ellipsis and new axis): `strided_slice` itself.

    DTensor 2.21 cannot lay out a StridedSlice that adds an axis to a split
    tensor: "'tf.StridedSlice' op ComputeLayoutForward error: sharding
    spec" in a step, or a segmentation fault of the process
    (tests/dtensor_newaxis_slice_repro.py). keras-hub's XLNet
    (`segment_ids[:, None]`, split over data) failed on every mesh, a
    data-only one included. Spec position i of the slice's `begin`, `end`
    and `strides` is bit i of each mask; the new axes' positions are
    dropped from both, so the kept positions' bits are renumbered.

    >>> slice_adding_axes_by_expand_dims(  # x[:, None, :]
    ...     tf.strided_slice, tf.ones((2, 3)), [0, 0, 0], [0, 0, 0],
    ...     [1, 1, 1], begin_mask=5, end_mask=5, new_axis_mask=2).shape
    TensorShape([2, 1, 3])
    """
    def sliced(*spec, masks=(begin_mask, end_mask, ellipsis_mask,
                             new_axis_mask, shrink_axis_mask)):
        return strided_slice(input_, *spec, *masks, name=name)

    length = tf.TensorShape(begin.shape if hasattr(begin, "shape")
                            else [len(begin)])
    rank = tf.TensorShape(getattr(input_, "shape", None)).rank
    if (not new_axis_mask or rank is None or length.rank != 1
            or length[0] is None or new_axis_mask & ellipsis_mask):
        return sliced(begin, end, strides)
    positions = range(length[0])
    keep = [i for i in positions if not new_axis_mask >> i & 1]
    specified = sum(not (new_axis_mask | ellipsis_mask) >> i & 1
                    for i in positions)
    new_axes, out_axis = [], 0  # the new axes' places in the result
    for i in positions:
        if new_axis_mask >> i & 1:
            new_axes.append(out_axis)
            out_axis += 1
        elif ellipsis_mask >> i & 1:
            out_axis += rank - specified
        elif not shrink_axis_mask >> i & 1:
            out_axis += 1

    def renumbered(mask):  # bit i of a kept position -> its place in keep
        return sum((mask >> i & 1) << j for j, i in enumerate(keep))

    if keep:
        result = sliced(*(_kept(spec, keep) for spec in (begin, end,
                                                         strides)),
                        masks=(renumbered(begin_mask), renumbered(end_mask),
                               renumbered(ellipsis_mask), 0,
                               renumbered(shrink_axis_mask)))
    else:  # only new axes: the input itself (an Identity before the
        # expand_dims left Keras' "...,d->...d" einsum of RoFormerV2's
        # positions unable to lay out its broadcast)
        result = tf.convert_to_tensor(input_)
    for axis in new_axes:  # ascending: each lands at its place
        result = tf.expand_dims(result, axis)
    return result


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


def sparse_quotient(x1, x2, divide):
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


def reverse_by_gather(x, axis):
    """`tf.reverse(x, axis)` (axis: an int or ints) as gathers: element i
    of a reversed dimension of size n is element n - 1 - i. DTensor 2.21
    cannot lay out ReverseV2 ("'tf.ReverseV2' op does not implement layout
    propagation": RandomFlip and `keras.ops.flip` failed in a step); it
    lays out GatherV2."""
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    for a in [axis] if isinstance(axis, int) else axis:
        a %= rank
        n = tf.shape(x)[a]
        x = tf.gather(x, tf.range(n - 1, -1, -1), axis=a)
    return x


def mirror_pad_by_gather(mirror_pad, tensor, paddings, mode, name=None):
    """TF's `MirrorPad` (`tf.pad` with mode "reflect" or "symmetric";
    Keras' `ops.stft` with `center=True`, so MelSpectrogram) as one gather
    per padded axis, for static paddings and sizes: along an axis of size
    n padded by (b, a), the result reads x at

      reflect:   b, ..., 1,  0, ..., n-1,  n-2, ..., n-1-a
      symmetric: b-1, ..., 0,  0, ..., n-1,  n-1, ..., n-a

    (the edge repeated or not). Anything else: `mirror_pad` itself.
    DTensor 2.21 cannot lay out MirrorPad ("'tf.MirrorPad' op does not
    implement layout propagation"); it lays out GatherV2.

    >>> mirror_pad_by_gather(tf.raw_ops.MirrorPad, tf.constant([1, 2, 3]),
    ...                      [[2, 1]], "REFLECT").numpy()
    array([3, 2, 1, 2, 3, 2], dtype=int32)
    """
    tensor = tf.convert_to_tensor(tensor)
    pads = tf.get_static_value(paddings)
    how = mode.decode() if isinstance(mode, bytes) else str(mode)
    shift = {"REFLECT": 1, "SYMMETRIC": 0}.get(how.upper())
    if pads is None or shift is None or tensor.shape.rank is None or any(
            tensor.shape[axis] is None
            for axis, pad in enumerate(pads) if any(pad)):
        return mirror_pad(input=tensor, paddings=paddings, mode=mode,
                          name=name)
    for axis, (before, after) in enumerate(np.asarray(pads).tolist()):
        if before or after:
            n = tensor.shape[axis]
            index = (list(range(before - 1 + shift, shift - 1, -1))
                     + list(range(n))
                     + list(range(n - 1 - shift, n - 1 - shift - after, -1)))
            tensor = tf.gather(tensor, index, axis=axis)
    return tensor


def crop_by_gather(x, starts, sizes, axes):
    """`x` cut to `sizes[k]` elements from `starts[k]` (scalar tensors)
    along each `axes[k]`, as gathers: element i of a cut dimension is
    element start + i. The same values as the slice `x[..., s:s + n, ...]`
    Keras' RandomCrop takes, whose start is a drawn tensor: DTensor 2.21
    lays that StridedSlice out wrongly on a batch-split image (an empty
    block, "input image must be of non-zero size"; a Conv2D after it
    inconsistent with its layout); it lays out GatherV2."""
    x = tf.convert_to_tensor(x)
    for start, size, axis in zip(starts, sizes, axes):
        start = tf.cast(start, tf.int32)
        x = tf.gather(x, start + tf.range(size), axis=axis % x.shape.rank)
    return x


def concat_whole_along_axis(values, axis, concat):
    """`concat(values, axis)` (TF's `ConcatV2`) with `axis` made
    non-negative and, for floating values, the joined dimension whole on
    every device (`collectives.whole_along`); every other dimension is laid
    out as DTensor chooses. Values are unchanged.

    DTensor 2.21 propagates a consumer's split of the joined dimension
    (e.g. a row-parallel Dense, or a BatchNormalization gamma split over a
    mesh axis) back into the ConcatV2 and, when the axis is negative
    (Keras' `Concatenate(axis=-1)`, or `tf.concat(..., axis=-1)` in a
    layer's own code), concatenates each device's blocks: with [a | b]
    split in k blocks, device i holds [a_i | b_i], not block i of [a | b]
    — a silent wrong result. For a non-negative axis it refuses the split
    instead ("Concat op SPMD with concat dimension in sharded dimension is
    not supported"). tests/dtensor_concat_axis_repro.py shows both. The
    pin keeps the concat on whole rows; a consumer that splits the joined
    dimension slices its block afterwards, and the gradient is gathered
    along it in the backward pass (none where the consumer keeps it
    whole). Integer values (shapes, token ids) get the non-negative axis
    only: no relayout among the shape arithmetic DTensor folds.
    """
    rank = getattr(getattr(values[0], "shape", None), "rank", None) if (
        len(values)) else None
    if not isinstance(axis, (int, np.integer)) or not rank:
        return concat(values, axis)
    axis = int(axis) % rank
    result = concat(values, axis)
    if not result.dtype.is_floating:
        return result
    return collectives.whole_along(result, axis)


def stack_by_concat(values, axis, pack):
    """`pack(values, axis)` (TF's `Pack`, `tf.stack`): for floating tensors
    of rank >= 1, the same values as a `ConcatV2` of the values each given
    the new dimension (`expand_dims`) on a non-negative axis, so that the
    gradient is the concat's (slices), not TF's `Unpack`.

    DTensor 2.21's SPMD expansion of `Unpack` does not slice its input when
    layout propagation splits an output dimension the input holds whole:
    the outputs keep the whole dimension and compilation fails ("SPMD
    expansion resulted in op output inconsistent with the provided layout.
    Expected shape: <8,8,16,1> got shape: <8,8,8,1>",
    tests/dtensor_unpack_layout_repro.py). keras-hub's rotate-half
    (`RotaryEmbedding`: `stack((-x2, x1), axis=-2)`) met it in the gradient
    of Qwen3.5's partial rotary dimensions (a quarter of each head) with
    the heads split over "model". TF's own `ConcatV2` (not the step's
    `concat_whole_along_axis`): the new dimension has n elements and no
    consumer splits it, so it needs no pin and the other dimensions keep
    their layouts (no all-gather). Anything else: `pack` unchanged.

    >>> stack_by_concat([tf.ones((2, 3)), tf.zeros((2, 3))], -1,
    ...                 tf.stack).shape
    TensorShape([2, 3, 2])
    """
    if not (isinstance(values, (list, tuple)) and values
            and isinstance(axis, (int, np.integer))
            and all(tf.is_tensor(v) and v.dtype.is_floating
                    and v.shape.rank for v in values)):
        return pack(values, axis)
    rank = values[0].shape.rank + 1  # the stack's rank
    if not -rank <= axis < rank:  # TF's own error for an axis out of range
        return pack(values, axis)
    axis = int(axis) % rank
    expanded = [tf.expand_dims(v, axis) for v in values]
    if len(expanded) == 1:  # ConcatV2 takes two values or more
        return expanded[0]
    return tf.raw_ops.ConcatV2(values=expanded, axis=axis)


def eye_by_comparison(rows, columns=None, diagonal=0, dtype="float32"):
    """The (rows, columns) matrix with ones on diagonal `diagonal` (Keras'
    `ops.eye(N, M, k)`): element (i, j) is 1 when i + k == j, else 0, as
    `cast(equal(range(rows)[:, None] + k, range(columns)[None, :]))`.

    TF writes `tf.eye` as `MatrixDiagV3` of ones, which DTensor 2.21
    cannot lay out ("'tf.MatrixDiagV3' op does not implement layout
    propagation": keras-hub's Qwen3.5 gated delta net adds `ops.eye` to its
    chunk's correction matrix). A comparison and a cast: exact values.

    >>> eye_by_comparison(2, 3, 1).numpy()
    array([[0., 1., 0.],
           [0., 0., 1.]], dtype=float32)
    """
    columns = rows if columns is None else columns
    row = tf.range(rows)[:, None] + diagonal
    return tf.cast(tf.equal(row, tf.range(columns)[None, :]), dtype)


def depthwise_conv_by_shifts(inputs, kernel, strides=1, padding="valid",
                             dilation_rate=1):
    """A depthwise convolution, channels last (Keras' 1-D or 2-D
    `ops.depthwise_conv`, or any number of spatial dimensions: the sum
    runs over every kernel offset), of `inputs` (batch, *spatial,
    channels) and `kernel` (*k, channels, multiplier), as a sum of shifted
    copies: with stride and dilation 1 and "valid" padding,
    out[b, t, c·m + q] = Σ_j x[b, t + j, c] · w[j, c, q] (1-D; in 2-D the
    sum runs over both kernel offsets), each term a slice of x times a row
    of w. Dilation d shifts by j·d; "same" pads x as TF does (total
    (k - 1)·d + 1 - s for stride s where the length is a multiple of s,
    in general max((out - 1)·s + (k - 1)·d + 1 - length, 0), the smaller
    half before); a stride s keeps every s-th output of the stride-1 sum.

    TF's `DepthwiseConv2dNative` runs forward, but DTensor 2.21 cannot lay
    out the filter gradient (`DepthwiseConv2dNativeBackpropFilter` "does
    not implement layout propagation": keras-hub's Qwen3.5 gated delta net
    (a causal 1-D convolution, kernel 4) and SegFormer's MiT (3×3 in its
    Mix-FFN) failed to compile, on a data-only mesh too). Here the
    gradients are slices, multiplies and sums. The same values up to float
    rounding (the order of the sum).

    >>> x = tf.reshape(tf.range(4.0), (1, 4, 1))
    >>> depthwise_conv_by_shifts(x, tf.ones((2, 1, 1)))[0, :, 0].numpy()
    array([1., 3., 5.], dtype=float32)
    """
    inputs = tf.convert_to_tensor(inputs)
    kernel = tf.convert_to_tensor(kernel, inputs.dtype)
    spatial = inputs.shape.rank - 2
    channels, multiplier = kernel.shape[spatial:]
    out = _shifted_sum(inputs, kernel, strides, padding, dilation_rate,
                       lambda window, w: window[..., None] * w)
    if multiplier == 1:
        return tf.squeeze(out, -1)
    shape = tf.shape(out)
    return tf.reshape(out, tf.concat(
        [shape[:-2], [channels * multiplier]], 0))


def conv_by_shifts(inputs, kernel, strides=1, padding="valid",
                   dilation_rate=1):
    """A convolution, channels last (Keras' `ops.conv`, any number of
    spatial dimensions), of `inputs` (batch, *spatial, in) and `kernel`
    (*k, in, out) as the sum over kernel offsets of shifted copies of x
    times that offset's (in, out) matrix: with stride and dilation 1 and
    "valid" padding, out[b, t] = Σ_j x[b, t + j] · w[j] (1-D; in 2-D the
    sum runs over both offsets); dilation, "same" padding and strides as
    `depthwise_conv_by_shifts`.

    TF runs a dilated convolution on CPU as SpaceToBatchND, a convolution
    and BatchToSpaceND, and DTensor 2.21 cannot lay out SpaceToBatchND
    ("'tf.SpaceToBatchND' op does not implement layout propagation":
    keras-hub's DeepLabV3, whose atrous pyramid dilates by 6, 12 and 18,
    failed to compile on a data-only mesh). Here the shifts are slices and
    each term a matrix product. The same values up to float rounding.

    >>> x = tf.reshape(tf.range(5.0), (1, 5, 1))
    >>> conv_by_shifts(x, tf.ones((2, 1, 1)), dilation_rate=2)[0, :, 0].numpy()
    array([2., 4., 6.], dtype=float32)
    """
    inputs = tf.convert_to_tensor(inputs)
    kernel = tf.convert_to_tensor(kernel, inputs.dtype)
    return _shifted_sum(inputs, kernel, strides, padding, dilation_rate,
                        tf.linalg.matmul)


def _shifted_sum(inputs, kernel, strides, padding, dilation_rate, term):
    """Σ over the kernel's offsets j of term(x shifted by j·dilation, w[j])
    for channels-last `inputs` (padded as TF pads "same"), every stride-th
    output kept: the convolutions by shifts."""
    spatial = inputs.shape.rank - 2
    sizes = kernel.shape[:spatial]
    strides, dilations = (_per_dimension(v, spatial)
                          for v in (strides, dilation_rate))
    if padding == "same":
        inputs = tf.pad(inputs, [[0, 0]] + [
            _same_padding(inputs.shape[1 + i], sizes[i], strides[i],
                          dilations[i]) for i in range(spatial)] + [[0, 0]])
    reach = [(k - 1) * d for k, d in zip(sizes, dilations)]
    lengths = [tf.shape(inputs)[1 + i] - reach[i] for i in range(spatial)]
    terms = []
    for offsets in itertools.product(*(range(k) for k in sizes)):
        window = tuple(slice(j * d, j * d + n)
                       for j, d, n in zip(offsets, dilations, lengths))
        terms.append(term(inputs[(slice(None),) + window + (slice(None),)],
                          kernel[offsets]))
    out = tf.add_n(terms) if len(terms) > 1 else terms[0]
    if any(s > 1 for s in strides):
        out = out[(slice(None),) + tuple(slice(None, None, s)
                                         for s in strides)]
    return out


def average_pool_by_shifts(inputs, pool_size, strides=None,
                           padding="valid"):
    """TF's average pooling (`tf.nn.avg_pool`, Keras' AveragePooling1D/2D/
    3D) of (batch, *spatial, channels) inputs as the window sum of
    `depthwise_conv_by_shifts` (a kernel of ones) divided by the number of
    inputs each window holds: the pool size with "valid" padding; with
    "same", only the positions inside the input (TF does not count the
    padding), a static table (`_window_counts`).

    DTensor 2.21 cannot lay out `AvgPoolGrad` ("does not implement layout
    propagation"): keras.applications' DenseNet, whose transition blocks
    average-pool a convolution's output, failed to compile on a data-only
    mesh. The same values up to float rounding (the order of the sum).

    >>> x = tf.reshape(tf.range(4.0), (1, 4, 1))
    >>> average_pool_by_shifts(x, 2, 1, "same")[0, :, 0].numpy()
    array([0.5, 1.5, 2.5, 3. ], dtype=float32)
    """
    inputs = tf.convert_to_tensor(inputs)
    spatial = inputs.shape.rank - 2
    sizes = _per_dimension(pool_size, spatial)
    strides = _per_dimension(sizes if strides is None else strides, spatial)
    ones = tf.ones(sizes + (inputs.shape[-1], 1), inputs.dtype)
    total = depthwise_conv_by_shifts(inputs, ones, strides, padding)
    if padding == "valid":
        return total / float(np.prod(sizes))
    counts = _window_counts(inputs.shape[1:-1], sizes, strides)
    return total / tf.constant(counts[None, ..., None], inputs.dtype)


def _window_counts(lengths, sizes, strides):
    """How many input positions each "same"-padded window of `sizes` and
    `strides` covers, per output position (an array of the output's
    spatial shape): per dimension, the stride-1 windows of the input padded
    by `_same_padding`, every s-th kept, counted inside the input; the
    product over dimensions (a window is a box)."""
    per_dimension = []
    for length, size, stride in zip(lengths, sizes, strides):
        before, after = _same_padding(length, size, stride, 1)
        starts = np.arange(length + before + after - size + 1)[::stride]
        inside = [np.sum((t + np.arange(size) - before >= 0)
                         & (t + np.arange(size) - before < length))
                  for t in starts]
        per_dimension.append(np.asarray(inside, np.float64))
    counts = per_dimension[0]
    for more in per_dimension[1:]:
        counts = np.multiply.outer(counts, more)
    return counts


def _kept(spec, keep):
    """The entries `keep` of a slice's begin, end or strides: constants
    where they are known (DTensor lays them out as constants), else a
    gather."""
    static = tf.get_static_value(spec)
    if static is None:
        return tf.gather(spec, keep)
    return [int(np.asarray(static)[i]) for i in keep]


def roll_by_slices(roll, inputs, shift, axis, name=None):
    """TF's `Roll` (`tf.roll`, Keras' `ops.roll` with an axis) of a tensor
    whose rolled dimensions have static sizes, for static shifts and axes:
    along each axis a of size n, shifted by s (mod n), the concatenation
    of its last s elements and its first n - s —
    roll(x, s)[i] = x[(i - s) mod n]. Anything else: `roll` itself.

    DTensor 2.21 cannot lay out TF's `Roll` ("'tf.Roll' op does not
    implement layout propagation"): keras-hub's Swin Transformer (its
    shifted windows) failed to compile on every mesh. Slices and a
    concatenation lay out; the same values.

    >>> roll_by_slices(tf.roll, tf.range(5), 2, 0).numpy()
    array([3, 4, 0, 1, 2], dtype=int32)
    """
    inputs = tf.convert_to_tensor(inputs)
    shifts, axes = tf.get_static_value(shift), tf.get_static_value(axis)
    rank = inputs.shape.rank
    if shifts is None or axes is None or rank is None:
        return roll(inputs, shift, axis, name=name)
    shifts, axes = np.atleast_1d(shifts), np.atleast_1d(axes)
    if len(shifts) != len(axes) or any(
            inputs.shape[int(a)] is None for a in axes):
        return roll(inputs, shift, axis, name=name)
    out = inputs
    for s, a in zip(shifts, axes):
        a = int(a) % rank
        n = inputs.shape[a]
        s = int(s) % n if n else 0
        if s:
            head = [slice(None)] * a
            out = tf.concat([out[tuple(head + [slice(n - s, None)])],
                             out[tuple(head + [slice(None, n - s)])]], a)
    return out


def unrolled_map(keras_map, f, xs):
    """Keras' `ops.map` (TF: `tf.map_fn` over TensorArrays) as f applied to
    each element along the first axis of `xs` (a tensor or a structure of
    them) and the results stacked: `stack([f(xs[0]), f(xs[1]), ...])`. An
    unknown first axis runs `keras_map` (and fails in a step with the op
    named). keras-hub's D-FINE gathers each image's top queries this way.

    >>> unrolled_map(None, lambda x: x * 2, tf.constant([[1], [2]])).numpy()
    array([[2],
           [4]], dtype=int32)
    """
    flat = [tf.convert_to_tensor(x) for x in tree.flatten(xs)]
    length = flat[0].shape[0] if flat[0].shape.rank else None
    if not length:  # unknown, or no element to give the results' structure
        return keras_map(f, xs)
    outputs = [f(tree.pack_sequence_as(xs, [x[i] for x in flat]))
               for i in range(length)]
    return tree.map_structure(lambda *ys: _stacked_whole(ys), *outputs)


def unrolled_scan(keras_scan, f, init, xs=None, length=None, reverse=False,
                  unroll=1):
    """Keras' `ops.scan` (jax.lax.scan's meaning: f(carry, x) -> (carry,
    y); returns the last carry and the ys stacked) with its loop written
    out, element by element along the first axis of `xs` (backwards when
    `reverse`, the ys still in the xs' order). A length unknown when the
    step is traced runs `keras_scan`.

    >>> carry, ys = unrolled_scan(None, lambda c, x: (c + x, c + x), 0,
    ...                           tf.constant([1, 2, 3]))
    >>> int(carry), ys.numpy().tolist()
    (6, [1, 3, 6])
    """
    flat = [] if xs is None else [tf.convert_to_tensor(x)
                                  for x in tree.flatten(xs)]
    n = length if length is not None else (
        flat[0].shape[0] if flat and flat[0].shape.rank else None)
    if not n:  # unknown, or no element to give the ys' structure
        return keras_scan(f, init, xs, length, reverse, unroll)
    carry, ys = init, [None] * int(n)
    for i in (reversed(range(int(n))) if reverse else range(int(n))):
        x = (None if xs is None
             else tree.pack_sequence_as(xs, [x[i] for x in flat]))
        carry, ys[i] = f(carry, x)
    if ys[0] is None:
        return carry, None
    return carry, tree.map_structure(lambda *y: _stacked_whole(y), *ys)


def _stacked_whole(values):
    """`tf.stack(values)`, the new first dimension whole on every device
    for floating values (`collectives.whole_along`): a consumer splitting
    it — the batch, when a map runs over the examples — made DTensor 2.21
    refuse the stack's concat ("Concat op SPMD with concat dimension in
    sharded dimension is not supported"); it slices its block instead."""
    stacked = tf.stack(values)
    if not stacked.dtype.is_floating:
        return stacked
    return collectives.whole_along(stacked, 0)


def top_k_read_by_gather(top_k, inputs, k, *args, **kwargs):
    """TF's `TopKV2` (`tf.math.top_k`, Keras' `ops.top_k`) whose values are
    read from `inputs` by a gather along the last axis at its indices
    (`batch_dims` = the other axes), so that their gradient is the
    gather's: DTensor 2.21 fails TopKV2's own gradient on a batch-split
    tensor (it scatters into the flattened global shape with per-device
    indices: "indices[..] = [..] does not index into shape [..]",
    tests/dtensor_top_k_gradient_repro.py; keras-hub's D-FINE ranks its
    corner distributions this way). The same values and indices.

    >>> top_k_read_by_gather(tf.math.top_k, tf.constant([[1.0, 3.0, 2.0]]),
    ...                      2).values.numpy()
    array([[3., 2.]], dtype=float32)
    """
    result = top_k(inputs, k, *args, **kwargs)
    inputs = tf.convert_to_tensor(inputs)
    if not inputs.dtype.is_floating or not inputs.shape.rank:
        return result
    values = tf.gather(inputs, tf.stop_gradient(result.indices),
                       batch_dims=inputs.shape.rank - 1)
    return type(result)(values, result.indices)


def cumprod_by_shifts(cumprod, x, axis, exclusive=False, reverse=False,
                      name=None):
    """TF's `Cumprod` (`tf.math.cumprod`, Keras' `ops.cumprod`) along a
    static axis of static size n, by log2(n) shifted products
    (Hillis-Steele): after the round with shift k = 1, 2, 4, ... each
    element is the product of itself and the 2k - 1 elements before it
    (after it when `reverse`), y[i] <- y[i] * y[i - k] with ones shifted
    in, so after ceil(log2 n) rounds y[i] = x[0]·…·x[i]. `exclusive`
    shifts the result by one more, a one first. Anything else:
    `cumprod` itself.

    DTensor 2.21 cannot lay out TF's `Cumprod` ("'tf.Cumprod' op does not
    implement layout propagation": keras-hub's SpeculativeSampler's
    accepted-prefix mask, any `ops.cumprod` in a step); slices, a
    concatenation and products lay out, and their gradient is the
    product rule (TF's own Cumprod gradient divides by x).

    >>> cumprod_by_shifts(tf.math.cumprod, tf.constant([1, 2, 3, 4]), 0).numpy()
    array([ 1,  2,  6, 24], dtype=int32)
    """
    x = tf.convert_to_tensor(x)
    static_axis = tf.get_static_value(axis)
    rank = x.shape.rank
    if static_axis is None or rank is None or np.ndim(static_axis) or (
            x.shape[int(static_axis) % rank] is None):
        return cumprod(x, axis, exclusive=exclusive, reverse=reverse,
                       name=name)
    a = int(static_axis) % rank
    n = x.shape[a]

    def shifted(y, k):
        """y moved k places along `a` (towards the end, or the start when
        `reverse`), ones filling the k places it leaves."""
        head = [slice(None)] * a
        ones = tf.ones_like(y[tuple(head + [slice(0, k)])])
        if reverse:
            return tf.concat([y[tuple(head + [slice(k, None)])], ones], a)
        return tf.concat([ones, y[tuple(head + [slice(None, n - k)])]], a)

    k = 1
    while k < n:
        x = x * shifted(x, k)
        k *= 2
    return shifted(x, 1) if exclusive and n else x


def bias_add_by_broadcast(bias_add, value, bias, data_format=None,
                          name=None):
    """TF's `BiasAdd` (`tf.nn.bias_add`; Keras' `ops.add` of a bias to
    channels-first features) as a broadcast add: channels first ("NC..."),
    y[n, c, ...] = value[n, c, ...] + bias[c], with `bias` reshaped to
    (1, C, 1, ..., 1). Any other data format, or rank 4: `bias_add`
    itself.

    DTensor 2.21 lays the bias of a channels-first `BiasAdd` on a rank-3
    value out like the value's batch dimension, so on a data mesh the
    bias (C,) is split C ways by the data axis and a channels-first
    `Conv1D` with a bias fails to compile
    (`tests/dtensor_bias_add_repro.py`); rank 4 (NCHW) is laid out right.
    A broadcast add lays out on every rank, and its bias gradient is the
    sum over every other dimension, as BiasAddGrad's.

    >>> bias_add_by_broadcast(tf.nn.bias_add, tf.zeros((1, 2, 3)),
    ...                       tf.constant([1., 2.]), "NCHW").numpy()
    array([[[1., 1., 1.],
            [2., 2., 2.]]], dtype=float32)
    """
    value = tf.convert_to_tensor(value)
    rank = value.shape.rank
    if not (data_format or "").startswith("NC") or rank in (None, 4):
        return bias_add(value, bias, data_format=data_format, name=name)
    bias = tf.reshape(bias, [1, -1] + [1] * (rank - 2))
    return tf.add(value, tf.cast(bias, value.dtype), name=name)


MAX_ELIMINATION_SIZE = 16


def solve_by_elimination(matrix, rhs):
    """TF's `MatrixSolve` (`tf.linalg.solve`, Keras' `ops.solve`) of a
    batch of small systems A x = b, (..., n, n) and (..., n, m) with a
    static n ≤ MAX_ELIMINATION_SIZE, by Gauss-Jordan elimination with
    partial pivoting written as elementwise ops and reductions, one
    unrolled round per column: at column k the row p ≥ k with the
    largest |a_pk| is swapped into row k, row k is divided by its pivot,
    and every other row i loses a_ik times row k; after n rounds [A | b]
    is [I | x]. `None` for larger or unknown n (the caller runs TF's
    op).

    DTensor 2.21 cannot lay out TF's `MatrixSolve` ("'tf.MatrixSolve' op
    does not implement layout propagation": RandomPerspective solves an
    8 × 8 system per image for its homography). TF's kernel factors A by
    LU with the same partial pivoting; the two agree to rounding, and the
    gradient is autodiff's of the same rounds.

    >>> a = tf.constant([[[0.0, 2.0], [1.0, 1.0]]])
    >>> solve_by_elimination(a, tf.constant([[[4.0], [3.0]]]))[0, :, 0].numpy()
    array([1., 2.], dtype=float32)
    """
    matrix, rhs = tf.convert_to_tensor(matrix), tf.convert_to_tensor(rhs)
    n = matrix.shape[-1]
    if n is None or n > MAX_ELIMINATION_SIZE or matrix.shape[-2] != n:
        return None
    system = tf.concat([matrix, tf.cast(rhs, matrix.dtype)], axis=-1)
    rows = np.arange(n)
    for k in range(n):
        unit = tf.constant(rows == k, matrix.dtype)  # e_k over the rows
        candidates = tf.where(rows >= k, tf.abs(system[..., :, k]),
                              -tf.ones_like(tf.abs(system[..., :, k])))
        chosen = tf.one_hot(tf.argmax(candidates, axis=-1), n,
                            dtype=matrix.dtype)  # e_p
        pivot_row = tf.reduce_sum(system * chosen[..., :, None], axis=-2)
        # swap rows k and p: row k += (row p - row k), row p -= the same
        system += ((unit - chosen)[..., :, None]
                   * (pivot_row - system[..., k, :])[..., None, :])
        pivot_row /= pivot_row[..., k:k + 1]
        factors = system[..., :, k] * (1 - unit)
        system -= factors[..., :, None] * pivot_row[..., None, :]
        system = (system * (1 - unit)[:, None]
                  + unit[:, None] * pivot_row[..., None, :])
    return system[..., :, n:]


def affine_transform_by_gather(images, transforms, interpolation="bilinear",
                               fill_mode="constant", fill_value=0.0):
    """TF's `ImageProjectiveTransformV3` (Keras' `image.affine_transform`:
    RandomRotation, RandomZoom, RandomTranslation, RandomShear) of (batch,
    height, width, channels) images with static height and width, by
    gathers: the same math as TF's kernel (tensorflow/core/kernels/image/
    image_ops.h), value for value.

    For output pixel (x, y) and a transform [a0 a1 a2 b0 b1 b2 c0 c1] (one
    per image, or one for all): k = c0·x + c1·y + 1, the input point is
    ((a0·x + a1·y + a2)/k, (b0·x + b1·y + b2)/k), mapped into the image by
    `fill_mode` (`_mapped_coordinate`), then read nearest (rounded half
    away from zero) or bilinear (the four neighbours weighted by distance);
    a read outside the image, or k = 0, gives `fill_value`. DTensor 2.21
    cannot lay out TF's op ("'tf.ImageProjectiveTransformV3' op does not
    implement layout propagation"); it lays out a gather per image
    (`batch_dims=1`).

    >>> image = tf.reshape(tf.range(4.0), (1, 2, 2, 1))
    >>> shift_right = [[1.0, 0, -1, 0, 1, 0, 0, 0]]  # reads x - 1
    >>> affine_transform_by_gather(image, shift_right)[0, :, :, 0].numpy()
    array([[0., 0.],
           [0., 2.]], dtype=float32)
    """
    images = tf.convert_to_tensor(images)
    _, height, width, channels = images.shape
    t = tf.unstack(tf.cast(transforms, tf.float32)[:, :, None, None], axis=1)
    ys, xs = tf.meshgrid(tf.range(height, dtype=tf.float32),
                         tf.range(width, dtype=tf.float32), indexing="ij")
    projection = t[6] * xs + t[7] * ys + 1.0  # (batch or 1, height, width)
    safe = tf.where(projection == 0, tf.ones_like(projection), projection)
    x = _mapped_coordinate((t[0] * xs + t[1] * ys + t[2]) / safe, width,
                           fill_mode)
    y = _mapped_coordinate((t[3] * xs + t[4] * ys + t[5]) / safe, height,
                           fill_mode)
    flat = tf.reshape(images, (-1, height * width, channels))
    fill = tf.cast(fill_value, images.dtype)
    shape = tf.shape(images)

    def read(row, col):
        """images[b, row, col] at whole-number float coordinates, the fill
        value outside the image."""
        inside = (row >= 0) & (row < height) & (col >= 0) & (col < width)
        index = tf.cast(tf.clip_by_value(row, 0, height - 1) * width
                        + tf.clip_by_value(col, 0, width - 1), tf.int32)
        index = tf.reshape(tf.broadcast_to(index, shape[:3]),
                           (-1, height * width))
        got = tf.reshape(tf.gather(flat, index, batch_dims=1), shape)
        return tf.where(tf.broadcast_to(inside[..., None], shape), got, fill)

    if interpolation == "nearest":
        out = read(_rounded_half_away(y), _rounded_half_away(x))
    else:
        y0, x0 = tf.floor(y), tf.floor(x)
        left, right = (x0 + 1 - x)[..., None], (x - x0)[..., None]
        top = left * read(y0, x0) + right * read(y0, x0 + 1)
        bottom = left * read(y0 + 1, x0) + right * read(y0 + 1, x0 + 1)
        out = (y0 + 1 - y)[..., None] * top + (y - y0)[..., None] * bottom
    at_infinity = tf.broadcast_to((projection == 0)[..., None], shape)
    return tf.where(at_infinity, fill, tf.cast(out, images.dtype))


def rgb_to_hsv_by_ops(images):
    """TF's `RGBToHSV` (`tf.image.rgb_to_hsv`: Keras' RandomHue and
    RandomSaturation) of (..., 3) float images, in elementwise ops, as
    TF's kernel computes it (tensorflow/core/kernels/image/colorspace_op.h):
    V = max(r, g, b), range = V - min(r, g, b), S = range / V (0 where
    V = 0), H = ((g - b), (b - r) + 2 or (r - g) + 4, by which channel is
    the maximum) / (6 · range), 0 where range = 0, plus 1 where negative.
    DTensor 2.21 cannot lay out TF's op.

    >>> rgb_to_hsv_by_ops(tf.constant([[0.5, 0.25, 0.0]])).numpy()
    array([[0.08333334, 1.        , 0.5       ]], dtype=float32)
    """
    r, g, b = tf.unstack(tf.convert_to_tensor(images), axis=-1)
    value = tf.maximum(tf.maximum(r, g), b)
    spread = value - tf.minimum(tf.minimum(r, g), b)
    saturation = tf.where(value > 0, spread / tf.where(
        value > 0, value, tf.ones_like(value)), tf.zeros_like(value))
    norm = 1.0 / (6.0 * tf.where(spread > 0, spread, tf.ones_like(spread)))
    hue = tf.where(r == value, norm * (g - b), tf.where(
        g == value, norm * (b - r) + 2.0 / 6.0, norm * (r - g) + 4.0 / 6.0))
    hue = tf.where(spread > 0, hue, tf.zeros_like(hue))
    hue = tf.where(hue < 0, hue + 1.0, hue)
    return tf.stack([hue, saturation, value], axis=-1)


def hsv_to_rgb_by_ops(images):
    """TF's `HSVToRGB` (`tf.image.hsv_to_rgb`) of (..., 3) float images in
    elementwise ops, as TF's kernel computes it: with h6 = 6·H, each
    channel is V · (1 - S + S · c), c = clip(|h6 - 3| - 1) for red,
    clip(2 - |h6 - 2|) for green, clip(2 - |h6 - 4|) for blue, clipped to
    [0, 1]. DTensor 2.21 cannot lay out TF's op.

    >>> hsv_to_rgb_by_ops(tf.constant([[1 / 12, 1.0, 0.5]])).numpy()
    array([[0.5 , 0.25, 0.  ]], dtype=float32)
    """
    hue, saturation, value = tf.unstack(tf.convert_to_tensor(images),
                                        axis=-1)
    sixths = hue * 6.0

    def clipped(x):
        return tf.minimum(tf.maximum(x, 0.0), 1.0)

    channels = (clipped(tf.abs(sixths - 3.0) - 1.0),
                clipped(2.0 - tf.abs(sixths - 2.0)),
                clipped(2.0 - tf.abs(sixths - 4.0)))
    return tf.stack([(1.0 - saturation + saturation * c) * value
                     for c in channels], axis=-1)


def resize_by_matmul(resize, images, size, method, antialias=False):
    """`resize(images, size, method=method, antialias=antialias)` (TF's
    `tf.image.resize`, passed as `resize`) of (batch, height, width,
    channels) images of static spatial size, as two matrix products:
    every method TF offers is linear in the image and separable, out =
    R_h · image · R_wᵀ, where R (new length × old length) is `resize` of the
    identity along one dimension (`_resize_matrix`, computed once per
    length, method and antialias by TF's own op on the host). DTensor 2.21
    cannot lay out TF's ResizeBicubic nor ScaleAndTranslate (lanczos,
    area, antialiased resizing), in a step or its gradient; it lays out
    einsums. float32 like TF's result.

    >>> x = tf.reshape(tf.range(4.0), (1, 2, 2, 1))
    >>> got = resize_by_matmul(tf.image.resize, x, (3, 3), "bicubic")
    >>> want = tf.image.resize(x, (3, 3), "bicubic")
    >>> bool(np.allclose(got, want, atol=1e-6))
    True
    """
    images = tf.cast(images, tf.float32)
    _, height, width, _ = images.shape
    rows = _resize_matrix(resize, height, int(size[0]), method, antialias)
    columns = _resize_matrix(resize, width, int(size[1]), method, antialias)
    out = tf.einsum("oh,bhwc->bowc", tf.constant(rows), images)
    return tf.einsum("pw,bowc->bopc", tf.constant(columns), out)


@functools.lru_cache(maxsize=None)
def _resize_matrix(resize, old, new, method, antialias):
    """R (new × old, float32): column i is `resize` of the i-th unit vector
    of length `old` to length `new` (run eagerly on the host: `old` images
    of old × 1 pixels resized to new × 1; a 1-pixel width stays itself)."""
    with tf.init_scope():
        unit = np.eye(old, dtype=np.float32).reshape(old, old, 1, 1)
        out = resize(tf.constant(unit), (new, 1), method=method,
                     antialias=antialias)
        return np.asarray(out, np.float32).reshape(old, new).T


def _truncated(x):
    """C++'s float-to-integer cast, toward zero (as floats)."""
    return tf.where(x < 0, tf.math.ceil(x), tf.floor(x))


def _rounded_half_away(x):
    """`std::round`: halves away from zero (`tf.round` rounds to even)."""
    return tf.sign(x) * tf.floor(tf.abs(x) + 0.5)


def _mapped_coordinate(coord, length, fill_mode):
    """TF's `MapCoordinate` for `fill_mode`: "constant" keeps the
    coordinate (a read outside gives the fill value); "nearest" clamps it
    to [0, n - 1]; "reflect" folds it back (dcba|abcd|dcba), "wrap" wraps
    it (abcd|abcd|abcd), both then clamped, as the kernel computes them."""
    n = float(length)
    if fill_mode == "constant":
        return coord
    if fill_mode in ("reflect", "wrap") and length <= 1:
        return tf.zeros_like(coord)
    if fill_mode == "reflect":
        period = 2.0 * n
        below = period * _truncated(-coord / period) + coord
        below = tf.where(below < -n, below + period, -below - 1)
        above = coord - period * _truncated(coord / period)
        above = tf.where(above >= n, period - above - 1, above)
        coord = tf.where(coord < 0, below,
                         tf.where(coord > n - 1, above, coord))
    elif fill_mode == "wrap":
        below = coord + n * (_truncated(-coord / (n - 1)) + 1)
        above = coord - n * _truncated(coord / (n - 1))
        coord = tf.where(coord < 0, below,
                         tf.where(coord > n - 1, above, coord))
    return tf.clip_by_value(coord, 0.0, n - 1)


def _per_dimension(value, spatial):
    """An int or a sequence of ints as a tuple of `spatial` ints."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (
        value,) * spatial
    return values if len(values) == spatial else values * spatial


def _same_padding(length, size, stride, dilation):
    """[before, after] of TF's "same" padding of one spatial dimension of
    static `length` (stride 1: `length` may be None)."""
    extent = (size - 1) * dilation + 1
    if stride == 1:
        total = extent - 1
    else:
        total = max((-(-length // stride) - 1) * stride + extent - length, 0)
    return [total // 2, total - total // 2]
