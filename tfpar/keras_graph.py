"""Reading and running the layer graph of a Keras model.

A functional (or Sequential) Keras model is a graph of call nodes between
KerasTensors. The pipeline cuts that graph into parts and runs it node by
node (`tfpar.pipeline.split`), the planner costs it node by node
(`tfpar.planner.profile`), and `tfpar.auto_plan` traces a model once to see
which layer reads which. The private Keras attributes this needs are reached
through `tfpar._compat`'s one-line shims (`functional_of`, `nodes_by_depth`,
`inputs_struct`, `outputs_struct`, `inbound_nodes`, `operation_fn`).

Example:

>>> import keras
>>> from tfpar import keras_graph
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
>>> nodes, inputs, outputs = keras_graph.functional_graph(model)
>>> [type(node.operation).__name__ for node in nodes], len(inputs)
(['Dense'], 1)
"""

import contextlib
import functools

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat


def functional_graph(model):
    """(nodes, inputs, outputs) of a functional or Sequential model.

    `nodes` are the graph's call nodes (input nodes excluded) in an order
    Keras itself executes them (deepest first); `inputs`/`outputs` are the
    model's flat lists of KerasTensors. Returns None for a model without a
    graph (subclassed, or a Sequential that was never given an input shape).
    """
    graph = _compat.functional_of(model)
    by_depth = None if graph is None else _compat.nodes_by_depth(graph)
    if by_depth is None:
        return None
    nodes = [
        node
        for depth in sorted(by_depth, reverse=True)
        for node in by_depth[depth]
        if node.operation is not None and not node.is_input
    ]
    return nodes, list(graph.inputs), list(graph.outputs)


def call_count(layer):
    """How many times `layer` was called on symbolic tensors (graph nodes)."""
    return len(_compat.inbound_nodes(layer))


def is_model(layer):
    """Whether `layer` is a Keras Model (a nested model can be inlined)."""
    return isinstance(layer, keras.Model)


def has_keras_tensor(structure):
    """Whether a nested `structure` holds a symbolic KerasTensor."""
    return any(isinstance(t, keras.KerasTensor)
               for t in keras.tree.flatten(structure))


def flat_model_inputs(model, inputs):
    """Symbolic `inputs` of a call of functional `model`, flat in the order
    of `model.inputs` as `Functional._standardize_inputs` orders them (a
    dict by input name, else by structure); None when they do not map."""
    struct = _compat.inputs_struct(_compat.functional_of(model))
    if isinstance(inputs, dict) and not isinstance(struct, dict):
        names = [t.name for t in keras.tree.flatten(struct)]
        if not set(names) <= set(inputs):
            return None
        inputs = [inputs[n] for n in names]
    flat = keras.tree.flatten(inputs)
    if not all(isinstance(t, keras.KerasTensor) for t in flat):
        return None
    return flat


def node_inputs(node):
    """The KerasTensors a graph node reads."""
    return list(node.input_tensors)


def run_node(node, tensors, training):
    """Runs one functional graph node on concrete tensors.

    `tensors` maps id(KerasTensor) to a value; the node's outputs are added
    to it. `training` is passed to layers that take it, as Keras'
    Functional.call does.
    """
    args, kwargs = node.arguments.fill_in(tensors)
    if not tf.executing_eagerly():
        # A model built with an eager constant (e.g. `keras.ops.arange(n)`
        # added to a symbolic tensor) keeps that tensor in its graph; traced
        # into a DTensor function it would be captured and placed on
        # whatever mesh DTensor last defaulted to. Re-created in the graph,
        # it follows the mesh of the code being traced (a pipeline stage).
        args, kwargs = keras.tree.map_structure(_as_graph_constant,
                                                (args, kwargs))
    outputs = _compat.operation_fn(node.operation, training)(*args, **kwargs)
    for symbolic, value in zip(node.outputs, keras.tree.flatten(outputs)):
        tensors[id(symbolic)] = value


def _as_graph_constant(value):
    """An eager, non-DTensor tensor as a constant of the graph being traced."""
    if not (isinstance(value, tf.Tensor) and hasattr(value, "numpy")):
        return value  # symbolic tensors and other values
    with tf.init_scope():
        if dtensor.is_dtensor(value):
            return value
        array = value.numpy()
    return tf.constant(array)


def model_output_structure(model, flat_outputs):
    """`flat_outputs` packed like a functional model's outputs."""
    return keras.tree.pack_sequence_as(
        _compat.outputs_struct(_compat.functional_of(model)), flat_outputs)


@contextlib.contextmanager
def reading_values(pairs, variables=()):
    """Keras weights read as the given tensors: `pairs` of (weight, value)
    (a tied weight's copy on another pipeline stage, `tfpar.pipeline.part`). Built on `keras.StatelessScope`,
    which also holds back the updates of other `variables` made inside it:
    those are applied when the block ends."""
    if not pairs:
        yield
        return
    with keras.StatelessScope(state_mapping=list(pairs)) as scope:
        yield
    replaced = {id(w) for w, _ in pairs}
    for variable in variables:
        value = scope.get_current_value(variable)
        if id(variable) not in replaced and value is not None:
            variable.assign(value)


# -- one symbolic trace: what each layer reads and makes (auto_rules) --------


def trace_layer_calls(model, layers):
    """Traces `model` once and returns what each of `layers` read and made.

    The model is called on symbolic inputs of its own input signature in a
    `tf.function` graph (traced, never run: no values are computed or
    changed). Returns `({id(layer): [(inputs, outputs), ...]}, outputs)`:
    per call of each layer the flat graph tensors of its arguments and of
    its results, and the flat outputs of the model. Returns None for a model
    without an input signature (subclassed, or never given an input shape).
    """
    graph = _compat.functional_of(model)
    struct = None if graph is None else _compat.inputs_struct(graph)
    if struct is None:
        return None
    specs = tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype), struct)
    calls = {id(layer): [] for layer in layers}
    saved = [(layer, layer.__dict__.get("call")) for layer in layers]
    for layer in layers:
        layer.call = _recording(layer, calls[id(layer)])
    try:
        traced = tf.function(lambda x: model(x, training=False),
                             autograph=False).get_concrete_function(specs)
    finally:
        for layer, previous in saved:
            if previous is None:
                del layer.__dict__["call"]
            else:
                layer.call = previous
    return calls, _graph_tensors(traced.structured_outputs)


def _recording(layer, calls):
    """`layer.call` appending (flat input tensors, flat output tensors) of
    each call to `calls`."""
    original = layer.call

    @functools.wraps(original)
    def call(*args, **kwargs):
        outputs = original(*args, **kwargs)
        calls.append((_graph_tensors((args, kwargs)), _graph_tensors(outputs)))
        return outputs

    return call


def _graph_tensors(structure):
    """The tf.Tensors of a nested `structure`, flat."""
    return [t for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor)]
