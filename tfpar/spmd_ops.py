"""Ops DTensor 2.21 can lay out, standing in for Keras/TF ones in a step.

Inside a tfpar step (`tfpar.spmd_patches`, installed when the first
`ParallelStrategy` is made) Keras' `slice_update`, `random.categorical`,
`ops.divide(sparse, dense)`, `ops.einsum` of two activations,
`ops.transpose`, `numpy.flip`, `numpy.eye`, `core.map`/`scan`, TF's
`ConcatV2`, `Pack`, `Roll`, `Cumprod`, `TopKV2`, `MirrorPad`, the int8
`BatchMatMulV3` of Keras' quantized layers,
RandomCrop's drawn window and TF's `tensor[key]` use these instead of ops
DTensor cannot lay out or lays out wrongly (convolutions, pooling and
image ops: `tfpar.spmd_image_ops`). Each gives the same values as the op
it replaces (the sampler: the same distribution; the int8 matmul: float32's
rounding once a partial sum passes 2**24).

Example:

>>> import numpy as np
>>> from tfpar.spmd_ops import dense_slice_update
>>> dense_slice_update(np.zeros((2, 4), "float32"), [0, 1],
...                    np.ones((2, 2), "float32")).numpy()
array([[0., 1., 1., 0.],
       [0., 1., 1., 0.]], dtype=float32)
"""

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


def subscripts_without_ellipsis(subscripts, operands):
    """`subscripts` of an einsum with "..." written out as letters of their
    own, from the operands' static shapes ("...n,d->...nd" of a rank-3
    and a rank-1 operand: "ABn,d->ABnd"), or None if a rank is unknown,
    there is no "->" or no "..." after it, or the dimensions "..." covers
    would broadcast (a 1 against another size). Each operand's "..."
    covers its last dimensions of the longest "...", aligned at the right
    as numpy aligns them.

    DTensor 2.21 refuses an Einsum with "..." ("Broadcasting is
    unimplemented for einsum": keras-hub's Flux, its rotary table
    "...n,d->...nd"); written out, the same contraction lays out.

    >>> subscripts_without_ellipsis("...n,d->...nd",
    ...                             [tf.zeros((2, 5, 3)), tf.zeros(4)])
    'ABn,d->ABnd'
    """
    inputs, arrow, output = subscripts.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if not arrow or len(terms) != len(operands):
        return None
    shapes = [tf.TensorShape(getattr(operand, "shape", np.shape(operand)))
              for operand in operands]  # read only: no op made
    if any(shape.rank is None or shape.rank < len(term.replace("...", ""))
           for term, shape in zip(terms, shapes)):
        return None
    covered = [shape[:shape.rank - len(term.replace("...", ""))]
               if "..." in term else None for term, shape in zip(terms, shapes)]
    longest = max((len(dims) for dims in covered if dims is not None),
                  default=0)
    if longest and "..." not in output:
        return None  # TF refuses it; so does one device
    sizes = {}
    for dims in covered:
        for place, size in enumerate(dims or (), longest - len(dims or ())):
            if sizes.setdefault(place, size) != size:
                return None  # a broadcast: written out it would not be one
    free = [letter for letter in string.ascii_uppercase + string.ascii_lowercase
            if letter not in subscripts][:longest]
    if len(free) < longest:
        return None

    def written_out(term, dims):
        return term.replace("...", "".join(free[longest - len(dims):]))

    return "->".join([",".join(
        written_out(term, dims) if dims is not None else term
        for term, dims in zip(terms, covered)),
        written_out(output, free)])


def transpose_by_einsum(transpose, x, axes=None):
    """Keras' `ops.transpose(x, axes)` of a floating tensor as one
    one-operand TF Einsum op ("abc->cab" for axes (2, 0, 1); reversed axes
    when `axes` is None). Anything else (sparse, integer, unknown rank,
    axes given as a tensor or no permutation): `transpose` itself.

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
            x.dtype.is_floating) or (axes is not None and not all(
                isinstance(axis, (int, np.integer)) for axis in axes)):
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


def diag_part_by_selection(diag_part, input, k, padding_value,  # noqa: A002
                           align="RIGHT_LEFT", name=None):
    """TF's `MatrixDiagPartV3` (`tf.linalg.diag_part`; Keras' `ops.diag`
    of a matrix and `ops.diagonal` of the last two axes) of the main
    diagonal (k = 0) of a tensor whose last two dimensions M, N are
    static: with L = min(M, N), d[..., i] = Σ_j where(i = j, x[..., i, j],
    0) over the leading L × L block, which is x[..., i, i] (one term per
    sum; a selection, not a product, so an infinite or NaN entry off the
    diagonal stays out). Anything else (another diagonal, a band, unknown
    sizes): `diag_part` itself.

    DTensor 2.21 cannot lay out MatrixDiagPartV3 ("'tf.MatrixDiagPartV3'
    op does not implement layout propagation"): Keras' IoU metrics
    (MeanIoU, IoU, BinaryIoU, OneHotIoU, OneHotMeanIoU) read their
    confusion matrix's diagonal in every step. A selection and a sum lay
    out.

    >>> diag_part_by_selection(tf.linalg.diag_part, tf.reshape(
    ...     tf.range(6.0), (2, 3)), 0, 0.0).numpy()
    array([0., 4.], dtype=float32)
    """
    static_k = tf.get_static_value(k)
    x = tf.convert_to_tensor(input)
    rank = x.shape.rank
    if (static_k is None or np.ndim(static_k) or int(static_k) != 0
            or rank is None or rank < 2 or None in x.shape[-2:]):
        return diag_part(input, k, padding_value, align=align, name=name)
    size = min(int(x.shape[-2]), int(x.shape[-1]))
    block = x[..., :size, :size]
    on_diagonal = tf.constant(np.eye(size, dtype=bool))
    return tf.reduce_sum(tf.where(on_diagonal, block, tf.zeros_like(block)),
                         axis=-1)


def scatter_by_segment_sum(scatter, indices, values, shape):
    """Keras' `ops.scatter(indices, values, shape)` (TF's `ScatterNd`: a
    zero tensor of `shape` with `values` added at `indices`, duplicates
    summed) of a static `shape`, as one unsorted segment sum: the first D
    dimensions (D = indices.shape[-1]) flattened row-major, each index
    turned into its position there, Σ_d indices[..., d] · Π shape[d+1:D],
    and the values summed per position. Anything else (an unknown shape or
    index depth): `scatter` itself.

    Inside a DTensor step ScatterNd fails at run time with a TF-internal
    "input shape[0] expected type int64 != int32" when its indices are
    int64 and its shape a Python tuple (Keras' confusion matrix, which the
    IoU metrics update in every step, does both); a segment sum lays out.

    >>> scatter_by_segment_sum(None, tf.constant([[0, 1], [1, 0], [0, 1]]),
    ...                        tf.constant([1.0, 2.0, 3.0]), (2, 2)).numpy()
    array([[0., 4.],
           [2., 0.]], dtype=float32)
    """
    static_shape = tf.get_static_value(tf.convert_to_tensor(shape))
    indices = tf.convert_to_tensor(indices)
    depth = indices.shape[-1] if indices.shape.rank else None
    if static_shape is None or depth is None or not 0 < depth <= len(
            static_shape):
        return scatter(indices, values, shape)
    static_shape = [int(d) for d in static_shape]
    strides = [int(np.prod(static_shape[d + 1:depth])) for d in range(depth)]
    position = tf.reduce_sum(
        indices * tf.constant(strides, dtype=indices.dtype), axis=-1)
    values = tf.convert_to_tensor(values)
    rows = int(np.prod(static_shape[:depth]))
    flat = tf.math.unsorted_segment_sum(
        tf.reshape(values, [-1] + static_shape[depth:]),
        tf.reshape(position, [-1]), num_segments=rows)
    return tf.reshape(flat, static_shape)


def digitize_by_comparison(digitize, x, bins):
    """Keras' `ops.digitize(x, bins)` (TF's `Bucketize`: the index i with
    bins[i-1] <= x < bins[i]) of a dense tensor, as the number of bins at
    or below each value: Σ_j [bins[j] <= x], the same int32 index (bins are
    sorted). Ragged and sparse tensors: `digitize` itself.

    DTensor 2.21 cannot lay out `Bucketize` ("'tf.Bucketize' op does not
    implement layout propagation": Keras' Discretization layer inside a
    model); a comparison and a sum lay out.

    >>> digitize_by_comparison(None, tf.constant([-2.0, 0.0, 0.5, 3.0]),
    ...                        [-1.0, 0.0, 1.0]).numpy()
    array([0, 2, 2, 3], dtype=int32)
    """
    if isinstance(x, (tf.RaggedTensor, tf.SparseTensor)):
        return digitize(x, bins)
    x = tf.convert_to_tensor(x)
    dtype = x.dtype if x.dtype.is_floating else tf.float64
    edges = tf.constant([float(b) for b in bins], dtype=dtype)
    return tf.reduce_sum(tf.cast(tf.cast(x, dtype)[..., None] >= edges,
                                 tf.int32), axis=-1)


def integer_matmul_in_float(batch_mat_mul_v3, x, y, Tout, adj_x=False,  # noqa: N803
                            adj_y=False, grad_x=False, grad_y=False,
                            name=None):
    """TF's `BatchMatMulV3` of two integer tensors into an integer result
    (Keras' `ops.matmul` of int8 operands, int32 out: a Dense quantized by
    `model.quantize("int8")` or `"int4"`) as a float32 matmul of the same
    integers, cast back to `Tout`. Other dtypes: `batch_mat_mul_v3` itself.

    Exact while no partial sum exceeds 2**24 in magnitude — for int8
    operands (|x|, |y| <= 128, so each product <= 2**14) whenever the
    contracted length is at most 1024; beyond that each addition rounds to
    float32's 24 bits (relative 6e-8), below the rounding of the float cast
    Keras applies to the int32 result next. DTensor 2.21 cannot lay out
    `BatchMatMulV3` ("does not implement layout propagation"); a float
    `BatchMatMulV2` lays out on every device type, a split contraction
    included.

    >>> x = tf.constant([[127, -128]], tf.int8)
    >>> y = tf.constant([[-128], [-128]], tf.int8)
    >>> integer_matmul_in_float(None, x, y, tf.int32).numpy()
    array([[128]], dtype=int32)
    """
    x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
    if not (x.dtype.is_integer and y.dtype.is_integer
            and tf.as_dtype(Tout).is_integer):
        return batch_mat_mul_v3(x, y, Tout, adj_x=adj_x, adj_y=adj_y,
                                grad_x=grad_x, grad_y=grad_y, name=name)
    product = tf.linalg.matmul(tf.cast(x, tf.float32), tf.cast(y, tf.float32),
                               adjoint_a=adj_x, adjoint_b=adj_y)
    return tf.cast(product, Tout)



def expand_then_squeeze_by_reshape(x, expand_axes, squeeze_axes):
    """`ops.squeeze(ops.expand_dims(x, expand_axes), squeeze_axes)` of a
    tensor of static shape as one `Reshape` (either tuple may be empty):
    both only add or drop dimensions of size 1.

    DTensor 2.21's `Squeeze` fails to compile when its input is replicated
    and its consumer wants the result split ("SPMD expansion resulted in op
    output inconsistent with the provided layout": the int8 kernel scale of
    an EinsumDense whose kernel is split, brought to the kernel's shape in
    the backward pass); a `Reshape` lays out.

    >>> expand_then_squeeze_by_reshape(tf.ones((1, 1, 4, 16)), (), (1,)).shape
    TensorShape([1, 4, 16])
    >>> expand_then_squeeze_by_reshape(tf.ones((4, 16)), (0, 2), (0,)).shape
    TensorShape([4, 1, 16])
    """
    shape = list(x.shape)
    rank = len(shape) + len(expand_axes)
    for axis in sorted(a % rank for a in expand_axes):
        shape.insert(axis, 1)
    dropped = {a % len(shape) for a in squeeze_axes}
    if any(shape[a] != 1 for a in dropped):
        raise ValueError(f"Cannot squeeze axes {tuple(squeeze_axes)} of "
                         f"shape {tuple(shape)}: not all of size 1.")
    return tf.reshape(x, [d for a, d in enumerate(shape) if a not in dropped])
