"""Convolutions, pooling and image ops DTensor 2.21 can lay out, standing
in for Keras/TF ones in a step (`tfpar.spmd_image_patches` installs them;
`tfpar.spmd_ops` holds the rest).

Depthwise, separable (`nn.depthwise_conv`, `nn.separable_conv`) and
dilated convolutions are sums of shifted slices times the kernel's
matrices; average pooling is their window sum divided by the inputs each
window holds; `image.affine_transform` and `perspective_transform` are
gathers at the mapped coordinates; `rgb_to_hsv`/`hsv_to_rgb` are
elementwise ops; TF's `image.resize` (bicubic, lanczos, area, antialiased)
is two matrix products; `linalg.solve` of a small system is Gauss-Jordan
elimination; a channels-first `BiasAdd` of rank other than 4 is a
broadcast add. Each gives the same values as the op it replaces.

Example:

>>> import numpy as np
>>> from tfpar.spmd_image_ops import conv_by_shifts
>>> x = np.arange(6, dtype="float32").reshape(1, 6, 1)
>>> conv_by_shifts(x, np.ones((2, 1, 1), "float32"), dilation_rate=2
...                ).numpy()[0, :, 0]
array([2., 4., 6., 8.], dtype=float32)
"""

import functools
import itertools

import numpy as np
import tensorflow as tf


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
