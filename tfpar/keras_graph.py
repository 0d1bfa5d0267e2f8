"""Reading and running the layer graph of a Keras model.

A functional (or Sequential) Keras model is a graph of call nodes between
KerasTensors. The pipeline cuts that graph into parts and runs it node by
node (`tfpar.pipeline.split`), the planner costs it node by node
(`tfpar.planner.profile`), and `tfpar.auto_plan` traces a model once to see
which layer reads which (`trace_layer_calls`; the profile traces a model's
blocks to see which of their kernels read one tensor). The private Keras
attributes this needs are reached through `tfpar._compat`'s one-line shims
(`functional_of`, `nodes_by_depth`, `inputs_struct`, `outputs_struct`,
`inbound_nodes`, `operation_fn`).

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
import re

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


def owning_layers(model):
    """{id(weight): the innermost layer that owns it}. Layers come
    outermost first, so a later layer holding the weight is usually
    nested in its owner so far and takes its place; but a layer shared by
    two (an embedding that a hand-written output head holds to project
    onto its table; keras-hub's MaskedLMHead holding the token embedding)
    is listed once, where it is met first, and the layer met later only
    holds it: a layer takes a weight's place only when nested in its
    owner so far."""
    owners, nested = {}, {}
    for layer in _compat.all_layers(model):
        for weight in layer.weights:
            owner = owners.get(id(weight))
            if owner is None or id(layer) in _nested_ids(owner, nested):
                owners[id(weight)] = layer
    return owners


def own_weights(layer):
    """The weights `layer` owns itself (not through sublayers)."""
    inner = {id(w) for sub in _compat.all_layers(layer, include_self=False)
             for w in sub.weights}
    return [w for w in layer.weights if id(w) not in inner]


def _nested_ids(layer, memo):
    """ids of the layers nested in `layer` (memoised in `memo`)."""
    if id(layer) not in memo:
        memo[id(layer)] = {id(sub) for sub in _compat.all_layers(
            layer, include_self=False)}
    return memo[id(layer)]


def call_count(layer):
    """How many times `layer` was called on symbolic tensors (graph nodes)."""
    return len(_compat.inbound_nodes(layer))


def is_model(layer):
    """Whether `layer` is a Keras Model (a nested model can be inlined)."""
    return isinstance(layer, keras.Model)


KERAS_NORMS = (
    keras.layers.LayerNormalization, keras.layers.BatchNormalization,
    keras.layers.GroupNormalization, keras.layers.UnitNormalization,
    keras.layers.RMSNormalization,
)
# Norm classes of other libraries (keras-hub's RMSNormalization,
# LlamaLayerNorm, MistralLayerNormalization, ...), known by name: they
# normalize each token over its last axis with 1-D weights.
_NORM_NAME = re.compile(r".*(RMS|Layer)Norm(alization)?")


def is_norm(layer):
    """Whether `layer` is a normalization: one of Keras' (`KERAS_NORMS`) or
    another library's class named `...(RMS|Layer)Norm(alization)` whose
    weights are all 1-D (a scale and maybe an offset per feature)."""
    return isinstance(layer, KERAS_NORMS) or (
        _NORM_NAME.fullmatch(type(layer).__name__) is not None
        and all(len(w.shape) == 1 for w in layer.weights))


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


def run_node(node, tensors, training, operation_fn=None):
    """Runs one functional graph node on concrete tensors.

    `tensors` maps id(KerasTensor) to a value; the node's outputs are added
    to it. `training` is passed to layers that take it, as Keras'
    Functional.call does; or `operation_fn(operation)` is called instead,
    the op as a Functional.call hands it to its graph runner.
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
    call = (operation_fn(node.operation) if operation_fn is not None
            else _compat.operation_fn(node.operation, training))
    outputs = call(*args, **kwargs)
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
    those are applied when the block ends. Losses layers add inside it
    (`add_loss`: keras-hub Mixtral's router loss) are the scope's, read
    from `layer.losses` inside the block only (a scope that did not
    collect them dropped them)."""
    if not pairs:
        yield
        return
    with keras.StatelessScope(state_mapping=list(pairs),
                              collect_losses=True) as scope:
        yield
    replaced = {id(w) for w, _ in pairs}
    for variable in variables:
        value = scope.get_current_value(variable)
        if id(variable) not in replaced and value is not None:
            variable.assign(value)


# -- one symbolic trace: what each layer reads and makes (auto_rules) --------


def trace_layer_calls(model, layers, by_node=True, unknown_size=None):
    """Traces `model` symbolically and returns what each of `layers` read
    and made.

    Traced, never run: no values are computed or changed. Returns
    `({id(layer): [(inputs, outputs), ...]}, outputs)`: per call of each
    layer the flat graph tensors of its arguments and of its results, and
    the flat outputs of the model. Returns None for a model without an
    input signature (subclassed, or never given an input shape).

    With `by_node` (the default) each call node of the model's functional
    graph is traced in a `tf.function` graph of its own, on placeholders of
    its inputs' specs, and a node whose layer repeats one traced before —
    same class, config, sublayers and weight shapes, same argument specs:
    every block of a transformer — reuses that trace for its own
    sublayers. The tensors returned are then `NodeTensor`s (a graph tensor
    of one node's call, whose `.op.inputs` lead into the nodes that made
    them), describing the same dataflow as one trace of the whole model
    (`by_node=False`; tests/test_planner_speed.py checks both give the same
    plans). Tracing costs about a millisecond per TF op, and more per op as
    one graph grows: a trillion-parameter GPT's 903 layers took a minute
    traced whole, well under a second by node. Layers built under
    `keras.RematScope` (or calling `keras.remat`) are traced with
    recomputation off (`_compat.remat_off`); they still recompute when
    trained.

    `unknown_size` (an int): the inputs' unknown dimensions after the first
    (the batch) are traced with that length, for layers whose Python code
    needs a known one (keras-hub's Qwen3.5 gated delta net pads its
    sequence with `if pad_size > 0`); None (the default): left unknown.
    """
    graph = _compat.functional_of(model)
    struct = None if graph is None else _compat.inputs_struct(graph)
    if struct is None:
        return None
    log = []
    saved = [(layer, method, layer.__dict__.get(method)) for layer in layers
             for method in _compat.CALL_METHODS if hasattr(layer, method)]
    for layer, method, _ in saved:
        setattr(layer, method, _recording(layer, method, log))
    try:
        # Recomputation changes no weight read and no shape, and TF's
        # `tf.recompute_grad` refuses keyword arguments (`training=`) in a
        # graph: traced with it off, the model still recomputes after.
        with _compat.remat_off():
            traced = None
            if by_node:
                hooked = {id(layer) for layer, _, previous in saved
                          if previous is not None}
                traced = _traced_by_node(model, layers, log, hooked,
                                         unknown_size)
            if traced is None:
                outputs = _trace_whole(model, struct, unknown_size)
                calls = {id(layer): [] for layer in layers}
                for layer, inputs, made in log:
                    calls[id(layer)].append((inputs, made))
            else:
                calls, outputs = traced
    finally:
        for layer, method, previous in saved:
            if previous is None:
                del layer.__dict__[method]
            else:
                setattr(layer, method, previous)
    return calls, outputs


# The length of the unknown dimensions (the sequence) of a model whose trace
# needs a known one (`trace_layer_calls_any_length`).
RETRY_LENGTH = 8


def trace_layer_calls_any_length(model, layers):
    """`trace_layer_calls(model, layers)`; if that trace fails, again with
    the inputs' unknown dimensions after the batch set to `RETRY_LENGTH`
    (which layer reads which does not depend on the length): keras-hub's
    Qwen3.5 gated delta net (`linear_attention` layers) compares its
    padding with 0 in Python, which a symbolic sequence length refuses.
    The first failure is raised if both fail.

    >>> calls, outputs = trace_layer_calls_any_length(model, [model.layers[1]])
    """
    try:
        return trace_layer_calls(model, layers)
    except Exception as error:  # noqa: BLE001 (retried once, then raised)
        try:
            return trace_layer_calls(model, layers, unknown_size=RETRY_LENGTH)
        except Exception:  # noqa: BLE001
            raise error from None


def _traced_by_node(model, layers, log, hooked, unknown_size):
    """`_NodeTracer(...).run()`, or None when some node cannot be traced
    on the specs Keras recorded for its inputs: a layer whose declared
    output shape is not what its call makes (keras-hub's Moonshine
    declares its rotary table (None,) and makes it 2-D, and the attention
    reading it fails on the declared spec). The whole model, traced on
    its inputs, carries the shapes the calls make instead (`log` is
    emptied for it)."""
    try:
        return _NodeTracer(model, layers, log, hooked, unknown_size).run()
    except (ValueError, TypeError):
        del log[:]
        return None


def _spec(tensor, unknown_size=None):
    """The TensorSpec `tensor` is traced on: its shape, with `unknown_size`
    (an int) for its unknown dimensions after the first (the batch)."""
    shape = list(tensor.shape)
    if unknown_size is not None:
        shape[1:] = [unknown_size if d is None else d for d in shape[1:]]
    return tf.TensorSpec(shape, tensor.dtype)


def _trace_whole(model, struct, unknown_size=None):
    """The flat outputs of `model` traced in one graph on its input specs."""
    specs = tf.nest.map_structure(
        lambda t: _spec(t, unknown_size), struct)
    traced = tf.function(lambda x: model(x, training=False),
                         autograph=False).get_concrete_function(specs)
    return _graph_tensors(traced.structured_outputs)


def _recording(layer, method, log):
    """`layer.<method>` (`call` or `quantized_call`) appending (layer, flat
    input tensors, flat output tensors) of each call to `log`."""
    original = getattr(layer, method)

    @functools.wraps(original)
    def call(*args, **kwargs):
        outputs = original(*args, **kwargs)
        log.append((layer, _graph_tensors((args, kwargs)),
                    _graph_tensors(outputs)))
        return outputs

    return call


def _graph_tensors(structure):
    """The tf.Tensors of a nested `structure`, flat."""
    return [t for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor)]


class NodeTensor:
    """A graph tensor of one call node's trace (`trace_layer_calls`): the
    tensor `tensor` of a graph several identical nodes may share, as seen
    from `node`'s call. `op.inputs` maps the trace's placeholders to the
    tensors of the nodes that made them, so walking back crosses nodes as
    in one trace of the whole model."""

    __slots__ = ("tensor", "node")

    def __init__(self, tensor, node):
        self.tensor, self.node = tensor, node

    name = property(lambda self: f"{self.node.index}/{self.tensor.name}")
    shape = property(lambda self: self.tensor.shape)
    dtype = property(lambda self: self.tensor.dtype)
    op = property(lambda self: _NodeOp(self.tensor.op, self.node))


class _NodeOp:
    """A graph op as seen from one node's call (see `NodeTensor`)."""

    __slots__ = ("op", "node")

    def __init__(self, op, node):
        self.op, self.node = op, node

    type = property(lambda self: self.op.type)
    name = property(lambda self: self.op.name)
    inputs = property(lambda self: [self.node.tensor(t)
                                    for t in self.op.inputs])


class _NodeCall:
    """One node's call: its index and the tensors its placeholders stand
    for (by placeholder name)."""

    def __init__(self, index, upstream):
        self.index, self.upstream = index, upstream

    def tensor(self, t):
        if not tf.is_symbolic_tensor(t):
            return t  # an eager constant a layer was called with
        return self.upstream.get(t.name) or NodeTensor(t, self)


class _Trace:
    """A traced node: its operation, placeholders (one per distinct input),
    flat outputs and the recorded (layer, inputs, outputs) calls."""

    def __init__(self, operation, placeholders, outputs, calls):
        self.operation, self.placeholders = operation, placeholders
        self.outputs, self.calls = outputs, calls

    def layers_of(self, operation):
        """{id(layer in this trace): the same-placed layer of `operation`}
        when every recorded call is of a layer of the traced operation,
        else None (the trace cannot stand for another node's)."""
        mine, theirs = _layers_of(self.operation), _layers_of(operation)
        if len(mine) != len(theirs):
            return None
        mapping = {id(a): b for a, b in zip(mine, theirs)}
        if any(id(layer) not in mapping for layer, _, _ in self.calls):
            return None
        return mapping


def _layers_of(operation):
    if isinstance(operation, keras.layers.Layer):
        return _compat.all_layers(operation)
    return []


class _NodeTracer:
    """Traces a functional model node by node (see `trace_layer_calls`)."""

    def __init__(self, model, layers, log, hooked=(), unknown_size=None):
        self.nodes, self.inputs, self.outputs = functional_graph(model)
        self.unknown_size = unknown_size
        self.calls = {id(layer): [] for layer in layers}
        # Layers whose `call` an instance attribute replaces (a hook, e.g.
        # a style's): their nodes are traced on their own.
        self.hooked = set(hooked) | {
            id(layer) for layer in _compat.all_layers(model)
            if id(layer) not in self.calls and any(
                method in layer.__dict__ for method in _compat.CALL_METHODS)}
        self.log = log
        self.traces = {}  # node key -> _Trace
        self.count = 0    # node calls so far (each names its tensors)

    def run(self):
        made = {}  # id(KerasTensor) -> NodeTensor
        self._run(self.nodes, made)
        return self.calls, [made[id(t)] for t in self.outputs
                            if id(t) in made]

    def _run(self, nodes, made):
        for node in nodes:
            if not self._inline(node, made):
                self._add(node, made)

    def _inline(self, node, made):
        """Runs the nodes of a nested functional model called on its inputs
        alone (a keras-hub backbone inside its task model) in place, so its
        repeated blocks are traced once too; False for any other node."""
        operation, args = node.operation, node.arguments.args
        graph = functional_graph(operation) if is_model(operation) else None
        if (graph is None or len(args) != 1
                or has_keras_tensor(node.arguments.kwargs)):
            return False
        nodes, inputs, outputs = graph
        flat = flat_model_inputs(operation, args[0])
        if (flat is None or len(flat) != len(inputs)
                or len(node.outputs) != len(outputs)):
            return False
        inner = {id(i): made[id(t)] for i, t in zip(inputs, flat)
                 if id(t) in made}
        self._run(nodes, inner)
        for i, t in zip(inputs, flat):  # model inputs first read inside
            if id(i) in inner:
                made.setdefault(id(t), inner[id(i)])
        for symbolic, t in zip(node.outputs, outputs):
            if id(t) in inner:
                made[id(symbolic)] = inner[id(t)]
        return True

    def _add(self, node, made):
        distinct = list({id(t): t for t in node_inputs(node)}.values())
        key = _node_key(node, distinct, self.hooked)
        trace = self.traces.get(key) if key is not None else None
        mapping = trace.layers_of(node.operation) if trace else None
        if mapping is None:
            trace = self._trace(node, distinct)
            mapping = trace.layers_of(node.operation)
            if key is not None and mapping is not None:
                self.traces[key] = trace
        upstream = {p.name: made[id(t)]
                    for p, t in zip(trace.placeholders, distinct)
                    if id(t) in made}
        self.count += 1
        call = _NodeCall(self.count, upstream)
        for p, t in zip(trace.placeholders, distinct):
            made.setdefault(id(t), call.tensor(p))  # a model input
        for layer, inputs, outputs in trace.calls:
            target = mapping[id(layer)] if mapping else layer
            self.calls[id(target)].append(
                ([call.tensor(t) for t in inputs],
                 [call.tensor(t) for t in outputs]))
        for symbolic, t in zip(node.outputs, trace.outputs):
            made[id(symbolic)] = call.tensor(t)

    def _trace(self, node, distinct):
        """Traces one node on placeholders of its distinct inputs' specs,
        as Keras' Functional.call runs it (inference mode)."""
        fn = _compat.operation_fn(node.operation, False)
        held, start = {}, len(self.log)

        def body(*placeholders):
            values = {id(t): p for t, p in zip(distinct, placeholders)}
            args, kwargs = node.arguments.fill_in(values)
            outputs = keras.tree.flatten(fn(*args, **kwargs))
            held.update(placeholders=list(placeholders), outputs=outputs)
            return outputs

        specs = [_spec(t, self.unknown_size) for t in distinct]
        tf.function(body, autograph=False).get_concrete_function(*specs)
        calls = self.log[start:]
        del self.log[start:]
        return _Trace(node.operation, held["placeholders"], held["outputs"],
                      calls)


def _node_key(node, distinct, hooked=()):
    """What a node's trace depends on — its operation's class and config
    (name aside), each sublayer's class, config, weight shapes and
    recomputation mode, its arguments with tensors by spec — as a string;
    None when some part is not plain data (a tensor constant, an object)
    or a layer of it is in `hooked` (ids): such a node is traced on its
    own. A layer whose `get_config` fails (keras-hub Llama's decoder block
    reads an attribute it never set; Mixtral's expert block was built from
    objects) is compared by its public attributes that are plain data
    (its constructor's numbers and flags).
    """
    position = {id(t): i for i, t in enumerate(distinct)}
    arguments = keras.tree.map_structure(
        lambda v: ("input", position[id(v)])
        if isinstance(v, keras.KerasTensor) else v,
        (node.arguments.args, node.arguments.kwargs))
    parts = [arguments, [(tuple(t.shape), str(t.dtype)) for t in distinct]]
    for layer in _layers_of(node.operation) or [node.operation]:
        if id(layer) in hooked:
            return None
        parts.append((type(layer).__module__, type(layer).__qualname__,
                      _config(layer), _compat.remat_mode(layer),
                      [(tuple(w.shape), str(w.dtype), bool(w.trainable))
                       for w in getattr(layer, "weights", [])]))
    return repr(parts) if _plain(parts) else None


def _config(layer):
    """`layer`'s config without its name; if it has none, its public
    attributes that are plain data (`_plain`), name aside."""
    try:
        config = dict(layer.get_config())
    except (NotImplementedError, TypeError, ValueError, AttributeError):
        config = {"attributes": {
            key: value for key, value in vars(layer).items()
            if not key.startswith("_") and _plain(value)}}
        config["attributes"].pop("name", None)
    config.pop("name", None)
    return config


def _plain(value):
    """Whether `value` is data whose repr determines it (numbers, strings,
    None and tuples, lists and str-keyed dicts of them)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
