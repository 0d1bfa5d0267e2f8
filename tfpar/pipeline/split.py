"""Cutting a Keras Sequential or functional model into pipeline parts.

(A part is one run of layers on one stage's mesh; a stage holds v parts
when interleaved, one otherwise. Below, "stage" is a part of the cut.)

A model's graph is run in Keras' own order (deepest node first). Its layers,
in order of first use, are cut into `p` consecutive runs: stage `s` runs
the nodes from the first call of its first layer on. Any tensor a later
stage reads — a skip connection, or a model input used deep in the model —
is carried forward stage by stage, so every cut is valid. A layer called
again on a later stage (a tied output head) stays on its first stage and
is a guest of the later one, which reads its weights; a weight that layers
of two stages hold (PyTorch-style tying, `head.kernel = embedding.
embeddings`) lives on the first and is read on the later one (`shared`).

A functional (or Sequential) model used as a layer inside another — a
keras-hub task holding its backbone, at any depth — is inlined: its layers
join the graph that is cut, named by their path (`llama_backbone/
transformer_layer_1`). A nested model called more than once, or with more
than its inputs, stays one layer.

Cuts are either named (`boundaries`: the layers where stages 1..p-1 begin,
by path, or by name when that is unique) or chosen to balance a per-layer
cost — by default the parameter count —
minimising the largest stage (a contiguous linear partition, solved
exactly by dynamic programming).

Example:

>>> import keras
>>> model = keras.Sequential([keras.Input((4,))] + [
...     keras.layers.Dense(8, name=f"d{i}") for i in range(4)])
>>> [s.layer_names for s in split_model(model, 2)]
[['d0', 'd1'], ['d2', 'd3']]
"""

import dataclasses

import numpy as np

from tfpar import _compat
from tfpar import keras_graph

BALANCE_MODES = ("params", "time")


@dataclasses.dataclass
class Part:
    """The layers of one model part of a split model (a pipeline stage's
    without interleaving; `tfpar.pipeline.part.ModelPart` runs them).

    Attributes:
        index: 0 for the stage that reads the model inputs.
        layers: the Keras layers it owns, in graph order.
        nodes: the `GraphNode`s it runs, in order.
        inputs: KerasTensors it receives (the model inputs for stage 0).
        outputs: KerasTensors it sends on (the model outputs for the last
            stage); tensors a later stage still needs pass through.
        num_params: number of weights' elements of its layers.
        cost: the balancing cost (parameters, or measured seconds).
        paths: its layers' paths (nested layers "outer/inner").
        guests: layers of earlier stages it calls again (tied weights: it
            reads their weights, they are updated on their own stage).
        shared: weights its own layers hold that a layer of an earlier
            stage holds too (tied weights as well: read here, updated
            there).
    """

    index: int
    layers: list
    nodes: list
    inputs: list
    outputs: list
    num_params: int
    cost: float = 0.0
    paths: list = None
    guests: list = dataclasses.field(default_factory=list)
    shared: list = dataclasses.field(default_factory=list)

    @property
    def layer_names(self):
        """Its layers' paths ("backbone/block_1"; the name at top level)."""
        return list(self.paths or [layer.name for layer in self.layers])


Stage = Part  # its name before parts and stages were told apart


class GraphNode:
    """One layer call of the graph that is cut, nested models inlined.

    `inputs`/`outputs` are the KerasTensors it reads and makes, where a
    tensor entering or leaving an inlined model is replaced by the one it
    stands for (`aliases`: id(KerasTensor) -> the KerasTensor whose value it
    has). `run` executes the Keras node on concrete tensors keyed by id.
    """

    def __init__(self, node, path, aliases):
        self.node = node
        self.operation = node.operation
        self.path = path
        self._aliases = aliases
        self.inputs = [resolve(t, aliases)
                       for t in keras_graph.node_inputs(node)]
        self.outputs = list(node.outputs)

    def run(self, tensors, training, operation_fn=None):
        keras_graph.run_node(self.node, _Aliased(tensors, self._aliases),
                             training, operation_fn)


class _Aliased:
    """`tensors` read through the aliases of inlined models' boundaries."""

    def __init__(self, tensors, aliases):
        self._tensors, self._aliases = tensors, aliases

    def _key(self, key):
        while key in self._aliases:
            key = id(self._aliases[key])
        return key

    def __getitem__(self, key):
        return self._tensors[self._key(key)]

    def get(self, key, default=None):
        return self._tensors.get(self._key(key), default)

    def __setitem__(self, key, value):
        self._tensors[key] = value


def resolve(tensor, aliases):
    """The KerasTensor whose value `tensor` has (itself if not an alias)."""
    while id(tensor) in aliases:
        tensor = aliases[id(tensor)]
    return tensor


def _inlinable(node, calls):
    """The flat (inner input, outer tensor) pairs when `node` calls a
    functional model once on its inputs alone, else None."""
    inner = node.operation
    graph = (keras_graph.functional_graph(inner)
             if keras_graph.is_model(inner) else None)
    if graph is None or calls[id(inner)] > 1:
        return None
    args, kwargs = node.arguments.args, node.arguments.kwargs
    if len(args) != 1 or any(keras_graph.has_keras_tensor(v)
                             for v in kwargs.values()):
        return None
    outer = keras_graph.flat_model_inputs(inner, args[0])
    if outer is None or len(outer) != len(graph[1]) or any(
            len(o.shape) != len(i.shape) for o, i in zip(outer, graph[1])):
        return None
    return list(zip(graph[1], outer))


def _inline(model, prefix, aliases, calls, out):
    """Appends `model`'s nodes to `out` as GraphNodes, inlining nested
    functional models (their boundary tensors become aliases)."""
    nodes, _, outputs = keras_graph.functional_graph(model)
    for node in nodes:
        pairs = _inlinable(node, calls)
        if pairs is None:
            out.append(GraphNode(node, prefix + node.operation.name, aliases))
            continue
        inner = node.operation
        for inner_input, outer in pairs:
            outer = resolve(outer, aliases)
            if outer is not inner_input:  # a task reuses its backbone's inputs
                aliases[id(inner_input)] = outer
        inner_outputs = _inline(inner, f"{prefix}{inner.name}/", aliases,
                                calls, out)
        for made, inner_output in zip(node.outputs, inner_outputs):
            inner_output = resolve(inner_output, aliases)
            if inner_output is not made:
                aliases[id(made)] = inner_output
    return outputs


def model_graph(model):
    """(GraphNodes with nested models inlined, layers in order of first
    use, inputs, outputs, each layer's path); raises a clear error for a
    model that has no graph to cut."""
    graph = keras_graph.functional_graph(model)
    if graph is None:
        raise ValueError(
            "PipelineModel can only cut a Sequential or functional Keras "
            "model (a graph of layers). Received: model "
            f"{getattr(model, 'name', model)!r} of type "
            f"{type(model).__name__}, which has no layer graph (a subclassed "
            "model, or a Sequential without keras.Input). Rebuild it with "
            "the functional API or give the Sequential a keras.Input."
        )
    calls = {id(layer): keras_graph.call_count(layer)
             for layer in _compat.all_layers(model, include_self=False)}
    aliases = {}
    nodes = []
    outputs = [resolve(t, aliases) for t in _inline(model, "", aliases,
                                                     calls, nodes)]
    layers, paths = [], []
    seen = set()
    for node in nodes:
        if id(node.operation) not in seen:
            seen.add(id(node.operation))
            layers.append(node.operation)
            paths.append(node.path)
    return nodes, layers, list(graph[1]), outputs, paths


def weights_of(operation, trainable=False):
    """A graph operation's weights ([] for plain Keras ops such as
    `keras.ops.add` applied to symbolic tensors, which are not layers);
    with `trainable`, those training updates (`_compat.trained_weights`)."""
    if trainable:
        return _compat.trained_weights(operation)
    return list(getattr(operation, "weights", []))


def num_params(operation):
    return int(sum(np.prod(w.shape) for w in weights_of(operation)))


def balanced_cuts(costs, num_stages):
    """Start indices of stages 1..p-1 minimising the largest stage cost.

    `costs[i]` is the cost of layer i; stages are contiguous and non-empty.
    best[k][j] = min over i < j of max(best[k-1][i], sum(costs[i:j])).
    Ties prefer the cut that leaves more layers to later stages' equal
    shares (the earliest optimal cut is taken).
    """
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs, dtype=float)])
    inf = float("inf")
    best = np.full((num_stages + 1, n + 1), inf)
    cut = np.zeros((num_stages + 1, n + 1), dtype=int)
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j] - 1e-12:
                    best[k][j], cut[k][j] = value, i
    starts = []
    j = n
    for k in range(num_stages, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return sorted(starts)[1:]


def split_model(model, num_stages, boundaries=None, costs=None):
    """Cuts `model` into `num_stages` parts (a list of `Part`).

    Args:
        model: a built Sequential or functional Keras model.
        num_stages: p >= 1.
        boundaries: names of the layers where stages 1..p-1 begin, in graph
            order; None balances `costs`.
        costs: per-layer costs for balancing, one per layer in graph order
            (default: parameter counts, plus one so that weightless layers
            spread out too).
    """
    nodes, layers, inputs, outputs, paths = model_graph(model)
    names = paths
    if num_stages > len(layers):
        raise ValueError(
            f"PipelineModel needs at least one layer per stage: the mesh has "
            f"{num_stages} pipeline stages but model {model.name!r} has only "
            f"{len(layers)} layer(s) {names}. Received: num_stages="
            f"{num_stages}. Use fewer stages (a smaller pipeline axis)."
        )
    if boundaries is None:
        if costs is None:
            costs = [num_params(layer) + 1 for layer in layers]
        starts = balanced_cuts(costs, num_stages)
    else:
        starts = _boundary_indices(boundaries, paths, layers, num_stages)
    if costs is None:
        costs = [num_params(layer) for layer in layers]
    edges = [0] + list(starts) + [len(layers)]
    stage_nodes, produced_in, last_reader = _assign_nodes(
        nodes, [_first_call(nodes, layers[i]) for i in starts], inputs,
        outputs, num_stages)
    tensors = {id(t): t for t in inputs}
    for node in nodes:
        tensors.update((id(t), t) for t in node.outputs)
    stages = []
    received = list(inputs)
    for s in range(num_stages):
        if s == num_stages - 1:
            sent = list(outputs)
        else:
            # Everything made up to here that a later stage still reads, in
            # a fixed order (the graph order of its producer).
            sent = [tensors[key] for key in tensors
                    if produced_in[key] <= s and last_reader.get(key, -1) > s]
        owned = layers[edges[s]:edges[s + 1]]
        home = {id(layer) for layer in owned}
        guests = list({id(node.operation): node.operation
                       for node in stage_nodes[s]
                       if id(node.operation) not in home}.values())
        stages.append(Part(
            index=s, layers=owned, nodes=stage_nodes[s], inputs=received,
            outputs=sent, num_params=sum(num_params(x) for x in owned),
            cost=float(sum(costs[edges[s]:edges[s + 1]])),
            paths=paths[edges[s]:edges[s + 1]], guests=guests))
        received = sent
    _find_shared(stages)
    return stages


def _find_shared(parts):
    """Sets each part's `shared`: the weights of its layers that a layer of
    an earlier part holds (its first holder's part is their home)."""
    home = {}
    for part in parts:
        for layer in part.layers:
            for w in weights_of(layer):
                if home.setdefault(id(w), part.index) != part.index and \
                        all(w is not x for x in part.shared):
                    part.shared.append(w)


def _first_call(nodes, layer):
    """The position of `layer`'s first call among `nodes`."""
    return next(n for n, node in enumerate(nodes) if node.operation is layer)


def _assign_nodes(nodes, cuts, inputs, outputs, num_stages):
    """Which stage runs each node, and for each tensor (by id) the stage
    that makes it (-1: a model input) and the last stage that reads it.

    A stage begins at the first call of its first layer (`cuts`); every
    node runs on the stage its position falls in. A layer lives on the
    stage of its first call (its home); a later call on another stage (a
    tied output head reusing the input embedding) reads it there
    (`Part.guests`)."""
    produced_in = {id(t): -1 for t in inputs}  # -1: a model input
    stage_nodes = [[] for _ in range(num_stages)]
    last_reader = {}
    s = 0
    for n, node in enumerate(nodes):
        while s < len(cuts) and n >= cuts[s]:
            s += 1
        for tensor in node.inputs:
            last_reader[id(tensor)] = max(last_reader.get(id(tensor), -1), s)
        for tensor in node.outputs:
            produced_in[id(tensor)] = s
        stage_nodes[s].append(node)
    for tensor in outputs:
        last_reader[id(tensor)] = num_stages  # read after the last stage
    return stage_nodes, produced_in, last_reader


def _boundary_indices(boundaries, names, layers, num_stages):
    """Positions of the named layers: a path ("backbone/block_1"), or a
    bare layer name that only one layer has."""
    if isinstance(boundaries, str) or not all(
            isinstance(b, str) for b in boundaries):
        raise TypeError(
            "stage_boundaries must be a list of layer names. Received: "
            f"stage_boundaries={boundaries!r}"
        )
    boundaries = list(boundaries)
    if len(boundaries) != num_stages - 1:
        raise ValueError(
            f"stage_boundaries names the first layer of stages 1..p-1 (of "
            f"model parts 1..v·p-1 with virtual_stages=v), so it needs "
            f"{num_stages - 1} name(s) for {num_stages} stages/parts. "
            f"Received: stage_boundaries={boundaries!r}"
        )
    by_name = {}
    for position, layer in enumerate(layers):
        by_name.setdefault(layer.name, []).append(position)
    ambiguous = [b for b in boundaries
                 if b not in names and len(by_name.get(b, [])) > 1]
    if ambiguous:
        raise ValueError(
            f"stage_boundaries names {ambiguous}, which several nested "
            f"layers are called. Received: stage_boundaries={boundaries!r}. "
            "Name them by path; the layers in graph order are "
            f"{names}.")
    missing = [b for b in boundaries if b not in names and b not in by_name]
    if missing:
        raise ValueError(
            f"stage_boundaries names layer(s) {missing} that the model does "
            f"not have. Received: stage_boundaries={boundaries!r}; the "
            f"layers in graph order (nested ones by path) are {names}."
        )
    starts = [names.index(b) if b in names else by_name[b][0]
              for b in boundaries]
    if starts[0] == 0 or any(a >= b for a, b in zip(starts, starts[1:])):
        raise ValueError(
            "stage_boundaries must name layers in graph order, after the "
            f"first layer, each at most once. Received: stage_boundaries="
            f"{boundaries!r} at positions {starts} of the layers {names}."
        )
    return starts


def format_split(stages, devices=None, num_stages=None,
                 stage_and_chunk=None):
    """A table: stage, devices, layers, parameters, cost share, carried.

    With `num_stages` p smaller than the number of parts (interleaving),
    part k is labelled with its stage and chunk: `stage_and_chunk(k)`
    (`Schedule.stage_and_chunk`), by default (k mod p, k // p)."""
    total = sum(s.cost for s in stages) or 1.0
    p = num_stages or len(stages)
    where_is = stage_and_chunk or (lambda k: (k % p, k // p))
    lines = []
    for stage in stages:
        where = f" on {devices[stage.index]}" if devices else ""
        carried = [t.name for t in stage.inputs] if stage.index else []
        label = (f"stage {stage.index}" if p == len(stages) else
                 "part {} (stage {}, chunk {})".format(
                     stage.index, *where_is(stage.index)))
        lines.append(
            f"{label}{where}: {len(stage.layers)} layer(s) "
            f"{stage.layer_names[0]}..{stage.layer_names[-1]}, "
            f"{stage.num_params:,} params, est. {stage.cost / total:.0%} of "
            "the time"
            + (f", receives {carried}" if carried else "")
            + (f", reads tied weights of {[g.name for g in stage.guests]}"
               if stage.guests else "")
            + (f", reads tied weights {[w.path for w in stage.shared]}"
               if stage.shared else ""))
    return "\n".join(lines)
