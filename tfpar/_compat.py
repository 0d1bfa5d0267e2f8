"""Every private TensorFlow hook tfpar uses, in one place.

A TensorFlow upgrade that moves one of these touches only this file.
Checked against tensorflow 2.21.
"""

import threading

from tensorflow.dtensor.python import d_variable
from tensorflow.python.distribute import distribute_lib

# The base classes tf.distribute strategies are built from.
StrategyExtendedV2 = distribute_lib.StrategyExtendedV2
DVariable = d_variable.DVariable


def require_cross_replica_or_default_context(extended):
    """Raises unless called outside `strategy.run` (as `run` itself must be)."""
    distribute_lib._require_cross_replica_or_default_context_extended(extended)  # noqa: SLF001


def route_keras_step_functions(make_function_for):
    """Lets a strategy build a Keras model's train/test/predict functions.

    Patches `make_{train,test,predict}_function` of Keras' TensorFlow
    trainer once: for a model whose `distribute_strategy` answers
    `make_function_for(model, mode)` with a function, that function is used;
    for every other model Keras' own code runs unchanged.
    """
    from keras.src.backend.tensorflow import trainer  # noqa: PLC0415

    cls = trainer.TensorFlowTrainer
    if getattr(cls, "_tfpar_routed", False):
        return
    for mode in ("train", "test", "predict"):
        attribute = f"{mode}_function"
        original = getattr(cls, f"make_{attribute}")

        def make(self, force=False, _mode=mode, _attr=attribute,
                 _original=original):
            if getattr(self, _attr) is not None and not force:
                return getattr(self, _attr)
            function = make_function_for(self, _mode)
            if function is None:
                return _original(self, force=force)
            setattr(self, _attr, function)
            return function

        setattr(cls, f"make_{attribute}", make)
    cls._tfpar_routed = True  # noqa: SLF001


_initializing = threading.local()


def keras_variable_being_created():
    """The Keras Variable whose backing tf.Variable is being created, or None.

    A strategy's variable creator sees only tf.Variable kwargs; the Keras
    path (`variable.path`, e.g. "model/dense/kernel") lives on the Keras
    Variable, which Keras' TensorFlow backend wraps around the tf.Variable in
    `Variable._initialize`. That method is wrapped once to publish `self`.
    """
    stack = getattr(_initializing, "stack", None)
    return stack[-1] if stack else None


def _publish_keras_variables():
    from keras.src.backend.tensorflow import core  # noqa: PLC0415

    original = core.Variable._initialize  # noqa: SLF001
    if getattr(original, "_tfpar_wrapped", False):
        return

    def _initialize(self, value):
        stack = _initializing.__dict__.setdefault("stack", [])
        stack.append(self)
        try:
            return original(self, value)
        finally:
            stack.pop()

    _initialize._tfpar_wrapped = True  # noqa: SLF001
    core.Variable._initialize = _initialize  # noqa: SLF001


_publish_keras_variables()
