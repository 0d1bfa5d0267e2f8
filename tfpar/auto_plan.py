"""Automatic tensor-parallel plans: `auto_rules(model)`.

The model is traced once on symbolic inputs (`_Dataflow`: which
weight-owning layer reads which); the Megatron patterns found in that
dataflow (attention by heads, MLP column/row pairs, embeddings, norms)
become one `tfpar.styles` rule per layer, with every layer left whole named
in a warning. Pure planning: the model is not changed (the strategy's
`apply_rules` lays the plan out).

Example:

>>> rules = tfpar.auto_rules(model, mesh=tfpar.Mesh({"model": 4}))
"""

import contextlib
import re
import warnings
import weakref

import keras
import tensorflow as tf

from tfpar import _compat
from tfpar import keras_graph
from tfpar import parallel_dims
from tfpar import vocab_parallel as vocab_parallel_lib
from tfpar.layout import QUANTIZATION_STATE, LayoutRules
from tfpar.weightless import build_without_weights
from tfpar.styles import (ColumnParallel, RowParallel, SequenceParallel,
                          VocabParallel)

# Ops a value passes through unchanged in layout: each output element depends
# only on the same element of its inputs (and on constants). A Megatron MLP
# may have only these between its column- and row-parallel layers.
_ELEMENTWISE_OPS = frozenset({
    "Identity", "IdentityN", "Cast", "StopGradient", "Neg", "Abs", "Square",
    "Sqrt", "Rsqrt", "Exp", "Log", "Log1p", "Erf", "Erfc", "Tanh", "Sigmoid",
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Softplus", "Softsign",
    "Gelu", "AddV2", "Add", "Sub", "Mul", "RealDiv", "Div", "Pow",
    "Maximum", "Minimum", "Select", "SelectV2",
})
# Ops that read only a tensor's shape: no value flows through them.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def auto_rules(model, axis=None, axis_size=None, mesh=None,
               sequence_parallel=False, expert_axis=None,
               vocab_parallel=False):
    """LayoutRules for the standard tensor-parallel patterns of `model`.

    Plans every layer that owns weights, however deeply it is nested in
    subclassed blocks (keras-hub's decoders, attention classes, MLPs). To
    see which layer feeds which, the model is traced once on symbolic inputs
    of its input signature (inference mode, nothing computed), recording
    the graph tensors each layer reads and returns; a layer *reads* another
    when a path of ops of no weight-owning layer leads from the other's
    output to its input. Then:

    - **Attention by heads.** An EinsumDense that contracts two dimensions
      of its input (heads, head_dim: an output projection) and the
      EinsumDense layers it reads that make two new dimensions (heads,
      head_dim: query, key, value) are RowParallel and ColumnParallel: each
      device computes whole heads (the first kernel letter the projection
      makes is the heads dimension, as in Keras and keras-hub); one
      all-reduce follows. Heads may also be made and merged by reshapes,
      heads-major: a Dense making heads·head_dim that a reshape splits
      into (..., heads, head_dim) is a query/key/value projection (keras-hub's
      T5, ESM2, RoFormerV2, SmolLM3), and a Dense or one-contraction
      EinsumDense after a reshape merging (..., heads, head_dim) into
      heads·head_dim is an output projection (GPT-NeoX, T5): a block split
      of heads·head_dim is a split by heads. A fused query/key/value
      EinsumDense that makes the heads dimension (GPT-NeoX's (heads,
      3·head_dim)) is split by heads like one of three. Layers that are not
      projections on the way (T5's position bias, rotary frequencies) are
      looked past. A Dense making q, k and v side by side in one
      dimension ((3, heads, head_dim) flattened: keras-hub's MMDiT, Flux,
      Swin, ViTDet) stays whole (listed in the warning): no block split of
      that dimension gives a device whole heads of all three.
      Grouped-query attention: key/value projections
      with fewer heads are split where the axis divides their heads, else
      kept whole (DTensor gives every device the whole key/value; named in
      the warning with the reason). Keras' `MultiHeadAttention` (and
      subclasses such as keras-hub's CachedMultiHeadAttention) get one
      ColumnParallel rule for the layer.
    - **MLPs.** A Dense/EinsumDense with one contracted dimension that reads
      only Dense/EinsumDense outputs through elementwise ops (activations,
      dropout, the product of a gated MLP: `down(silu(gate(x)) * up(x))`)
      is RowParallel and what it reads ColumnParallel: Megatron's
      Y = sum_i f(X W1_i) W2_i, one all-reduce per MLP.
    - **Embeddings** (a layer whose weights are `embeddings` tables, e.g.
      Embedding, keras-hub's PositionEmbedding and ReversibleEmbedding with
      its `reverse_embeddings`) split along the hidden dimension
      (ColumnParallel): the lookup needs no communication and is gathered
      whole after it; a tied or reverse projection to logits then sums
      partial products over the hidden dimension, so logits are whole.
    - **Output heads** (a Dense/EinsumDense whose output reaches a model
      output through elementwise ops) and other unpaired Dense layers stay
      whole, so logits are computed whole. With `vocab_parallel=True` the
      heads are split over their outputs (the vocabulary) instead
      (`VocabParallel`): a Dense/EinsumDense head by its kernel's columns;
      an embedding whose reverse projection makes the logits (keras-hub's
      ReversibleEmbedding) by vocabulary, its `reverse_embeddings` if
      untied (the lookup table stays split by hidden), else its table; a
      head projecting onto the token embedding it holds (keras-hub's
      MaskedLMHead, `vocab_parallel.reverse_head_biases`): that table by
      vocabulary and the head's (vocab,) bias with it (a raw spec).
      Each device then computes logits (batch, sequence, vocab/k), and
      DTensor's expansion of `SparseSoftmaxCrossEntropyWithLogits` (what
      Keras' `SparseCategoricalCrossentropy(from_logits=True)` runs) keeps
      them split: a local max, sum of exp and target logit per token, each
      all-reduced over the model axis ((tokens, 1) values), as in
      Megatron-LM's vocab-parallel cross-entropy. Whole logits are never
      formed by the loss, nor by a metric taking their argmax (keras-hub's
      default `SparseCategoricalAccuracy`: `tfpar.vocab_parallel` computes
      Keras' argmax in a step by a max and a min).
    - **Norms** (Keras' and other libraries' LayerNormalization /
      RMSNormalization, known by class) stay whole, or `SequenceParallel`
      with `sequence_parallel=True`.
    - **Expert banks** of mixture-of-experts blocks (a layer with a
      `num_experts` attribute whose own weights all lead with that many
      experts, e.g. keras-hub's Mixtral, Qwen-MoE, Qwen3-MoE and GPT-OSS
      `[experts, in, out]` kernels and `[experts, out]` biases) are split
      along the experts dimension over the expert axis
      (`ParallelStrategy(expert_axis=...)`, default "expert"): each device
      holds E / n whole experts. The routers (other projections of the same
      MoE block outside an MLP pattern, e.g. `sparse_feedforward_gate_dense`,
      GPT-OSS' `router_dense`, Qwen-MoE's `shared_expert_gate_dense`) stay
      whole on every device, silently; a shared-expert MLP is an MLP. A
      mesh without the expert axis keeps the banks whole (named in the
      warning); a mesh without the model axis gets no tensor-parallel rule.
    - **Per-head norms inside attention** (Qwen3's query/key norms between
      the projections and the attention core) are looked through: the
      projections they norm are still split by heads, and the norms' 1-D
      scales stay whole (never `SequenceParallel`).

    A subclassed *model* has no input signature to trace: there, consecutive
    Dense layers whose widths chain are paired, in attribute order.

    With `sequence_parallel=True` (Megatron-SP) the column/row styles get
    `sequence_parallel=True` and norms that normalize each token get
    `SequenceParallel`: the residual stream, norms and dropout hold
    (batch, sequence/k, hidden) per device; the sequence is all-gathered
    before each column-parallel layer and reduce-scattered after each
    row-parallel one; embedding outputs are re-split from hidden-wise to
    sequence-wise (gathered and sliced: DTensor's all-to-all is off). The head stays whole; DTensor gathers its
    input, so the logits are computed whole as without it.

    `vocab_parallel=True` and `sequence_parallel=True` together are refused
    (not planned yet: the reverse projection's logits would be re-split
    along the sequence).

    Every layer with weights left whole, other than norms, is named by its
    own path in one warning, with the reason. Head counts or widths the axis
    does not divide raise ValueError naming the layer.

    Example:

    >>> mesh = tfpar.Mesh({"data": 2, "model": 4})
    >>> strategy = tfpar.ParallelStrategy(mesh)
    >>> with strategy.scope():
    ...     model = build_model()
    ...     rules = tfpar.auto_rules(model, mesh=mesh, sequence_parallel=True)
    ...     strategy.apply_rules(model, rules)
    ...     model.compile(optimizer="adam", loss="mse")

    Args:
        model: a built Keras model, or a zero-argument function building
            one (`lambda: keras_hub.models.Llama3Backbone.from_preset(
            path, load_weights=False)`): built once with every weight's
            shape and no memory (`tfpar.plan` does the same), its layer
            names given back so that building it again, in the scope of
            `ParallelStrategy(mesh, rules=...)`, gives the same paths and
            creates every split weight already split (no device ever
            holds it whole: a pretrained model that fits no device loads).
        axis: the mesh axis to split over; None: the current strategy's
            model axis (`ParallelStrategy(model_axis=...)`), "model"
            outside a strategy. Another axis than the strategy's is an
            error naming both.
        axis_size: its size (or give `mesh`); used to check divisibility.
            Without either, inside a strategy's scope: its mesh's.
        mesh: a `tfpar.Mesh` to read `axis_size` from.
        sequence_parallel: also split the activations between the
            tensor-parallel layers along the sequence (dimension 1).
        expert_axis: the mesh axis expert banks split over; None: the
            current strategy's (`ParallelStrategy(expert_axis=...)`),
            "expert" outside a strategy. Its size is read from `mesh` (or
            the strategy's mesh); without either the banks stay whole.
        vocab_parallel: split the output heads (logits) over the
            vocabulary (see above); a vocabulary the model axis does not
            divide raises ValueError naming the head.

    Returns:
        `tfpar.LayoutRules` with one exact-path rule per sharded layer.
    """
    if not isinstance(sequence_parallel, bool):
        raise TypeError(
            "auto_rules(sequence_parallel) must be True or False. Received: "
            f"sequence_parallel={sequence_parallel!r}"
        )
    _check_vocab_parallel(vocab_parallel, sequence_parallel)
    if callable(model) and not isinstance(model, keras.Model):
        # A builder: traced on a copy with shapes and no memory, its layer
        # names given back so the next build's paths match the rules.
        model = build_without_weights(model, "tfpar.auto_rules(model)")
    experts = _expert_axis_and_size(expert_axis, mesh)
    tensor_parallel = _has_model_axis(axis, mesh)
    axis, axis_size = _axis_and_size(axis, axis_size, mesh)
    if axis_size is None:
        raise ValueError(
            "auto_rules needs the size of the model axis to check that "
            "widths divide. Received: axis_size=None, mesh=None. Pass "
            "mesh=tfpar.Mesh(...) or axis_size=n."
        )
    if not model.built:
        raise ValueError(
            f"auto_rules needs a built model; {model.name!r} is not built. "
            "Call it on data or build it with keras.Input first."
        )
    plan, whole, banks = _plan(model, axis, axis_size, sequence_parallel,
                               experts, tensor_parallel, vocab_parallel)
    if whole:
        listed = "".join(f"\n  {path} ({type(layer).__name__}): {reason}"
                         for path, (layer, reason) in whole.items())
        warnings.warn(
            "tfpar.auto_rules keeps these layers' weights whole on every "
            f"device:{listed}",
            stacklevel=2,
        )
    return LayoutRules({re.escape(path): style for path, style
                        in {**plan, **banks}.items()})


def _expert_axis_and_size(expert_axis, mesh):
    """(expert axis, its size or None) of `auto_rules`' arguments, the
    current strategy's dims filling in what is not given."""
    dims = parallel_dims.current()
    if dims is not None:
        expert_axis = dims.resolve_axis("expert", expert_axis, "auto_rules",
                                        "expert_axis")
        mesh = dims.mesh if mesh is None else mesh
    elif expert_axis is None:
        expert_axis = parallel_dims.DEFAULT_EXPERT_AXIS
    return expert_axis, None if mesh is None else mesh.axis_size(expert_axis)


def _has_model_axis(axis, mesh):
    """False when the mesh `auto_rules` plans for (given, or the current
    strategy's) lacks the model axis: no tensor-parallel rule can name it."""
    dims = parallel_dims.current()
    if mesh is None and dims is not None:
        mesh, axis = dims.mesh, dims.resolve_model_axis(axis, "auto_rules")
    axis = parallel_dims.DEFAULT_MODEL_AXIS if axis is None else axis
    return mesh is None or axis in mesh.axis_names


def _axis_and_size(axis, axis_size, mesh):
    """(axis, size) of `auto_rules`' arguments, the current strategy's
    dims filling in what is not given (`ParallelDims.resolve_model_axis`)."""
    dims = parallel_dims.current()
    if dims is not None:
        axis = dims.resolve_model_axis(axis, "auto_rules")
        if mesh is None and axis_size is None:
            mesh = dims.mesh
    elif axis is None:
        axis = parallel_dims.DEFAULT_MODEL_AXIS
    if mesh is not None:
        axis_size = mesh.axis_size(axis)
    return axis, axis_size


def _plan(model, axis, axis_size, sequence_parallel, experts,
          tensor_parallel=True, vocab_parallel=False):
    """({layer path: style}, {path: (layer, why it stays whole)},
    {expert bank weight path: spec}) of `model`."""
    column = ColumnParallel(axis, sequence_parallel=sequence_parallel)
    row = RowParallel(axis, sequence_parallel=sequence_parallel)
    units = _weight_owners(model)
    flow = _Dataflow.trace(model, units)
    plan, whole = {}, {}
    banks, silent = _plan_experts(units, experts, whole)
    for projection, sources, heads, made in flow.attention():
        _plan_attention(projection, sources, heads, made, column, row,
                        axis_size, plan, whole)
    for sources, target in flow.mlps(exclude=set(plan) | silent):
        if _narrower_than_axis(sources, target, axis, axis_size, whole):
            continue
        for source in sources:
            _check_divides(source, _split_size(source, row=False), axis,
                           axis_size, "units")
            plan[source.path] = column
        plan[target.path] = row
    silent |= _routers(units, set(plan)) | flow.head_norms
    for layer in units:
        if layer.path not in plan and layer.path not in set(whole) | silent:
            _plan_unpaired(layer, flow, column, axis_size, plan, whole,
                           vocab_parallel)
    if not tensor_parallel:  # no model axis: only the expert banks split
        plan = {}
        whole = {path: why for path, why in whole.items()
                 if path in _bank_paths(units)}
    _keep_shared_paths_whole(units, plan, whole)
    if sequence_parallel:
        for layer in units:
            if layer.path in plan:
                _check_sequence_divides(layer, axis, axis_size)
    return plan, whole, banks


def _keep_shared_paths_whole(units, plan, whole):
    """Moves from `plan` to `whole` every planned layer whose path another
    layer's weights sit under: a rule for path P is matched by each weight
    whose layer path starts with P, so it would lay those out too, and
    clash with their own rule (keras-hub's BLIP-2: the Q-Former's
    attention block and the language model's attention are both
    "transformer_layer_0/self_attention", and the Q-Former's projections
    sit under it)."""
    under = {}  # layer path prefix -> ids of the weights below it
    for layer in units:
        for weight in layer.weights:
            parts = weight.path.split("/")
            for cut in range(1, len(parts)):
                under.setdefault("/".join(parts[:cut]), set()).add(id(weight))
    planned = {}
    for layer in units:
        if layer.path in plan:
            planned.setdefault(layer.path, set()).update(
                id(w) for w in layer.weights)
    for path, own in planned.items():
        if under.get(path, set()) - own:
            for layer in units:
                if layer.path == path:
                    whole[path] = (layer, (
                        "another layer's weights sit under its path "
                        f"{path!r} (a rule for it would lay them out too): "
                        "every device uses it whole"))
            del plan[path]


def _expert_bank_weights(layer):
    """The weights `layer` owns itself when it is an expert bank (an int
    `num_experts` attribute, every own weight of rank >= 2 leading with
    that many experts, one of rank 3: `[experts, in, out]`), else []."""
    experts = getattr(layer, "num_experts", None)
    own = keras_graph.own_weights(layer)
    if (not isinstance(experts, int) or isinstance(experts, bool)
            or not own or not any(len(w.shape) == 3 for w in own)
            or any(len(w.shape) < 2 or w.shape[0] != experts for w in own)):
        return []
    return own


def _plan_experts(units, experts, whole):
    """({bank weight path: spec}, {bank layer paths}): every expert bank's
    weights split along their experts dimension over the expert axis
    (`experts` = (axis, size or None)); without that axis the banks stay
    whole, in `whole` with the reason."""
    axis, size = experts
    specs, bank_layers = {}, set()
    for layer in units:
        own = _expert_bank_weights(layer)
        if not own:
            continue
        bank_layers.add(layer.path)
        if size is None or size == 1:
            whole[layer.path] = (layer, (
                f"an expert bank of {layer.num_experts} experts: split over "
                f"the expert axis {axis!r} when the mesh has one"))
            continue
        _check_divides(layer, layer.num_experts, axis, size, "num_experts")
        for weight in own:
            specs[weight.path] = (axis,) + (None,) * (len(weight.shape) - 1)
    return specs, bank_layers


def _bank_paths(units):
    """Paths of the bank layers among `units` (planned or kept whole)."""
    return {layer.path for layer in units if _expert_bank_weights(layer)}


def _routers(units, planned):
    """Paths of the routers: projections of an MoE block (under the parent
    path of an expert bank) outside any planned pattern. They stay whole:
    every device routes its tokens over all experts."""
    blocks = {path.rsplit("/", 1)[0] + "/" for path in
              _bank_paths(units)}
    return {layer.path for layer in units
            if _is_projection(layer) and layer.path not in planned
            and any(layer.path.startswith(b) for b in blocks)}


def _plan_attention(projection, sources, heads, made, column, row,
                    axis_size, plan, whole):
    """Attention by `heads`: the output `projection` row-parallel, the
    query/key/value `sources` column-parallel (`made`: {path: the heads
    each makes}; grouped-query key/value heads the axis does not divide:
    whole)."""
    axis = row.axis
    if heads % axis_size and (_contracts(projection) == 1 or any(
            _makes(source) == 1 for source in sources)):
        # Heads made by reshapes were kept whole before they were read as
        # attention (SegFormer's first stages have 1 or 2): still whole.
        for layer in (projection, *sources):
            whole[layer.path] = (layer, (
                f"{heads} attention heads (made by reshapes), which mesh "
                f"axis {axis!r} of size {axis_size} does not divide: every "
                "device uses them whole"))
        return
    _check_divides(projection, heads, axis, axis_size, "heads")
    plan[projection.path] = row
    for source in sources:
        size = made[source.path]
        if size % axis_size == 0:
            plan[source.path] = column
        elif size < heads:  # grouped-query key/value heads
            whole[source.path] = (source, (
                f"{size} key/value heads, which mesh axis {axis!r} of "
                f"size {axis_size} does not divide (grouped-query "
                "attention): every device uses them whole"))
            if column.sequence_parallel:
                # Each device projects its tokens; attention reads the
                # heads whole (read split, DTensor 2.21 fails in the
                # backward of keras-hub's repeat of the heads).
                plan[source.path] = SequenceParallel(axis, gather_output=True)
        else:
            _check_divides(source, size, axis, axis_size, "heads")


def _narrower_than_axis(sources, target, axis, axis_size, whole):
    """Whether an MLP's hidden layer has fewer units than the model axis
    has devices (Gemma 3n's AltUp router, Dense(2) -> tanh -> Dense, on
    model=4): no split of it exists, so the pair stays whole, in `whole`
    with the reason. A wider hidden layer the axis does not divide is
    still `_check_divides`' error (a width the user chose)."""
    widths = [_split_size(source, row=False) for source in sources]
    if min(widths) >= axis_size:
        return False
    for layer in (*sources, target):
        whole[layer.path] = (layer, (
            f"an MLP {min(widths)} units wide, fewer than mesh axis "
            f"{axis!r} has devices ({axis_size}): every device uses it "
            "whole"))
    return True


def _plan_unpaired(layer, flow, column, axis_size, plan, whole,
                   vocab_parallel=False):
    """A layer in no attention or MLP pattern: MultiHeadAttention and
    embeddings column-parallel, norms SequenceParallel (with sequence
    parallelism) or whole, output heads split over the vocabulary (with
    `vocab_parallel`) or whole, anything else whole with the reason."""
    axis = column.axis
    head = vocab_parallel and id(layer) in flow.heads
    biases = head and vocab_parallel_lib.reverse_head_biases(layer)
    if head and (_is_projection(layer) or _embedding_table(layer) is not None):
        plan[layer.path] = _vocab_split(layer, column, axis_size)
    elif biases:
        # A head projecting onto the token embedding it holds (keras-hub's
        # MaskedLMHead): the table split by vocabulary, the logits' biases
        # too (raw specs: the head's sublayers, before the projection,
        # stay whole).
        table_layer = layer.token_embedding
        plan[table_layer.path] = _vocab_split(table_layer, column, axis_size)
        for bias in biases:
            plan[bias.path] = (axis,)
    elif isinstance(layer, keras.layers.MultiHeadAttention):
        _check_divides(layer, layer.num_heads, axis, axis_size, "num_heads")
        plan[layer.path] = column
    elif _embedding_table(layer) is not None:
        _check_divides(layer, _embedding_table(layer).shape[1], axis,
                       axis_size, "output_dim")
        plan[layer.path] = column
    elif keras_graph.is_norm(layer):
        if column.sequence_parallel and _normalizes_each_token(
                layer, flow.input_rank(layer)):
            plan[layer.path] = SequenceParallel(axis)
    else:
        whole[_label(layer)] = (layer, _why_whole(layer, flow))


def _vocab_split(head, column, axis_size):
    """`VocabParallel`: output head `head` split over its outputs (the
    vocabulary; see tfpar.styles), after checking the axis divides it."""
    table = _embedding_table(head)
    vocab = (table.shape[0] if table is not None
             else _split_size(head, row=False))
    if vocab % axis_size:
        raise ValueError(
            f"auto_rules(vocab_parallel=True) splits output head "
            f"{head.path!r} ({type(head).__name__}) over its vocabulary of "
            f"{vocab}, which mesh axis {column.axis!r} of size {axis_size} "
            f"does not divide. Received: vocabulary={vocab}. Pad the "
            f"vocabulary to a multiple of {axis_size}, or use "
            "vocab_parallel=False (logits computed whole)."
        )
    return VocabParallel(column.axis)


def _check_vocab_parallel(vocab_parallel, sequence_parallel):
    if not isinstance(vocab_parallel, bool):
        raise TypeError(
            "auto_rules(vocab_parallel) must be True or False. Received: "
            f"vocab_parallel={vocab_parallel!r}"
        )
    if vocab_parallel and sequence_parallel:
        raise ValueError(
            "auto_rules(vocab_parallel=True) with sequence_parallel=True is "
            "not supported yet. Received: vocab_parallel=True, "
            "sequence_parallel=True. Use one of the two."
        )


# Models whose weight-owning layers are read once while a caller asks for
# several plans of the unchanged model (`unchanged_model`).
_OWNERS = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def unchanged_model(model):
    """Inside this block, `auto_rules(model, ...)` reads which layers of
    `model` own weights once (the walk takes seconds for a model of 900
    layers), for a caller that asks for plans of the same, unchanged model
    at several axis sizes (`tfpar.plan`).

    >>> with unchanged_model(model):
    ...     plans = [auto_rules(model, axis_size=t) for t in (2, 4, 8)]
    """
    _OWNERS[model] = None
    try:
        yield
    finally:
        _OWNERS.pop(model, None)


def _weight_owners(model):
    """The layers that own weights themselves (not only through sublayers),
    outermost first; a MultiHeadAttention counts as one (its projections
    are planned with it)."""
    if model in _OWNERS:
        if _OWNERS[model] is None:
            _OWNERS[model] = _find_weight_owners(model)
        return _OWNERS[model]
    return _find_weight_owners(model)


def _find_weight_owners(model):
    owners = keras_graph.owning_layers(model)
    owning = {id(owners[id(w)]) for w in model.weights if id(w) in owners}
    out, inside_attention = [], set()
    for layer in _compat.all_layers(model, include_self=False):
        if id(layer) in inside_attention:
            continue
        if isinstance(layer, keras.layers.MultiHeadAttention):
            inside_attention.update(
                id(sub) for sub in _compat.all_layers(layer, include_self=False))
            out.append(layer)
        elif id(layer) in owning:
            out.append(layer)
    return out


def _moves_last_axis(transpose):
    """Whether a Transpose op's permutation (static) does not keep the last
    axis last (unknown: True), e.g. (..., heads, head_dim) swapped."""
    perm = tf.get_static_value(getattr(transpose.inputs[1], "tensor",
                                       transpose.inputs[1]))
    return perm is None or int(perm[-1]) != len(perm) - 1


def _made_heads(layer, after):
    """The heads `layer` makes for an attention core, or None: an
    EinsumDense making >= 2 dimensions makes its first (heads); a Dense or
    EinsumDense making one makes heads·head_dim outputs that a reshape
    splits heads-major into (..., heads, head_dim) (`after`: the tensors
    ops made of its output, as `_Dataflow._walk` reached it)."""
    if not _is_projection(layer):
        return None
    if isinstance(layer, keras.layers.EinsumDense) and _makes(layer) >= 2:
        return _split_size(layer, row=False)
    if _makes(layer) != 1:
        return None
    width = _split_size(layer, row=False)
    for tensor in after:
        if tensor is None or tensor.op.type != "Reshape":
            continue
        shape = tensor.shape
        if (shape.rank is not None and shape.rank >= 3
                and None not in shape[-2:] and shape[-2] > 1
                and shape[-2] * shape[-1] == width):
            return shape[-2]
    return None


def _einsum_letters(layer):
    """(kernel letters, letters it contracts, letters it makes) of an
    EinsumDense, e.g. "bqm,muh->bquh": ("muh", "m", "uh")."""
    inputs, output = layer.equation.split("->")
    data, kernel = inputs.split(",")
    return (kernel, [c for c in kernel if c not in output],
            [c for c in kernel if c in output and c not in data])


def _is_projection(layer):
    return isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))


def _contracts(layer):
    """How many input dimensions a Dense/EinsumDense kernel contracts."""
    if isinstance(layer, keras.layers.Dense):
        return 1
    return len(_einsum_letters(layer)[1])


def _makes(layer):
    """How many dimensions a Dense/EinsumDense kernel adds to its input's."""
    if isinstance(layer, keras.layers.Dense):
        return 1
    return len(_einsum_letters(layer)[2])


def _split_size(layer, row):
    """The length of the kernel dimension RowParallel (`row`) or
    ColumnParallel splits (see `tfpar.styles._split`)."""
    if isinstance(layer, keras.layers.Dense):
        return layer.kernel.shape[0 if row else 1]
    kernel, contracted, _ = _einsum_letters(layer)
    output = layer.equation.split("->")[1]
    letter = contracted[0] if row else next(c for c in kernel if c in output)
    return layer.kernel.shape[kernel.index(letter)]


def _embedding_table(layer):
    """The (vocab, hidden) `embeddings` weight of a layer whose weights are
    embedding tables (and a reverse one; int8's scales beside them), or
    None."""
    tables = {w.path.rsplit("/", 1)[-1]: w for w in layer.weights}
    table = tables.get("embeddings")
    if (table is None or len(table.shape) != 2
            or not set(tables) - QUANTIZATION_STATE <= {
                "embeddings", "reverse_embeddings"}):
        return None
    return table


def _why_whole(layer, flow):
    if _is_projection(layer):
        if id(layer) in flow.heads:
            return "an output head, kept whole so the logits are whole"
        return ("in no MLP or attention pattern (no Dense/EinsumDense pairs "
                "with it through elementwise ops)")
    inner = {id(w) for sub in _compat.all_layers(layer, include_self=False)
             for w in sub.weights}
    own = [w for w in layer.weights if id(w) not in inner]
    names = sorted({w.path.rsplit("/", 1)[-1] for w in own})
    if own and not any(w.trainable for w in own):
        return (f"non-trainable constants {names} (e.g. rotary "
                "frequencies): the same on every device")
    return f"no plan for {type(layer).__name__} weights {names}"


def _label(layer):
    """`layer.path`, or for a layer Keras gave none (keras-hub SmolLM3's
    rotary embedding) the path its weights sit under."""
    if layer.path:
        return layer.path
    paths = [w.path.rsplit("/", 1)[0] for w in layer.weights]
    return paths[0] if paths else layer.name


# The last trace of each model (by the identity of its weight-owning
# layers): tracing a large model symbolically takes most of a plan's time,
# and the planner asks auto_rules once per model-axis size.
_TRACES = weakref.WeakKeyDictionary()


class _Dataflow:
    """Which weight-owning layer reads which, from one symbolic trace.

    `producer` maps each graph tensor a layer returned to that layer;
    `_reads` walks back from a layer's input through ops of no layer.
    """

    def __init__(self, units, calls=None, outputs=()):
        self.units = units
        self.calls = calls
        self.head_norms = set()  # per-head norms inside attention
        self.producer = {}
        for layer in units:
            for _, made in (calls or {}).get(id(layer), []):
                for tensor in made:
                    self.producer.setdefault(tensor.name, layer)
        if calls is None:  # no graph: the last Dense is the head
            dense = [l for l in units if isinstance(l, keras.layers.Dense)]
            self.heads = {id(dense[-1])} if dense else set()
        else:
            self.heads = {id(l) for l in self._reads(outputs, True)[0]}

    @classmethod
    def trace(cls, model, units):
        key = tuple(map(id, units))
        cached = _TRACES.get(model)
        if cached is not None and cached[0] == key:
            traced = cached[1]
            return cls(units) if traced is None else cls(units, *traced)
        try:
            traced = keras_graph.trace_layer_calls_any_length(model, units)
        except Exception as error:  # noqa: BLE001 (any failure: say what to do)
            first = (str(error).strip().splitlines() or [""])[0]
            raise ValueError(
                f"auto_rules traces model {model.name!r} once on symbolic "
                "inputs of its input signature (inference mode) to see which "
                "layer feeds which, and that trace failed. Received: "
                f"{type(error).__name__}: {first}. Make the model callable "
                "on symbolic inputs (e.g. keras.Input shapes), or write the "
                "plan by hand: tfpar.LayoutRules({layer regex: "
                "tfpar.ColumnParallel(), ...})."
            ) from error
        _TRACES[model] = (key, traced)
        return cls(units) if traced is None else cls(units, *traced)

    def input_rank(self, layer):
        calls = (self.calls or {}).get(id(layer))
        return calls[0][0][0].shape.rank if calls and calls[0][0] else None

    def _reads(self, tensors, elementwise):
        """(layers whose outputs reach `tensors`, whether only elementwise
        ops on them and constants lie between)."""
        found, pure = self._walk(tensors, elementwise)
        return [layer for layer, _ in found.values()], pure

    def _walk(self, tensors, elementwise):
        """`_reads`, each layer found with the tensors the walk reached it
        from ({id: (layer, [tensor an op made of its output, or None where
        its output is one of `tensors`])}): a Reshape's output there is how
        the layer's output was split (`_made_heads`)."""
        found, pure, seen = {}, True, set()
        stack = [(tensor, None) for tensor in tensors]
        while stack:
            tensor, after = stack.pop()
            if tensor.name in seen:
                continue
            seen.add(tensor.name)
            layer = self.producer.get(tensor.name)
            if layer is not None:
                found.setdefault(id(layer), (layer, []))[1].append(after)
                continue
            op = tensor.op
            if op.type in _SHAPE_OPS or op.type == "Const":
                continue
            if op.type not in _ELEMENTWISE_OPS:
                pure = False  # a model input, a weight, or mixing values
                if elementwise:
                    continue
            # An Identity is looked through: what follows it stays `after`.
            made = after if op.type == "Identity" else tensor
            stack.extend((source, made) for source in op.inputs)
        return found, pure

    def _first_input(self, layer):
        calls = (self.calls or {}).get(id(layer))
        return calls[0][0][:1] if calls else []

    def attention(self):
        """[(output projection, [query/key/value projections], heads,
        {projection path: the heads it makes})].

        The output projection contracts the heads and their features:
        either itself (an EinsumDense contracting >= 2 dimensions,
        "btnh,nhd->btd") or after a reshape merging them heads-major
        ((..., heads, head_dim) -> (..., heads·head_dim), then a Dense or
        "abc,cd->abd": GPT-NeoX, T5), so that splitting its rows in t
        blocks splits the heads. The projections it reads make the heads
        (`_made_heads`): an EinsumDense making >= 2 dimensions (e.g.
        GPT-NeoX's fused "abc,cde->abde" of (heads, 3·head_dim)), or a
        Dense whose heads·head_dim outputs a reshape splits heads-major
        (T5, ESM, SmolLM3).
        """
        if self.calls is None:
            return []
        found = []
        for layer in self.units:
            heads = self._output_heads(layer)
            if heads is None:
                continue
            made = self._through_head_norms(self._heads_read(
                self._first_input(layer)))
            # Only projections make the heads: other layers read are
            # looked past (T5's attention layers, which return the position
            # bias their cores add; SmolLM3's rotary frequencies).
            made = {source: n for source, n in made.items()
                    if _is_projection(source)}
            if not made or None in made.values():
                continue
            # Merged heads: the reshape's (heads, head_dim) must be the
            # query's heads (not (head_dim, heads) after a transpose).
            if _contracts(layer) == 1 and heads != max(made.values()):
                continue
            found.append((layer, list(made), heads,
                          {s.path: n for s, n in made.items()}))
        return found

    def _heads_read(self, tensors):
        """{layer whose output reaches `tensors`: the heads it makes, or
        None} (`_made_heads`)."""
        found, _ = self._walk(tensors, elementwise=False)
        return {layer: _made_heads(layer, after)
                for layer, after in found.values()}

    def _output_heads(self, layer):
        """How many heads `layer` contracts as an attention output
        projection (`attention`), or None where it is not one."""
        if isinstance(layer, keras.layers.EinsumDense) and (
                _contracts(layer) >= 2):
            return _split_size(layer, row=True)
        if not _is_projection(layer) or _contracts(layer) != 1 or (
                id(layer) in self.heads):
            return None
        tensors = self._first_input(layer)
        if not tensors:
            return None
        merged = tensors[0]
        while merged.op.type == "Identity" and self.producer.get(
                merged.name) is None:
            merged = merged.op.inputs[0]
        if merged.op.type != "Reshape" or self.producer.get(merged.name):
            return None
        heads = merged.op.inputs[0]
        if heads.op.type == "Transpose" and not self.producer.get(
                heads.name) and _moves_last_axis(heads.op):
            return None  # (..., head_dim, heads): its blocks are not heads
        split = heads.shape
        rows = _split_size(layer, row=True)
        if (split.rank is None or split.rank < 3 or None in split[-2:]
                or split[-2] * split[-1] != rows or split[-2] == 1):
            return None
        return split[-2]

    def _through_head_norms(self, made):
        """`made` ({layer: heads}) with each norm replaced by what it reads
        (Qwen3's query/key norms sit between the projections and the
        attention core); the norms looked through are kept in
        `head_norms`."""
        out = {}
        for source, heads in made.items():
            if not keras_graph.is_norm(source):
                out[source] = heads
                continue
            read = self._heads_read(self._first_input(source))
            if read and None not in read.values():
                self.head_norms.add(source.path)
            out.update(read)
        return out

    def mlps(self, exclude):
        """[([column layers], row layer)]: Megatron MLPs, plain or gated."""
        if self.calls is None:
            return _chained_dense_pairs(self.units)
        found, used = [], set(exclude)
        for layer in self.units:
            if (not _is_projection(layer) or _contracts(layer) != 1
                    or id(layer) in self.heads or layer.path in used):
                continue
            sources, pure = self._reads(self._first_input(layer),
                                        elementwise=True)
            if (pure and sources
                    and all(_is_projection(s) and _makes(s) == 1
                            and id(s) not in self.heads
                            and s.path not in used for s in sources)):
                found.append((sources, layer))
                used.update([layer.path] + [s.path for s in sources])
        return found


def _chained_dense_pairs(units):
    """For subclassed models (no graph): consecutive Dense layers (a, b)
    whose widths chain (a.units == b's input width), the last Dense being
    the head."""
    dense = [l for l in units if isinstance(l, keras.layers.Dense)][:-1]
    pairs, used = [], set()
    for a, b in zip(dense, dense[1:]):
        if id(a) in used or id(b) in used:
            continue
        if b.kernel.shape[0] == a.units:
            pairs.append(([a], b))
            used.update({id(a), id(b)})
    return pairs


def _normalizes_each_token(layer, rank):
    """A norm over feature axes only (not batch or sequence) of a rank
    `rank` input (None: unknown), so each token is normalized alone and
    sequence parallelism applies. Norms of other libraries normalize the
    last axis."""
    if isinstance(layer, keras_graph.KERAS_NORMS) and not isinstance(
            layer, (keras.layers.LayerNormalization,
                    keras.layers.RMSNormalization)):
        return False  # batch, group and unit norms mix tokens or channels
    axes = getattr(layer, "axis", -1)
    axes = list(axes) if isinstance(axes, (list, tuple)) else [axes]
    if rank is None:  # no trace: only the last axis is sure
        return axes == [-1]
    return rank >= 3 and all(a % rank >= 2 for a in axes)


def _check_sequence_divides(layer, axis, axis_size):
    """For functional models: the sequence (dimension 1) of the layer's
    output must split over the axis. (Subclassed models are checked when
    the step is traced.)"""
    try:
        shape = layer.output.shape
    except (AttributeError, ValueError):
        return
    if len(shape) < 3:
        raise ValueError(
            f"Sequence parallelism needs (batch, sequence, features) "
            f"activations, but layer {layer.path!r} "
            f"({type(layer).__name__}) outputs shape {tuple(shape)}. "
            f"Received: rank={len(shape)}. Use sequence_parallel=False for "
            "models without a sequence dimension."
        )
    if shape[1] is not None and shape[1] % axis_size:
        raise ValueError(
            f"Layer {layer.path!r} ({type(layer).__name__}) outputs shape "
            f"{tuple(shape)}: sequence parallelism splits dimension 1 "
            f"(length {shape[1]}) over mesh axis {axis!r} of size "
            f"{axis_size}, which does not divide it. Received: "
            f"sequence length {shape[1]}. Use a multiple of {axis_size} or "
            "sequence_parallel=False."
        )


def _check_divides(layer, size, axis, axis_size, what):
    if size % axis_size:
        raise ValueError(
            f"Layer {layer.path!r} ({type(layer).__name__}) has {what}={size}, "
            f"which mesh axis {axis!r} of size {axis_size} does not divide. "
            f"Received: {what}={size}. Choose a multiple of {axis_size} or "
            "a smaller axis."
        )
