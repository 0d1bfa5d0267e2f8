"""Every private TensorFlow or Keras hook tfpar uses, in one place.

A TensorFlow upgrade that moves one of these touches only this file (and
the patch factories of the features that own them). Checked against
tensorflow 2.21. What is here: one-line shims named for the private
attribute or module they reach (e.g. `functional_of`, `inbound_nodes`,
`optimizer_strategy`), short helpers that encode a TF 2.21 internal (the
names DTensor gives its ops), and the patch registry (`Patch`,
`install_group`, `in_graph_step_instead`, `unpatched`, `uninstall`).
Imports no tfpar module.

The patches themselves live with the features that own them, each a tuple
of `Patch`es installed through `install_group`: routing and the SPMD
stand-ins in `tfpar.patches` and `tfpar.spmd_patches` (installed by the
first `ParallelStrategy`), `tfpar.recompute.REMAT_PATCHES` (the strategy,
or `tfpar.recompute.install()`), `tfpar.offload.master.MASTER_PATCHES`
(a strategy with offload="optimizer+master"), and keras.distribution's in
`tfpar.keras_distribution` (its import is the opt-in). The two that publish
the Keras variable being created are in `tfpar.variable_creation`.
`tests/test_architecture.py` checks that no function here but a patch
factory is over 15 lines.
"""

import collections
import contextlib
import functools
import importlib
import inspect

import keras
import tensorflow as tf
from tensorflow.dtensor.python import d_variable
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.eager import record

# The base classes tf.distribute strategies are built from.
StrategyExtendedV2 = distribute_lib.StrategyExtendedV2
DVariable = d_variable.DVariable


def require_cross_replica_or_default_context(extended):
    """Raises unless called outside `strategy.run` (as `run` itself must be)."""
    distribute_lib._require_cross_replica_or_default_context_extended(extended)  # noqa: SLF001


# -- the patch registry ------------------------------------------------------
#
# Each patch is a `Patch`: the object to change (a function returning it, so
# nothing is imported before it is needed), the attribute, and a factory
# `make(original, hooks)` of the replacement, `hooks` being what the
# replacement asks of the feature installing it. A group is installed once
# (`install_group`), by the first strategy (so `import tfpar` alone changes
# nothing) or by a documented opt-in; `uninstall()` restores every
# original, in reverse order (for tests).


class Patch(collections.namedtuple("Patch", "name owner attribute make")):
    """`owner().attribute = make(original, hooks)`, undone by `uninstall`."""


class Absent:
    """The owner of a patch whose optional package (keras-hub, or one of
    its models) is not installed: patching it changes nothing."""


def optional_owner(module, name=None):
    """A `Patch` owner: `module` imported when the patch is installed (its
    attribute `name`, if given), or `Absent` when that import or attribute
    is missing — tfpar runs without keras-hub.

    >>> optional_owner("no_such_package.models")() is Absent
    True
    """
    def owner():
        try:
            found = importlib.import_module(module)
            return found if name is None else getattr(found, name)
        except (ImportError, AttributeError):
            return Absent

    return owner


_ABSENT = object()  # the attribute was inherited, not set on the owner
_originals = {}  # (id(owner), attribute) -> (owner, attribute, own value)
_installed = set()  # names of the patch groups installed


def _replace(owner, attribute, make):
    """Sets `owner.attribute = make(current value, None if it has none)`
    unless tfpar did already, recording the owner's own value (or its
    absence) for `uninstall`."""
    key = (id(owner), attribute)
    if key in _originals:
        return
    _originals[key] = (owner, attribute, vars(owner).get(attribute, _ABSENT))
    setattr(owner, attribute, make(getattr(owner, attribute, None)))


def unpatched(owner, attribute):
    """`owner.attribute` as it was before tfpar replaced it (the current
    value when tfpar did not)."""
    record = _originals.get((id(owner), attribute))
    if record is None or record[2] is _ABSENT:
        return getattr(owner, attribute)
    return record[2]


def install_group(group, patches, hooks):
    """Applies `patches` (Patch tuples) as the group named `group`, their
    factories given `hooks`; once per group (undone by `uninstall`).
    Whether it installed them now (False: installed before)."""
    if group in _installed:
        return False
    _installed.add(group)
    for patch in patches:
        _replace(patch.owner(), patch.attribute,
                 lambda original, p=patch: p.make(original, hooks))
    return True


def in_graph_step_instead(stand_in):
    """A `Patch` factory for a stand-in of the same arguments: in a graph
    step (`hooks.in_graph_step()`) the replacement returns
    `stand_in(original, *arguments)`, the call's arguments bound to the
    original's signature, in its order and with its defaults (so a call by
    keyword reaches the stand-in's parameter of the same place, whatever
    its name); elsewhere it returns the original's result.

    >>> class InStep:
    ...     in_graph_step = staticmethod(lambda: True)
    >>> make = in_graph_step_instead(lambda original, x, k: -original(x, k))
    >>> make(lambda x, k=2: x * k, InStep())(3, k=5)
    -15
    """
    def make(original, hooks):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def in_step(*args, **kwargs):
            if not hooks.in_graph_step():
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return stand_in(original, *bound.args, **bound.kwargs)

        return in_step

    return make


def keras_module(path):
    """Keras' private module `keras.src.<path>` (e.g.
    "backend.tensorflow.core")."""
    return importlib.import_module(f"keras.src.{path}")


def tf_python_module(path):
    """TensorFlow's private module `tensorflow.python.<path>`."""
    return importlib.import_module(f"tensorflow.python.{path}")


def tape_recording():
    """Whether a gradient tape could record the ops run now (TF's private
    `record.could_possibly_record`): a training step's forward pass, not
    an inference step's."""
    return tf_python_module("eager.record").could_possibly_record()


def async_wait():
    """Waits until every op this host dispatched has run (TF's private
    `context.async_wait`: a step call returns before its collectives
    complete)."""
    tf_python_module("eager.context").async_wait()


def keras_tf_core():
    """Keras' TensorFlow backend core module (its `Variable`, `remat`,
    `slice_update`): the owner several patches replace attributes of."""
    return keras_module("backend.tensorflow.core")


def uninstall():
    """Restores every Keras/TF attribute tfpar replaced (all groups, and
    the keras-hub `make_generate_function`s routed since)."""
    for owner, attribute, value in reversed(list(_originals.values())):
        if value is _ABSENT:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, value)
    _originals.clear()
    _installed.clear()


# -- recomputation (tfpar/recompute.py): Keras' per-thread state, TF's tape --


def keras_global(name):
    """Keras' per-thread global attribute `name` (e.g. "current_call_ctx")."""
    return keras_global_state().get_global_attribute(name)


@contextlib.contextmanager
def keras_globals(values):
    """Keras' per-thread global attributes set to `values` ({name: value})
    inside the block, restored after it."""
    global_state = keras_global_state()
    saved = {name: global_state.get_global_attribute(name) for name in values}
    for name, value in values.items():
        global_state.set_global_attribute(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            global_state.set_global_attribute(name, value)


def stop_recording():
    """A block in which no gradient tape records."""
    return record.stop_recording()


def bind_model_strategy(model, strategy):
    """Makes `strategy` the one `model` was built under (Keras records it
    at construction; a model built outside any scope has none)."""
    model._distribute_strategy = strategy  # noqa: SLF001


def all_layers(layer, include_self=True):
    """`layer` and every layer nested in it, outermost first."""
    return list(layer._flatten_layers(include_self=include_self,  # noqa: SLF001
                                      recursive=True))


# The methods Keras' `Layer.__call__` runs: `call`, or `quantized_call`
# for a layer quantized by Keras' `quantize` (which never runs `call`). A
# hook of a layer's calls wraps both.
CALL_METHODS = ("call", "quantized_call")


def kernel_variable(layer):
    """A Dense or EinsumDense layer's kernel variable (None: it has none).
    Keras' `kernel` property is a new tensor when LoRA is enabled (the
    kernel plus its factors' product); the variable is `_kernel`."""
    kernel = getattr(layer, "_kernel", None)
    return kernel if kernel is not None else getattr(layer, "kernel", None)


def trained_weights(layer):
    """The weights of `layer` that training updates: those whose variable
    is trainable, as Keras' `Model.trainable_weights` reads them. A
    layer's own `trainable_weights` is empty when the layer is frozen,
    even where a sublayer was made trainable again after (keras-hub's
    `enable_lora` freezes every block, then unfreezes the LoRA targets).

    >>> import keras
    >>> block = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> block.trainable = False
    >>> block.layers[0].trainable = True
    >>> len(block.trainable_weights), len(trained_weights(block))
    (0, 2)
    """
    return [w for w in getattr(layer, "weights", []) if w.trainable]


def backing_variable(variable):
    """The tf.Variable behind a Keras Variable (or `variable` itself)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def keras_autocasts(variable):
    """Whether Keras casts `variable` to a layer's compute dtype in use
    (its `autocast`, Keras' default for a layer's weights)."""
    return bool(getattr(variable, "_autocast", False))


def rebind_keras_variable(keras_variable, tf_variable):
    """Makes `keras_variable` store its value in `tf_variable` from now on."""
    keras_variable._value = tf_variable  # noqa: SLF001


def tf_initialized():
    """Whether TensorFlow's eager context (devices, cluster) is set up."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return context.context()._context_handle is not None  # noqa: SLF001


def eager_context_token():
    """An object standing for TF's current eager context; a new one after
    `context._reset_context()` (what TF's, Keras' and DTensor's test classes
    call between tests)."""
    return eager_context_state("token", object)


def eager_context_state(name, factory):
    """A value kept as an attribute of TF's current eager context (made by
    `factory()` on first use), so it dies with the context: a fresh one
    after `context._reset_context()`."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    ctx = context.context()
    attribute = f"_tfpar_{name}"
    value = getattr(ctx, attribute, None)
    if value is None:
        value = factory()
        setattr(ctx, attribute, value)
    return value


def ensure_dtensor_device():
    """Makes DTensor's process-wide custom device belong to the current
    eager context.

    DTensor creates one device per process (`api._dtensor_singleton`) and
    registers it with the context current at that time. After a context
    reset the new context does not know it, and every DTensor op fails
    ("CUSTOM:0 unknown device", "Could not find device for node
    Relayout"). Dropping it makes DTensor create and register a new one
    on its next use, as in a fresh process (DTensor's own test utilities
    do the same with `reset_dtensor()`).
    """
    from tensorflow.dtensor.python import api  # noqa: PLC0415
    from tensorflow.python.eager import context  # noqa: PLC0415

    device = api._dtensor_singleton  # noqa: SLF001
    if device is not None and not context.context().is_custom_device(
            device.name):
        api._reset()  # noqa: SLF001


# -- Keras' layer graph (tfpar/keras_graph.py) ---------------------------------


def functional_of(model):
    """The functional graph of `model`: itself, or a Sequential's inner
    Functional (None when the Sequential was never given an input shape)."""
    return getattr(model, "_functional", None) if isinstance(
        model, keras.Sequential) else model


def nodes_by_depth(graph):
    """{depth: [Node]} of a functional graph (None for a subclassed model)."""
    return getattr(graph, "_nodes_by_depth", None)


def inputs_struct(graph):
    """The nested structure of a functional graph's inputs, or None."""
    return getattr(graph, "_inputs_struct", None)


def outputs_struct(graph):
    """The nested structure of a functional graph's outputs."""
    return graph._outputs_struct  # noqa: SLF001


def inbound_nodes(layer):
    """The graph nodes of `layer`'s symbolic calls."""
    return getattr(layer, "_inbound_nodes", [])


def keras_mask(tensor):
    """The Keras mask `tensor` carries (its `_keras_mask`), or None."""
    return keras_module("backend.common.masking").get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    """Sets the Keras mask `tensor` carries (None: none)."""
    keras_module("backend.common.masking").set_keras_mask(tensor, mask)


def graph_runner(graph):
    """What a Functional's `call` runs its graph with: its
    `_run_through_graph(inputs, operation_fn, call_fn)`, bound."""
    return graph._run_through_graph  # noqa: SLF001


def set_graph_runner(graph, runner):
    """`runner` in place of this Functional's `_run_through_graph` (None:
    Keras' own again); set on the instance, untracked by Keras."""
    if runner is None:
        vars(graph).pop("_run_through_graph", None)
    else:
        object.__setattr__(graph, "_run_through_graph", runner)


def operation_fn(operation, training):
    """`operation` as Keras' Functional.call calls it (`training` passed
    to layers that take it)."""
    from keras.src.models import functional  # noqa: PLC0415

    return functional.operation_fn(operation, training=training)


def optimizer_strategy(optimizer):
    """The tf.distribute strategy a Keras TF optimizer was created under
    (None when it records none)."""
    return getattr(optimizer, "_distribution_strategy", None)


def weight_decay_exclusions(optimizer):
    """What `optimizer.exclude_from_weight_decay` set, which Keras keeps on
    the instance and not in its config: (the excluded variables' keys, as
    `optimizer._var_key` gives them; the compiled name pattern or None)."""
    return (set(getattr(optimizer, "_exclude_from_weight_decay", ()) or ()),
            getattr(optimizer, "_exclude_from_weight_decay_pattern", None))


def set_weight_decay_exclusions(optimizer, keys, pattern):
    """Sets what `weight_decay_exclusions` reads (Keras' setter refuses a
    built optimizer and takes variables, not keys), emptying the cache of
    the answers Keras gave from the previous exclusions."""
    optimizer._exclude_from_weight_decay = set(keys)
    optimizer._exclude_from_weight_decay_pattern = pattern
    optimizer._exclude_from_weight_decay_cache = {}


def optimizer_variable_key(optimizer, variable):
    """The key a Keras optimizer files `variable` under (its slots, its
    weight-decay exclusions)."""
    return optimizer._var_key(variable)


def optimizer_learning_rate_variable(optimizer):
    """The variable holding a Keras optimizer's learning rate, or None when
    it is a schedule (computed from `iterations`)."""
    value = getattr(optimizer, "_learning_rate", None)
    return value if hasattr(value, "assign") else None


# -- DTensor's compiled programs (tfpar/reports/program.py) -----------------


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


def profiler_xspaces(directory):
    """The XSpace protobufs (TF-private `xplane_pb2`) TF's profiler wrote
    under `directory`, parsed (`tfpar.pipeline.profiler` reads their
    events)."""
    import glob  # noqa: PLC0415

    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415

    spaces = []
    for path in glob.glob(f"{directory}/**/*.xplane.pb", recursive=True):
        with open(path, "rb") as f:
            spaces.append(xplane_pb2.XSpace.FromString(f.read()))
    return spaces


# Names in TF 2.21's DTensor-expanded programs (tfpar/reports/program.py):
# tf.GradientTape puts gradient ops under this name scope; DTensor names the
# nodes it inserts "<op>/DTensor<Collective>Op_<n>" and their group-key
# lookups ".../group_key"; a zero-padded all-gather's blocks are written by
# nodes named "...DTensorAllGatherOp...". The expanded function's first
# argument is the device id, "device_id" (none on a mesh of one device).
GRADIENT_SCOPE = "gradient_tape/"
DTENSOR_ALL_GATHER_NODE = "DTensorAllGatherOp"
DTENSOR_INSERTED_NODE = r"DTensor\w*Op|group_key"
DTENSOR_DEVICE_ID_ARG = "device_id"


def backward_uses(tensor):
    """[(op, input index)] of the gradient ops (under tf.GradientTape's name
    scope) of `tensor`'s graph that read it."""
    return [(op, i) for op in tensor.consumers() if GRADIENT_SCOPE in op.name
            for i, t in enumerate(op.inputs) if t is tensor]


def forward_readers(tensor):
    """The ops of `tensor`'s graph that read it, gradient ops left out."""
    return [op for op in tensor.consumers() if GRADIENT_SCOPE not in op.name]


def relayout_op(gathered):
    """The DTensor Relayout op whose result `gathered`, the output of a
    `tf.custom_gradient` function (an IdentityN of it), forwards."""
    tensor = gathered
    while tensor.op.type in ("IdentityN", "Identity"):
        tensor = tensor.op.inputs[tensor.value_index
                                  if tensor.op.type == "IdentityN" else 0]
    op = tensor.op
    if op.type != "Relayout":
        raise RuntimeError(
            f"Expected a DTensor Relayout op behind {gathered.name!r}; "
            f"found {op.type!r} ({op.name!r}). This TensorFlow builds "
            "custom gradients or relayouts differently than 2.21.")
    return op


def depends_on(tensor, op):
    """Whether graph tensor `tensor` is computed from graph op `op`. Ops are
    numbered as they are made (TF-private `Operation._id`), and an op only
    reads older ones, so the search stops at ops older than `op`."""
    seen, stack = set(), [tensor.op]
    while stack:
        current = stack.pop()
        if current is op:
            return True
        if current._id < op._id or current in seen:  # noqa: SLF001
            continue
        seen.add(current)
        stack.extend(t.op for t in current.inputs)
        stack.extend(current.control_inputs)
    return False


def rewire_input(op, index, tensor):
    """Makes graph op `op` read `tensor` as its input `index` (TF-private
    `Operation._update_input`: the op is already built)."""
    op._update_input(index, tensor)  # noqa: SLF001


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


# -- Keras' global state and rematerialization ------------------------------


def keras_global_state():
    """Keras' per-thread global state (the module
    `keras.src.backend.common.global_state`)."""
    return keras_module("backend.common.global_state")


def forget_uninitialized_variables(variables):
    """Drops `variables` from Keras' list of variables that a
    `StatelessScope(initialize_variables=False)` left uninitialised (the
    planner's shape-only models), so nothing ever allocates them."""
    from keras.src.backend.common import global_state  # noqa: PLC0415

    pending = global_state.get_global_attribute("uninitialized_variables")
    if pending:
        gone = {id(v) for v in variables}
        global_state.set_global_attribute(
            "uninitialized_variables", [v for v in pending if id(v) not in gone])


def set_remat_mode(layer, mode):
    """Makes `layer` recompute in the backward pass as if it had been built
    inside `keras.RematScope(mode=mode)` (Keras reads `_remat_mode` at call
    time)."""
    from keras.src.backend.common import remat  # noqa: PLC0415

    layer._remat_mode = (  # noqa: SLF001
        remat.RematMode(mode, 1024, None) if mode else None)


@contextlib.contextmanager
def remat_off():
    """Keras' rematerialization off for the block: its TF `remat(f)` (what
    `keras.RematScope` layers and `keras.remat` call, at call time) is `f`
    itself; restored after, whichever `remat` (TF's or tfpar's) it was."""
    core = keras_tf_core()
    current = core.remat
    core.remat = lambda f: f
    try:
        yield
    finally:
        core.remat = current


def remat_mode(layer):
    """The `keras.RematScope` mode `layer` was built in (a RematMode
    namedtuple: mode, output size threshold, layer names), or None."""
    return getattr(layer, "_remat_mode", None)

