"""Convolutions, pooling and image ops replaced inside a tfpar step
(installed with the strategy's patches, `tfpar.patches.install`, beside
`tfpar.spmd_patches`).

Inside a step (`tfpar.step_context.in_spmd_step`) each of these runs
instead of Keras' or TF's op: the ones DTensor 2.21 cannot lay out, or
lays out wrongly, become the `tfpar.spmd_image_ops` that give the same
values — depthwise, separable, grouped and dilated convolutions, average pooling,
a channels-first bias, image transforms, colour conversions, resizing,
and the small linear solves of the perspective transform. Channels-first
inputs run channels last between two transposes
(`_channels_last_applied`). Outside a step the original op runs, after
one check. The factories' `hooks` are the strategy's (`tfpar.patches`):
`owns` and `in_graph_step`.
"""

import functools

import tensorflow as tf

from tfpar import _compat
from tfpar import spmd_image_ops
from tfpar.step_context import in_spmd_step


# The modules whose attributes these patches replace (read when installed).
_keras_nn = functools.partial(_compat.keras_module, "backend.tensorflow.nn")
_keras_image = functools.partial(_compat.keras_module,
                                 "backend.tensorflow.image")
_gen_nn_ops = functools.partial(_compat.tf_python_module, "ops.gen_nn_ops")


def _depthwise_conv_by_shifts_in_step(original, hooks):
    """Keras' TF `nn.depthwise_conv` of a 1-D or 2-D input (channels
    first between two transposes, or last; a static kernel, "valid" or "same" padding, any stride and dilation;
    "same" with a stride needs static spatial sizes) as
    `spmd_image_ops.depthwise_conv_by_shifts` in a step whose gradients are
    taken (a tape records): DTensor 2.21 cannot lay out the filter
    gradient of TF's op (`DepthwiseConv2dNativeBackpropFilter`: Qwen3.5's
    causal convolution in its gated delta net and SegFormer's Mix-FFN
    failed to compile). Inference steps (predict, generate), other
    convolutions and everything outside a step run Keras' op, whose
    forward pass lays out."""
    @functools.wraps(original)
    def depthwise_conv(inputs, kernel, strides=1, padding="valid",
                       data_format=None, dilation_rate=1):
        if in_spmd_step() and _compat.tape_recording():
            inputs = tf.convert_to_tensor(inputs)
            kernel = tf.convert_to_tensor(kernel)
            if _by_shifts(inputs, kernel, strides, padding, data_format):
                return _channels_last_applied(
                    lambda x: spmd_image_ops.depthwise_conv_by_shifts(
                        x, kernel, strides, padding, dilation_rate),
                    inputs, 1 if _channels_first(data_format) else None)
        return original(inputs, kernel, strides=strides, padding=padding,
                        data_format=data_format, dilation_rate=dilation_rate)

    return depthwise_conv


def _separable_conv_by_shifts_in_step(original, hooks):
    """Keras' TF `nn.separable_conv` (SeparableConv1D/2D: a depthwise
    convolution, then a 1×1 "pointwise" one) in a step whose gradients are
    taken, as Keras' `depthwise_conv` — `spmd_image_ops.depthwise_conv_by_shifts`
    there (`_depthwise_conv_by_shifts_in_step`) — then Keras' `conv` with
    the pointwise kernel: TF's `separable_conv2d` runs the same
    `DepthwiseConv2dNative`, whose filter gradient DTensor 2.21 cannot lay
    out. Channels first, both run channels last between two transposes (a
    channels-first pointwise convolution after the stand-in was 2% off one
    device in float32 and failed in float64). Elsewhere Keras' op runs."""
    @functools.wraps(original)
    def separable_conv(inputs, depthwise_kernel, pointwise_kernel, strides=1,
                       padding="valid", data_format=None, dilation_rate=1):
        if in_spmd_step() and _compat.tape_recording():
            inputs = tf.convert_to_tensor(inputs)
            depthwise_kernel = tf.convert_to_tensor(depthwise_kernel)
            if _by_shifts(inputs, depthwise_kernel, strides, padding,
                          data_format):
                nn = _keras_nn()

                def separable(x):
                    depthwise = nn.depthwise_conv(
                        x, depthwise_kernel, strides=strides,
                        padding=padding, data_format="channels_last",
                        dilation_rate=dilation_rate)
                    return nn.conv(depthwise, pointwise_kernel, strides=1,
                                   padding="valid",
                                   data_format="channels_last")

                return _channels_last_applied(
                    separable, inputs,
                    1 if _channels_first(data_format) else None)
        return original(inputs, depthwise_kernel, pointwise_kernel,
                        strides=strides, padding=padding,
                        data_format=data_format, dilation_rate=dilation_rate)

    return separable_conv


def _average_pool_by_shifts_in_step(original, hooks):
    """Keras' TF `nn.average_pool` of a 1-D, 2-D or 3-D input ("valid", or
    "same" with static spatial sizes) as `spmd_image_ops.average_pool_by_shifts`
    in a step whose gradients are taken: DTensor 2.21 cannot lay out TF's
    `AvgPoolGrad` (DenseNet failed to compile) nor `AvgPool3DGrad`.
    Inference steps and everything else run Keras' op, whose forward pass
    lays out."""
    @functools.wraps(original)
    def average_pool(inputs, pool_size, strides=None, padding="valid",
                     data_format=None):
        if not (in_spmd_step() and _compat.tape_recording()):
            return original(inputs, pool_size, strides, padding,
                            data_format)
        inputs = tf.convert_to_tensor(inputs)
        rank = inputs.shape.rank
        if rank not in (3, 4, 5) or padding not in ("valid", "same"):
            return original(inputs, pool_size, strides, padding,
                            data_format)
        channels_first = _channels_first(data_format)
        spatial = inputs.shape[2:] if channels_first else inputs.shape[1:-1]
        if padding == "same" and None in spatial:
            return original(inputs, pool_size, strides, padding,
                            data_format)
        return _channels_last_applied(
            lambda x: spmd_image_ops.average_pool_by_shifts(x, pool_size, strides,
                                                      padding),
            inputs, 1 if channels_first else None)

    return average_pool


def _channels_first(data_format):
    return _compat.keras_module("backend").standardize_data_format(
        data_format) == "channels_first"


def _axis_moved(tensor, source, destination):
    """`tensor` with its axis `source` moved to `destination` (numpy's
    `moveaxis`): channels first to last and back."""
    order = list(range(tensor.shape.rank))
    order.insert(destination % len(order), order.pop(source % len(order)))
    return tf.transpose(tensor, order)


def _channels_last_applied(compute, inputs, channels_axis=None):
    """`compute` (which takes and returns channels-last tensors) applied
    to `inputs`, whose channels are at `channels_axis` (None: already
    last): moved last for it, and its result's channels moved back."""
    if channels_axis is None:
        return compute(inputs)
    return _axis_moved(compute(_axis_moved(inputs, channels_axis, -1)), -1,
                       channels_axis)


def _grouped_or_dilated_conv_in_step(original, hooks):
    """Keras' TF `nn.conv` with groups (Conv layers' `groups`: the kernel
    reads channels/groups inputs) in a step: Keras runs a grouped
    convolution as its own XLA-compiled function nested in the step, whose
    filter gradient failed in float64 ("filter_size does not have enough
    elements", or "Function was cancelled": keras.applications' ConvNeXt,
    whose depthwise 7×7 is a Conv2D with groups = channels). There, one
    group per channel is Keras' `depthwise_conv` with the kernel
    (*k, 1, channels·m) read as (*k, channels, m) — output c·m + q reads
    input c either way — and other groupings are one plain convolution
    per group, concatenated along the channels. A dilated convolution
    (ungrouped) is `spmd_image_ops.conv_by_shifts`: TF runs it on CPU through
    SpaceToBatchND, which DTensor 2.21 cannot lay out (keras-hub's
    DeepLabV3). A dilated or grouped channels-first convolution runs
    channels last between two transposes, and so does a channels-first
    3-D one, which Keras also runs as a nested XLA function (a Conv3D's
    second step on data=8 was 1% off one device's in float32, and
    "Function was cancelled" in float64). Other convolutions run Keras'
    op."""
    @functools.wraps(original)
    def conv(inputs, kernel, strides=1, padding="valid", data_format=None,
             dilation_rate=1):
        if not in_spmd_step():
            return original(inputs, kernel, strides, padding, data_format,
                            dilation_rate)
        inputs = tf.convert_to_tensor(inputs)
        kernel = tf.convert_to_tensor(kernel)
        axis = 1 if _channels_first(data_format) else -1
        channels, per_group = inputs.shape[axis], kernel.shape[-2]
        dilated = _dilated(dilation_rate)
        if axis == 1 and (dilated or channels != per_group
                          or inputs.shape.rank == 5):
            return _channels_last_applied(
                lambda x: conv(x, kernel, strides, padding, "channels_last",
                               dilation_rate), inputs, 1)
        if channels == per_group and dilated and \
                kernel.shape.is_fully_defined() and padding in (
                    "valid", "same"):
            return spmd_image_ops.conv_by_shifts(inputs, kernel, strides,
                                           padding, dilation_rate)
        if channels is None or channels == per_group:
            return original(inputs, kernel, strides, padding, data_format,
                            dilation_rate)
        if per_group == 1 and inputs.shape.rank in (3, 4):
            depthwise = tf.reshape(kernel, kernel.shape[:-2] + (
                channels, kernel.shape[-1] // channels))
            return _keras_nn().depthwise_conv(
                inputs, depthwise, strides, padding, data_format,
                dilation_rate)
        groups = channels // per_group
        pieces = zip(tf.split(inputs, groups, axis),
                     tf.split(kernel, groups, -1))
        return tf.concat([original(x, k, strides, padding, data_format,
                                   dilation_rate) for x, k in pieces], axis)

    return conv


def _dilated(dilation_rate):
    """Whether a convolution's `dilation_rate` (an int or one per spatial
    dimension) dilates some dimension."""
    rates = dilation_rate if isinstance(dilation_rate, (tuple, list)) else (
        dilation_rate,)
    return any(rate > 1 for rate in rates)


def _affine_transform_by_gather_in_step(original, hooks):
    """Keras' TF `image.affine_transform` (RandomRotation, RandomZoom,
    RandomTranslation, RandomShear) as `spmd_image_ops.affine_transform_by_gather`
    in a step, for a batch of images of static height and width: DTensor
    2.21 cannot lay out TF's `ImageProjectiveTransformV3`. Elsewhere, and
    for arguments Keras refuses (its own error), Keras' op runs."""
    @functools.wraps(original)
    def affine_transform(images, transform, interpolation="bilinear",
                         fill_mode="constant", fill_value=0,
                         data_format=None):
        if not in_spmd_step() or interpolation not in (
                "nearest", "bilinear") or fill_mode not in (
                "constant", "nearest", "wrap", "reflect"):
            return original(images, transform, interpolation, fill_mode,
                            fill_value, data_format)
        images = tf.convert_to_tensor(images)
        transform = tf.convert_to_tensor(transform)
        channels_first = _channels_first(data_format)
        if images.shape.rank != 4 or transform.shape.rank not in (1, 2) \
                or None in _image_size(images, channels_first):
            return original(images, transform, interpolation, fill_mode,
                            fill_value, data_format)
        return _channels_last_applied(
            lambda x: spmd_image_ops.affine_transform_by_gather(
                x, tf.reshape(transform, (-1, 8)), interpolation, fill_mode,
                fill_value),
            images, 1 if channels_first else None)

    return affine_transform


def _image_size(images, channels_first):
    """(height, width) of a batch of images, static or None."""
    return images.shape[2:4] if channels_first else images.shape[1:3]


def _solve_by_elimination_in_step(original, hooks):
    """`tf.linalg.solve` (Keras' `ops.solve`, RandomPerspective's
    homography) of small systems as `spmd_image_ops.solve_by_elimination` in a
    step: DTensor 2.21 cannot lay out TF's `MatrixSolve`. Systems larger
    than `spmd_image_ops.MAX_ELIMINATION_SIZE`, and everything outside a step,
    run TF's op."""
    @functools.wraps(original)
    def solve(matrix, rhs, adjoint=False, name=None):
        if not in_spmd_step():
            return original(matrix, rhs, adjoint=adjoint, name=name)
        matrix = tf.convert_to_tensor(matrix)
        solution = spmd_image_ops.solve_by_elimination(
            tf.linalg.adjoint(matrix) if adjoint else matrix, rhs)
        if solution is None:
            return original(matrix, rhs, adjoint=adjoint, name=name)
        return solution

    return solve


def _perspective_transform_by_gather_in_step(original, hooks):
    """Keras' TF `image.perspective_transform` (RandomPerspective) in a
    step: Keras' own homography (its `tf.linalg.solve` by elimination,
    `_solve_by_elimination_in_step`) applied by
    `spmd_image_ops.affine_transform_by_gather` — TF's
    `ImageProjectiveTransformV3` with a constant fill, which is what Keras
    asks of it, and which DTensor 2.21 cannot lay out. Elsewhere, and for
    arguments Keras refuses (its own error), Keras' op runs."""
    @functools.wraps(original)
    def perspective_transform(images, start_points, end_points,
                              interpolation="bilinear", fill_value=0,
                              data_format=None):
        def keras_op():
            return original(images, start_points, end_points,
                            interpolation, fill_value, data_format)

        if not in_spmd_step() or interpolation not in ("nearest", "bilinear"):
            return keras_op()
        images = tf.convert_to_tensor(images)
        start = tf.convert_to_tensor(start_points, tf.float32)
        end = tf.convert_to_tensor(end_points, tf.float32)
        channels_first = _channels_first(data_format)
        if start.shape.rank == 2:  # one set of points for every image
            start, end = start[None], end[None]
        if images.shape.rank != 4 or start.shape.rank != 3 \
                or start.shape != end.shape \
                or None in _image_size(images, channels_first):
            return keras_op()
        transform = _keras_image().compute_homography_matrix(start, end)
        return _channels_last_applied(
            lambda x: spmd_image_ops.affine_transform_by_gather(
                x, transform, interpolation, "constant", fill_value),
            images, 1 if channels_first else None)

    return perspective_transform


def _colour_conversion_in_step(name):
    """Keras' TF `image.rgb_to_hsv` / `hsv_to_rgb` (RandomHue,
    RandomSaturation) of float images as `spmd_image_ops.rgb_to_hsv_by_ops` /
    `hsv_to_rgb_by_ops` in a step: DTensor 2.21 cannot lay out TF's
    `RGBToHSV` and `HSVToRGB`. Elsewhere, and for inputs Keras refuses
    (its own error), Keras' function runs."""
    convert = getattr(spmd_image_ops, f"{name}_by_ops")

    def make(original, hooks):
        @functools.wraps(original)
        def conversion(images, data_format=None):
            if not in_spmd_step():
                return original(images, data_format)
            images = tf.convert_to_tensor(images)
            if images.shape.rank not in (3, 4) or not images.dtype.is_floating:
                return original(images, data_format)
            channels = images.shape.rank - 3  # (..., c, h, w)
            return _channels_last_applied(
                convert, images,
                channels if _channels_first(data_format) else None)

        return conversion

    return make


def _resize_by_matmul_in_step(original, hooks):
    """TF's `image.resize` (Keras' `image.resize`, Resizing, keras-hub's
    image converters) in a step, for methods other than "bilinear" and
    "nearest" or antialiased, of (batch, height, width, channels) images of
    static size to a static size, as `spmd_image_ops.resize_by_matmul`: DTensor
    2.21 cannot lay out TF's ResizeBicubic or ScaleAndTranslate. Bilinear,
    nearest and everything else run TF's op."""
    @functools.wraps(original)
    def resize(images, size, method="bilinear", preserve_aspect_ratio=False,
               antialias=False, name=None):
        if not in_spmd_step() or preserve_aspect_ratio or (
                method in ("bilinear", "nearest") and not antialias):
            return original(images, size, method, preserve_aspect_ratio,
                            antialias, name)
        images = tf.convert_to_tensor(images)
        static_size = tf.get_static_value(size)
        if images.shape.rank != 4 or None in images.shape[1:3] \
                or static_size is None or method == "nearest":
            return original(images, size, method, preserve_aspect_ratio,
                            antialias, name)
        return spmd_image_ops.resize_by_matmul(original, images, static_size,
                                         method, antialias)

    return resize


def _by_shifts(inputs, kernel, strides, padding, data_format):
    """Whether `spmd_image_ops.depthwise_conv_by_shifts` computes this call."""
    rank = inputs.shape.rank
    strided = any(s > 1 for s in (strides if isinstance(strides, (
        tuple, list)) else (strides,)))
    spatial = inputs.shape[2:] if _channels_first(data_format) else (
        inputs.shape[1:-1])
    return (rank in (3, 4) and kernel.shape.rank == rank
            and kernel.shape.is_fully_defined()
            and padding in ("valid", "same")
            and not (padding == "same" and strided and None in spatial))


PATCHES = (
    _compat.Patch("depthwise_conv", _keras_nn, "depthwise_conv",
                  _depthwise_conv_by_shifts_in_step),
    _compat.Patch("separable_conv", _keras_nn, "separable_conv",
                  _separable_conv_by_shifts_in_step),
    _compat.Patch("affine_transform", _keras_image, "affine_transform",
                  _affine_transform_by_gather_in_step),
    *(_compat.Patch(name, _keras_image, name, _colour_conversion_in_step(name))
      for name in ("rgb_to_hsv", "hsv_to_rgb")),
    _compat.Patch("perspective_transform", _keras_image,
                  "perspective_transform",
                  _perspective_transform_by_gather_in_step),
    _compat.Patch("linalg_solve", lambda: tf.linalg, "solve",
                  _solve_by_elimination_in_step),
    _compat.Patch("image_resize", lambda: tf.image, "resize",
                  _resize_by_matmul_in_step),
    _compat.Patch("average_pool", _keras_nn, "average_pool",
                  _average_pool_by_shifts_in_step),
    _compat.Patch("conv", _keras_nn, "conv",
                  _grouped_or_dilated_conv_in_step),
    # DTensor 2.21 lays a rank-3 channels-first bias (a channels-first
    # Conv1D's) out like the batch (tests/dtensor_bias_add_repro.py).
    _compat.Patch("bias_add", _gen_nn_ops, "bias_add",
                  _compat.in_graph_step_instead(
                      spmd_image_ops.bias_add_by_broadcast)),
)
