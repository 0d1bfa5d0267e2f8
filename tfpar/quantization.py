"""Keras' `quantize` under a ParallelStrategy: which modes may meet a
split layer (`PATCHES`, installed with the strategy's).

Keras' `Layer.quantize(mode)` replaces a layer's kernel or table with a
quantized one. Under tfpar, int8 and float8 layers train and predict as
one device's with their weights split (tests/test_quantized.py). int4
packs two 4-bit values per byte along the output dimension and
dequantizes its sub-channel groups by gathers that DTensor 2.21 cannot
lay out when the layer's weights are split ("input and output layout do
not agree on non-axis dim 1"): int4 runs in parity only on a layer whose
weights are whole (a data-parallel mesh). So `quantize(mode)` of a layer
with a split weight is refused, naming the layer, for every mode but int8
and float8 — before anything changes, where the step would otherwise fail
to compile.

GPTQ and AWQ are refused under a ParallelStrategy on any mesh: Keras
calibrates them by calling the model's layers eagerly on plain tensors
(`keras.src.quantizers.gptq_core`, `awq_core`), which DTensor 2.21 does
not accept beside weights on a mesh ("expecting a DTensor"), and by then
Keras has already turned every layer into its quantized form, its float
weights gone (tests/test_quantized.py shows both). Refused before any
layer changes.

>>> from tfpar import quantization
>>> quantization.SPLITTABLE_MODES
('int8', 'float8')
"""

import functools

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat

# The modes whose quantized layers run under tfpar with their weights
# split (tested); any other needs the layer's weights whole.
SPLITTABLE_MODES = ("int8", "float8")
# The modes Keras calibrates from data, eagerly (module docstring).
CALIBRATED_MODES = ("gptq", "awq")


def split_weights(layer):
    """The paths of `layer`'s weights laid out split over some mesh axis
    (a DTensor whose layout is not fully replicated)."""
    split = []
    for weight in getattr(layer, "weights", []):
        value = _compat.backing_variable(weight)
        if isinstance(value, tf.Variable) and dtensor.is_dtensor(value):
            if not dtensor.fetch_layout(value).is_fully_replicated():
                split.append(weight.path)
    return split


def _quantized_layers(layer):
    """The layers Keras' `quantize` of `layer` quantizes: itself or, for a
    model or block, each Dense, EinsumDense and Embedding inside it."""
    kinds = (keras.layers.Dense, keras.layers.EinsumDense,
             keras.layers.Embedding)
    return [inner for inner in _compat.all_layers(layer)
            if isinstance(inner, kinds)]


def _unsplittable_modes_refused(original, hooks):
    """Keras' check of `quantize`'s arguments, run on a layer (a model: on
    it, then on each layer) before it is quantized, also refusing a mode
    outside `SPLITTABLE_MODES` when a layer it would quantize has split
    weights under a ParallelStrategy: the first such layer is named,
    before any is quantized."""

    @functools.wraps(original)
    def check(self, mode, compute_dtype):
        original(self, mode, compute_dtype)
        if mode in SPLITTABLE_MODES or hooks.strategy_of_layer(self) is None:
            return
        if mode in CALIBRATED_MODES:
            raise ValueError(_calibrated_refusal(self, mode))
        for layer in _quantized_layers(self):
            split = split_weights(layer)
            if split:
                raise ValueError(_refusal(layer, mode, split))

    return check


def _refusal(layer, mode, split):
    return (f"Layer {layer.path!r} ({type(layer).__name__}) cannot be "
            f"quantized with mode={mode!r} under tfpar while its weights "
            f"are split ({split}): tfpar runs modes {SPLITTABLE_MODES} with "
            f"split weights, {mode!r} only with the layer's weights whole "
            "(DTensor 2.21 cannot lay out int4's dequantizing gathers on a "
            "split kernel). Use quantize('int8'), or keep this layer's "
            "weights whole (a LayoutRules entry of `tfpar.Replicated()` "
            "for it, or a mesh without a model axis).")


def _calibrated_refusal(layer, mode):
    return (f"Layer {layer.path!r} ({type(layer).__name__}) cannot be "
            f"quantized with mode={mode!r} under a tfpar ParallelStrategy: "
            f"Keras calibrates {mode!r} by calling the model's layers "
            "eagerly on plain tensors, which DTensor 2.21 does not accept "
            "beside weights on a mesh, after it has already replaced every "
            f"layer's float weights. Received: mode={mode!r}. Quantize with "
            f"{mode!r} on one device, outside every strategy scope; under "
            "tfpar use quantize('int8') or quantize('float8') (split "
            "weights) or quantize('int4') (whole weights).")


PATCHES = (
    _compat.Patch("check_quantize_args",
                  lambda: _compat.keras_module("layers.layer").Layer,
                  "_check_quantize_args", _unsplittable_modes_refused),
)
