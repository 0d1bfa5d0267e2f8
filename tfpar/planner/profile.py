"""What a model costs, read from its shapes: weights, FLOPs, activations.

`profile_model(model)` walks a built Sequential or functional Keras model
(nested functional models such as keras-hub backbones included) and
records, for each layer of the graph `PipelineModel` cuts (nested
functional models such as a keras-hub task's backbone inlined:
`pipeline.split.model_graph`; the units a pipeline cut can separate), per
*sample*:

- FLOPs of the forward pass: every kernel (a weight of rank >= 2 that is
  not an embedding table) costs 2 · size · tokens, where tokens is the
  number of positions the layer maps (the product of its output's
  dimensions between batch and features: the sequence, or a conv's output
  pixels); attention adds 4 · s · (heads · key_dim) per token (scores QKᵀ
  and their product with V). The backward pass costs 2× the forward.
- activation bytes kept for the backward pass: the layer's outputs, plus,
  inside a composite layer (attention, a transformer block), each kernel's
  output and input (its weight gradient reads the input; an input several
  kernels read — self-attention's query, key and value, a gated MLP's gate
  and up projections — counted once, one another kernel makes counted as
  its output, and none that is the layer's own input or output, which the
  graph holds: which kernel reads which tensor is read from one symbolic
  trace; `Weight.activation_in` and
  `Weight.contracted` tell the cost model which side a model-axis split
  divides), each normalization's normalized input and attention's scores
  and probabilities (2 · heads · s per token); a Dense with a non-linear
  activation also keeps its pre-activation. A convolution's input is its
  input channels at Π strides positions per output position (a patch
  embedding's kh·kw·cin); a normalization is what the tensor-parallel
  rules take for one (`keras_graph.is_norm`).
- its weights (path, shape, bytes per element, trainable, owning layer,
  whether a convolution's kernel: convolutions run at their own measured
  rate on a calibrated host, `cost.py`).
- the bytes a pipeline cut before it must carry (every tensor made before
  it and read at or after it).
- the ops its forward and backward pass run beyond 4 per weight
  (`layer_ops`, counted in traced steps: the cost model's fixed cost per
  op on a calibrated shared host).

The cost model's layer inspection lives here: attention's width
(`attention_hidden`), a kernel's input and output widths (`in_width`,
`out_width`), nested layers (`sublayers`), a layer's op count
(`layer_ops`). `build_without_weights` builds a model from a function with
every weight's shape and no memory.

Example:

>>> profile = profile_model(model)
>>> profile.total_flops, profile.num_params
"""

import dataclasses
import math

import keras
import numpy as np

from tfpar import _compat
from tfpar import keras_graph
from tfpar import recompute_spans
from tfpar.pipeline import split
# Re-exported: the planner's callers build a builder's model through it.
from tfpar.weightless import build_without_weights  # noqa: F401


@dataclasses.dataclass
class Weight:
    path: str
    shape: tuple
    itemsize: int
    trainable: bool
    owner: object          # the innermost layer owning it
    flops: float = 0.0     # forward FLOPs per sample of its matmul/conv
    activation: float = 0.0  # bytes per sample kept: its output (composites)
    activation_in: float = 0.0  # ... of which its input (composites)
    contracted: tuple = ()  # per dimension: read from the input side
    conv: bool = False     # a convolution's kernel (not a matmul's)
    # The tensor its owner reads (a name from the profile's trace) inside a
    # composite op: kernels of one op reading one tensor share its gradient.
    reads: str = None

    @property
    def size(self):
        return int(np.prod(self.shape))


@dataclasses.dataclass
class Op:
    """One layer of the cut graph (a possible pipeline stage start)."""
    name: str
    layer: object
    weights: list
    flops: float            # forward FLOPs per sample (kernels + attention)
    attention_flops: float  # part of `flops` in attention scores
    outputs: float          # bytes per sample of its outputs
    internal: float         # bytes per sample kept inside it
    attention_internal: float  # part of `internal` in attention scores
    tokens: int
    layer_ops: int = 0       # ops of its passes beyond 4 per weight
    carried_in: float = 0.0  # bytes per sample a cut just before it carries
    needs_input_grad: bool = True
    consumers: set = dataclasses.field(default_factory=set)  # op indices
    # Layers of earlier ops it runs again on float inputs (a shared layer
    # called a second time, e.g. a tied embedding's reverse projection, not
    # a second lookup of token ids), or holds (nested in it:
    # keras-hub's MaskedLMHead holding the token embedding); their weights
    # are counted at their first op, their FLOPs here by no one.
    reuses: list = dataclasses.field(default_factory=list)
    # Its outputs are read only inside a block that full recomputation
    # runs again as one call (`tfpar.recompute_spans`): not kept then.
    in_block: bool = False
    # Its attention layers whose keys and values are another tensor than
    # their queries (an encoder-decoder's cross attention reading the
    # encoder's output: `_cross_attentions`).
    cross_attention: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ModelProfile:
    name: str
    ops: list
    compute_itemsize: int
    has_graph: bool
    layers_by_path: dict

    @property
    def total_flops(self):
        """Forward FLOPs per sample."""
        return sum(op.flops for op in self.ops)

    @property
    def num_params(self):
        return sum(w.size for op in self.ops for w in op.weights)


def profile_model(model, sequence_length=None):
    """The `ModelProfile` of a built Keras model; a clear ValueError naming
    the model for anything it cannot analyse. `sequence_length` stands for
    dimensions the model leaves unknown besides the batch (keras-hub models
    take sequences of any length)."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            "tfpar.plan needs a Keras model or a zero-argument function "
            f"returning one. Received: {model!r} of type "
            f"{type(model).__name__}.")
    if not model.built or not model.weights:
        raise ValueError(
            f"tfpar.plan cannot analyse model {model.name!r}: it is not built "
            "(no weights yet). Build it (call it on data, or give it a "
            "keras.Input) before planning.")
    graph = keras_graph.functional_graph(model)
    if graph is None:
        raise ValueError(
            f"tfpar.plan cannot analyse model {model.name!r} "
            f"({type(model).__name__}): it has no layer graph to read "
            "activation shapes and pipeline cuts from (a subclassed model, "
            "or a Sequential without keras.Input). Build it with the "
            "functional API or give the Sequential a keras.Input.")
    nodes, _, inputs, outputs, _ = split.model_graph(model)
    compute = keras.backend.standardize_dtype(
        getattr(model.dtype_policy, "compute_dtype", "float32"))
    itemsize = np.dtype(compute if compute != "bfloat16" else "float16").itemsize
    owners = keras_graph.owning_layers(model)
    reads = _tensor_reads(model, nodes, owners)
    # runs_in[n]: the op whose stage runs node n, the last layer first
    # called at or before it (a shared layer called again, e.g. a tied
    # output head, runs where its call falls, as PipelineModel runs it).
    ops, first_called, runs_in, seen = [], set(), [], set()
    for node in nodes:
        layer = node.operation
        shape = _output_shape(model, layer, node, sequence_length)
        tokens = _tokens(shape, sequence_length)
        if id(layer) in first_called:  # a shared layer called again
            ops[-1].outputs += _float_bytes(node.outputs, itemsize,
                                            sequence_length)
            if node.inputs and "float" in str(node.inputs[0].dtype):
                ops[-1].reuses.append(layer)  # a projection, not a lookup
            runs_in.append(len(ops) - 1)
            continue
        first_called.add(id(layer))
        runs_in.append(len(ops))
        ops.append(_op(layer, node, tokens, owners, itemsize, seen,
                       sequence_length, reads))
    _carried(ops, nodes, runs_in, inputs, outputs, itemsize,
             sequence_length)
    _mark_blocks(ops, nodes, runs_in, outputs)
    seen_weights = False
    for op in ops:
        op.needs_input_grad = seen_weights
        seen_weights = seen_weights or any(w.trainable for w in op.weights)
    layers_by_path = {layer.path: layer
                      for layer in _compat.all_layers(model, include_self=False)}
    return ModelProfile(model.name, ops, itemsize, True, layers_by_path)


def _output_shape(model, layer, node, sequence_length):
    out = node.outputs[0] if node.outputs else None
    shape = tuple(out.shape) if out is not None else ()
    if any(d is None for d in shape[1:]) and sequence_length is None:
        raise ValueError(
            f"tfpar.plan cannot analyse model {model.name!r}: layer "
            f"{layer.name!r} outputs shape {shape} with an unknown dimension "
            "besides the batch. Pass tfpar.plan(..., sequence_length=n) or "
            "give keras.Input a full shape so costs can be computed.")
    return shape


def _tokens(shape, seq):
    return int(np.prod(_known(shape, seq)[1:-1])) if len(shape) > 2 else 1


def _known(shape, seq):
    """`shape` with `seq` for its unknown dimensions."""
    return tuple(seq if d is None else d for d in shape)


def _float_bytes(tensors, itemsize, seq):
    total = 0
    for t in tensors:
        if "float" in str(t.dtype):
            total += int(np.prod(_known(t.shape, seq)[1:])) * itemsize
    return float(total)


def _op(layer, node, tokens, owners, itemsize, seen, seq, reads):
    """The `Op` of a graph layer; weights already in `seen` (a layer shared
    with an earlier op, e.g. a tied embedding) are counted there; `reads`:
    `_tensor_reads`."""
    weights, flops, attention, internal, attention_internal = [], 0.0, 0.0, 0.0, 0.0
    reuses = []
    composite = bool(sublayers(layer, include_self=False))
    attentions = _leaf_attention(layer)
    unread, unkept = _boundary_kernels(layer, owners, reads)
    for sub in attentions:
        s = tokens
        width = attention_width(sub)
        attention += 4.0 * s * width * tokens
        heads = _num_heads(sub)
        attention_internal += 2.0 * heads * s * tokens * itemsize
    for w in getattr(layer, "weights", []):
        if id(w) in seen:
            reuses.append(owners.get(id(w), layer))
            continue
        seen.add(id(w))
        owner = owners.get(id(w), layer)
        shape = tuple(int(d) for d in w.shape)
        record = Weight(w.path, shape, np.dtype(w.dtype).itemsize,
                        bool(w.trainable), owner)
        if _is_kernel(w):
            positions = tokens
            if _is_conv(owner, shape):
                positions = max(tokens, 1)
                record.conv = True
            record.flops = 2.0 * record.size * positions
            record.contracted = contracted_dims(owner, shape)
            if composite and reads.get(id(owner), ((),))[0]:
                record.reads = reads[id(owner)][0][0]
            width = 0 if id(owner) in unkept else out_width(owner, shape)
            read = 0
            if composite and id(owner) not in unread:
                read = in_width(owner, shape)  # the weight gradient's
            if composite or _nonlinear(owner):
                record.activation = float(positions * (width + read)
                                          * itemsize)
                record.activation_in = float(positions * read * itemsize)
        flops += record.flops
        internal += record.activation
        weights.append(record)
    if composite:
        internal += _normalized(layer, tokens, itemsize)
    return Op(layer.name, layer, weights, flops + attention, attention,
              _float_bytes(node.outputs, itemsize, seq),
              internal + attention_internal, attention_internal, tokens,
              layer_ops(layer), reuses=reuses,
              cross_attention=_cross_attentions(attentions, owners, reads))


def _cross_attentions(attentions, owners, reads):
    """Those of `attentions` a kernel of which reads one of the layer's
    own inputs other than the one its query kernel reads: cross attention
    (`value=encoder_output`), where self-attention's query, key and value
    read one tensor. From the trace (`reads`, `_tensor_reads`); none when
    it has not traced them."""
    cross = []
    for layer in attentions:
        own_inputs = reads.get(id(layer), ((), ()))[0]
        query_input = reads.get(id(_query_kernel(layer)[0]), ((), ()))[0]
        if not own_inputs or not query_input:
            continue
        kernel_inputs = {reads[id(owner)][0][0] for owner in (
            owners.get(id(w), layer) for w in layer.weights
            if _is_kernel(w)) if reads.get(id(owner), ((), ()))[0]}
        if kernel_inputs & (set(own_inputs) - {query_input[0]}):
            cross.append(layer)
    return cross


def _tensor_reads(model, nodes, owners):
    """{id(layer): (names of the tensors it reads, of those it makes)} of
    the graph's composite layers, the layers owning weights inside them and
    their attention layers, from their first calls in one symbolic trace
    of `model` (`keras_graph.trace_layer_calls_any_length`, by node: one
    trace per distinct block). {} when no composite layer holds a weight
    of another layer, or the model cannot be traced (then each kernel of a
    composite layer counts its own input and output: an upper bound).

    >>> reads = _tensor_reads(model, split.model_graph(model)[0],
    ...                       keras_graph.owning_layers(model))
    """
    composites = [node.operation for node in nodes
                  if sublayers(node.operation, include_self=False)]
    layers = {}
    for layer in composites:
        layers[id(layer)] = layer
        for w in layer.weights:
            owner = owners.get(id(w), layer)
            layers.setdefault(id(owner), owner)
        for attention in _leaf_attention(layer):  # `_cross_attentions`
            layers.setdefault(id(attention), attention)
    if len(layers) == len(composites):
        return {}
    try:
        traced = keras_graph.trace_layer_calls_any_length(
            model, list(layers.values()))
    except Exception:  # noqa: BLE001 (an upper bound instead, as documented)
        return {}
    if traced is None:
        return {}
    return {key: tuple([t.name for t in tensors] for tensors in calls[0])
            for key, calls in traced[0].items() if calls}


def _boundary_kernels(layer, owners, reads):
    """(ids of kernels whose input the composite `layer` does not keep as
    its own, ids of those whose output it does not), from the trace
    (`reads`, `_tensor_reads`): an input that is the layer's own input
    (the graph holds it), another kernel's output (counted there, but
    for one of a non-linear activation, whose input is also kept) or one
    an earlier kernel of the layer reads (self-attention's key and value
    read the query's, a gated MLP's gate the up projection's: one tensor
    kept once); an output that is the layer's own output (an attention
    layer that is itself the graph's op returns its output projection's),
    which the graph holds."""
    own_inputs, own_outputs = reads.get(id(layer), ((), ()))
    kernels = {id(owner): owner for owner in (
        owners.get(id(w), layer) for w in getattr(layer, "weights", [])
        if _is_kernel(w)) if owner is not layer and id(owner) in reads}
    made = {reads[key][1][0] for key, owner in kernels.items()
            if reads[key][1] and not _nonlinear(owner)}
    seen, unread, unkept = set(own_inputs) | made, set(), set()
    for key in kernels:
        inputs, outputs = reads[key]
        if inputs and inputs[0] in seen:
            unread.add(key)
        elif inputs:
            seen.add(inputs[0])
        if outputs and outputs[0] in own_outputs:
            unkept.add(key)
    return unread, unkept


def _is_kernel(weight):
    """A matmul's or convolution's weight: rank >= 2, not a table, nor an
    einsum layer's (heads, width) bias."""
    return len(weight.shape) >= 2 and weight.path.rsplit("/", 1)[-1] not in (
        "embeddings", "bias")


def _normalized(layer, tokens, itemsize):
    """Bytes per sample the normalizations nested in a composite layer keep
    beyond their outputs: each its normalized input (x̂ = (x - μ)/σ, which
    its scale's gradient and its input's read), one element per feature."""
    total = 0.0
    for sub in sublayers(layer, include_self=False):
        weights = getattr(sub, "weights", [])
        if keras_graph.is_norm(sub) and weights:
            total += tokens * int(weights[0].shape[-1]) * itemsize
    return total


def sublayers(layer, include_self=True):
    """`layer` and the layers nested in it ([] for a plain Keras op such as
    `keras.ops.add` in a functional graph)."""
    if not isinstance(layer, keras.layers.Layer):
        return []
    return _compat.all_layers(layer, include_self=include_self)


def _leaf_attention(layer):
    """The attention layers of `layer` (itself included), outermost first;
    an attention nested in one already found is not (its parts)."""
    found = []
    for sub in sublayers(layer):
        if is_attention(sub):
            if not any(sub in sublayers(f) for f in found):
                found.append(sub)
    return found


def is_attention(layer):
    """A MultiHeadAttention, or a layer named like attention that has a
    query kernel (keras-hub's attention layers)."""
    return isinstance(layer, keras.layers.MultiHeadAttention) or (
        "attention" in type(layer).__name__.lower()
        and _query_weight(layer) is not None)


def attention_hidden(layer):
    """The model width attention reads and writes (0: not attention): its
    query kernel's contracted dimensions (MultiHeadAttention's and Llama's
    (h, heads, head width), Gemma's (heads, h, head width))."""
    if not is_attention(layer):
        return 0
    return in_width(*_query_kernel(layer))


def attention_width(layer):
    """heads × head width of attention's query: its query kernel's
    dimensions kept in the output (the model width unless the heads are
    wider or narrower, as Gemma's 16 × 256 at width 3072); a third of a
    fused query-key-value kernel's (GPT-NeoX's `query_key_value`)."""
    owner, shape = _query_kernel(layer)
    width = out_width(owner, shape)
    return width // 3 if "key" in owner.name else width


def _query_weight(layer):
    """Attention's query kernel: a weight `.../<name>/kernel` whose
    layer is named like a query (`query`, `query_key_value`, `q_proj`,
    `wq`, `q`)."""
    for w in layer.weights:
        parts = w.path.split("/")
        if len(parts) > 1 and parts[-1] == "kernel" and (
                "query" in parts[-2] or parts[-2] in ("q_proj", "wq", "q")):
            return w
    return None


def _query_kernel(layer):
    """(the layer owning attention's query kernel, the kernel's shape)."""
    if isinstance(layer, keras.layers.MultiHeadAttention):
        kernel = _compat.kernel_variable(layer.query_dense)
    else:
        kernel = _query_weight(layer)
    owner = next((sub for sub in sublayers(layer)
                  if _compat.kernel_variable(sub) is kernel), layer)
    return owner, tuple(int(d) for d in kernel.shape)


_HEADS_ATTRIBUTES = ("num_heads", "num_query_heads", "num_attention_heads",
                     "_num_heads", "_num_query_heads",
                     "_num_attention_heads")


def num_heads(layer):
    """An attention layer's number of (query) heads, from its attribute
    (None: it has none of `_HEADS_ATTRIBUTES`)."""
    for name in _HEADS_ATTRIBUTES:
        value = getattr(layer, name, None)
        if isinstance(value, int):
            return value
    return None


def _num_heads(layer):
    heads = num_heads(layer)
    if heads is not None:
        return heads
    shape = tuple(_query_weight(layer).shape)
    return int(shape[1]) if len(shape) == 3 else 1


def _einsum_sides(owner):
    """(the kernel's letters, the output's) of an einsum layer's equation
    (None: `owner` is not an einsum layer)."""
    equation = getattr(owner, "equation", None)
    if not equation or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    return inputs.split(",")[-1], output


def contracted_dims(owner, shape):
    """Per dimension of a kernel of `shape`, whether it is contracted with
    the input (a Dense kernel's first, a convolution's all but the last,
    an einsum layer's letters missing from its output)."""
    sides = _einsum_sides(owner)
    if sides is not None and len(sides[0]) == len(shape):
        letters, output = sides
        return tuple(c not in output for c in letters)
    return tuple(i < len(shape) - 1 for i in range(len(shape)))


def in_width(owner, shape):
    """Elements a kernel of `shape` reads per output position: its
    contracted dimensions (a Dense kernel's first); a convolution reads
    its input channels at Π strides positions per output position (a
    patch embedding's kh·kw·cin, a stride-1 convolution's cin)."""
    if _is_conv(owner, shape):
        return _conv_widths(owner, shape)[0]
    return int(np.prod([d for d, c in zip(shape, contracted_dims(owner, shape))
                        if c]))


def out_width(owner, shape):
    """Elements a kernel of `shape` writes per output position: its
    dimensions kept in the output (a Dense kernel's last, a convolution's
    output channels)."""
    if _is_conv(owner, shape):
        return _conv_widths(owner, shape)[1]
    return int(np.prod([d for d, c in zip(shape, contracted_dims(owner, shape))
                        if not c]))


def _is_conv(owner, shape):
    return len(shape) >= 3 and hasattr(owner, "kernel_size")


def _conv_widths(owner, shape):
    """(input elements read, output elements written) per output position
    of a convolution kernel (k₁, ..., cin/groups, cout): the input holds
    Π strides positions per output position of cin = groups·shape[-2]
    channels. A depthwise kernel (k₁, ..., cin, multiplier) writes
    cin·multiplier channels; a separable layer's 1×1 pointwise kernel
    reads the depthwise output at the output's positions."""
    channels_in = int(shape[-2]) * int(getattr(owner, "groups", 1) or 1)
    channels_out = int(shape[-1])
    pointwise = (hasattr(owner, "pointwise_kernel")
                 and all(d == 1 for d in shape[:-2]))
    if not pointwise and getattr(owner, "depth_multiplier", None) == shape[-1]:
        channels_out = int(shape[-2]) * int(shape[-1])
    strides = 1 if pointwise else int(np.prod(getattr(owner, "strides", 1)))
    return channels_in * strides, channels_out


# The forward and backward ops of a layer beyond 4 per weight, counted in
# traced steps of Keras 3.15's layers (a layer's class or a base class of
# it; attention with a causal mask, 142 without; a Dense's activation
# adds its own): the rest count `_OPS_LAYER` (each layer's forward and
# backward pass, counted in the traced steps of Dense stacks:
# `docs/guides/planner.md`).
_OPS_LAYER = 6
_OPS_BY_CLASS = {"MultiHeadAttention": 175, "LayerNormalization": 73,
                 "BatchNormalization": 78, "GroupNormalization": 93,
                 "RMSNormalization": 38, "Dropout": 38}
_OPS_BY_ACTIVATION = {"gelu": 25, "silu": 30}


def layer_ops(layer):
    """Ops of `layer`'s forward and backward pass beyond 4 per weight: a
    counted class's figure, or for a composite layer the sum over what it
    holds (counted classes whole, other leaves `_OPS_LAYER` each)."""
    known = _class_ops(layer)
    if known is not None:
        return known
    inner = sublayers(layer, include_self=False)
    if not inner:
        return _OPS_LAYER
    counted = [sub for sub in inner if _class_ops(sub) is not None]
    inside = {id(x) for sub in counted
              for x in sublayers(sub, include_self=False)}
    counted = [sub for sub in counted if id(sub) not in inside]
    leaves = [sub for sub in inner if id(sub) not in inside
              and _class_ops(sub) is None
              and not sublayers(sub, include_self=False)]
    return sum(_class_ops(sub) for sub in counted) + _OPS_LAYER * len(leaves)


def _class_ops(layer):
    """The counted ops of `layer`'s class or activation (None: not
    counted)."""
    for cls in type(layer).__mro__:
        if cls.__name__ in _OPS_BY_CLASS:
            return _OPS_BY_CLASS[cls.__name__]
    activation = getattr(getattr(layer, "activation", None), "__name__", "")
    return _OPS_BY_ACTIVATION.get(activation)


def _nonlinear(owner):
    """Whether the layer's activation needs its input for the gradient
    (ReLU's gradient reads its output, which is kept anyway)."""
    activation = getattr(owner, "activation", None)
    return activation is not None and getattr(
        activation, "__name__", "linear") not in ("linear", "relu")


def _mark_blocks(ops, nodes, runs_in, outputs):
    """op.in_block for the ops all of whose nodes make tensors read only
    inside their block (`recompute_spans.block_spans`)."""
    internal = set()
    for span in recompute_spans.block_spans(nodes, outputs):
        leaving = {id(t) for t in span.outputs}
        internal.update(n for n in range(span.start, span.stop)
                        if not any(id(t) in leaving for t in nodes[n].outputs))
    # An op runs its layer's first call and any later one (runs_in).
    outside = {at for n, at in enumerate(runs_in) if n not in internal}
    for i, op in enumerate(ops):
        op.in_block = i not in outside


def _carried(ops, nodes, runs_in, inputs, outputs, itemsize, seq):
    """op.carried_in: bytes per sample of the tensors made before op i and
    read at op i or later (what a pipeline cut before op i sends on)."""
    made = {id(t): -1 for t in inputs}
    size = {id(t): _float_bytes([t], itemsize, seq) or
            float(np.prod(_known(t.shape, seq)[1:])) * 4 for t in inputs}
    last_read = {}
    for node, i in zip(nodes, runs_in):
        for t in node.inputs:
            last_read[id(t)] = max(last_read.get(id(t), -1), i)
            if made.get(id(t), -1) >= 0:
                ops[made[id(t)]].consumers.add(i)
        for t in node.outputs:
            made.setdefault(id(t), i)
            size[id(t)] = _float_bytes([t], itemsize, seq)
    for t in outputs:
        last_read[id(t)] = math.inf
    events = np.zeros(len(ops) + 2)
    for key, i in made.items():
        end = last_read.get(key, -1)
        if end > i:  # alive over the cuts i+1 .. min(end, n)
            start = i + 1
            stop = len(ops) if end == math.inf else int(end)
            if stop >= start:
                events[start] += size[key]
                events[stop + 1] -= size[key]
    alive = np.cumsum(events)
    for i, op in enumerate(ops):
        op.carried_in = float(alive[i])
