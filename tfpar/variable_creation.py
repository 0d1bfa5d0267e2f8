"""Which Keras variable, and which layer's `add_weight`, is being created
on this thread: published by two patches the strategy installs
(`VARIABLE_CREATION_PATCHES`: Keras' `Layer.add_weight` and its TF
backend's `Variable._initialize`), read by the strategy's variable creator
and the registry (`tfpar.variables`), which see only tf.Variable kwargs.

>>> from tfpar import variable_creation
>>> variable_creation.keras_variable_being_created() is None  # none now
True
"""

import contextlib
import threading
import weakref

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat

_initializing = threading.local()


def keras_variable_being_created():
    """The Keras Variable whose backing tf.Variable is being created, or None.

    A strategy's variable creator sees only tf.Variable kwargs; the Keras
    path (`variable.path`, e.g. "model/dense/kernel") lives on the Keras
    Variable, which Keras' TensorFlow backend wraps around the tf.Variable in
    `Variable._initialize`. That method is wrapped (`VARIABLE_CREATION_PATCHES`) to publish
    `self`.
    """
    stack = getattr(_initializing, "stack", None)
    return stack[-1] if stack else None


def keras_variable_layout(path):
    """The spec of the layout given to the Keras Variable at `path` being
    created (`keras.Variable(..., layout=TensorLayout(axes))`, stored as
    its private `_layout`, which Keras' TF backend ignores), or None."""
    variable = keras_variable_being_created()
    if variable is None or variable.path != path:
        return None
    return layout_spec_of(variable)


def layout_spec_of(variable):
    """The spec of the layout a Keras Variable was made with
    (`keras.Variable(..., layout=...)`, its private `_layout`), or None:
    `tfpar.layers.MixtureOfExperts` lays its banks out so."""
    layout = getattr(variable, "_layout", None)
    if layout is None:
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


class DeferredValue:
    """The initial value of a layer's weight made inside
    `deferred_initial_values()`: its shape and dtype only. The registry
    creates the weight with each device's block allocated on the device
    and left unwritten (`placement.unwritten`: no host array of the whole
    weight), and notes the variable it made (`created`); `make()` is
    Keras' initializer call, for a weight that the block leaves
    unwritten."""

    def __init__(self, make, shape, dtype):
        self.make = make
        self.shape = tf.TensorShape(shape)
        self.dtype = tf.as_dtype(dtype)
        self.created = None  # weakref to the variable made, once made

    def variable(self):
        """The variable made from this value (None: not made, or gone)."""
        return self.created() if self.created is not None else None


@contextlib.contextmanager
def deferred_initial_values():
    """Inside the block, on this thread, a layer's weight created by a
    strategy from a Keras initializer starts unwritten (see
    `deferred_value`); yields the list of their `DeferredValue`s, in
    creation order (`tfpar.pretrained.deferred_init` fills the unwritten
    ones with their initializer's values when its block ends).

    >>> with deferred_initial_values() as deferred:
    ...     pass
    >>> deferred
    []
    """
    stacks = _initializing.__dict__.setdefault("deferred", [])
    deferred = []
    stacks.append(deferred)
    try:
        yield deferred
    finally:
        stacks.pop()


def deferred_value(initial_value, dtype):
    """A `DeferredValue` standing in for `initial_value` (recorded in the
    innermost `deferred_initial_values` block) when such a block is open
    on this thread, the value is a Keras initializer's call (callable)
    and a layer's `add_weight` is making the Keras variable; else None
    (the value is made as usual)."""
    stacks = getattr(_initializing, "deferred", None)
    variable = keras_variable_being_created()
    if not stacks or not callable(initial_value) or variable is None or \
            keras_layer_adding_weight() is None:
        return None
    deferred = DeferredValue(initial_value, variable.shape,
                             dtype or variable.dtype)
    stacks[-1].append(deferred)
    return deferred


def _publishing_adding_layer(original):
    """`Layer.add_weight` that publishes the layer adding the weight
    (`keras_layer_adding_weight`) and notes it on the variable."""

    def add_weight(self, *args, **kwargs):
        stack = _initializing.__dict__.setdefault("layers", [])
        stack.append(self)
        try:
            variable = original(self, *args, **kwargs)
        finally:
            stack.pop()
        variable._tfpar_owner = weakref.ref(self)  # noqa: SLF001
        return variable

    return add_weight


def _publishing_variable(original):
    """Keras' TF `Variable._initialize` that publishes the Keras Variable
    whose tf.Variable is being created (`keras_variable_being_created`)."""

    def _initialize(self, value):
        stack = _initializing.__dict__.setdefault("stack", [])
        stack.append(self)
        try:
            return original(self, value)
        finally:
            stack.pop()

    return _initialize


# The strategy's: Keras' `Layer.add_weight` and TF `Variable._initialize`
# publish the layer and the Keras Variable being created (read by the
# strategy's variable creator through `keras_variable_being_created`).
VARIABLE_CREATION_PATCHES = (
    _compat.Patch("add_weight",
                  lambda: _compat.keras_module("layers.layer").Layer,
                  "add_weight",
                  lambda original, _: _publishing_adding_layer(original)),
    _compat.Patch("variable_initialize",
                  lambda: _compat.keras_tf_core().Variable, "_initialize",
                  lambda original, _: _publishing_variable(original)),
)
