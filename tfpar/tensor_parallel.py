"""Tensor-parallel styles and automatic plans (Megatron-LM style).

A plan is data: `LayoutRules({layer regex: style})`, separate from the
layers. A style knows how to lay out the weights of the layer it is given:

- `ColumnParallel(axis)` splits a layer's *outputs* over `axis`. For a Dense
  kernel (in, out) that is axis 1, plus the bias; for an EinsumDense the
  first kernel dimension that appears in the output; for an Embedding the
  hidden dimension (a ReversibleEmbedding's (hidden, vocab)
  `reverse_embeddings` too: the projection to logits sums partial products);
  for MultiHeadAttention, or any attention layer with query/key/value and
  attention_output EinsumDense sublayers (keras-hub's), the heads
  (query/key/value split by heads, the output projection split row-wise by
  heads) — each device then computes whole heads and one all-reduce follows
  the block.
- `RowParallel(axis)` splits a layer's *inputs*: Dense kernel axis 0 (bias
  replicated: it is added once, after the all-reduce of the partial sums);
  EinsumDense the first contracted kernel dimension; Embedding the
  vocabulary (and a `reverse_embeddings` table by vocabulary).
- `Replicated()` keeps every weight whole on every device.
- `SequenceParallel(axis)` (for LayerNormalization/RMSNormalization) keeps
  the weights whole and the layer's activations split along the sequence.

Sequence parallelism (Megatron-SP, Korthikanti et al. 2022): with
`sequence_parallel=True`, activations between the tensor-parallel blocks
(norms, dropout, residual adds) are split along the sequence dimension
(batch, sequence, hidden) -> each device holds (b, s/k, h). Before a
column-parallel layer the sequence is gathered (g: all-gather forward,
reduce-scatter backward); after a row-parallel layer the partial sums are
reduce-scattered along the sequence (g-bar: reduce-scatter forward,
all-gather backward) instead of all-reduced. tfpar expresses both as
DTensor relayouts of the layer's input and output; DTensor inserts the
collectives. Values are unchanged: a relayout only moves data. On CPU (and
GPU without NCCL) DTensor 2.21 runs the all-gather as an all-reduce of
zero-padded blocks and the reduce-scatter as an all-reduce plus a slice, so
sequence parallelism saves activation memory there but moves about twice
the bytes of plain tensor parallelism (`tfpar.communication_report` shows
both; tests/dtensor_sp_collectives_repro.py reproduces it without tfpar).

The math of the Megatron MLP, with X replicated and W1 = [W1_1 ... W1_k]
split by columns, W2 = [W2_1; ...; W2_k] split by rows over k devices:
Y = gelu(X W1) W2 = sum_i gelu(X W1_i) W2_i — device i computes its term
alone; the sum is the one all-reduce of the forward pass (and its transpose,
one all-reduce of dX, in the backward pass).

Example:

>>> rules = tfpar.LayoutRules({
...     r".*mlp_up": tfpar.ColumnParallel(),
...     r".*mlp_down": tfpar.RowParallel(),
...     r".*attention": tfpar.ColumnParallel(),   # by heads
... })
"""

import re
import warnings

import keras
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import strategy as strategy_lib
from tfpar.layout import LayoutRules


class Style:
    """Base class: how one layer's weights are laid out over a mesh axis."""

    def __init__(self, axis="model"):
        if not isinstance(axis, str):
            raise TypeError(
                f"{type(self).__name__}(axis) needs a mesh axis name. "
                f"Received: axis={axis!r}"
            )
        self.axis = axis

    def axes(self):
        return (self.axis,)

    def spec_for(self, layer, role, shape):
        """The spec of weight `role` (e.g. "kernel", "query/bias") of `layer`.

        `layer` is the Keras layer that owns the weight (for MultiHeadAttention
        the EinsumDense sublayer); raises ValueError for weights it does not
        know how to lay out.
        """
        raise NotImplementedError  # every concrete style overrides this

    def _key(self):
        return (type(self), self.axis)

    def __repr__(self):
        return f"{type(self).__name__}(axis={self.axis!r})"

    def __eq__(self, other):
        return isinstance(other, Style) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


class _TensorParallel(Style):
    """Column/row styles: an axis, and whether sequence parallelism is on."""

    def __init__(self, axis="model", sequence_parallel=False):
        super().__init__(axis)
        if not isinstance(sequence_parallel, bool):
            raise TypeError(
                f"{type(self).__name__}(sequence_parallel) must be True or "
                f"False. Received: sequence_parallel={sequence_parallel!r}"
            )
        self.sequence_parallel = sequence_parallel

    def _key(self):
        return (type(self), self.axis, self.sequence_parallel)

    def __repr__(self):
        extra = ", sequence_parallel=True" if self.sequence_parallel else ""
        return f"{type(self).__name__}(axis={self.axis!r}{extra})"


class Replicated(Style):
    """Every weight of the layer whole on every device."""

    def __init__(self):
        super().__init__("model")

    def axes(self):
        return ()

    def spec_for(self, layer, role, shape):
        return (None,) * len(shape)

    def __repr__(self):
        return "Replicated()"


class ColumnParallel(_TensorParallel):
    """Split the layer's outputs over `axis` (see module docstring).

    With `sequence_parallel=True` the layer's input, split along the
    sequence, is first gathered whole (all-gather forward, reduce-scatter
    backward); for MultiHeadAttention that is the input of query, key and
    value (gathered once when they are the same tensor), and the output
    projection's partial sums are reduce-scattered along the sequence. An
    Embedding's output, split along the hidden dimension, is re-split along
    the sequence instead of gathered (an all-to-all).

    Example:

    >>> rules = tfpar.LayoutRules({
    ...     r".*up": tfpar.ColumnParallel(sequence_parallel=True)})
    """

    def spec_for(self, layer, role, shape):
        if "/" in role:  # a sublayer of MultiHeadAttention
            sublayer = role.split("/", 1)[0]
            row = sublayer in _ATTENTION_OUTPUT
            spec = _split(layer, role, shape, self.axis, row=row, owner=self,
                          gather_embedding=not self.sequence_parallel)
            if self.sequence_parallel:
                if row:  # the output projection: partial sums, split by sequence
                    _sequence_output(layer, self.axis)
                else:  # query/key/value (and gate) need the whole sequence
                    _sequence_input(layer, self.axis, split=False)
            return spec
        spec = _split(layer, role, shape, self.axis, row=False, owner=self,
                      gather_embedding=not self.sequence_parallel)
        if self.sequence_parallel:
            if _is_embedding_table(role, shape):
                _sequence_output(layer, self.axis)
            else:
                _sequence_input(layer, self.axis, split=False)
        return spec


class RowParallel(_TensorParallel):
    """Split the layer's inputs over `axis` (see module docstring).

    With `sequence_parallel=True` the output, a partial sum on each device,
    is reduce-scattered along the sequence instead of all-reduced.
    """

    def spec_for(self, layer, role, shape):
        if "/" in role:
            raise ValueError(
                f"RowParallel does not apply to MultiHeadAttention (weight "
                f"{role!r} of layer {getattr(layer, 'path', layer)!r}). "
                "Use ColumnParallel(), which splits attention by heads."
            )
        spec = _split(layer, role, shape, self.axis, row=True, owner=self)
        if self.sequence_parallel:
            _sequence_output(layer, self.axis)
        return spec


class SequenceParallel(Style):
    """Weights whole; the layer's input and output split along the sequence.

    For layers with weights that act on each token alone
    (LayerNormalization and RMSNormalization over the features): each
    device computes its s/k tokens of the (batch, sequence, hidden)
    activation, so what the layer keeps for its backward pass takes 1/k of
    the memory; the weight gradients are summed over the devices (a small
    all-reduce). Layers without weights between them (Dropout, residual
    adds) keep the sequence split DTensor gives them. Use it together with
    `ColumnParallel(sequence_parallel=True)` / `RowParallel(...)` (what
    `auto_rules(model, sequence_parallel=True)` plans).

    Example:

    >>> rules = tfpar.LayoutRules({r".*ln\\d": tfpar.SequenceParallel()})
    """

    def spec_for(self, layer, role, shape):
        _sequence_input(layer, self.axis, split=True)
        _sequence_output(layer, self.axis)
        return (None,) * len(shape)


_ATTENTION_OUTPUT = ("attention_output", "output")


def _step_mesh(tensor):
    """The DTensor mesh `tensor` lives on inside a tfpar step, or None when
    it is not on a mesh (e.g. Keras' symbolic build, a single device)."""
    if tf.executing_eagerly():
        return dtensor.fetch_layout(tensor).mesh if dtensor.is_dtensor(tensor) else None
    if strategy_lib.in_spmd_step():
        # The whole mesh, or the pipeline stage being traced.
        return tf.distribute.get_strategy().extended.placement_mesh.dtensor_mesh
    return None


def _gather_output_hidden(layer):
    """Makes a hidden-wise split Embedding return whole hidden vectors.

    The lookup itself needs no communication; its output is gathered along
    the hidden dimension (an all-gather over the model axis; other
    dimensions keep their layout), as in Megatron. Left to itself, DTensor
    2.21 propagates the hidden split into the following LayerNormalization
    and then fails to expand the backward pass (EmitAllScatter).
    """
    if layer is None:
        return

    def gather_hidden(outputs):
        mesh = _step_mesh(outputs)
        if mesh is None:
            return outputs
        # Keep the batch layout (split over data or not); all else whole.
        specs = [dtensor.MATCH] + [dtensor.UNSHARDED] * (outputs.shape.rank - 1)
        return dtensor.relayout(outputs, dtensor.Layout(specs, mesh))

    _compat.transform_layer_outputs(layer, "tfpar_gather_hidden", gather_hidden)


def _sequence_relayout(tensor, axis, layer, where, split):
    """`tensor` (batch, sequence, ...) split along the sequence over `axis`
    (`split`) or whole along it (gathered); the batch keeps its layout
    (split over the data axis or not), every other dimension is whole.

    The gradient is pinned to the sequence-split layout: it stays in the
    sequence-parallel region (a reduce-scatter after the backward of a
    column-parallel layer, no gather in the backward of a norm).
    """
    mesh = _step_mesh(tensor)
    if mesh is None or axis not in mesh.dim_names or mesh.dim_size(axis) == 1:
        return tensor
    path = getattr(layer, "path", None) or getattr(layer, "name", layer)
    rank = tensor.shape.rank
    if rank is None or rank < 3:
        raise ValueError(
            f"Sequence parallelism needs (batch, sequence, features) "
            f"activations, but the {where} of layer {path!r} has shape "
            f"{tensor.shape}. Received: rank={rank}. Turn sequence_parallel "
            "off for this layer (plain ColumnParallel/RowParallel, or no "
            "SequenceParallel rule)."
        )
    size = mesh.dim_size(axis)
    length = tensor.shape[1]
    if length is not None and length % size:
        raise ValueError(
            f"Sequence parallelism splits the sequence (dimension 1) of the "
            f"{where} of layer {path!r} over mesh axis {axis!r} of size "
            f"{size}, which does not divide it. Received: shape="
            f"{tensor.shape}. Use a sequence length that is a multiple of "
            f"{size}, or sequence_parallel=False."
        )
    whole = [dtensor.MATCH] + [dtensor.UNSHARDED] * (rank - 1)
    split_specs = list(whole)
    split_specs[1] = axis
    target = dtensor.Layout(split_specs if split else whole, mesh)
    sequence = dtensor.Layout(split_specs, mesh)
    # Self-attention feeds one tensor to query, key and value: relayout it
    # once, so the backward sums the three gradients before one collective.
    # (A relayout is a pure function of its input: reusing it is exact.)
    last = _LAST_RELAYOUT.get("entry")
    if last is not None and last[0] is tensor and last[1] == target:
        return last[2]

    @tf.custom_gradient
    def relayout(x):
        def grad(dy):
            if not split:
                # The gradient of a gather is a sum of partial gradients
                # (query, key and value of self-attention, each partial
                # over the heads): made whole once (one all-reduce of the
                # sum), then each device keeps its sequence block.
                dy = dtensor.relayout(dy, dtensor.Layout(whole, mesh))
            return dtensor.relayout(dy, sequence)
        return dtensor.relayout(x, target), grad

    result = relayout(tensor)
    _LAST_RELAYOUT["entry"] = (tensor, target, result)
    return result


# The last sequence relayout: (input tensor, target layout, output). Holding
# the input keeps its id from being reused while it is cached.
_LAST_RELAYOUT = {}


def _sequence_output(layer, axis):
    """`layer`'s output is relaid out split along the sequence over `axis`.

    After a row-parallel layer (a partial sum on every device) DTensor
    reduces and scatters: Y_i = (sum_j Y^(j))[sequence block i].
    """
    if layer is None:
        return
    _compat.transform_layer_outputs(
        layer, "tfpar_sequence_output",
        lambda out: _sequence_relayout(out, axis, layer, "output", split=True))


def _sequence_input(layer, axis, split):
    """`layer`'s first input is relaid out: split along the sequence
    (`split`, for norms) or whole (an all-gather of the sequence blocks,
    before a column-parallel layer)."""
    if layer is None:
        return
    _compat.transform_layer_inputs(
        layer, "tfpar_sequence_input",
        lambda x: _sequence_relayout(x, axis, layer, "input", split=split))


def _is_embedding_table(role, shape):
    return role.rsplit("/", 1)[-1] == "embeddings" and len(shape) == 2


def _split(layer, role, shape, axis, row, owner, gather_embedding=True):
    """Spec splitting the input (row) or output (column) side of a weight."""
    name = role.rsplit("/", 1)[-1]
    spec = [None] * len(shape)
    if _is_embedding_table(role, shape):
        spec[0 if row else 1] = axis  # vocab-wise or hidden-wise
        if not row and gather_embedding:
            _gather_output_hidden(layer)
        return tuple(spec)
    if name == "reverse_embeddings" and len(shape) == 2:
        # A ReversibleEmbedding's (hidden, vocab) projection to logits, split
        # like its table: by hidden (partial logits, summed) or by vocab.
        spec[1 if row else 0] = axis
        return tuple(spec)
    equation = getattr(layer, "equation", None)
    if equation is not None:  # EinsumDense
        inputs, output = equation.split("->")
        kernel_letters = inputs.split(",")[1]
        if name == "kernel":
            letters = [c for c in kernel_letters if (c in output) != row]
            if letters:
                spec[kernel_letters.index(letters[0])] = axis
            return tuple(spec)
        if name == "bias":
            if row:
                return tuple(spec)
            sharded = [c for c in kernel_letters if c in output]
            bias_axes = getattr(layer, "bias_axes", None) or ""
            if sharded and sharded[0] in bias_axes:
                # Keras shapes the bias as the output dims from the first
                # bias axis on: output[first:], whatever bias_axes' order.
                first = min(output.index(c) for c in bias_axes)
                spec[output[first:].index(sharded[0])] = axis
            return tuple(spec)
    elif name == "kernel" and len(shape) == 2:  # Dense: (in, out)
        spec[0 if row else 1] = axis
        return tuple(spec)
    elif name == "bias" and len(shape) == 1:
        if not row:
            spec[0] = axis
        return tuple(spec)
    raise ValueError(
        f"{owner!r} does not know how to lay out weight {role!r} with shape "
        f"{tuple(shape)} of layer {getattr(layer, 'path', layer)!r} "
        f"({type(layer).__name__}). It handles Dense, EinsumDense, Embedding "
        "(ReversibleEmbedding) and MultiHeadAttention; use a raw spec tuple "
        "for other layers."
    )


# -- automatic plans -----------------------------------------------------------

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
_KERAS_NORMS = (
    keras.layers.LayerNormalization, keras.layers.BatchNormalization,
    keras.layers.GroupNormalization, keras.layers.UnitNormalization,
    keras.layers.RMSNormalization,
)
# Norm classes of other libraries (keras-hub's RMSNormalization,
# LlamaLayerNorm, MistralLayerNormalization, ...), known by name: they
# normalize each token over its last axis with 1-D weights.
_NORM_NAME = re.compile(r".*(RMS|Layer)Norm(alization)?")


def auto_rules(model, axis="model", axis_size=None, mesh=None,
               sequence_parallel=False):
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
      all-reduce follows. Grouped-query attention: key/value projections
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
      whole, so logits are computed whole.
    - **Norms** (Keras' and other libraries' LayerNormalization /
      RMSNormalization, known by class) stay whole, or `SequenceParallel`
      with `sequence_parallel=True`.

    A subclassed *model* has no input signature to trace: there, consecutive
    Dense layers whose widths chain are paired, in attribute order.

    With `sequence_parallel=True` (Megatron-SP) the column/row styles get
    `sequence_parallel=True` and norms that normalize each token get
    `SequenceParallel`: the residual stream, norms and dropout hold
    (batch, sequence/k, hidden) per device; the sequence is all-gathered
    before each column-parallel layer and reduce-scattered after each
    row-parallel one; embedding outputs are re-split from hidden-wise to
    sequence-wise (an all-to-all). The head stays whole; DTensor gathers its
    input, so the logits are computed whole as without it.

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
        model: a built Keras model.
        axis: the mesh axis to split over.
        axis_size: its size (or give `mesh`); used to check divisibility.
        mesh: a `tfpar.Mesh` to read `axis_size` from.
        sequence_parallel: also split the activations between the
            tensor-parallel layers along the sequence (dimension 1).

    Returns:
        `tfpar.LayoutRules` with one exact-path rule per sharded layer.
    """
    if not isinstance(sequence_parallel, bool):
        raise TypeError(
            "auto_rules(sequence_parallel) must be True or False. Received: "
            f"sequence_parallel={sequence_parallel!r}"
        )
    if mesh is not None:
        axis_size = mesh.axis_size(axis)
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
    sp = sequence_parallel
    column = ColumnParallel(axis, sequence_parallel=sp)
    row = RowParallel(axis, sequence_parallel=sp)
    units = _weight_owners(model)
    flow = _Dataflow.trace(model, units)
    plan, whole = {}, {}  # path -> style; path -> (layer, reason)
    for projection, sources in flow.attention():
        heads = _split_size(projection, row=True)
        _check_divides(projection, heads, axis, axis_size, "heads")
        plan[projection.path] = row
        for source in sources:
            size = _split_size(source, row=False)
            if size % axis_size == 0:
                plan[source.path] = column
            elif size < heads:  # grouped-query key/value heads
                whole[source.path] = (source, (
                    f"{size} key/value heads, which mesh axis {axis!r} of "
                    f"size {axis_size} does not divide (grouped-query "
                    "attention): every device uses them whole"))
            else:
                _check_divides(source, size, axis, axis_size, "heads")
    for sources, target in flow.mlps(exclude=set(plan)):
        for source in sources:
            _check_divides(source, _split_size(source, row=False), axis,
                           axis_size, "units")
            plan[source.path] = column
        plan[target.path] = row
    for layer in units:
        if layer.path in plan or layer.path in whole:
            continue
        if isinstance(layer, keras.layers.MultiHeadAttention):
            _check_divides(layer, layer.num_heads, axis, axis_size, "num_heads")
            plan[layer.path] = column
        elif _embedding_table(layer) is not None:
            _check_divides(layer, _embedding_table(layer).shape[1], axis,
                           axis_size, "output_dim")
            plan[layer.path] = column
        elif _is_norm(layer):
            if sp and _normalizes_each_token(layer, flow.input_rank(layer)):
                plan[layer.path] = SequenceParallel(axis)
        else:
            whole[layer.path] = (layer, _why_whole(layer, flow))
    if sp:
        for layer in units:
            if layer.path in plan:
                _check_sequence_divides(layer, axis, axis_size)
    if whole:
        listed = "".join(f"\n  {path} ({type(layer).__name__}): {reason}"
                         for path, (layer, reason) in whole.items())
        warnings.warn(
            "tfpar.auto_rules keeps these layers' weights whole on every "
            f"device:{listed}",
            stacklevel=2,
        )
    return LayoutRules({re.escape(path): style for path, style in plan.items()})


def _weight_owners(model):
    """The layers that own weights themselves (not only through sublayers),
    outermost first; a MultiHeadAttention counts as one (its projections
    are planned with it)."""
    owners = strategy_lib._owning_layers(model)  # noqa: SLF001 (one walk rule)
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
    ColumnParallel splits (see `_split`)."""
    if isinstance(layer, keras.layers.Dense):
        return layer.kernel.shape[0 if row else 1]
    kernel, contracted, _ = _einsum_letters(layer)
    output = layer.equation.split("->")[1]
    letter = contracted[0] if row else next(c for c in kernel if c in output)
    return layer.kernel.shape[kernel.index(letter)]


def _embedding_table(layer):
    """The (vocab, hidden) `embeddings` weight of a layer whose weights are
    embedding tables (and a reverse one), or None."""
    tables = {w.path.rsplit("/", 1)[-1]: w for w in layer.weights}
    table = tables.get("embeddings")
    if (table is None or len(table.shape) != 2
            or not set(tables) <= {"embeddings", "reverse_embeddings"}):
        return None
    return table


def _is_norm(layer):
    return isinstance(layer, _KERAS_NORMS) or (
        _NORM_NAME.fullmatch(type(layer).__name__) is not None
        and all(len(w.shape) == 1 for w in layer.weights))


def _why_whole(layer, flow):
    if _is_projection(layer):
        if id(layer) in flow.heads:
            return "an output head, kept whole so the logits are whole"
        return ("in no MLP or attention pattern (no Dense/EinsumDense pairs "
                "with it through elementwise ops)")
    own = sorted({w.path.rsplit("/", 1)[-1] for w in layer.weights}
                 - {w.path.rsplit("/", 1)[-1]
                    for sub in _compat.all_layers(layer, include_self=False)
                    for w in sub.weights})
    return f"no plan for {type(layer).__name__} weights {own}"


class _Dataflow:
    """Which weight-owning layer reads which, from one symbolic trace.

    `producer` maps each graph tensor a layer returned to that layer;
    `_reads` walks back from a layer's input through ops of no layer.
    """

    def __init__(self, units, calls=None, outputs=()):
        self.units = units
        self.calls = calls
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
        try:
            traced = _compat.trace_layer_calls(model, units)
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
        return cls(units) if traced is None else cls(units, *traced)

    def input_rank(self, layer):
        calls = (self.calls or {}).get(id(layer))
        return calls[0][0][0].shape.rank if calls and calls[0][0] else None

    def _reads(self, tensors, elementwise):
        """(layers whose outputs reach `tensors`, whether only elementwise
        ops on them and constants lie between)."""
        found, pure, seen = {}, True, set()
        stack = list(tensors)
        while stack:
            tensor = stack.pop()
            if tensor.name in seen:
                continue
            seen.add(tensor.name)
            layer = self.producer.get(tensor.name)
            if layer is not None:
                found[id(layer)] = layer
                continue
            op = tensor.op
            if op.type in _SHAPE_OPS or op.type == "Const":
                continue
            if op.type not in _ELEMENTWISE_OPS:
                pure = False  # a model input, a weight, or mixing values
                if elementwise:
                    continue
            stack.extend(op.inputs)
        return list(found.values()), pure

    def _first_input(self, layer):
        calls = (self.calls or {}).get(id(layer))
        return calls[0][0][:1] if calls else []

    def attention(self):
        """[(output projection, [query/key/value projections])]."""
        if self.calls is None:
            return []
        found = []
        for layer in self.units:
            if not (isinstance(layer, keras.layers.EinsumDense)
                    and _contracts(layer) >= 2):
                continue
            sources, _ = self._reads(self._first_input(layer),
                                     elementwise=False)
            if sources and all(isinstance(s, keras.layers.EinsumDense)
                               and _makes(s) >= 2 for s in sources):
                found.append((layer, sources))
        return found

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
    if isinstance(layer, _KERAS_NORMS) and not isinstance(
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
