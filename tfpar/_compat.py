"""Every private TensorFlow hook tfpar uses, in one place.

A TensorFlow upgrade that moves one of these touches only this file.
Checked against tensorflow 2.21.
"""

import functools
import threading

import tensorflow as tf
from tensorflow.dtensor.python import d_variable
from tensorflow.python.distribute import distribute_lib

# The base classes tf.distribute strategies are built from.
StrategyExtendedV2 = distribute_lib.StrategyExtendedV2
DVariable = d_variable.DVariable


def require_cross_replica_or_default_context(extended):
    """Raises unless called outside `strategy.run` (as `run` itself must be)."""
    distribute_lib._require_cross_replica_or_default_context_extended(extended)  # noqa: SLF001


def route_keras_step_functions(make_function_for, owns):
    """Lets a strategy build a Keras model's train/test/predict functions.

    Patches Keras' TensorFlow trainer once: for a model whose
    `distribute_strategy` answers `make_function_for(model, mode)` with a
    function, `make_{train,test,predict}_function` use that function; for
    every other model Keras' own code runs unchanged. `compile` of a model
    whose strategy `owns(strategy)` enters that strategy's scope, so the
    optimizer is created under it even when `compile` is called outside.
    """
    from keras.src.backend.tensorflow import trainer  # noqa: PLC0415
    from keras.src.trainers import trainer as base_trainer  # noqa: PLC0415

    cls = trainer.TensorFlowTrainer
    if getattr(cls, "_tfpar_routed", False):
        return
    original_compile = base_trainer.Trainer.compile

    def compile(self, *args, **kwargs):  # noqa: A001
        strategy = self.distribute_strategy
        if not owns(strategy):
            return original_compile(self, *args, **kwargs)
        with strategy.scope():
            result = original_compile(self, *args, **kwargs)
            _optimizer_under(self, strategy)
        return result

    # Patched on the base class: Keras' `compile_from_config` (what
    # `load_model` compiles with) skips compiling, with a warning, any model
    # whose `type(model).compile` is not `Trainer.compile`.
    base_trainer.Trainer.compile = compile
    original_symbolic_build = cls._maybe_symbolic_build  # noqa: SLF001

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras builds a model under a strategy from `next()` of a fresh
        # iterator, which for a one-shot generator silently drops a batch.
        # Only shapes and dtypes are used: take them from the dataset spec.
        dataset = getattr(iterator, "_distributed_dataset", None)
        if owns(self.distribute_strategy) and dataset is not None:
            data_batch = tf.nest.map_structure(
                lambda s: s if isinstance(s, tf.TensorSpec) else None,
                dataset.element_spec)
            iterator = None
        return original_symbolic_build(self, iterator=iterator,
                                       data_batch=data_batch)

    cls._maybe_symbolic_build = _maybe_symbolic_build  # noqa: SLF001

    def original_call(self, *args, **kwargs):
        # Next in the MRO of keras.Model after the trainer: Layer.__call__.
        return super(cls, self).__call__(*args, **kwargs)

    def __call__(self, *args, **kwargs):  # models only: layers keep theirs
        # The strategy the model was built under, not merely the current one.
        strategy = getattr(self, "_distribute_strategy", None)
        if tf.executing_eagerly() and owns(strategy):
            return strategy.extended.eager_model_call(
                original_call, self, args, kwargs)
        return original_call(self, *args, **kwargs)

    cls.__call__ = __call__
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


def _optimizer_under(model, strategy):
    """Makes sure `model.optimizer` was created under `strategy`.

    Keras' TF optimizer remembers the strategy current at construction and
    creates its `iterations` and `learning_rate` variables right away. One
    built outside `strategy.scope()` therefore cannot train under it (Keras
    fails with "Mixing different tf.distribute.Strategy objects"). While it
    has no slots yet, an equal optimizer is rebuilt from its config under the
    scope and becomes `model.optimizer`.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or getattr(optimizer, "_distribution_strategy",
                                    strategy) is strategy:
        return
    if optimizer.built:
        raise ValueError(
            f"The optimizer {optimizer.name!r} was created and built outside "
            "the strategy's scope. Received: an optimizer bound to "
            f"{type(optimizer._distribution_strategy).__name__}. Create it "  # noqa: SLF001
            "inside `with strategy.scope():` or pass its name to compile()."
        )
    try:
        config = optimizer.get_config()
        with strategy.scope():
            model.optimizer = type(optimizer).from_config(config)
    except Exception as error:  # noqa: BLE001 (any failure: explain how to fix)
        raise ValueError(
            f"The optimizer {optimizer.name!r} was created outside the "
            "strategy's scope and could not be rebuilt from its config "
            f"({error}). Create it inside `with strategy.scope():`."
        ) from error


def all_layers(layer, include_self=True):
    """`layer` and every layer nested in it, outermost first."""
    return list(layer._flatten_layers(include_self=include_self,  # noqa: SLF001
                                      recursive=True))


def producers(layer):
    """The layers whose outputs `layer` was called on in a functional graph
    (first call), or [] for layers with no graph (subclassed models)."""
    for node in getattr(layer, "_inbound_nodes", []):
        return [t._keras_history.operation  # noqa: SLF001
                for t in node.arguments.keras_tensors]
    return []


def model_output_layers(model):
    """The layers whose outputs are a functional model's outputs ([] for
    subclassed models)."""
    return [t._keras_history.operation  # noqa: SLF001
            for t in getattr(model, "outputs", None) or []]


def transform_layer_outputs(layer, name, transform):
    """Makes `layer` return `transform(outputs)`; once per `name`.

    Wraps this one layer object's `call` (not its class), keeping its
    signature for Keras' argument inspection.
    """
    applied = layer.__dict__.setdefault("_tfpar_output_transforms", set())
    if name in applied:
        return
    original_call = layer.call

    @functools.wraps(original_call)
    def call(*args, **kwargs):
        return transform(original_call(*args, **kwargs))

    layer.call = call
    applied.add(name)


def backing_variable(variable):
    """The tf.Variable behind a Keras Variable (or `variable` itself)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def rebind_keras_variable(keras_variable, tf_variable):
    """Makes `keras_variable` store its value in `tf_variable` from now on."""
    keras_variable._value = tf_variable  # noqa: SLF001


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


def keras_layer_adding_weight():
    """The Keras layer whose `add_weight` is running, or None."""
    stack = getattr(_initializing, "layers", None)
    return stack[-1] if stack else None


def _publish_adding_layers():
    from keras.src.layers import layer as layer_module  # noqa: PLC0415

    original = layer_module.Layer.add_weight
    if getattr(original, "_tfpar_wrapped", False):
        return

    def add_weight(self, *args, **kwargs):
        stack = _initializing.__dict__.setdefault("layers", [])
        stack.append(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            stack.pop()

    add_weight._tfpar_wrapped = True  # noqa: SLF001
    layer_module.Layer.add_weight = add_weight


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
_publish_adding_layers()
