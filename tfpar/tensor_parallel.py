"""Tensor-parallel styles and automatic plans (Megatron-LM style).

A plan is data: `LayoutRules({layer regex: style})`, separate from the
layers. A style knows how to lay out the weights of the layer it is given:

- `ColumnParallel(axis)` splits a layer's *outputs* over `axis`. For a Dense
  kernel (in, out) that is axis 1, plus the bias; for an EinsumDense the
  first kernel dimension that appears in the output; for an Embedding the
  hidden dimension; for MultiHeadAttention the heads (query/key/value split
  by heads, the output projection split row-wise by heads) — each device
  then computes whole heads and one all-reduce follows the block.
- `RowParallel(axis)` splits a layer's *inputs*: Dense kernel axis 0 (bias
  replicated: it is added once, after the all-reduce of the partial sums);
  EinsumDense the first contracted kernel dimension; Embedding the vocabulary.
- `Replicated()` keeps every weight whole on every device.

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

    def __repr__(self):
        return f"{type(self).__name__}(axis={self.axis!r})"

    def __eq__(self, other):
        return type(self) is type(other) and self.axis == other.axis

    def __hash__(self):
        return hash((type(self), self.axis))


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


class ColumnParallel(Style):
    """Split the layer's outputs over `axis` (see module docstring)."""

    def spec_for(self, layer, role, shape):
        if "/" in role:  # a sublayer of MultiHeadAttention
            sublayer = role.split("/", 1)[0]
            row = sublayer in _ATTENTION_OUTPUT
            return _split(layer, role, shape, self.axis, row=row, owner=self)
        return _split(layer, role, shape, self.axis, row=False, owner=self)


class RowParallel(Style):
    """Split the layer's inputs over `axis` (see module docstring)."""

    def spec_for(self, layer, role, shape):
        if "/" in role:
            raise ValueError(
                f"RowParallel does not apply to MultiHeadAttention (weight "
                f"{role!r} of layer {getattr(layer, 'path', layer)!r}). "
                "Use ColumnParallel(), which splits attention by heads."
            )
        return _split(layer, role, shape, self.axis, row=True, owner=self)


_ATTENTION_OUTPUT = ("attention_output", "output")


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
        if tf.executing_eagerly() and dtensor.is_dtensor(outputs):
            mesh = dtensor.fetch_layout(outputs).mesh
        elif not tf.executing_eagerly() and strategy_lib.in_spmd_step():
            mesh = tf.distribute.get_strategy().mesh.dtensor_mesh
        else:  # not on a mesh, e.g. Keras' symbolic build
            return outputs
        # Keep the batch layout (split over data or not); all else whole.
        specs = [dtensor.MATCH] + [dtensor.UNSHARDED] * (outputs.shape.rank - 1)
        return dtensor.relayout(outputs, dtensor.Layout(specs, mesh))

    _compat.transform_layer_outputs(layer, "tfpar_gather_hidden", gather_hidden)


def _split(layer, role, shape, axis, row, owner):
    """Spec splitting the input (row) or output (column) side of a weight."""
    name = role.rsplit("/", 1)[-1]
    spec = [None] * len(shape)
    if name == "embeddings" and len(shape) == 2:
        spec[0 if row else 1] = axis  # vocab-wise or hidden-wise
        if not row:
            _gather_output_hidden(layer)
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
        "and MultiHeadAttention; use a raw spec tuple for other layers."
    )


# -- automatic plans -----------------------------------------------------------

_PASS_THROUGH = (
    keras.layers.Activation, keras.layers.Dropout, keras.layers.ReLU,
    keras.layers.LeakyReLU, keras.layers.ELU, keras.layers.Softmax,
)
_REPLICATED_KINDS = (
    keras.layers.LayerNormalization, keras.layers.BatchNormalization,
    keras.layers.GroupNormalization, keras.layers.UnitNormalization,
    keras.layers.RMSNormalization,
)


def auto_rules(model, axis="model", axis_size=None, mesh=None):
    """LayoutRules for the standard tensor-parallel patterns of `model`.

    Walks a built Keras model and plans:

    - each pair of Dense layers where the second reads the first's output
      (directly or through activations/dropout) as ColumnParallel ->
      RowParallel: the Megatron MLP, one all-reduce per pair forward and one
      backward;
    - MultiHeadAttention split by heads (ColumnParallel);
    - Embedding split along its hidden dimension (ColumnParallel): the lookup
      needs no communication and the output is gathered where the next layer
      needs it whole; vocab-wise splitting would need a masked lookup and an
      all-reduce of the embedded batch instead;
    - every other Dense (e.g. the output head), norms and small layers
      replicated, so logits are computed whole and are exact.

    Layers with weights it does not understand stay replicated and are
    listed in a warning. Head counts or widths the axis does not divide
    raise ValueError naming the layer.

    Example:

    >>> mesh = tfpar.Mesh({"data": 2, "model": 4})
    >>> strategy = tfpar.ParallelStrategy(mesh)
    >>> with strategy.scope():
    ...     model = build_model()
    ...     strategy.apply_rules(model, tfpar.auto_rules(model, mesh=mesh))
    ...     model.compile(optimizer="adam", loss="mse")

    Args:
        model: a built Keras model.
        axis: the mesh axis to split over.
        axis_size: its size (or give `mesh`); used to check divisibility.
        mesh: a `tfpar.Mesh` to read `axis_size` from.

    Returns:
        `tfpar.LayoutRules` with one exact-path rule per sharded layer.
    """
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
    layers = _leaf_layers(model)
    plan = {}
    not_understood = []
    dense_pairs = _dense_pairs(model, layers)
    for first, second in dense_pairs:
        _check_divides(first, first.units, axis, axis_size, "units")
        plan[first.path] = ColumnParallel(axis)
        plan[second.path] = RowParallel(axis)
    for layer in layers:
        if layer.path in plan or not layer.weights:
            continue
        if isinstance(layer, keras.layers.MultiHeadAttention):
            _check_divides(layer, layer.num_heads, axis, axis_size, "num_heads")
            plan[layer.path] = ColumnParallel(axis)
        elif isinstance(layer, keras.layers.Embedding):
            _check_divides(layer, layer.output_dim, axis, axis_size,
                           "output_dim")
            plan[layer.path] = ColumnParallel(axis)
        elif isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)
                        + _REPLICATED_KINDS):
            continue  # unpaired Dense (e.g. the head), norms: replicated
        else:
            not_understood.append(f"{layer.path} ({type(layer).__name__})")
    if not_understood:
        warnings.warn(
            "tfpar.auto_rules keeps these layers replicated (no plan for "
            f"them): {not_understood}",
            stacklevel=2,
        )
    return LayoutRules({re.escape(path): style for path, style in plan.items()})


def _check_divides(layer, size, axis, axis_size, what):
    if size % axis_size:
        raise ValueError(
            f"Layer {layer.path!r} ({type(layer).__name__}) has {what}={size}, "
            f"which mesh axis {axis!r} of size {axis_size} does not divide. "
            f"Received: {what}={size}. Choose a multiple of {axis_size} or "
            "a smaller axis."
        )


def _leaf_layers(model):
    """Layers that own weights directly (attention counted whole), in order."""
    out, inside_attention = [], set()
    for layer in _compat.all_layers(model, include_self=False):
        if id(layer) in inside_attention or isinstance(layer, keras.Model):
            continue
        if isinstance(layer, keras.layers.MultiHeadAttention):
            inside_attention.update(
                id(sub) for sub in _compat.all_layers(layer, include_self=False))
        out.append(layer)
    return out


def _dense_pairs(model, layers):
    """Dense pairs (a, b) where b reads a's output, possibly via activations.

    Functional and Sequential models are read from their graph; for
    subclassed models (no graph) consecutive Dense layers whose widths chain
    (a.units == b's input width) are paired in attribute order.
    """
    # A Dense that produces a model output is the head: never split, so
    # logits are computed whole (subclassed models: the last Dense).
    dense = [l for l in layers if isinstance(l, keras.layers.Dense)]
    heads = {id(l) for l in _compat.model_output_layers(model)}
    if not heads and dense:
        heads = {id(dense[-1])}
    dense = [l for l in dense if id(l) not in heads]
    producer = {}
    graph_known = False
    for layer in layers:
        parents = _compat.producers(layer)
        graph_known = graph_known or bool(parents)
        producer[id(layer)] = parents
    pairs, used = [], set()
    if graph_known:
        for b in dense:
            parents = producer.get(id(b), [])
            while len(parents) == 1 and isinstance(parents[0], _PASS_THROUGH):
                parents = producer.get(id(parents[0]), [])
            if (len(parents) == 1 and isinstance(parents[0], keras.layers.Dense)
                    and id(parents[0]) not in used and id(b) not in used):
                pairs.append((parents[0], b))
                used.update({id(parents[0]), id(b)})
        return pairs
    for a, b in zip(dense, dense[1:]):
        if id(a) in used or id(b) in used:
            continue
        if b.kernel.shape[0] == a.units:
            pairs.append((a, b))
            used.update({id(a), id(b)})
    return pairs
