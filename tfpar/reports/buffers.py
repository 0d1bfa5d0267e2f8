"""What both memory reports share: the report, its rows and the buffers.

`MemoryReport` ({device: {kind: bytes}}, see `tfpar.reports.memory` for each
kind) and how a row is made (`device_memory`, `host_update_memory`,
`batch_bytes`), and the accounting of an expanded program's buffers
(`tfpar.reports.program.Program`): the order its ops run in (`run_order`),
who reads each buffer (`readers_of`), when it lives (`buffer_interval`),
the bytes live after each op (`live_bytes`) and the all-gathered weights
the backward pass reads (`saved_gathered`). Used by `tfpar.reports.memory`
(one SPMD program) and `tfpar.reports.pipeline_memory` (one per stage).
"""

import collections
import re

import numpy as np
import tensorflow as tf

from tfpar import _compat
from tfpar.reports import program as program_lib

KINDS = ("params", "gradients", "optimizer", "other", "activations",
         "gathered", "peak")
# Producers whose outputs need no buffer of their own in the step.
_NO_BUFFER = {"ReadVariableOp", "Const", "VarHandleOp", "_Arg", "NoOp",
              "AssignVariableOp", "AssignAddVariableOp",
              "AssignSubVariableOp"}


class MemoryReport(dict):
    """{device name: {kind: bytes}} of one training step (see
    `tfpar.reports.memory` for each kind).

    Attributes:
        by_layer: {layer scope: {"activations": bytes, "gathered": bytes}}
            per device, from the names of the saved tensors' ops.
        live: bytes of the step's tensors live after each op, in the order
            the analysis ran them (variables not included).
        communication: the `tfpar.CommunicationReport` of the same program
            (its collectives, e.g. the all-gathers).
        function_name: the expanded function the figures come from.
        stages: of a `PipelineModel`, one `tfpar.reports.pipeline_memory.
            StageMemory` per stage program (`live`, `communication` and
            `function_name` are then those of the stage with the highest
            peak, `by_layer` is per micro-batch); None otherwise.
    """

    def __init__(self, per_device, by_layer, live, communication_report,
                 function_name, stages=None):
        super().__init__(per_device)
        self.by_layer = dict(by_layer)
        self.live = list(live)
        self.communication = communication_report
        self.function_name = function_name
        self.stages = stages

    def __str__(self):
        """One row per device, then one per layer, named in full (the
        layer paths the weights' paths start with)."""
        mb = lambda n: f"{n / 2**20:10.3f}"  # noqa: E731
        width = max([len("layer (MiB per device)"), *map(len, self),
                     *map(len, self.by_layer)])
        rows = [f"{'device (MiB)':{width}s}"
                + "".join(f" {k:>10s}" for k in KINDS)]
        for device, kinds in self.items():
            rows.append(f"{device:{width}s}" + "".join(
                " " + mb(kinds[k]) for k in KINDS))
        if self.by_layer:
            rows.append(f"{'layer (MiB per device)':{width}s}"
                        f" {'activations':>10s} {'gathered':>10s}")
            for layer, kinds in sorted(self.by_layer.items()):
                rows.append(f"{layer:{width}s} {mb(kinds['activations'])} "
                            f"{mb(kinds['gathered'])}")
        return "\n".join(rows)

    def plot(self, path):
        """Saves a PNG: bytes by kind per device, and the live bytes of the
        step's tensors over its ops (needs matplotlib)."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
            from matplotlib.figure import Figure  # noqa: PLC0415
        except ImportError as error:
            raise ImportError(
                "MemoryReport.plot (memory_report(path=...)) needs "
                "matplotlib: pip install matplotlib.") from error
        figure = Figure(figsize=(10, 4))
        FigureCanvasAgg(figure)
        bars, line = figure.subplots(1, 2)
        devices = list(self)
        bottom = [0.0] * len(devices)
        for kind in KINDS[:-1]:
            heights = [self[d][kind] / 2**20 for d in devices]
            bars.bar(range(len(devices)), heights, bottom=bottom, label=kind)
            bottom = [b + h for b, h in zip(bottom, heights)]
        bars.plot(range(len(devices)), [self[d]["peak"] / 2**20
                                        for d in devices], "k_", ms=20,
                  label="peak")
        bars.set_xticks(range(len(devices)),
                        [d.split("/")[-1] for d in devices], rotation=90)
        bars.set_ylabel("MiB per device")
        bars.legend(fontsize="small")
        for label, live in ([(f"stage {i}", stage.live) for i, stage
                             in enumerate(self.stages)] if self.stages
                            else [("step", self.live)]):
            line.plot([b / 2**20 for b in live], label=label)
        line.legend(fontsize="small")
        line.set_xlabel("op (program order)")
        line.set_ylabel("MiB of live tensors")
        figure.tight_layout()
        figure.savefig(path, format="png")


def batch_bytes(data):
    """Bytes of the host tensors in `data` (a structure; None skipped)."""
    return sum(tf.convert_to_tensor(t).dtype.size * int(np.prod(np.shape(t)))
               for t in tf.nest.flatten([d for d in data if d is not None]))


def device_memory(held, activations, gathered, transient):
    """The report row of a mesh device holding `held` (its
    `memory_per_device()` row): gradients laid out like the stored
    weights, the peak its variables plus `transient` (the step's live
    tensors at their most, and the batch blocks it holds)."""
    return {"params": held["params"], "gradients": held["params"],
            "optimizer": held["optimizer"], "other": held["other"],
            "activations": activations, "gathered": gathered,
            "peak": (held["params"] + held["optimizer"] + held["other"]
                     + transient)}


def host_update_memory(held):
    """A host device of `offload="optimizer"` (`tfpar.offload`): the
    weights' copy, the gradients moved there (laid out like the weights)
    and the optimizer state, all live in its update (whose temporaries are
    not counted); no activations, no gathered weights."""
    return {"params": held["params"], "gradients": held["params"],
            "optimizer": held["optimizer"], "other": held["other"],
            "activations": 0, "gathered": 0,
            "peak": 2 * held["params"] + held["optimizer"] + held["other"]}


def layer_scope(tensor_name):
    """"gpt_1/b0_up_1/MatMul:0" -> "gpt_1/b0_up_1" (the op's name scope)."""
    return tensor_name.split(":")[0].rsplit("/", 1)[0]


# A name scope TF made unique in a graph: "query_1" for a second "query".
_UNIQUIFIED = re.compile(r"_\d+$")


class LayerPaths:
    """Op names read as the paths of the layers that made them: the names
    the layers' weights' paths start with (`layer.path`), not the name
    scopes of the traced step, which TF made unique with `_1` suffixes.

    "gpt2_causal_lm_1/gpt2_backbone_1/transformer_layer_0_1/
    self_attention_1/query_1/einsum/Einsum:0" of a keras-hub GPT-2 reads
    "transformer_layer_0/self_attention/query". Each scope component is
    matched to a layer nested in the one before, by its name or by its name
    without the `_<n>` suffix TF added: the bare name first when the
    model's own scope had that suffix (then "dense_1" is auto-named layer
    "dense"'s scope, not layer "dense_1"'s), else the name as it is; what
    follows the innermost layer (the op's own scopes) is dropped. A scope
    whose first component is no layer of `model` keeps its first two
    components (e.g. "compile_loss/sparse_categorical_crossentropy").

    Example:

    >>> paths = LayerPaths(model)
    >>> paths("sequential_1/up_1/MatMul:0")
    'up'
    """

    def __init__(self, model):
        self._model = model
        self._nested = {}  # id(layer) -> the layers nested in it

    def __call__(self, tensor_name):
        scope = layer_scope(tensor_name)
        components = scope.split("/")
        layer, path = self._model, None
        uniquified = False  # whether TF suffixed the model's own scope
        if _matches(components[0], self._model.name):
            uniquified = components[0] != self._model.name
            components, path = components[1:], self._model.name
        for component in components:
            inner = self._find(layer, component, uniquified)
            if inner is None:
                break
            path = inner.path or (inner.name if layer is self._model
                                  else f"{path}/{inner.name}")
            layer = inner
        if path is None:  # not a layer's: its first two scopes
            return "/".join(scope.split("/")[:2])
        return path

    def _find(self, layer, component, uniquified):
        """The layer nested in `layer` that scope `component` names; its
        name without TF's suffix is tried first when `uniquified`."""
        if id(layer) not in self._nested:
            self._nested[id(layer)] = _compat.all_layers(layer,
                                                         include_self=False)
        nested = self._nested[id(layer)]
        bare = _UNIQUIFIED.sub("", component)
        for name in ((bare, component) if uniquified else (component, bare)):
            inner = next((inner for inner in nested if inner.name == name),
                         None)
            if inner is not None:
                return inner
        return None


def _matches(component, name):
    """Whether scope `component` is layer `name`'s, perhaps made unique."""
    return component == name or _UNIQUIFIED.sub("", component) == name


def saved_gathered(program, backward, from_batch=None):
    """{(node key, output index): (shape, dtype)} of forward tensors made
    from weights by an all-gather (not from the batch: `from_batch`, the
    nodes computed from it, by default those downstream of the step's
    data inputs) that backward ops read."""
    gathers = program.all_gathers()
    if from_batch is None:
        from_batch = program.batch_dependent_nodes()
    derived = (set(gathers) | program.downstream(gathers)) - backward - from_batch
    saved = {}
    for key in program.order:
        if key not in backward:
            continue
        for ref in program.nodes[key].input:
            if ref.startswith("^"):
                continue
            hit = program.producer(key, ref)
            hit = hit and program.owner(*hit)
            if hit is None or hit[0] not in derived:
                continue
            size = program_lib.output_size(program.nodes[hit[0]], hit[1])
            if size is not None:
                saved[hit] = size
    return saved


def run_order(program):
    """{node key: step} of `program`'s ops, each run as soon as its inputs
    (data and control) are ready, as TF's executor does (first ready, first
    run; program order among ops ready together).

    A receive from another mesh (`_HostRecv`: a pipeline's stage-to-stage
    move) waits for its sender, in another program: it, and what is
    computed from receives and constants alone, runs when an op needing
    it is otherwise ready, or else when the program has nothing else to
    run (the stage waits for the next message)."""
    position = {key: i for i, key in enumerate(program.order)}
    producers = {key: _producers(program, key) for key in program.order}
    users = collections.defaultdict(list)  # producer -> dependent ops
    for key in program.order:
        for producer in producers[key]:
            users[producer].append(key)
    lazy = _waiting_for_receives(program, producers, users, position)
    waits = {key: sum(p not in lazy for p in producers[key])
             for key in program.order}
    ready = collections.deque(k for k in program.order
                              if waits[k] == 0 and k not in lazy)
    step = {}

    def run(key):
        for producer in producers[key]:  # lazy chains, pulled on demand
            if producer not in step:
                run(producer)
        step[key] = len(step)
        if key in lazy:
            return  # its readers do not wait for it: they pull it
        for user in sorted(users[key], key=position.get):
            if user not in lazy:
                waits[user] -= 1
                if waits[user] == 0:
                    ready.append(user)

    waiting = [key for key in program.order if key in lazy]
    while ready or len(step) < len(program.order):
        if not ready:  # idle: the first receive (chain) whose inputs exist
            key = next((k for k in waiting if k not in step and all(
                p in step for p in producers[k])), None)
            if key is None:
                break
            run(key)
            continue
        key = ready.popleft()
        if key not in step:
            run(key)
    return step


def _producers(program, key):
    """The nodes of `program` node `key` reads (data and control)."""
    return {(key[0], ref.lstrip("^").split(":")[0])
            for ref in program.nodes[key].input
            if (key[0], ref.lstrip("^").split(":")[0]) in program.nodes}


def _waiting_for_receives(program, producers, users, position):
    """Receives and the ops computed only from receives and constants (or
    arguments): each waits for one of its readers (`run_order`)."""
    lazy, free = set(), set()
    pending = {key: len(producers[key]) for key in program.order}
    queue = collections.deque(k for k in program.order if not pending[k])
    while queue:  # topological: every producer classified first
        key = queue.popleft()
        if program.nodes[key].op == "_HostRecv":
            lazy.add(key)
        elif producers[key] <= free:
            free.add(key)
        elif producers[key] <= free | lazy:
            lazy.add(key)
        for user in sorted(users[key], key=position.get):
            pending[user] -= 1
            if pending[user] == 0:
                queue.append(user)
    return lazy


def live_bytes(program, step):
    """Bytes of live tensors after each op of `program`, run in the order
    `step` ({node key: step}, `run_order`); a buffer lives from its
    producer to its last reader (readers of its views included)."""
    delta = [0] * (len(step) + 1)
    readers = readers_of(program)
    for (key, index), size in _buffers(program, step).items():
        begin, end = buffer_interval(readers, step, key, index)
        delta[begin] += program_lib.nbytes(*size)
        delta[end + 1] -= program_lib.nbytes(*size)
    live, total = [], 0
    for change in delta[:-1]:
        total += change
        live.append(total)
    return live


def _buffers(program, step):
    """{(node key, output index): (shape, dtype)} of the buffers the ops
    that ran (`step`) make (no views, variable reads or constants)."""
    buffers = {}
    for key, node in program.nodes.items():
        if (key not in step or node.op in _NO_BUFFER
                or node.op in program_lib.VIEW_OPS):
            continue
        for index in range(len(program_lib.output_shapes(node))):
            size = program_lib.output_size(node, index)
            if size is not None:
                buffers[(key, index)] = size
    return buffers


def buffer_interval(readers, step, key, index):
    """(first, last) step output `index` of node `key` is live in: from its
    op to its last reader (of a view of it too; `readers`: `readers_of`)."""
    end = max((step[r] for r in readers.get((key, index), ()) if r in step),
              default=step[key])
    return step[key], end


def readers_of(program):
    """{buffer owner (node key, output index): the ops reading it or a
    view of it}."""
    reads = collections.defaultdict(set)
    for key in program.order:
        for ref in program.nodes[key].input:
            if ref.startswith("^"):
                continue
            hit = program.producer(key, ref)
            owner = hit and program.owner(*hit)
            if owner is not None:
                reads[owner].add(key)
    return reads
