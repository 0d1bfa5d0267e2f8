"""Keras' layers that take a `data_format` (convolutions, poolings,
resizing, padding, cropping, ConvLSTM, spatial dropout), and
normalizations over axis 1, channels first, train on data=8 as on one
device.

The suite had trained almost every convolution and pooling layer channels
last only; asking the same of channels first (2026-12-06) found three
failures: a Conv1D's bias did not compile (`tests/dtensor_bias_add_repro.py`),
depthwise and separable convolutions did not compile (their stand-in ran
channels last only), and a Conv3D trained *silently wrong* (second loss
1% off one device's in float32; "Function was cancelled" in float64):
Keras runs a channels-first 3-D convolution as a nested XLA function.
Each now runs channels last between two transposes in a step
(`tfpar.spmd_image_patches`); the separable convolution as a whole, since its
depthwise stand-in followed by a channels-first pointwise convolution
and bias was 2% off one device in float32.

float32 throughout: TF's CPU kernels refuse several channels-first
convolutions in float64 on one device, the oracle. The silently wrong
Conv3D and the SeparableConv2D run by default; the rest are slow.
"""

import keras
import pytest

import models

L = keras.layers
FIRST = "channels_first"

# name: (input shape without the batch, the layer)
LAYERS = {
    "Conv1D": ((3, 10), lambda: L.Conv1D(4, 3, data_format=FIRST)),
    "Conv1D_strided_same": ((3, 10), lambda: L.Conv1D(
        4, 3, strides=2, padding="same", data_format=FIRST)),
    "Conv1D_dilated": ((3, 10), lambda: L.Conv1D(
        4, 3, dilation_rate=2, data_format=FIRST)),
    "Conv2D": ((3, 6, 6), lambda: L.Conv2D(4, 3, data_format=FIRST)),
    "Conv2D_grouped": ((4, 6, 6), lambda: L.Conv2D(
        4, 3, groups=2, data_format=FIRST)),
    "Conv3D": ((2, 4, 4, 4), lambda: L.Conv3D(3, 2, data_format=FIRST)),
    "Conv1DTranspose": ((3, 10), lambda: L.Conv1DTranspose(
        4, 3, strides=2, data_format=FIRST)),
    "Conv2DTranspose": ((3, 5, 5), lambda: L.Conv2DTranspose(
        4, 3, strides=2, data_format=FIRST)),
    "Conv3DTranspose": ((2, 3, 3, 3), lambda: L.Conv3DTranspose(
        3, 2, strides=2, data_format=FIRST)),
    "SeparableConv1D": ((3, 10), lambda: L.SeparableConv1D(
        4, 3, data_format=FIRST)),
    "SeparableConv2D": ((3, 6, 6), lambda: L.SeparableConv2D(
        4, 3, data_format=FIRST)),
    "DepthwiseConv1D": ((3, 10), lambda: L.DepthwiseConv1D(
        3, data_format=FIRST)),
    "DepthwiseConv2D": ((3, 6, 6), lambda: L.DepthwiseConv2D(
        3, data_format=FIRST)),
    "MaxPooling1D": ((3, 10), lambda: L.MaxPooling1D(2, data_format=FIRST)),
    "MaxPooling2D": ((3, 6, 6), lambda: L.MaxPooling2D(2, data_format=FIRST)),
    "MaxPooling3D": ((2, 4, 4, 4), lambda: L.MaxPooling3D(
        2, data_format=FIRST)),
    "AveragePooling1D": ((3, 10), lambda: L.AveragePooling1D(
        2, data_format=FIRST)),
    "AveragePooling2D": ((3, 6, 6), lambda: L.AveragePooling2D(
        2, data_format=FIRST)),
    "AveragePooling3D": ((2, 4, 4, 4), lambda: L.AveragePooling3D(
        2, data_format=FIRST)),
    "GlobalAveragePooling1D": ((3, 10), lambda: L.GlobalAveragePooling1D(
        data_format=FIRST)),
    "GlobalMaxPooling2D": ((3, 6, 6), lambda: L.GlobalMaxPooling2D(
        data_format=FIRST)),
    "GlobalAveragePooling3D": ((2, 4, 4, 4), lambda: L.GlobalAveragePooling3D(
        data_format=FIRST)),
    "UpSampling2D_bilinear": ((3, 3, 3), lambda: L.UpSampling2D(
        2, data_format=FIRST, interpolation="bilinear")),
    "UpSampling3D": ((2, 2, 2, 2), lambda: L.UpSampling3D(
        2, data_format=FIRST)),
    "ZeroPadding2D": ((3, 6, 6), lambda: L.ZeroPadding2D(
        1, data_format=FIRST)),
    "Cropping3D": ((2, 4, 4, 4), lambda: L.Cropping3D(1, data_format=FIRST)),
    "ConvLSTM1D": ((3, 2, 8), lambda: L.ConvLSTM1D(2, 3, data_format=FIRST)),
    "ConvLSTM2D": ((3, 2, 5, 5), lambda: L.ConvLSTM2D(
        2, 3, data_format=FIRST)),
    "SpatialDropout2D": ((3, 6, 6), lambda: L.SpatialDropout2D(
        0.3, data_format=FIRST, seed=1)),
    "Resizing": ((3, 6, 6), lambda: L.Resizing(4, 4, data_format=FIRST)),
    "BatchNormalization_axis_1": ((3, 6, 6), lambda: L.BatchNormalization(
        axis=1)),
    "GroupNormalization_axis_1": ((4, 6, 6), lambda: L.GroupNormalization(
        2, axis=1)),
}
DEFAULT_CASES = ("Conv3D", "SeparableConv2D")


@pytest.mark.parametrize("name", [
    name if name in DEFAULT_CASES else pytest.param(
        name, marks=pytest.mark.slow) for name in LAYERS])
def test_channels_first_layer_trains_as_one_device(name):
    models.assert_layer_trains_as_one_device(*LAYERS[name])
