"""A model from a zero-argument builder, built with every weight's shape
and dtype and no memory, and Keras' automatic names given back so that
the builder's next run names its layers, and so its weight paths, the
same: what `tfpar.plan(builder)` profiles and what
`tfpar.auto_rules(builder)` plans before the real model exists (its rules
then create every split weight already split in a strategy's scope).

Example:

>>> shapes = build_without_weights(
...     lambda: keras_hub.models.Llama3Backbone.from_preset(
...         path, load_weights=False))
>>> shapes.count_params()        # nothing allocated
"""

import collections
import contextlib
import threading

import keras

from tfpar import _compat


def build_without_weights(build, caller="tfpar.plan(model)"):
    """Calls `build()` inside `keras.StatelessScope(initialize_variables=
    False)`: every weight gets its shape and dtype but no memory. An
    optimizer made inside (a keras-hub task compiles in its constructor)
    is made outside the scope (`_optimizers_with_state`). Keras' automatic
    names are given back afterwards (`names_given_back`): the next
    `build()` names its layers, and so its weight paths, as this one did
    (`caller` names the API in the error for a builder returning no model).

    >>> shapes = build_without_weights(lambda: keras.Sequential(
    ...     [keras.Input((4,)), keras.layers.Dense(8)]))
    """
    with names_given_back(), _optimizers_with_state(), \
            keras.StatelessScope(initialize_variables=False):
        model = build()
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"{caller} as a function must return a Keras model. "
            f"Received: {build!r} returned {type(model).__name__}.")
    _compat.forget_uninitialized_variables(model.weights)
    return model


@contextlib.contextmanager
def names_given_back():
    """Keras' automatic-name counters (per prefix: "dense" -> dense,
    dense_1, ...) as they were before the block, once it ends: a model
    built inside and built again after gets the same layer names, so the
    same weight paths (exact-path layout rules made from the first build
    match the second).

    >>> with names_given_back():
    ...     first = keras.layers.Dense(2).name
    >>> keras.layers.Dense(2).name == first
    True
    """
    state = _compat.keras_global_state()
    counters = state.get_global_attribute("object_name_uids")
    saved = None if counters is None else collections.defaultdict(int, counters)
    try:
        yield
    finally:
        state.set_global_attribute("object_name_uids", saved)


# Held while BaseOptimizer.__init__ is swapped: two builds at once (two
# threads planning) would otherwise restore each other's wrapper and leave
# one installed. Re-entrant: a builder may build another without weights.
_OPTIMIZER_PATCH = threading.RLock()


@contextlib.contextmanager
def _optimizers_with_state():
    """Keras optimizers made in the block are made outside any
    `StatelessScope`: an optimizer's step counter and learning rate are
    variables initialised from numbers, which a StatelessScope refuses
    ("attempting to create a variable while in a stateless scope"), and
    a keras-hub task (GPT2CausalLM, ...) compiles with one in its
    constructor. Two scalars; the model's weights stay shape-only."""
    base = _compat.keras_module("optimizers.base_optimizer").BaseOptimizer

    def init(self, *args, **kwargs):
        with _compat.keras_globals({"stateless_scope": None}):
            original(self, *args, **kwargs)

    with _OPTIMIZER_PATCH:
        original = base.__init__
        base.__init__ = init
        try:
            yield
        finally:
            base.__init__ = original
