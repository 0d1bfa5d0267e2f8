"""What `auto_rules`' warning says of a layer it keeps whole: a layer
owning only non-trainable constants (rotary frequencies) is named as such
(replicating them is the plan, not a gap), and a layer Keras gave no path
(keras-hub SmolLM3's rotary embedding) by the path its weights sit under,
not `None`."""

import warnings

import keras

import tfpar
from tfpar.weightless import build_without_weights

from test_estimate import HUB_DECODERS


class Frequencies(keras.layers.Layer):
    """Scales its input by a fixed, non-trainable vector (a rotary
    embedding's `inv_freq`)."""

    def build(self, input_shape):
        self.inv_freq = self.add_weight(
            shape=(input_shape[-1],), initializer="ones", trainable=False,
            name="inv_freq")

    def call(self, x):
        return x * self.inv_freq


def _warned(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tfpar.auto_rules(model, axis_size=2)
    return "\n".join(str(w.message) for w in caught)


def test_a_layer_of_constants_is_named_as_constants():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    outputs = keras.layers.Dense(8)(Frequencies(name="rotary")(hidden))
    message = _warned(keras.Model(inputs, outputs))
    assert "rotary (Frequencies): non-trainable constants ['inv_freq']" in (
        message)


def test_a_layer_without_a_path_is_named_by_its_weights():
    message = _warned(build_without_weights(HUB_DECODERS["smollm3"]))
    assert "None (" not in message
    assert "rotary_emb (SmolLM3RotaryEmbedding): non-trainable" in message
