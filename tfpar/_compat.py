"""Every private TensorFlow or Keras hook tfpar uses, in one place.

A TensorFlow upgrade that moves one of these touches only this file.
Checked against tensorflow 2.21.
"""

import contextlib
import functools
import threading
import weakref

import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.dtensor.python import d_variable
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.eager import record

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
            strategy.extended.adopt_model(self)  # a model built outside
            result = original_compile(self, *args, **kwargs)
            _optimizer_under(self, strategy)
            if self.built:
                strategy.extended.check_rules_used()
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


_RECOMPUTING = threading.local()


def _stack(name):
    return _RECOMPUTING.__dict__.setdefault(name, [])


@contextlib.contextmanager
def _pushed(name, value):
    """`value` on top of this thread's stack `name` inside the block."""
    stack = _stack(name)
    stack.append(value)
    try:
        yield value
    finally:
        stack.pop()


@contextlib.contextmanager
def _keras_globals(values):
    """Keras' per-thread global attributes set to `values` ({name: value})
    inside the block, restored after it."""
    from keras.src.backend.common import global_state  # noqa: PLC0415

    saved = {name: global_state.get_global_attribute(name) for name in values}
    for name, value in values.items():
        global_state.set_global_attribute(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            global_state.set_global_attribute(name, value)


def recompute_dependency():
    """While a layer is recomputed in the backward pass (see `recompute`):
    a scalar 0.0 computed from the upstream gradient. A variable read that
    must run again there adds it to its value. None at any other time."""
    stack = _stack("dependencies")
    return stack[-1] if stack else None


class _Seeds:
    """The Keras random seeds a checkpointed call drew in its forward pass,
    handed out again in the same order when it is recomputed (`replaying`),
    so Dropout applies the same mask twice."""

    def __init__(self, values=(), replaying=False):
        self.values = list(values)
        self.replaying = replaying


def _next_seed(generator, original, check_replay, ordered=True):
    """`keras.random.SeedGenerator.next`, replaying inside a recomputation
    (after `check_replay(generator)`, which may refuse)."""
    frames = _stack("seeds")
    if frames and frames[-1].replaying:
        check_replay(generator)
        if not frames[-1].values:
            raise RuntimeError(
                "A recomputed layer drew more random seeds in the backward "
                "pass than in its forward pass (e.g. a random op inside "
                "keras.ops.cond/while_loop, or a branch on a Python value "
                "that changed), so its recomputation cannot reproduce the "
                f"forward pass. Received: seed generator {generator.name!r}. "
                "Leave this layer out of keras.RematScope.")
        return frames[-1].values.pop(0)
    value = original(generator, ordered)
    if frames:
        frames[-1].values.append(value)
    return value


def recompute(f):
    """`f` whose gradient recomputes `f` from its inputs instead of keeping
    its intermediate results (activation checkpointing).

    Like `tf.recompute_grad`, except that: keyword arguments are accepted
    (tensor ones get gradients); the recomputation runs in the Keras
    context of the forward pass (its `training` value and mixed-precision
    autocast) with state updates discarded (BatchNormalization's moving
    statistics, seed generators, losses: the forward pass made them) and
    the Keras random seeds of the forward pass replayed (the same Dropout
    mask); it waits for the upstream gradient through one all-reduced
    scalar, 0.0 (NaN if that gradient is NaN), where `tf.recompute_grad`
    takes the upstream gradient's first element, which DTensor turns into
    an all-gather of the whole tensor; and `recompute_dependency()` hands
    that scalar to variable reads, so an fsdp weight is gathered again in
    the backward pass instead of the forward gather being kept (the
    compiler merges identical reads). A checkpointed call inside another
    (a recomputed layer's sublayers) runs plainly: the outer checkpoint
    recomputes it once. Without a gradient tape (predict, evaluate) `f`
    just runs.
    """
    from keras.src.backend import StatelessScope  # noqa: PLC0415
    from keras.src.backend.common import global_state  # noqa: PLC0415

    keras_context = ("current_call_ctx", "autocast_scope")

    def call(*args, **kwargs):
        if not record.could_possibly_record() or _stack("checkpoints"):
            return f(*args, **kwargs)
        layer = getattr(f, "__self__", None)  # a Layer's call (or an op's)
        if not hasattr(layer, "losses"):
            layer = None
        losses_before = len(layer.losses) if layer is not None else 0
        context = [global_state.get_global_attribute(name)
                   for name in keras_context]
        leaves = tf.nest.flatten((args, kwargs))
        at = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)]

        def run(*tensors):
            filled = list(leaves)
            for i, tensor in zip(at, tensors):
                filled[i] = tensor
            args_, kwargs_ = tf.nest.pack_sequence_as((args, kwargs), filled)
            with _pushed("checkpoints", f):
                return f(*args_, **kwargs_)

        @tf.custom_gradient
        def checkpointed(*tensors):
            # Keep no intermediate results; note the seeds drawn.
            with record.stop_recording(), _pushed("seeds", _Seeds()) as seeds:
                result = run(*tensors)

            def grad(*upstream, variables=None):
                first = upstream[0]
                if isinstance(first, tf.IndexedSlices):
                    first = first.values
                first = tf.reduce_sum(tf.cast(first, tf.float32))
                zero = tf.where(tf.equal(first, first), 0.0, float("nan"))
                again = [t + tf.cast(zero, t.dtype) if t.dtype.is_floating
                         else t for t in tensors]
                variables = list(variables or ())
                with _keras_globals(dict(zip(keras_context, context))), \
                        tf.GradientTape() as tape:
                    tape.watch([t for t in again if t.dtype.is_floating])
                    tape.watch(variables)
                    with _pushed("dependencies", zero), \
                            _pushed("seeds", _Seeds(seeds.values, True)) \
                            as replay, StatelessScope():
                        recomputed = run(*again)
                if replay.values:
                    raise RuntimeError(
                        "A recomputed layer drew fewer random seeds in the "
                        "backward pass than in its forward pass, so its "
                        "recomputation does not reproduce it. Leave it out "
                        "of keras.RematScope.")
                grads = tape.gradient(
                    recomputed, again + variables, output_gradients=upstream,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO)
                return grads[:len(again)], grads[len(again):]

            return result, grad

        result = checkpointed(*(leaves[i] for i in at))
        if layer is not None and len(layer.losses) > losses_before:
            raise ValueError(
                f"Layer {layer.name!r} adds a loss in call() (add_loss) and "
                "is recomputed (keras.RematScope): its forward pass runs "
                "without recording gradients, so that loss would get none. "
                "Leave this layer out of the RematScope (e.g. mode="
                "'list_of_layers' with the other layers' names).")
        return result

    return call


def patch_keras_remat(check_replay):
    """Makes Keras' rematerialization (`keras.RematScope`, `keras.remat`)
    work on the TF backend.

    Keras 3.15 rematerializes with `tf.recompute_grad(call)` called with the
    layer's keyword arguments (every layer gets `training=`), which
    `tf.custom_gradient` refuses in graph mode ("supports keywords arguments
    only when eager execution is enabled"): `RematScope(mode="full")` fails
    in any `fit`, even on one device (tests/test_recompute.py). And
    `tf.recompute_grad` would draw new Dropout masks in the recomputation.
    This replaces Keras' TF `remat` with `recompute` and lets
    `SeedGenerator.next` replay seeds inside a recomputation (calling
    `check_replay(generator)` first), once.
    """
    from keras.src.backend.tensorflow import core  # noqa: PLC0415
    from keras.src.random import seed_generator  # noqa: PLC0415

    if core.remat is recompute:
        return
    core.remat = recompute
    generator = seed_generator.SeedGenerator
    generator.next = functools.partialmethod(_next_seed, generator.next,
                                             check_replay)


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


def bind_model_strategy(model, strategy):
    """Makes `strategy` the one `model` was built under (Keras records it
    at construction; a model built outside any scope has none)."""
    model._distribute_strategy = strategy  # noqa: SLF001


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
    """The Keras layer whose `add_weight` is running, or None. When Keras
    defers a weight's initialisation (layers built by a symbolic call of a
    subclassed model), the layer that added the weight being initialised."""
    stack = getattr(_initializing, "layers", None)
    if stack:
        return stack[-1]
    owner = getattr(keras_variable_being_created(), "_tfpar_owner", None)
    return owner() if owner is not None else None


def _publish_adding_layers():
    from keras.src.layers import layer as layer_module  # noqa: PLC0415

    original = layer_module.Layer.add_weight
    if getattr(original, "_tfpar_wrapped", False):
        return

    def add_weight(self, *args, **kwargs):
        stack = _initializing.__dict__.setdefault("layers", [])
        stack.append(self)
        try:
            variable = original(self, *args, **kwargs)
        finally:
            stack.pop()
        variable._tfpar_owner = weakref.ref(self)  # noqa: SLF001
        return variable

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


def tf_initialized():
    """Whether TensorFlow's eager context (devices, cluster) is set up."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return context.context()._context_handle is not None  # noqa: SLF001


def functional_graph(model):
    """(nodes, inputs, outputs) of a functional or Sequential model.

    `nodes` are the graph's call nodes (input nodes excluded) in an order
    Keras itself executes them (deepest first); `inputs`/`outputs` are the
    model's flat lists of KerasTensors. Returns None for a model without a
    graph (subclassed, or a Sequential that was never given an input shape).
    """
    from keras.src.models import sequential  # noqa: PLC0415

    graph = model
    if isinstance(model, sequential.Sequential):
        graph = getattr(model, "_functional", None)
    nodes_by_depth = getattr(graph, "_nodes_by_depth", None)
    if graph is None or nodes_by_depth is None:
        return None
    nodes = [
        node
        for depth in sorted(nodes_by_depth, reverse=True)
        for node in nodes_by_depth[depth]
        if node.operation is not None and not node.is_input
    ]
    return nodes, list(graph.inputs), list(graph.outputs)


def node_inputs(node):
    """The KerasTensors a graph node reads."""
    return list(node.input_tensors)


def run_node(node, tensors, training):
    """Runs one functional graph node on concrete tensors.

    `tensors` maps id(KerasTensor) to a value; the node's outputs are added
    to it. `training` is passed to layers that take it, as Keras'
    Functional.call does.
    """
    from keras.src.models import functional  # noqa: PLC0415
    from keras.src import tree  # noqa: PLC0415

    args, kwargs = node.arguments.fill_in(tensors)
    if not tf.executing_eagerly():
        # A model built with an eager constant (e.g. `keras.ops.arange(n)`
        # added to a symbolic tensor) keeps that tensor in its graph; traced
        # into a DTensor function it would be captured and placed on
        # whatever mesh DTensor last defaulted to. Re-created in the graph,
        # it follows the mesh of the code being traced (a pipeline stage).
        args, kwargs = tree.map_structure(_as_graph_constant, (args, kwargs))
    outputs = functional.operation_fn(node.operation, training=training)(
        *args, **kwargs)
    for symbolic, value in zip(node.outputs, tree.flatten(outputs)):
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
    from keras.src import tree  # noqa: PLC0415
    from keras.src.models import sequential  # noqa: PLC0415

    graph = model._functional if isinstance(model, sequential.Sequential) else model  # noqa: SLF001
    return tree.pack_sequence_as(graph._outputs_struct, flat_outputs)  # noqa: SLF001


def optimizer_learning_rate_variable(optimizer):
    """The variable holding a Keras optimizer's learning rate, or None when
    it is a schedule (computed from `iterations`)."""
    value = getattr(optimizer, "_learning_rate", None)
    return value if hasattr(value, "assign") else None


# -- tensor parallelism: layer inputs; DTensor's compiled programs -----------


def transform_layer_inputs(layer, name, transform):
    """Makes `layer` call its `call` on `transform(first input)`; once per
    `name`.

    Like `transform_layer_outputs`, wraps this one layer object's `call`
    (keeping its signature); the first input is the first positional
    argument, or the first parameter of `call` when passed by keyword.
    """
    import inspect  # noqa: PLC0415

    applied = layer.__dict__.setdefault("_tfpar_input_transforms", set())
    if name in applied:
        return
    original_call = layer.call
    first = next(iter(inspect.signature(original_call).parameters), None)

    @functools.wraps(original_call)
    def call(*args, **kwargs):
        if args:
            args = (transform(args[0]),) + tuple(args[1:])
        elif first in kwargs:
            kwargs[first] = transform(kwargs[first])
        return original_call(*args, **kwargs)

    layer.call = call
    applied.add(name)


def runtime_function_names():
    """Names of every function in the eager context's function library."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return context.context().list_function_names()


def runtime_function_def(name):
    """The FunctionDef named `name` in the eager context's library."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return context.context().get_function_def(name)


def traced_function_name(concrete_function):
    """The library name of a traced `tf.function` (a ConcreteFunction)."""
    name = concrete_function.function_def.signature.name
    return name.decode() if isinstance(name, bytes) else name


def dtensor_expanded_wrappers(traced_name):
    """Names of the functions DTensor made by SPMD-expanding `traced_name`.

    TF 2.21's DTensor device, the first time it runs a traced function on a
    mesh, registers in the eager context a wrapper named
    `<traced name>__func_<fingerprint>_<n>` that calls the expanded
    per-device program (`_func_<fingerprint>`, every collective in it).
    """
    prefix = traced_name + "__func_"
    return [n for n in runtime_function_names() if n.startswith(prefix)]


def _op_def(node):
    from tensorflow.python.framework import op_def_registry  # noqa: PLC0415

    return op_def_registry.get(node.op)


def op_output_offsets(node):
    """{output argument name: flat index of its first tensor} of a NodeDef
    (FunctionDef bodies reference outputs as "node:argument:i")."""
    op_def = _op_def(node)
    offsets, index = {}, 0
    for arg in (op_def.output_arg if op_def else []):
        offsets[arg.name] = index
        if arg.number_attr:
            index += node.attr[arg.number_attr].i
        elif arg.type_list_attr:
            index += len(node.attr[arg.type_list_attr].list.type)
        else:
            index += 1
    return offsets


def op_output_dtypes(node):
    """The dtypes of a NodeDef's outputs, flat ([] for unknown ops)."""
    op_def = _op_def(node)
    types = []
    for arg in (op_def.output_arg if op_def else []):
        if arg.type_list_attr:
            types.extend(node.attr[arg.type_list_attr].list.type)
            continue
        single = node.attr[arg.type_attr].type if arg.type_attr else arg.type
        count = node.attr[arg.number_attr].i if arg.number_attr else 1
        types.extend([single] * count)
    return [tf.as_dtype(t) for t in types]


class OpEvents:
    """Records the TF ops executed in its `with` block (TF's profiler, host
    tracer level 3: every op kernel, named by its name scope).

    After the block, `events` holds (op name, start seconds, end seconds)
    of every executed op. The xplane protobuf it reads is TF-private.
    """

    def __init__(self):
        self.events = []
        self._directory = None

    def __enter__(self):
        import tempfile  # noqa: PLC0415

        self._directory = tempfile.mkdtemp(prefix="tfpar_trace_")
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=3)
        try:
            tf.profiler.experimental.start(self._directory, options=options)
        except Exception as error:  # noqa: BLE001 (already profiling, ...)
            raise RuntimeError(
                "record_timeline needs TF's profiler, which would not start "
                f"({error}). Stop any other profiler session first."
            ) from error
        return self

    def __exit__(self, *exc):
        import glob  # noqa: PLC0415
        import shutil  # noqa: PLC0415

        from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415

        tf.profiler.experimental.stop()
        try:
            for path in glob.glob(f"{self._directory}/**/*.xplane.pb",
                                  recursive=True):
                space = xplane_pb2.XSpace()
                with open(path, "rb") as f:
                    space.ParseFromString(f.read())
                for plane in space.planes:
                    names = plane.event_metadata
                    for line in plane.lines:
                        base = line.timestamp_ns * 1e-9
                        for event in line.events:
                            start = base + event.offset_ps * 1e-12
                            self.events.append((
                                names[event.metadata_id].name, start,
                                start + event.duration_ps * 1e-12))
        finally:
            shutil.rmtree(self._directory, ignore_errors=True)
        return False


# Names in TF 2.21's DTensor-expanded programs (tfpar/communication.py):
# tf.GradientTape puts gradient ops under this name scope; DTensor names the
# nodes it inserts "<op>/DTensor<Collective>Op_<n>" and their group-key
# lookups ".../group_key"; a zero-padded all-gather's blocks are written by
# nodes named "...DTensorAllGatherOp...". The expanded function's first
# argument is the device id.
GRADIENT_SCOPE = "gradient_tape/"
DTENSOR_ALL_GATHER_NODE = "DTensorAllGatherOp"
DTENSOR_INSERTED_NODE = r"DTensor\w*Op|group_key"



def layer_transforms(layer):
    """Names of the input/output transforms tfpar applied to `layer`."""
    return (layer.__dict__.get("_tfpar_output_transforms", set())
            | layer.__dict__.get("_tfpar_input_transforms", set()))


# Read by DTensor's MLIR lowering each time it compiles a function: an
# all-gather then compiles to a CollectiveGatherV2 instead of an all-reduce
# of zero-padded blocks (sends (n-1)/n of the tensor instead of 2(n-1)/n).
# TF 2.21 then fails to compile a relayout that gathers over two mesh axes at
# once (tests/dtensor_sp_collectives_repro.py), so tfpar turns it on only
# while it runs a step that may compile (a new input signature) on a mesh
# with a single axis of size > 1. The variable is process-wide: a DTensor
# function another thread compiles at that moment gets it too.
_GATHER_LOWERING = "LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2"


@contextlib.contextmanager
def collective_all_gathers(enabled):
    """All-gathers compiled in this block are CollectiveGatherV2 ops."""
    import os  # noqa: PLC0415

    if not enabled or os.environ.get(_GATHER_LOWERING) == "1":
        yield
        return
    outer = os.environ.get(_GATHER_LOWERING)
    os.environ[_GATHER_LOWERING] = "1"
    try:
        yield
    finally:
        if outer is None:
            del os.environ[_GATHER_LOWERING]
        else:
            os.environ[_GATHER_LOWERING] = outer


# -- log noise -----------------------------------------------------------------

# TF 2.21 logs through absl: each time DTensor SPMD-expands a step for a new
# input shape or layout it logs two INFO lines ("DTensor cache key lookup
# missed for __inference__in_replica_... (re-)computing its SPMD
# transformation") straight to stderr, into Keras' progress bar. Nothing in
# them is actionable. The level that filters them, TF_CPP_MIN_LOG_LEVEL, is
# read once when TensorFlow loads (before tfpar, when `import keras` comes
# first), so tfpar raises absl's minimum level from INFO to WARNING while its
# steps run, through absl's exported C++ API. Warnings and errors still show.
_ABSL_SET_MIN = rb"_ZN4absl\d+lts_\d+14SetMinLogLevelENS0_18LogSeverityAtLeastE"
_ABSL_GET_MIN = rb"_ZN4absl\d+lts_\d+11MinLogLevelEv"
_absl_log_level = []  # [(get, set)] once looked up; [None] if unavailable


def _absl_min_log_level_functions():
    """absl's (MinLogLevel, SetMinLogLevel) in TensorFlow's C++ library, or
    None. The absl version is part of the mangled names, so they are read
    from the library file."""
    if _absl_log_level:
        return _absl_log_level[0]
    import ctypes  # noqa: PLC0415
    import mmap  # noqa: PLC0415
    import os  # noqa: PLC0415
    import re  # noqa: PLC0415

    functions = None
    path = os.path.join(tf.sysconfig.get_lib(), "libtensorflow_framework.so.2")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                              access=mmap.ACCESS_READ) as m:
            found = [re.search(p, m) for p in (_ABSL_GET_MIN, _ABSL_SET_MIN)]
            names = [n.group().decode() for n in found if n is not None]
        if len(names) == 2:
            library = ctypes.CDLL(path)  # already loaded: the same handle
            get, set_ = (getattr(library, name) for name in names)
            get.restype, get.argtypes = ctypes.c_int, []
            set_.restype, set_.argtypes = None, [ctypes.c_int]
            functions = (get, set_)
    except (OSError, AttributeError):
        pass  # another TF build: its INFO lines stay
    _absl_log_level.append(functions)
    return functions


_ABSL_WARNING = 1  # absl::LogSeverityAtLeast::kWarning (kInfo is 0)


@contextlib.contextmanager
def quiet_cpp_info_logs():
    """TensorFlow's C++ INFO lines are dropped inside the block (WARNING
    and above still print), unless the user set TF_CPP_MIN_LOG_LEVEL or
    TF_CPP_MAX_VLOG_LEVEL: then the logging is theirs to choose."""
    import os  # noqa: PLC0415

    functions = None
    if not any(v in os.environ
               for v in ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL")):
        functions = _absl_min_log_level_functions()
    if functions is None:
        yield
        return
    get, set_ = functions
    before = get()
    set_(max(before, _ABSL_WARNING))
    try:
        yield
    finally:
        set_(before)
