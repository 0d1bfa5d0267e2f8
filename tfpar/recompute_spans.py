"""The transformer blocks full recomputation recomputes whole: runs of a
model's graph nodes from one attention layer's block to the next.

`set_recompute(model, "full")` recomputes every layer that has weights
(`keras.RematScope(mode="full")`), which keeps each layer's inputs for the
backward pass. A transformer block written one Keras layer per op
(`examples/gpt.py`: norm, attention, residual add, norm, two Dense layers,
add) then keeps six tensors h wide and one 4h wide per token; Megatron-LM's
full recomputation keeps the block's input alone and runs the whole block
again in the backward pass (Korthikanti et al. 2022: 2·s·b·h bytes per
block in 16 bits, against 34·s·b·h + 5·a·s²·b without recomputation).
`block_spans` finds those blocks in a model's graph, nested models inlined
(`tfpar.pipeline.split.model_graph`, the graph a pipeline cuts and the
planner costs):

- a cut before node i is crossed by the tensors made by nodes before i and
  read by node i or a later one (or returned by the graph); the graph's
  inputs do not count (they are kept anyway);
- between attention nodes k and k+1, block k+1 starts at the cut crossed by
  the fewest tensors (the latest of equals): in a pre-norm block, the
  residual stream before the norm, one tensor;
- the first block starts as many nodes before its attention node as the
  second does, and the last ends as many nodes after its attention node as
  the one before it, each only where its cut is crossed by no more tensors
  than the second block's start (else that block is left to per-layer
  recomputation, which is correct, only keeps more);
- a graph with fewer than two attention nodes has no span, and a block that
  is one node (keras-hub's transformer layers) is recomputed as that layer,
  the same thing.

Any run of nodes recomputed as one call is correct (its inputs are kept,
the rest runs again); the rule above only decides which runs keep least.
`tfpar.recompute` runs each span as one checkpointed call (plain steps and
pipeline parts), and the planner counts what it keeps
(`tfpar.planner.profile`).

Example (two blocks of attention, residual add and Dense: three nodes
each, each keeping one tensor, its input):

>>> import keras
>>> from tfpar.pipeline import split
>>> from tfpar.recompute_spans import block_spans
>>> h = x = keras.Input((8, 16))
>>> for _ in range(2):
...     a = keras.layers.MultiHeadAttention(2, 8)(h, h)
...     h = keras.layers.Dense(16)(h + a)
>>> nodes, _, _, outputs, _ = split.model_graph(keras.Model(x, h))
>>> [(s.stop - s.start, len(s.inputs)) for s in block_spans(nodes, outputs)]
[(3, 1), (3, 1)]
"""

import dataclasses

import keras
import numpy as np

from tfpar import _compat

# The attention core's method: Keras' MultiHeadAttention and
# GroupedQueryAttention and keras-hub's attention layers compute
# softmax(Q K^T / sqrt(d) + mask) (dropout) V from projected Q, K, V there.
CORE_METHOD = "_compute_attention"
# Layers that are an attention core whole (no projections).
WHOLE_CORES = (keras.layers.Attention,)


def is_core(layer):
    """Whether `layer` computes an attention core: "method" (it has
    `_compute_attention`), "whole" (it is one) or None."""
    if callable(getattr(type(layer), CORE_METHOD, None)):
        return "method"
    return "whole" if isinstance(layer, WHOLE_CORES) else None


def holds_attention(operation):
    """Whether a graph node's operation is or holds an attention core."""
    if not isinstance(operation, keras.layers.Layer):
        return False  # a keras.ops function applied to symbolic tensors
    return any(is_core(layer) for layer in _compat.all_layers(operation))


@dataclasses.dataclass
class Span:
    """Nodes `start` to `stop` (exclusive) run as one recomputed call:
    `inputs` are the tensors it reads from before it (kept), `outputs`
    those it makes that later nodes or the graph's outputs read."""
    start: int
    stop: int
    inputs: list
    outputs: list


def crossings(nodes, graph_outputs):
    """crossing[c], c = 0..len(nodes): how many tensors made by nodes
    before c are read by node c or later (or returned). A tensor made by
    node i and last read by node j crosses the cuts i < c <= j."""
    n = len(nodes)
    last = {id(t): i for i, node in enumerate(nodes) for t in node.inputs}
    last.update({id(t): n for t in graph_outputs})
    delta = np.zeros(n + 2, int)
    for i, node in enumerate(nodes):
        for tensor in node.outputs:
            j = last.get(id(tensor), i)
            if j > i:
                delta[i + 1] += 1
                delta[j + 1] -= 1
    return np.cumsum(delta)[:n + 1]


def _cuts(attention, crossing):
    """The block cuts (node indices where a block starts, and the last
    block's end) by the rule of the module docstring."""
    starts = [max(range(a + 1, b + 1), key=lambda c: (-crossing[c], c))
              for a, b in zip(attention, attention[1:])]
    first = attention[0] - (attention[1] - starts[0])
    end = attention[-1] + (starts[-1] - attention[-2])
    cuts = list(starts)
    if first >= 0 and crossing[first] <= crossing[starts[0]]:
        cuts.insert(0, first)
    if end < len(crossing) and crossing[end] <= crossing[starts[0]]:
        cuts.append(end)
    return cuts


def span_of(nodes, start, stop, graph_outputs):
    """The `Span` of `nodes[start:stop]` in a graph of `nodes` returning
    `graph_outputs`: what it reads from before it and hands on."""
    inside = nodes[start:stop]
    made = {id(t) for node in inside for t in node.outputs}
    inputs, seen = [], set()
    for node in inside:
        for tensor in node.inputs:
            if id(tensor) not in made and id(tensor) not in seen:
                seen.add(id(tensor))
                inputs.append(tensor)
    read_after = ({id(t) for node in nodes[stop:] for t in node.inputs}
                  | {id(t) for t in graph_outputs})
    outputs = [t for node in inside for t in node.outputs
               if id(t) in read_after]
    return Span(start, stop, inputs, outputs)


def block_spans(nodes, graph_outputs):
    """The `Span`s full recomputation runs as one call each, in order.

    `nodes`: a graph's nodes in execution order, each with `operation`,
    `inputs` and `outputs` (KerasTensors; `tfpar.pipeline.split.GraphNode`);
    `graph_outputs`: the tensors the graph returns. Empty when the graph
    has fewer than two attention nodes (see the module docstring)."""
    attention = [i for i, node in enumerate(nodes)
                 if holds_attention(node.operation)]
    if len(attention) < 2:
        return []
    cuts = _cuts(attention, crossings(nodes, graph_outputs))
    return [span_of(nodes, a, b, graph_outputs)
            for a, b in zip(cuts, cuts[1:]) if b - a > 1]
