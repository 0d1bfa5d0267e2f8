"""Reading a compiled DTensor step: its expanded per-device programs.

DTensor turns a step written for global tensors into one per-device SPMD
program per mesh and registers it in the runtime's function library. This
module finds those programs — `program_for_traced` and
`programs_for_traced` of a traced function DTensor ran, `keras_program` and
`keras_programs` of one training step of a Keras model, compiled and run as
`fit` does — and reads them (`Program`): the nodes in program order, which
node produces and which reads each tensor, what is computed from the batch
and what depends on the gradient computation, the collectives with their
mesh axes, group size, per-device shape and bytes (`Collective`), and the
forward tensors the backward pass reads. `tfpar.reports.communication`
(`communication_report`), `tfpar.reports.memory` (`memory_report`) and
`tfpar.reports.pipeline_memory` (a `PipelineModel`'s) are written on it.

A node is named by its key, (function name, node name): a program spans the
expanded function and every function it calls. Bytes of a collective: see
`tfpar.reports.communication`.
"""

import collections
import re

import numpy as np
import tensorflow as tf

from tfpar import _compat
from tfpar import strategy as strategy_lib
from tfpar import training

# The collective ops DTensor emits, by what they do.
COLLECTIVE_KINDS = {
    "CollectiveReduceV2": "all-reduce",
    "CollectiveGatherV2": "all-gather",
    "CollectiveReduceScatterV2": "reduce-scatter",
    "CollectiveAllToAllV2": "all-to-all",
}
# Ops whose output is (a view of) their input: one buffer, counted once.
VIEW_OPS = {"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims",
            "StopGradient", "Snapshot", "PreventGradient", "EnsureShape"}
# Producers whose outputs are not activations: weights, constants.
NOT_ACTIVATIONS = {"ReadVariableOp", "Const", "VarHandleOp", "_Arg",
                   "ResourceGather", "NoOp"}
# The name scope of the gradient computation's nodes.
BACKWARD_MARK = _compat.GRADIENT_SCOPE
# Nodes DTensor adds around its collectives (e.g. ".../DTensorAllGatherOp_1").
_DTENSOR_NODE = re.compile(_compat.DTENSOR_INSERTED_NODE)
_GATHER_MARK = _compat.DTENSOR_ALL_GATHER_NODE


class Collective(collections.namedtuple(
        "Collective", "name op kind purpose axes group_size shape dtype "
                      "bytes ring_bytes phase")):
    """One collective of a compiled step, as one device sees it.

    Attributes:
        name: the node name DTensor gave it (it starts with the name of the
            op it serves, e.g. "gpt/b0_down/MatMul/DTensorAllReduceOp_...").
        op: the TF op that runs, e.g. "CollectiveReduceV2".
        kind: what that op does: "all-reduce", "all-gather",
            "reduce-scatter" or "all-to-all".
        purpose: what DTensor asked for. Differs from `kind` where DTensor
            emulates: "all-gather" (an all-reduce of zero-padded blocks) or
            "reduce-scatter" (an all-reduce whose result is then sliced).
        axes: the mesh axes the group spans, e.g. ("model",); None if
            unknown.
        group_size: devices per group.
        shape: the per-device shape of the tensor the device sends in.
        dtype: its `tf.DType`.
        bytes: the message size (see `tfpar.reports.communication`).
        ring_bytes: bytes each device sends in a ring implementation.
        phase: "forward", or "backward" for collectives that depend on the
            gradient computation (optimizer updates included).
    """


def program_for_traced(traced_name):
    """The expanded per-device `Program` of the traced function
    `traced_name`, once DTensor ran it.

    Raises RuntimeError when DTensor has not expanded it (not yet run, or
    not run on a mesh)."""
    return Program(_expanded_wrappers(traced_name)[-1])


def programs_for_traced(traced_name):
    """The expanded per-device programs of `traced_name`, one per mesh it
    runs on (a `PipelineModel`'s step: one per stage mesh; DTensor expands
    a function over several meshes into one program per mesh), in the
    order DTensor registered them (the last expansion of each mesh)."""
    programs = {}
    for wrapper in _expanded_wrappers(traced_name):
        program = Program(wrapper)
        programs[program.devices] = program
    return list(programs.values())


def _expanded_wrappers(traced_name):
    wrappers = _compat.dtensor_expanded_wrappers(traced_name)
    if not wrappers:
        raise RuntimeError(
            f"No DTensor-expanded program of {traced_name!r} found in this "
            "process. Received: a function that was not run on a DTensor "
            "mesh (or a TensorFlow whose DTensor names expanded functions "
            "differently than 2.21). Run it on DTensor inputs first."
        )
    return wrappers


# -- reading the expanded program ---------------------------------------------


class Program:
    """The expanded per-device program DTensor built from a traced function:
    the nodes of the function the wrapper `wrapper` calls, and of every
    function that one calls in turn.

    Attributes:
        name: the expanded function's name.
        mesh: (axis names, sizes) of its mesh, or None.
        devices: the mesh's devices, short names ("CPU:0"), in mesh order.
        nodes: {node key: NodeDef}.
        order: the node keys in program order.
        args: the (function, input arg name) pairs of every function.
        data_args: the expanded function's arguments that carry the step's
            data (not DTensor's device id, not resources).
        consumers: {node key: keys of the nodes reading its outputs}.
    """

    def __init__(self, wrapper):
        fdef = _compat.runtime_function_def(wrapper)
        calls = [n for n in fdef.node_def if n.attr["f"].func.name]
        if len(calls) != 1:
            raise RuntimeError(
                f"Expected DTensor's wrapper {wrapper!r} to call one expanded "
                f"function; it calls {len(calls)}. Received: ops "
                f"{[n.op for n in fdef.node_def]}. This TensorFlow lays its "
                "expanded programs out differently than 2.21."
            )
        call = calls[0]
        self.name = call.attr["f"].func.name
        mesh = call.attr["_mesh"].s.decode() if "_mesh" in call.attr else ""
        self.mesh = _parse_mesh(mesh)
        self.devices = tuple(d.rsplit("device:", 1)[-1]
                             for d in mesh.split("|")[4].split(",")
                             ) if mesh.count("|") >= 4 else ()
        # The wrapper's arguments: DTensor's device id (not on a mesh of
        # one device), then the data inputs and the resources.
        wrapper_args = list(fdef.signature.input_arg)
        data = {a.name for a in wrapper_args
                if a.name != _compat.DTENSOR_DEVICE_ID_ARG
                and a.type != tf.resource.as_datatype_enum}
        self.nodes = {}       # (function, node name) -> NodeDef
        self.order = []       # keys in program order
        self.args = set()     # (function, input arg name)
        self._visit(self.name, set())
        root_args = _compat.runtime_function_def(self.name).signature.input_arg
        self.data_args = [arg.name for arg, ref in zip(root_args, call.input)
                          if ref.split(":")[0] in data]
        self.consumers = collections.defaultdict(list)
        for key in self.order:
            for ref in self.nodes[key].input:
                if not ref.startswith("^"):
                    self.consumers[(key[0], ref.split(":")[0])].append(key)

    def _visit(self, function, seen):
        if function in seen:
            return
        seen.add(function)
        fdef = _compat.runtime_function_def(function)
        self.args.update((function, a.name) for a in fdef.signature.input_arg)
        for node in fdef.node_def:
            key = (function, node.name)
            self.nodes[key] = node
            self.order.append(key)
            for called in _called_functions(node):
                self._visit(called, seen)

    def producer(self, key, ref):
        """(node key, output index) that input `ref` of node `key` reads,
        or None for a function argument."""
        function = key[0]
        name = ref.split(":")[0]
        if (function, name) in self.args or (function, name) not in self.nodes:
            return None
        node = self.nodes[(function, name)]
        return (function, name), _output_index(node, ref)

    def owner(self, key, index):
        """The buffer output `index` of node `key` is a view of: follows
        views (Identity, Reshape, ...) back to the (node key, output index)
        that owns it; None for function arguments (inputs, variables)."""
        for _ in range(64):
            node = self.nodes[key]
            if node.op not in VIEW_OPS:
                return key, index
            inputs = [i for i in node.input if not i.startswith("^")]
            ref = inputs[index if node.op == "IdentityN" else 0]
            hit = self.producer(key, ref)
            if hit is None:
                return None
            key, index = hit
        return key, index

    def downstream(self, start):
        """The keys `start` and every node computed from them."""
        seen, stack = set(start), list(start)
        while stack:
            for consumer in self.consumers.get(stack.pop(), []):
                if consumer not in seen:
                    seen.add(consumer)
                    stack.append(consumer)
        return seen

    def batch_dependent_nodes(self):
        """Keys of nodes computed from the step's data inputs."""
        return self.downstream(
            [k for name in self.data_args
             for k in self.consumers.get((self.name, name), [])])

    def backward_nodes(self):
        """Keys of nodes that depend on the gradient computation."""
        return self.downstream(
            [k for k in self.order if BACKWARD_MARK in k[1]])

    def forward_shapes(self, backward, from_batch):
        """{node name: per-device shape of its first output} of the forward
        ops of the model computed from the batch (`from_batch`; not in
        `backward`; DTensor's own bookkeeping, e.g. group keys, left
        out)."""
        return {
            key[1]: shapes[0] for key in self.order
            if key not in backward and key in from_batch
            and not _DTENSOR_NODE.search(key[1])
            and (shapes := output_shapes(self.nodes[key]))
            and shapes[0] is not None
        }

    def saved_activations(self, backward, from_batch):
        """{"<owner node name>:<output index>": (shape, dtype)} of the
        forward buffers computed `from_batch` (node keys) that nodes of
        `backward` read (weights, constants and views left out)."""
        saved = {}
        for key in self.order:
            if key not in backward:
                continue
            for ref in self.nodes[key].input:
                if ref.startswith("^"):
                    continue
                hit = self.producer(key, ref)
                hit = hit and self.owner(*hit)
                if hit is None or hit[0] in backward or hit[0] not in from_batch:
                    continue
                node = self.nodes[hit[0]]
                if node.op in NOT_ACTIVATIONS:
                    continue
                size = output_size(node, hit[1])
                if size is not None:
                    saved[f"{hit[0][1]}:{hit[1]}"] = size
        return saved

    # -- collectives ----------------------------------------------------------

    def collectives(self, backward):
        """The `Collective`s of the program, in program order; those in
        `backward` (node keys) are of phase "backward"."""
        return [
            self.collective(key, "backward" if key in backward else "forward")
            for key in self.order if self.nodes[key].op in COLLECTIVE_KINDS
        ]

    def all_gathers(self):
        """Keys of the collectives DTensor asked to all-gather (whatever op
        runs them: see `Collective.purpose`)."""
        return [key for key in self.order
                if self.nodes[key].op in COLLECTIVE_KINDS
                and self.purpose(key) == "all-gather"]

    def collective(self, key, phase):
        """The `Collective` of collective node `key`."""
        node = self.nodes[key]
        kind = COLLECTIVE_KINDS[node.op]
        dtype = tf.as_dtype(node.attr["T"].type)
        group_size = self._const_int(key, node.input[1])
        out = output_shapes(node)[0]
        n = group_size or 1
        if kind == "all-gather":      # input block: dimension 0 is 1/n
            shape = (out[0] // n,) + tuple(out[1:])
            message = nbytes(out, dtype)
        elif kind == "reduce-scatter":  # output block: dimension 0 is 1/n
            shape = (out[0] * n,) + tuple(out[1:])
            message = nbytes(shape, dtype)
        else:
            shape = tuple(out)
            message = nbytes(shape, dtype)
        factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
        return Collective(
            name=node.name, op=node.op, kind=kind,
            purpose=self.purpose(key), axes=self._axes(key, node),
            group_size=group_size, shape=shape, dtype=dtype, bytes=message,
            ring_bytes=message * factor, phase=phase)

    def purpose(self, key):
        """What DTensor asked collective node `key` for (its op's kind but
        where DTensor emulates: see `Collective.purpose`)."""
        kind = COLLECTIVE_KINDS[self.nodes[key].op]
        if kind != "all-reduce":
            return kind
        if self._sums_gathered_blocks(key) or _GATHER_MARK in key[1]:
            return "all-gather"
        # DTensor's reduce-scatter on CPU: all-reduce, then keep a slice
        # (possibly of a reshaped view).
        users, frontier = [], [key]
        while frontier:
            for user in self.consumers.get(frontier.pop(), []):
                if self.nodes[user].op in VIEW_OPS:
                    frontier.append(user)
                else:
                    users.append(self.nodes[user])
        if users and all(u.op in ("Slice", "StridedSlice") for u in users):
            return "reduce-scatter"
        return kind

    def _sums_gathered_blocks(self, key):
        """Whether all-reduce `key` is DTensor's zero-padded all-gather: the
        reduced buffer is built by "...DTensorAllGatherOp..." updates of a
        zero tensor (possibly several gathers summed into one
        all-reduce)."""
        frontier, seen = [key], set()
        for _ in range(3):
            next_frontier = []
            for k in frontier:
                for ref in self.nodes[k].input:
                    if ref.startswith("^"):
                        continue
                    hit = self.producer(k, ref)
                    if hit is None or hit[0] in seen:
                        continue
                    seen.add(hit[0])
                    if _GATHER_MARK in hit[0][1]:
                        return True
                    if self.nodes[hit[0]].op in ("AddV2", "AddN", "Identity"):
                        next_frontier.append(hit[0])
            frontier = next_frontier
        return False

    def _const_int(self, key, ref):
        hit = self.producer(key, ref)
        if hit is None or self.nodes[hit[0]].op != "Const":
            return None
        return int(tf.make_ndarray(self.nodes[hit[0]].attr["value"].tensor))

    def _axes(self, key, node):
        """Mesh axes the group spans, from DTensor's per-device group keys."""
        mesh = _mesh_of(node) or self.mesh
        if mesh is None:
            return None
        names, sizes = mesh
        devices = int(np.prod(sizes))
        table = self._group_key_table(key, node.input[2], devices)
        if table is None:
            return None
        coords = np.array(np.unravel_index(np.arange(devices), sizes)).T
        first = [d for d in range(devices) if table[d] == table[0]]
        varying = tuple(
            name for i, name in enumerate(names)
            if len({tuple(coords[d])[i] for d in first}) > 1)
        return varying

    def _group_key_table(self, key, ref, devices):
        """The constant {device: group key} table DTensor looks the
        device's group key up in (a constant key: one group)."""
        frontier = [(key, ref)]
        for depth in range(5):
            next_frontier = []
            for k, r in frontier:
                hit = self.producer(k, r)
                if hit is None:
                    continue
                node = self.nodes[hit[0]]
                if node.op == "Const":
                    value = tf.make_ndarray(node.attr["value"].tensor)
                    if depth == 0 and value.ndim == 0:
                        return np.zeros(devices, int)
                    if value.shape == (devices,):
                        return value
                    continue
                next_frontier.extend(
                    (hit[0], i) for i in node.input if not i.startswith("^"))
            frontier = next_frontier
        return None


def _called_functions(node):
    for value in node.attr.values():
        if value.HasField("func") and value.func.name:
            yield value.func.name
        if value.HasField("list"):
            for f in value.list.func:
                yield f.name


# -- shapes and bytes ---------------------------------------------------------


def output_shapes(node):
    """The per-device shapes of `node`'s outputs (None where unknown)."""
    shapes = node.attr["_output_shapes"].list.shape if "_output_shapes" in node.attr else []
    return [None if s.unknown_rank or any(d.size < 0 for d in s.dim)
            else tuple(d.size for d in s.dim) for s in shapes]


def output_dtype(node, index):
    """The `tf.DType` of output `index` of `node`, None if unknown."""
    types = _compat.op_output_dtypes(node)
    return types[index] if index < len(types) else None


def output_size(node, index):
    """(shape, dtype) of output `index` of `node`; None if unknown or not a
    buffer of values (a resource or variant)."""
    shapes = output_shapes(node)
    dtype = output_dtype(node, index)
    if index >= len(shapes) or shapes[index] is None or dtype is None:
        return None
    if dtype.name in ("resource", "variant"):
        return None
    return shapes[index], dtype


def nbytes(shape, dtype):
    """Bytes of a tensor of `shape` and `dtype` (0 for an unknown shape)."""
    return int(np.prod(shape, dtype=np.int64)) * dtype.size if shape is not None else 0


def _output_index(node, ref):
    """The flat output index that the reference "node:arg:i" reads."""
    parts = ref.split(":")
    if len(parts) < 3:
        return 0
    arg, index = parts[1], int(parts[2])
    offsets = _compat.op_output_offsets(node)
    return offsets.get(arg, 0) + index


def _mesh_of(node):
    """(axis names, sizes) from the "_layout" DTensor attached to `node`."""
    if "_layout" not in node.attr or not node.attr["_layout"].list.s:
        return None
    text = node.attr["_layout"].list.s[0].decode()
    return _parse_mesh(text.split("mesh:", 1)[-1])


def _parse_mesh(text):
    """(axis names, sizes) of a DTensor mesh string
    "<name>|data=2,model=4|<global ids>|<local ids>|<devices>"."""
    parts = text.split("|")
    if len(parts) < 2 or "=" not in parts[1]:
        return None
    names, sizes = [], []
    for dim in parts[1].split(","):
        name, size = dim.split("=")
        names.append(name)
        sizes.append(int(size))
    return names, sizes


# -- the program of a Keras model's training step ------------------------------


def keras_program(model, x, y=None, sample_weight=None,
                  caller="communication_report"):
    """The expanded `Program` of one training step of `model` on `(x, y)`,
    compiled and run as `fit` does; the model's variables are put back
    afterwards. `caller` names the report in error messages."""
    if isinstance(model, training.StagedModel):
        raise ValueError(
            f"{caller} reads one SPMD program, and {model.name!r} is a "
            "tfpar.PipelineModel, whose step is one program per stage. "
            "Received: a PipelineModel. Use tfpar.memory_report (per "
            "stage) or report the unwrapped model on a mesh without a "
            "pipeline axis.")
    return keras_programs(model, x, y, sample_weight, caller)[-1]


def keras_programs(model, x, y=None, sample_weight=None,
                   caller="memory_report"):
    """The expanded `Program`s (one per mesh: a `PipelineModel`'s one per
    stage) of one training step of `model` on `(x, y)`, compiled and run
    as `fit` does; the model's variables are put back afterwards."""
    strategy = getattr(model, "_distribute_strategy", None)
    if not isinstance(strategy, strategy_lib.ParallelStrategy):
        raise ValueError(
            f"{caller} reads the DTensor program of a model "
            f"built under a tfpar.ParallelStrategy; {model.name!r} was built "
            f"under {type(strategy).__name__ if strategy else 'no strategy'}. "
            "Build and compile it inside `with strategy.scope():`."
        )
    if not model.compiled:
        raise ValueError(
            f"{caller} runs a training step of {model.name!r}, "
            "which is not compiled. Received: an uncompiled model. Call "
            "model.compile(optimizer=..., loss=...) first."
        )
    extended = strategy.extended
    data = tuple(v for v in (x, y, sample_weight) if v is not None)
    data = data[0] if len(data) == 1 else data
    host = tf.nest.map_structure(tf.convert_to_tensor, data)
    extended.input_placer.check_batch_size(host)
    if isinstance(model, training.StagedModel):
        model.stage_optimizers  # noqa: B018 (builds one per part)
    elif not model.optimizer.built:
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)
    # The step `fit` runs, built by the runner `fit` uses.
    runner = extended.make_runner(model, "train")
    state = _state_variables(model)
    # (Of an offload="optimizer+master" weight its float32 master:
    # `tfpar.offload.master.ComputeCopy`.)
    saved = [tf.identity(_saved_source(v).read_value()) for v in state]
    known = {id(v) for v in state}
    try:
        concrete = runner.traced_step(host)
        return programs_for_traced(_compat.traced_function_name(concrete))
    finally:
        for variable, value in zip(state, saved):
            _compat.backing_variable(variable).assign(value)
        for metric in model.metrics:  # built by the step: back to empty
            if any(id(v) not in known for v in metric.variables):
                metric.reset_state()


def _saved_source(variable):
    """The tf.Variable whose value puts `variable` back when assigned."""
    backing = _compat.backing_variable(variable)
    return getattr(backing, "master", backing)


def _state_variables(model):
    seen, out = set(), []
    optimizers = (model.stage_optimizers if isinstance(
        model, training.StagedModel) else [model.optimizer])
    groups = [model.variables, *(o.variables for o in optimizers),
              getattr(model, "metrics_variables", []),
              model.tied_copy_state() if isinstance(
                  model, training.StagedModel) else []]
    for variable in (v for group in groups for v in group):
        if id(variable) not in seen:
            seen.add(id(variable))
            out.append(variable)
    return out
