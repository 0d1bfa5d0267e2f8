"""Communication you can check: the collectives of a compiled step.

DTensor turns a step written for global tensors into one per-device SPMD
program and inserts the collectives itself. `communication_report` reads
that program — the function DTensor actually compiled, taken from the
runtime's function library in this process, not re-derived from the model
— and lists every collective with its mesh axes, group size, per-device
shape, dtype and bytes, plus the forward activations the backward pass
keeps, per device.

Bytes, for a collective over a group of n devices (each device's own view):

- all-reduce of a tensor of B bytes (every device contributes and receives
  B): `bytes` = B; a ring all-reduce sends `ring_bytes` = 2(n-1)/n * B per
  device (a reduce-scatter then an all-gather, each (n-1)/n * B).
- all-gather of blocks of B/n bytes into B bytes: `bytes` = B,
  `ring_bytes` = (n-1)/n * B.
- reduce-scatter of B bytes into blocks of B/n: `bytes` = B,
  `ring_bytes` = (n-1)/n * B.
- all-to-all of B bytes: `bytes` = B, `ring_bytes` = (n-1)/n * B (every
  device keeps 1/n and sends the rest).

Megatron-LM's tensor parallelism needs, per transformer layer and step,
2 all-reduces forward and 2 backward of the b*s*h activation
(`megatron_tp_bytes`); tensor-parallel steps compiled by DTensor match it
(tests/test_collectives.py). For sequence parallelism DTensor on TF 2.21
compiles, on CPU (and on GPU without NCCL), an all-gather as an all-reduce
of zero-padded blocks and a reduce-scatter as an all-reduce followed by a
slice. (The environment variable LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2
makes all-gathers real CollectiveGatherV2 ops, but then a relayout that
gathers over two mesh axes at once fails to compile; see
tests/dtensor_sp_collectives_repro.py. tfpar sets it while compiling fsdp
steps on one-axis meshes, where no gather spans two axes, and so does the
report of such a model.) Each report row therefore names both the op that
runs (`kind`) and what DTensor asked for (`purpose`).

Example (one Megatron pair: one all-reduce forward; its input is data, so
none backward):

>>> import keras, numpy as np, tfpar
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"model": 8}), rules={
...     r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
...     r".*down/kernel": ("model", None)})
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((16,)),
...         keras.layers.Dense(64, activation="relu", name="up"),
...         keras.layers.Dense(16, name="down")])
...     model.compile(optimizer="sgd", loss="mse")
>>> x = np.ones((8, 16), "float32")
>>> report = tfpar.communication_report(model, x, x)
>>> report.count(axes=("model",))
1
>>> report.total_bytes()            # the (8, 16) float32 output, once
512
>>> print(report)                   # one row per collective, then totals
"""

import collections
import re

import numpy as np
import tensorflow as tf

from tfpar import _compat
from tfpar import training

_KINDS = {
    "CollectiveReduceV2": "all-reduce",
    "CollectiveGatherV2": "all-gather",
    "CollectiveReduceScatterV2": "reduce-scatter",
    "CollectiveAllToAllV2": "all-to-all",
}
# Ops whose output is (a view of) their input: one buffer, counted once.
_ALIASES = {"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims",
            "StopGradient", "Snapshot", "PreventGradient", "EnsureShape"}
# Producers whose outputs are not activations: weights, constants.
_NOT_ACTIVATIONS = {"ReadVariableOp", "Const", "VarHandleOp", "_Arg",
                    "ResourceGather", "NoOp"}
_BACKWARD_MARK = _compat.GRADIENT_SCOPE
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
        bytes: the message size (see the module docstring).
        ring_bytes: bytes each device sends in a ring implementation.
        phase: "forward", or "backward" for collectives that depend on the
            gradient computation (optimizer updates included).
    """


class CommunicationReport:
    """The collectives and saved activations of one compiled step.

    Attributes:
        collectives: list of `Collective`, in program order.
        saved_activation_bytes: bytes, per device, of the distinct forward
            tensors that backward ops read (what a training step keeps alive
            between its forward and backward passes; weights and inputs
            excluded; views such as reshapes counted once).
        saved_activations: {node name: (per-device shape, dtype)} of them.
        function_name: the expanded function the figures come from.
    """

    def __init__(self, collectives, saved_activations, forward_shapes,
                 function_name):
        self.collectives = list(collectives)
        self.saved_activations = dict(saved_activations)
        self._forward_shapes = forward_shapes
        self.function_name = function_name

    @property
    def saved_activation_bytes(self):
        return sum(_nbytes(shape, dtype)
                   for shape, dtype in self.saved_activations.values())

    def select(self, kind=None, purpose=None, axes=None, phase=None,
               spans=None):
        """The collectives matching every filter given.

        Args:
            kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all".
            purpose: what DTensor asked for (see `Collective`).
            axes: exactly these mesh axes, e.g. ("model",).
            spans: a mesh axis the group includes (possibly with others).
            phase: "forward" or "backward".
        """
        if axes is not None:
            axes = tuple(axes)
        return [c for c in self.collectives
                if (kind is None or c.kind == kind)
                and (purpose is None or c.purpose == purpose)
                and (axes is None or c.axes == axes)
                and (spans is None or spans in (c.axes or ()))
                and (phase is None or c.phase == phase)]

    def count(self, **filters):
        """How many collectives match `filters` (see `select`)."""
        return len(self.select(**filters))

    def total_bytes(self, **filters):
        """Sum of `bytes` of the collectives matching `filters`."""
        return sum(c.bytes for c in self.select(**filters))

    def total_ring_bytes(self, **filters):
        """Sum of `ring_bytes` (sent per device) matching `filters`."""
        return sum(c.ring_bytes for c in self.select(**filters))

    def forward_shapes(self, pattern):
        """{node name: per-device shape} of the model's forward ops (those
        computed from the batch; DTensor's own nodes left out) whose name
        matches the regex `pattern` (re.search), e.g. r"b0_ln2_1/"."""
        regex = re.compile(pattern)
        return {name: shape for name, shape in self._forward_shapes.items()
                if regex.search(name)}

    def __str__(self):
        rows = [f"{'phase':8s} {'kind':14s} {'purpose':14s} {'axes':10s} "
                f"{'n':>2s} {'shape':18s} {'dtype':8s} {'bytes':>10s} "
                f"{'ring B/dev':>10s}"]
        for c in self.collectives:
            axes = ",".join(c.axes) if c.axes else "?"
            rows.append(
                f"{c.phase:8s} {c.kind:14s} {c.purpose:14s} {axes:10s} "
                f"{c.group_size:2d} {str(list(c.shape)):18s} "
                f"{c.dtype.name:8s} {c.bytes:10d} {c.ring_bytes:10.0f}")
        rows.append(
            f"total: {len(self.collectives)} collectives, "
            f"{self.total_bytes()} bytes, {self.total_ring_bytes():.0f} sent "
            f"per device (ring); saved activations "
            f"{self.saved_activation_bytes} bytes per device")
        return "\n".join(rows)

    def __repr__(self):
        return (f"<CommunicationReport {len(self.collectives)} collectives, "
                f"{self.total_bytes()} bytes>")


def communication_report(target, *args, **kwargs):
    """Collectives and saved activations of a compiled DTensor step.

    Two forms:

    - `communication_report(model, x, y=None, sample_weight=None)`: a Keras
      model compiled under a `tfpar.ParallelStrategy`. Compiles and runs one
      training step on the global batch `(x, y)` exactly as `fit` builds it
      (`model.train_step` in the strategy's SPMD replica scope), then puts
      every variable it changed back (weights, optimizer state, metrics):
      the model is left as it was. The batch must split over the data axis.
    - `communication_report(function, *args, **kwargs)`: a `tf.function`
      taking DTensors (e.g. a custom loop's step). It is called once.

    Example (see the module docstring for a complete one):

    >>> report = tfpar.communication_report(model, x[:16], y[:16])
    >>> report.count(axes=("model",), phase="backward")
    >>> report.saved_activation_bytes   # per device

    Returns:
        A `CommunicationReport`.
    """
    if hasattr(target, "get_concrete_function"):
        target(*args, **kwargs)
        concrete = target.get_concrete_function(*args, **kwargs)
        return report_for_traced(_compat.traced_function_name(concrete))
    if _is_keras_model(target):
        return keras_program(target, *args, caller="communication_report",
                             **kwargs).report()
    raise TypeError(
        "communication_report needs a Keras model compiled under a "
        "tfpar.ParallelStrategy, or a tf.function. Received: "
        f"{type(target).__name__}. Pass the model (and a batch) or wrap "
        "your step in tf.function."
    )


class capture:  # noqa: N801 (used as a context manager, like a function)
    """Records the DTensor programs compiled inside a `with` block.

    For reading the exact step `fit` compiles (or a custom loop's): every
    traced function that DTensor expands and runs for the first time inside
    the block is recorded.

    Example:

    >>> with tfpar.communication.capture() as programs:
    ...     model.fit(x, y, batch_size=16, epochs=1)
    >>> report = programs.train_report()
    >>> report.count(axes=("model",), phase="forward")
    """

    def __init__(self):
        self._before = None
        self.names = []

    def __enter__(self):
        self._before = set(_compat.runtime_function_names())
        return self

    def __exit__(self, *exc):
        self.names = [
            name for name in _compat.runtime_function_names()
            if name not in self._before and name.startswith("__inference_")
            and "__func_" in name
        ]
        return False

    def reports(self):
        """A `CommunicationReport` per program compiled in the block."""
        return [_Program(name).report() for name in self.names]

    def train_report(self):
        """The report of the one compiled program with a backward pass."""
        reports = [r for r in self.reports()
                   if any(c.phase == "backward" for c in r.collectives)
                   or r.saved_activations]
        if len(reports) != 1:
            raise RuntimeError(
                "capture().train_report() needs exactly one training step "
                "compiled inside the block. Received: "
                f"{len(reports)} among {self.names}. Was the step compiled "
                "before the block (then nothing new is compiled), or did "
                "the block train several models?"
            )
        return reports[0]


def megatron_tp_bytes(batch, seq_len, hidden, layers, model_axis,
                      dtype_bytes=4):
    """Megatron-LM's tensor-parallel traffic per step, for comparison.

    Per transformer layer: 2 all-reduces forward (after attention and after
    the MLP) and 2 backward (of their input gradients), each of the b*s*h
    activation. Ring all-reduce: each device sends 2(n-1)/n of it.

    Returns:
        dict(count=4L, bytes=4L*b*s*h*dtype_bytes, ring_bytes=bytes*2(n-1)/n).
    """
    message = batch * seq_len * hidden * dtype_bytes
    count = 4 * layers
    n = model_axis
    return {"count": count, "bytes": count * message,
            "ring_bytes": count * message * 2 * (n - 1) / n}


def report_for_traced(traced_name):
    """The report of the traced function `traced_name`, once DTensor ran it.

    Raises RuntimeError when DTensor has not expanded it (not yet run, or
    not run on a mesh)."""
    return program_for_traced(traced_name).report()


def program_for_traced(traced_name):
    """The expanded per-device program (a `_Program`) of `traced_name`."""
    return _Program(_expanded_wrappers(traced_name)[-1])


def programs_for_traced(traced_name):
    """The expanded per-device programs of `traced_name`, one per mesh it
    runs on (a `PipelineModel`'s step: one per stage mesh; DTensor expands
    a function over several meshes into one program per mesh), in the
    order DTensor registered them (the last expansion of each mesh)."""
    programs = {}
    for wrapper in _expanded_wrappers(traced_name):
        program = _Program(wrapper)
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


class _Program:
    """The expanded per-device program DTensor built from a traced function:
    the nodes of the function the wrapper `name` calls, and of every
    function that one calls in turn."""

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
        # The mesh's devices, short names ("CPU:0"), in mesh order.
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

    def batch_dependent_nodes(self):
        """Keys of nodes computed from the step's data inputs."""
        return self._downstream(
            [k for name in self.data_args
             for k in self.consumers.get((self.name, name), [])])

    def _downstream(self, start):
        seen, stack = set(start), list(start)
        while stack:
            for consumer in self.consumers.get(stack.pop(), []):
                if consumer not in seen:
                    seen.add(consumer)
                    stack.append(consumer)
        return seen

    def backward_nodes(self):
        """Keys of nodes that depend on the gradient computation."""
        return self._downstream(
            [k for k in self.order if _BACKWARD_MARK in k[1]])

    def report(self):
        backward = self.backward_nodes()
        collectives = [
            self._collective(key, "backward" if key in backward else "forward")
            for key in self.order if self.nodes[key].op in _KINDS
        ]
        saved = self._saved_activations(backward)
        # Forward ops of the model computed from the batch (DTensor's own
        # bookkeeping, e.g. group keys, left out).
        from_batch = self.batch_dependent_nodes()
        forward_shapes = {
            key[1]: shapes[0] for key in self.order
            if key not in backward and key in from_batch
            and not _DTENSOR_NODE.search(key[1])
            and (shapes := _output_shapes(self.nodes[key]))
            and shapes[0] is not None
        }
        return CommunicationReport(collectives, saved, forward_shapes,
                                   self.name)

    def _collective(self, key, phase):
        node = self.nodes[key]
        kind = _KINDS[node.op]
        dtype = tf.as_dtype(node.attr["T"].type)
        group_size = self._const_int(key, node.input[1])
        out = _output_shapes(node)[0]
        n = group_size or 1
        if kind == "all-gather":      # input block: dimension 0 is 1/n
            shape = (out[0] // n,) + tuple(out[1:])
            message = _nbytes(out, dtype)
        elif kind == "reduce-scatter":  # output block: dimension 0 is 1/n
            shape = (out[0] * n,) + tuple(out[1:])
            message = _nbytes(shape, dtype)
        else:
            shape = tuple(out)
            message = _nbytes(shape, dtype)
        factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
        return Collective(
            name=node.name, op=node.op, kind=kind,
            purpose=self._purpose(key, kind), axes=self._axes(key, node),
            group_size=group_size, shape=shape, dtype=dtype, bytes=message,
            ring_bytes=message * factor, phase=phase)

    def _purpose(self, key, kind):
        if kind != "all-reduce":
            return kind
        # DTensor's zero-padded all-gather: the reduced buffer is built by
        # "...DTensorAllGatherOp..." updates of a zero tensor (possibly
        # several gathers summed into one all-reduce).
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
                        return "all-gather"
                    if self.nodes[hit[0]].op in ("AddV2", "AddN", "Identity"):
                        next_frontier.append(hit[0])
            frontier = next_frontier
        if _GATHER_MARK in key[1]:
            return "all-gather"
        # DTensor's reduce-scatter on CPU: all-reduce, then keep a slice
        # (possibly of a reshaped view).
        users, frontier = [], [key]
        while frontier:
            for user in self.consumers.get(frontier.pop(), []):
                if self.nodes[user].op in _ALIASES:
                    frontier.append(user)
                else:
                    users.append(self.nodes[user])
        if users and all(u.op in ("Slice", "StridedSlice") for u in users):
            return "reduce-scatter"
        return kind

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

    def _saved_activations(self, backward):
        """{owner node name: (shape, dtype)} of forward buffers that
        backward nodes read."""
        saved = {}
        from_batch = self.batch_dependent_nodes()
        for key in self.order:
            if key not in backward:
                continue
            for ref in self.nodes[key].input:
                if ref.startswith("^"):
                    continue
                hit = self.producer(key, ref)
                hit = hit and self._owner(*hit)
                if hit is None or hit[0] in backward or hit[0] not in from_batch:
                    continue
                node = self.nodes[hit[0]]
                if node.op in _NOT_ACTIVATIONS:
                    continue
                shapes = _output_shapes(node)
                if hit[1] >= len(shapes) or shapes[hit[1]] is None:
                    continue
                dtype = _output_dtype(node, hit[1])
                if dtype is None or dtype in (tf.resource, tf.variant):
                    continue
                saved[f"{hit[0][1]}:{hit[1]}"] = (shapes[hit[1]], dtype)
        return saved

    def _owner(self, key, index):
        """Follows views (Identity, Reshape, ...) back to the buffer owner;
        None for function arguments (inputs, variables)."""
        for _ in range(64):
            node = self.nodes[key]
            if node.op not in _ALIASES:
                return key, index
            inputs = [i for i in node.input if not i.startswith("^")]
            ref = inputs[index if node.op == "IdentityN" else 0]
            hit = self.producer(key, ref)
            if hit is None:
                return None
            key, index = hit
        return key, index


def _called_functions(node):
    for value in node.attr.values():
        if value.HasField("func") and value.func.name:
            yield value.func.name
        if value.HasField("list"):
            for f in value.list.func:
                yield f.name


def _output_shapes(node):
    shapes = node.attr["_output_shapes"].list.shape if "_output_shapes" in node.attr else []
    return [None if s.unknown_rank or any(d.size < 0 for d in s.dim)
            else tuple(d.size for d in s.dim) for s in shapes]


def _output_index(node, ref):
    """The flat output index that the reference "node:arg:i" reads."""
    parts = ref.split(":")
    if len(parts) < 3:
        return 0
    arg, index = parts[1], int(parts[2])
    offsets = _compat.op_output_offsets(node)
    return offsets.get(arg, 0) + index


def _output_dtype(node, index):
    types = _compat.op_output_dtypes(node)
    return types[index] if index < len(types) else None


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


def _nbytes(shape, dtype):
    return int(np.prod(shape, dtype=np.int64)) * dtype.size if shape is not None else 0


def _is_keras_model(target):
    import keras  # noqa: PLC0415

    return isinstance(target, keras.Model)


def keras_program(model, x, y=None, sample_weight=None,
                  caller="communication_report"):
    """The expanded program (a `_Program`) of one training step of `model`
    on `(x, y)`, compiled and run as `fit` does; the model's variables are
    put back afterwards."""
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
    """The expanded programs (`_Program`s, one per mesh: a `PipelineModel`'s
    one per stage) of one training step of `model` on `(x, y)`, compiled
    and run as `fit` does; the model's variables are put back afterwards."""
    from tfpar import strategy as strategy_lib  # noqa: PLC0415

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
    # `tfpar.offload_master.ComputeCopy`.)
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
