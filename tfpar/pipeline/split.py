"""Cutting a Keras Sequential or functional model into pipeline stages.

A model's graph is run in Keras' own order (deepest node first). Its layers,
in order of first use, are cut into `p` consecutive runs: stage `s` runs
the nodes of its layers. Any tensor a later stage reads — a skip
connection, or a model input used deep in the model — is carried forward
stage by stage, so every cut is valid as long as each layer sits in one
stage (a shared layer called on both sides of a cut is an error).

Cuts are either named (`boundaries`: the layers where stages 1..p-1 begin)
or chosen to balance a per-layer cost — by default the parameter count —
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

BALANCE_MODES = ("params", "time")


@dataclasses.dataclass
class Stage:
    """One pipeline stage of a split model.

    Attributes:
        index: 0 for the stage that reads the model inputs.
        layers: the Keras layers it owns, in graph order.
        nodes: the graph nodes it runs, in order.
        inputs: KerasTensors it receives (the model inputs for stage 0).
        outputs: KerasTensors it sends on (the model outputs for the last
            stage); tensors a later stage still needs pass through.
        num_params: number of weights' elements of its layers.
        cost: the balancing cost (parameters, or measured seconds).
    """

    index: int
    layers: list
    nodes: list
    inputs: list
    outputs: list
    num_params: int
    cost: float = 0.0

    @property
    def layer_names(self):
        return [layer.name for layer in self.layers]


def model_graph(model):
    """(nodes, layers in order of first use, inputs, outputs); raises a
    clear error for a model that has no graph to cut."""
    graph = _compat.functional_graph(model)
    if graph is None:
        raise ValueError(
            "PipelineModel can only cut a Sequential or functional Keras "
            "model (a graph of layers). Received: model "
            f"{getattr(model, 'name', model)!r} of type "
            f"{type(model).__name__}, which has no layer graph (a subclassed "
            "model, or a Sequential without keras.Input). Rebuild it with "
            "the functional API or give the Sequential a keras.Input."
        )
    nodes, inputs, outputs = graph
    layers = []
    seen = set()
    for node in nodes:
        if id(node.operation) not in seen:
            seen.add(id(node.operation))
            layers.append(node.operation)
    return nodes, layers, inputs, outputs


def weights_of(operation, trainable=False):
    """A graph operation's weights ([] for plain Keras ops such as
    `keras.ops.add` applied to symbolic tensors, which are not layers)."""
    return list(getattr(operation,
                        "trainable_weights" if trainable else "weights", []))


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
    """Cuts `model` into `num_stages` stages (a list of `Stage`).

    Args:
        model: a built Sequential or functional Keras model.
        num_stages: p >= 1.
        boundaries: names of the layers where stages 1..p-1 begin, in graph
            order; None balances `costs`.
        costs: per-layer costs for balancing, one per layer in graph order
            (default: parameter counts, plus one so that weightless layers
            spread out too).
    """
    nodes, layers, inputs, outputs = model_graph(model)
    names = [layer.name for layer in layers]
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
        starts = _boundary_indices(boundaries, names, num_stages)
    if costs is None:
        costs = [num_params(layer) for layer in layers]
    stage_of_layer = {}
    edges = [0] + list(starts) + [len(layers)]
    for s in range(num_stages):
        for layer in layers[edges[s]:edges[s + 1]]:
            stage_of_layer[id(layer)] = s
    # Which stage produces each tensor (-1: a model input), checking that
    # no node reads a tensor a later stage produces.
    produced_in = {id(t): -1 for t in inputs}
    stage_nodes = [[] for _ in range(num_stages)]
    last_reader = {}
    for node in nodes:
        s = stage_of_layer[id(node.operation)]
        for tensor in _compat.node_inputs(node):
            source = produced_in.get(id(tensor), -1)
            if source > s:
                producer = tensor._keras_history.operation  # noqa: SLF001
                raise ValueError(
                    f"Layer {node.operation.name!r} (stage {s}) reads the "
                    f"output of layer {producer.name!r} (stage {source}): a "
                    "layer shared across a stage boundary cannot be cut "
                    "there. Received: stage_boundaries="
                    f"{[names[i] for i in starts]}. Choose boundaries that "
                    "keep every call of a shared layer in one stage."
                )
            last_reader[id(tensor)] = max(last_reader.get(id(tensor), -1), s)
        for tensor in node.outputs:
            produced_in[id(tensor)] = s
        stage_nodes[s].append(node)
    for tensor in outputs:
        last_reader[id(tensor)] = num_stages  # read after the last stage
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
        stages.append(Stage(
            index=s, layers=owned, nodes=stage_nodes[s], inputs=received,
            outputs=sent, num_params=sum(num_params(x) for x in owned),
            cost=float(sum(costs[edges[s]:edges[s + 1]]))))
        received = sent
    return stages


def _boundary_indices(boundaries, names, num_stages):
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
    missing = [b for b in boundaries if b not in names]
    if missing:
        raise ValueError(
            f"stage_boundaries names layer(s) {missing} that the model does "
            f"not have. Received: stage_boundaries={boundaries!r}; the "
            f"layers in graph order are {names}."
        )
    starts = [names.index(b) for b in boundaries]
    if starts[0] == 0 or any(a >= b for a, b in zip(starts, starts[1:])):
        raise ValueError(
            "stage_boundaries must name layers in graph order, after the "
            f"first layer, each at most once. Received: stage_boundaries="
            f"{boundaries!r} at positions {starts} of the layers {names}."
        )
    return starts


def format_split(stages, devices=None, num_stages=None):
    """A table: stage, devices, layers, parameters, cost share, carried.

    With `num_stages` p smaller than the number of parts (interleaving),
    part k is labelled with its stage k mod p and chunk k // p."""
    total = sum(s.cost for s in stages) or 1.0
    p = num_stages or len(stages)
    lines = []
    for stage in stages:
        where = f" on {devices[stage.index]}" if devices else ""
        carried = [t.name for t in stage.inputs] if stage.index else []
        label = (f"stage {stage.index}" if p == len(stages) else
                 f"part {stage.index} (stage {stage.index % p}, chunk "
                 f"{stage.index // p})")
        lines.append(
            f"{label}{where}: {len(stage.layers)} layer(s) "
            f"{stage.layer_names[0]}..{stage.layer_names[-1]}, "
            f"{stage.num_params:,} params, est. {stage.cost / total:.0%} of "
            "the time"
            + (f", receives {carried}" if carried else ""))
    return "\n".join(lines)
