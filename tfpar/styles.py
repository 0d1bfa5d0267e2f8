"""Tensor-parallel styles (Megatron-LM style): data, and one apply step.

A plan is data: `LayoutRules({layer regex: style})`, separate from the
layers. A style is data too: how it lays out each weight of the layer it
is given (`spec_for(layer, role, shape)`, a pure function), and how that
layer's input and output activations are laid out (`input_layout`,
`output_layout`, and per weight `activation_layouts(layer, role, shape)`:
e.g. "sequence gathered over 'model'"). `apply(layer, role, shape)` is the
one step that changes a layer: it installs those activation relayouts (the
named collectives of `tfpar.collectives`) by wrapping the layer object's
`call`. The strategy calls it (through `apply_styles`) only once the
weights' plan is valid: nothing changes unless the whole plan is valid.
The automatic plans are in `tfpar.auto_plan`.

Every style's `axis` defaults to the strategy's model axis
(`tfpar.parallel_dims.ParallelDims.model_axis`, "model" unless
`ParallelStrategy(model_axis=...)` declares another).

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
- `VocabParallel(axis)` splits an output head over the vocabulary, so
  each device computes the logits of its vocab/k tokens: a Dense/EinsumDense
  head like ColumnParallel; a tied embedding table (vocab, hidden) by
  vocabulary; an untied ReversibleEmbedding's `reverse_embeddings`
  (hidden, vocab) by vocabulary while its lookup table stays split by
  hidden (the lookup needs no whole table).
- `Replicated()` keeps every weight whole on every device.
- `SequenceParallel(axis)` (for LayerNormalization/RMSNormalization) keeps
  the weights whole and the layer's activations split along the sequence
  (`gather_output=True`: its output gathered whole along it).

Sequence parallelism (Megatron-SP, Korthikanti et al. 2022): with
`sequence_parallel=True`, activations between the tensor-parallel blocks
(norms, dropout, residual adds) are split along the sequence dimension
(batch, sequence, hidden) -> each device holds (b, s/k, h). Before a
column-parallel layer the sequence is gathered (g: all-gather forward,
reduce-scatter backward); after a row-parallel layer the partial sums are
reduce-scattered along the sequence (g-bar: reduce-scatter forward,
all-gather backward) instead of all-reduced. tfpar expresses both as
DTensor relayouts of the layer's input and output
(`tfpar.collectives.gather_sequence` / `scatter_sequence`); DTensor
inserts the collectives. Values are unchanged: a relayout only moves data. On CPU (and
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

import copy
import dataclasses
import functools
import inspect
import re

from tfpar import _compat
from tfpar import collectives
from tfpar import context_parallel
from tfpar import layout as layout_lib
from tfpar import parallel_dims
from tfpar import vocab_parallel


@dataclasses.dataclass(frozen=True)
class ActivationLayout:
    """How a layer's input or output activation (batch, sequence, hidden) is
    laid out over a mesh axis: `dimension` ("sequence" or "hidden") split
    over `axis` (`split`), or gathered whole over it. The batch keeps its
    layout (split over the data axis or not); every other dimension is
    whole.

    Example:

    >>> tfpar.ColumnParallel(sequence_parallel=True).input_layout
    ActivationLayout(dimension='sequence', axis='model', split=False)
    >>> str(tfpar.SequenceParallel().output_layout)
    "sequence split over 'model'"
    """

    dimension: str
    axis: str
    split: bool

    def __str__(self):
        how = "split" if self.split else "gathered"
        return f"{self.dimension} {how} over {self.axis!r}"


class Style:
    """Base class: how one layer's weights and activations are laid out
    over a mesh axis.

    `axis=None` (the default) means the strategy's model axis
    (`ParallelStrategy(model_axis=...)`, "model" unless declared): the
    strategy binds the style to it (`on_axis`) when it takes the rules; an
    explicit axis other than the strategy's is an error naming both.
    """

    def __init__(self, axis=None):
        if axis is not None and not isinstance(axis, str):
            raise TypeError(
                f"{type(self).__name__}(axis) needs a mesh axis name. "
                f"Received: axis={axis!r}"
            )
        self.given_axis = axis
        self.axis = parallel_dims.DEFAULT_MODEL_AXIS if axis is None else axis

    def on_axis(self, axis):
        """This style splitting over mesh axis `axis` (a copy)."""
        bound = copy.copy(self)
        bound.given_axis = bound.axis = axis
        return bound

    def axes(self):
        return (self.axis,)

    @property
    def input_layout(self):
        """The `ActivationLayout` a layer's input is relaid out to, or None
        (left as DTensor propagates it)."""
        return None

    @property
    def output_layout(self):
        """The `ActivationLayout` a layer's output is relaid out to, or None."""
        return None

    def spec_for(self, layer, role, shape):
        """The spec of weight `role` (e.g. "kernel", "query/bias") of `layer`.

        `layer` is the Keras layer that owns the weight (for MultiHeadAttention
        the EinsumDense sublayer); raises ValueError for weights it does not
        know how to lay out. Changes nothing.
        """
        raise NotImplementedError  # every concrete style overrides this

    def activation_layouts(self, layer, role, shape):
        """(input layout, output layout) of `layer`, which owns weight `role`
        of `shape` (each an `ActivationLayout` or None). Changes nothing."""
        del layer, role, shape  # the same for every layer by default
        return self.input_layout, self.output_layout

    def apply(self, layer, role, shape):
        """Installs on `layer` the relayouts of its activation layouts for
        weight `role`: wraps this layer object's `call` (not its class),
        once (applying a style again, e.g. for the layer's next weight,
        installs nothing more).

        The one step of a style that changes a layer; the strategy calls it
        (`apply_styles`) once the whole plan is valid.
        """
        if layer is None:
            return
        before, after = self.activation_layouts(layer, role, shape)
        if before is not None:
            _transform_inputs(
                layer, "tfpar_sequence_input",
                lambda x: _relayout(x, before, layer, "input"))
        if after is not None and after.dimension == "hidden":
            # A hidden-wise split lookup: its ids split over the batch.
            _transform_inputs(layer, "tfpar_ids_split_over_data",
                              _lookup_ids)
        if after is not None:
            name = ("tfpar_sequence_output" if after.dimension == "sequence"
                    else "tfpar_gather_hidden")
            _transform_outputs(
                layer, name, lambda y: _relayout(y, after, layer, "output"))
        installed = vars(layer).setdefault("_tfpar_activation_layouts", {})
        for where, layout in (("input", before), ("output", after)):
            if layout is not None:  # the first one installed stays
                installed.setdefault(where, layout)

    def _key(self):
        return (type(self), self.axis)

    def __repr__(self):
        return f"{type(self).__name__}(axis={self.axis!r})"

    def __eq__(self, other):
        return isinstance(other, Style) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


def _wrap_call_once(layer, name, make_call,
                    registry="_tfpar_output_transforms"):
    """`layer.call = make_call(layer.call)`, once per `name` (recorded in
    the layer's `registry` set): wraps this one layer object's `call` (not
    its class), keeping its signature for Keras' argument inspection
    (`functools.wraps`); and its `quantized_call` alike, which Keras runs
    instead once the layer is quantized (`_compat.CALL_METHODS`)."""
    applied = layer.__dict__.setdefault(registry, set())
    if name in applied:
        return
    for method in _compat.CALL_METHODS:
        original = getattr(layer, method, None)
        if original is not None:
            setattr(layer, method,
                    functools.wraps(original)(make_call(original)))
    applied.add(name)


def _transform_outputs(layer, name, transform):
    """Makes `layer` return `transform(outputs)`; once per `name`."""
    def make_call(original_call):
        def call(*args, **kwargs):
            return transform(original_call(*args, **kwargs))
        return call

    _wrap_call_once(layer, name, make_call)


def _transform_inputs(layer, name, transform):
    """Makes `layer` call its `call` on `transform(first input)`; once per
    `name`.

    Like `_transform_outputs`, wraps this one layer object's `call`
    (keeping its signature); the first input is the first positional
    argument, or the first parameter of `call` when passed by keyword.
    """
    def make_call(original_call):
        first = next(iter(inspect.signature(original_call).parameters), None)

        def call(*args, **kwargs):
            if args:
                args = (transform(args[0]),) + tuple(args[1:])
            elif first in kwargs:
                kwargs[first] = transform(kwargs[first])
            return original_call(*args, **kwargs)
        return call

    _wrap_call_once(layer, name, make_call, "_tfpar_input_transforms")


def _relayout(tensor, target, layer, where):
    """`tensor` relaid out to the `ActivationLayout` `target` by its named
    collective (see `tfpar.collectives`)."""
    if target.dimension == "hidden":
        return _gathered_lookup(tensor)
    move = (collectives.scatter_sequence if target.split
            else collectives.gather_sequence)
    return move(tensor, target.axis, layer, where)


class _TensorParallel(Style):
    """Column/row styles: an axis, and whether sequence parallelism is on."""

    def __init__(self, axis=None, sequence_parallel=False):
        super().__init__(axis)
        if not isinstance(sequence_parallel, bool):
            raise TypeError(
                f"{type(self).__name__}(sequence_parallel) must be True or "
                f"False. Received: sequence_parallel={sequence_parallel!r}"
            )
        self.sequence_parallel = sequence_parallel

    def _sequence(self, split):
        """The sequence split over (`split`) or gathered over the axis, when
        sequence parallelism is on; else None."""
        if not self.sequence_parallel:
            return None
        return ActivationLayout("sequence", self.axis, split)

    def _key(self):
        return (type(self), self.axis, self.sequence_parallel)

    def __repr__(self):
        extra = ", sequence_parallel=True" if self.sequence_parallel else ""
        return f"{type(self).__name__}(axis={self.axis!r}{extra})"


class Replicated(Style):
    """Every weight of the layer whole on every device."""

    def __init__(self):
        super().__init__(None)

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
    the sequence (gathered and sliced: DTensor's all-to-all is off, see
    tfpar/__init__.py); without sequence parallelism it is gathered along
    the hidden dimension (beside a context axis its ids and output stay
    split along the sequence over it, as the step's inputs are).

    Example:

    >>> rules = tfpar.LayoutRules({
    ...     r".*up": tfpar.ColumnParallel(sequence_parallel=True)})
    """

    @property
    def input_layout(self):
        return self._sequence(split=False)

    def spec_for(self, layer, role, shape):
        if "/" in role:  # a sublayer of MultiHeadAttention
            row = role.split("/", 1)[0] in _ATTENTION_OUTPUT
            return _split(layer, role, shape, self.axis, row=row, owner=self)
        return _split(layer, role, shape, self.axis, row=False, owner=self)

    def activation_layouts(self, layer, role, shape):
        if not self.sequence_parallel:
            # A hidden-wise split embedding lookup is gathered whole.
            if _is_embedding_table(role, shape):
                return None, ActivationLayout("hidden", self.axis, False)
            return None, None
        if role == "reverse_embeddings":
            # A ReversibleEmbedding's own logits table: its layer's call is
            # also the lookup of token ids (batch, sequence), which has no
            # sequence to gather; DTensor contracts the split hidden
            # dimension of the projection itself, as for a tied table.
            return None, None
        if "/" in role:  # the attention output projection: partial sums
            row = role.split("/", 1)[0] in _ATTENTION_OUTPUT
        else:  # an embedding lookup: re-split along the sequence
            row = _is_embedding_table(role, shape)
        if row:
            return None, self._sequence(split=True)
        return self._sequence(split=False), None  # needs the whole sequence


class RowParallel(_TensorParallel):
    """Split the layer's inputs over `axis` (see module docstring).

    With `sequence_parallel=True` the output, a partial sum on each device,
    is reduce-scattered along the sequence instead of all-reduced.
    """

    @property
    def output_layout(self):
        return self._sequence(split=True)

    def spec_for(self, layer, role, shape):
        if "/" in role:
            raise ValueError(
                f"RowParallel does not apply to MultiHeadAttention (weight "
                f"{role!r} of layer {getattr(layer, 'path', layer)!r}). "
                "Use ColumnParallel(), which splits attention by heads."
            )
        return _split(layer, role, shape, self.axis, row=True, owner=self)


class VocabParallel(Style):
    """Split an output head over the vocabulary (Megatron-LM's
    vocab-parallel output layer): logits[..., j] = h . W[:, j] needs only
    column j of the projection, so each device computes (batch, sequence,
    vocab/k) logits with no communication. DTensor's expansion of
    `SparseSoftmaxCrossEntropyWithLogits` (Keras'
    `SparseCategoricalCrossentropy(from_logits=True)`) keeps them split: a
    local max, sum of exp and target logit per token, each all-reduced
    ((tokens, 1) values): log_softmax(z)[t] = z_t - m - log(sum_j
    exp(z_j - m)) with m = max_j z_j, every max and sum taken over the
    vocab blocks.

    - Dense / EinsumDense head: like `ColumnParallel` (kernel columns, bias).
    - Embedding table (vocab, hidden) of a tied head (keras-hub's
      ReversibleEmbedding with `tie_weights=True`, a plain Embedding): by
      vocabulary. A tied ReversibleEmbedding's lookups are Megatron-LM's
      vocab-parallel embedding (`vocab_parallel.lookup`: each device reads
      the rows it holds, the (tokens, hidden) output all-reduced), where
      DTensor 2.21 alone gathers the whole table on every device; a plain
      Embedding's, a quantized table's, or those of a subclass with a
      `call` of its own, still gather it
      (`vocab_parallel.takes_vocab_parallel_lookups` says why).
    - Untied ReversibleEmbedding: `reverse_embeddings` (hidden, vocab) by
      vocabulary; the lookup table by hidden, its lookups (calls without
      `reverse=True`) gathered along the hidden dimension as
      `ColumnParallel` does, so no device reads the whole table.

    Example:

    >>> rules = tfpar.LayoutRules({r".*token_embedding": tfpar.VocabParallel(),
    ...                            r".*lm_head": tfpar.VocabParallel()})
    """

    def spec_for(self, layer, role, shape):
        if _is_embedding_table(role, shape) and _untied(layer):
            return _split(layer, role, shape, self.axis, row=False, owner=self)
        if _is_embedding_table(role, shape) or (
                role.rsplit("/", 1)[-1] == "reverse_embeddings"):
            return _split(layer, role, shape, self.axis, row=True, owner=self)
        if "/" in role:
            raise ValueError(
                f"VocabParallel splits output heads; weight {role!r} of "
                f"layer {getattr(layer, 'path', layer)!r} belongs to a "
                "sublayer (MultiHeadAttention?). Use ColumnParallel().")
        return _split(layer, role, shape, self.axis, row=False, owner=self)

    def apply(self, layer, role, shape):
        """Installs, on an untied ReversibleEmbedding (lookup table split by
        hidden), the hidden gather of its lookups' outputs (and their ids
        split over the batch), leaving its reverse calls' logits split; on
        a table split by vocabulary, the vocab-parallel lookup."""
        if layer is None or not _is_embedding_table(role, shape):
            return
        if not _untied(layer):
            _lookups_by_vocab_block(layer, self.axis)
            return
        _transform_lookups(layer, "tfpar_gather_hidden_lookups")
        installed = vars(layer).setdefault("_tfpar_activation_layouts", {})
        installed.setdefault(
            "output", ActivationLayout("hidden", self.axis, False))


def _untied(layer):
    """Whether `layer` is a ReversibleEmbedding with its own logits table."""
    return getattr(layer, "tie_weights", True) is False


def _lookup_ids(ids):
    """The ids of a hidden-wise split lookup: beside a context axis, token
    ids (batch, sequence) split as the step's inputs are,
    (batch/data, sequence/context)
    (`context_parallel.split_along_sequence`: a lookup is per token); else
    split over the data axis along the batch, the rest whole
    (`collectives.ids_split_over_data`)."""
    split = context_parallel.split_along_sequence(ids, 2)
    return collectives.ids_split_over_data(ids) if split is None else split


def _gathered_lookup(outputs):
    """A hidden-wise split lookup's output (batch, sequence, hidden/t) made
    whole along the hidden dimension: an all-gather over the model axis.
    Beside a context axis a (batch, sequence, hidden) lookup keeps its
    sequence split over it (`context_parallel.split_along_sequence`); any
    other is whole
    (`collectives.gather_hidden`)."""
    split = context_parallel.split_along_sequence(outputs, 3)
    return collectives.gather_hidden(outputs) if split is None else split


def _transform_lookups(layer, name):
    """Makes `layer`'s lookups (calls without `reverse=True`) read their ids
    split over the batch (`_lookup_ids`) and return their output gathered
    along the hidden dimension (`_gathered_lookup`); reverse calls
    unchanged. Once
    per `name` (`_wrap_call_once`).
    """
    def make_call(original_call):
        def call(*args, **kwargs):
            if _reverse_call(args, kwargs):
                return original_call(*args, **kwargs)
            if args:
                args = (_lookup_ids(args[0]),) + args[1:]
            return _gathered_lookup(original_call(*args, **kwargs))
        return call

    _wrap_call_once(layer, name, make_call)


def _reverse_call(args, kwargs):
    """Whether a ReversibleEmbedding's call (`args`, `kwargs`) projects
    (`reverse=True`) rather than looks up."""
    return kwargs.get("reverse", args[1] if len(args) > 1 else False)


def _lookups_by_vocab_block(layer, axis):
    """Makes the lookups of `layer`, an Embedding whose table is split by
    vocabulary over `axis`, `vocab_parallel.embedding_lookup`s (reverse
    calls unchanged); one `vocab_parallel.takes_vocab_parallel_lookups`
    refuses keeps Keras' lookup (the table gathered). Once per layer."""
    def make_call(original_call):
        def call(*args, **kwargs):
            if (_reverse_call(args, kwargs) or not args
                    or not vocab_parallel.takes_vocab_parallel_lookups(layer)):
                return original_call(*args, **kwargs)
            return vocab_parallel.embedding_lookup(layer, args[0], axis)
        return call

    _wrap_call_once(layer, "tfpar_vocab_parallel_lookups", make_call)


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

    With `gather_output=True` the layer still computes its s/k tokens, and
    its output is then gathered whole along the sequence (all-gather
    forward, reduce-scatter backward): for a projection with whole weights
    whose output attention reads whole — grouped-query key/value heads the
    model axis does not divide (what `auto_rules` plans for them), which
    gathers (b, s, kv heads × head size) rather than the (b, s, hidden)
    input.

    Example:

    >>> rules = tfpar.LayoutRules({r".*ln\\d": tfpar.SequenceParallel()})
    >>> str(tfpar.SequenceParallel(gather_output=True).output_layout)
    "sequence gathered over 'model'"
    """

    def __init__(self, axis=None, gather_output=False):
        super().__init__(axis)
        if not isinstance(gather_output, bool):
            raise TypeError(
                "SequenceParallel(gather_output) must be True or False. "
                f"Received: gather_output={gather_output!r}")
        self.gather_output = gather_output

    @property
    def input_layout(self):
        return ActivationLayout("sequence", self.axis, True)

    @property
    def output_layout(self):
        return ActivationLayout("sequence", self.axis, not self.gather_output)

    def spec_for(self, layer, role, shape):
        return (None,) * len(shape)

    def _key(self):
        return (type(self), self.axis, self.gather_output)

    def __repr__(self):
        extra = ", gather_output=True" if self.gather_output else ""
        return f"{type(self).__name__}(axis={self.axis!r}{extra})"


_ATTENTION_OUTPUT = ("attention_output", "output")


def style_rule_for(rules, path):
    """(style, role) of the style rule of `rules` matching the layer that
    owns the weight at `path` (role: the rest of the path, e.g.
    "query/kernel"), or None (no rule, or a raw spec rule)."""
    for pattern, spec in rules.items():
        if callable(getattr(spec, "apply", None)):
            match = layout_lib.layer_prefix_match(re.compile(pattern), path)
            if match is not None:
                return spec, match[1]
    return None


def apply_styles(rules, weights):
    """Applies the style rules of `rules` to the layers owning `weights`
    ([(path, shape, owning layer)]): installs the activation relayouts of
    each style (`Style.apply`). Call it only once every weight's spec is
    valid (and, for a whole plan, every rule used)."""
    for path, shape, layer in weights:
        found = style_rule_for(rules, path)
        if found is not None:
            style, role = found
            style.apply(layer, role, tuple(shape))


def activation_layouts_of(layer):
    """{"input"/"output": ActivationLayout} installed on `layer` by styles."""
    return dict(vars(layer).get("_tfpar_activation_layouts", {}))


def is_sequence_parallel(layer):
    """Whether a style laid out an activation of `layer` along the sequence."""
    return any(layout.dimension == "sequence"
               for layout in activation_layouts_of(layer).values())


def _is_embedding_table(role, shape):
    return role.rsplit("/", 1)[-1] == "embeddings" and len(shape) == 2


def _is_quantization_state(name):
    """Whether `name` is one of the weights Keras' `quantize` adds
    (`layout.QUANTIZATION_STATE`): kept whole on every device (a 4096 x
    4096 kernel's int8 scale is 0.1% of its bytes)."""
    return name in layout_lib.QUANTIZATION_STATE


def _split(layer, role, shape, axis, row, owner):
    """Spec splitting the input (row) or output (column) side of a weight."""
    name = role.rsplit("/", 1)[-1]
    spec = [None] * len(shape)
    if _is_quantization_state(name):
        return tuple(spec)
    if _is_embedding_table(role, shape):
        spec[0 if row else 1] = axis  # vocab-wise or hidden-wise
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


