"""Context parallelism: sequences split over a `context` mesh axis.

On `tfpar.Mesh({"data": 2, "context": 4})` every input with a sequence
dimension (dimension 1: token ids, embeddings, labels, sample weights) is
placed split along it over the context axis, as the batch is over the data
axis: a device holds (b/data, s/context) of it. DTensor keeps the split
through every op acting per token (embeddings, norms, MLPs, residual adds,
the loss), keeps weights whole on each context coordinate and sums their
gradients over the axis (the all-reduce it inserts for any split operand,
as for the data axis). Attention is the one op mixing tokens: inside a step
Keras' `MultiHeadAttention` and `GroupQueryAttention` run
`blockwise_attention` instead (their patches here, `PATCHES`;
`attend_across_context`): the keys and values are gathered over the
context axis (all-gather; with grouped-query attention only the key/value
heads, the query heads' copies made after the gather), each device keeps
its own queries and attends to key blocks with an online softmax, masks
applied by global position. keras-hub's decoders: `context_keras_hub`.
A hidden-split (tensor-parallel) embedding keeps the split too: its ids and
gathered lookups are laid out as the inputs (`split_along_sequence`, which
`tfpar.styles` calls).

Causal load balance (`load_balance(strategy)`): the sequence is cut into
2·cp chunks and device r holds chunks r and 2cp−1−r, so causal attention
gives every device the same number of visible key blocks. The batch is
reordered on the host (every tensor with a sequence dimension alike),
attention masks by the chunks' global positions, predictions are restored
to the natural order; per-token losses are sums over tokens, so they do not
change. A model computing positions itself (`ops.arange(seq_len)`, e.g.
learned position embeddings) would see them in the natural order while its
tokens are permuted: load balance is for models without such positions.

Example:

>>> import tfpar
>>> tfpar.use_virtual_cpus(8)
>>> split = ContextSplit("context", 4, load_balance=True)
>>> split.order(16).tolist()
[0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
"""

import functools

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import _compat
from tfpar import blockwise_attention as blockwise
from tfpar import step_context
from tfpar import ulysses_attention as ulysses

DEFAULT_CONTEXT_AXIS = "context"
# "gather" | "ulysses" | "auto" per strategy (tfpar/ulysses_attention.py).
set_attention_exchange = ulysses.set_attention_exchange


class ContextSplit:
    """How sequences are split over the context axis `axis` of size `size`
    (> 1), in natural order or load balanced (`order`)."""

    def __init__(self, axis, size, load_balance=False):
        self.axis = axis
        self.size = size
        self.load_balance = bool(load_balance)
        self._lengths = set()  # the sequence lengths of the inputs placed

    @property
    def divisor(self):
        """What must divide a sequence length: cp, or 2·cp balanced."""
        return 2 * self.size if self.load_balance else self.size

    def order(self, length):
        """The global position of each row as stored (device r holds rows
        [r·s/cp, (r+1)·s/cp)): the identity, or balanced chunks r and
        2cp−1−r for device r."""
        if not self.load_balance:
            return np.arange(length)
        chunks = np.arange(length).reshape(2 * self.size, -1)
        return np.concatenate([
            np.concatenate([chunks[r], chunks[2 * self.size - 1 - r]])
            for r in range(self.size)])

    def positions_per_device(self, length):
        """[the global positions of the rows device r holds] for each r."""
        return np.split(self.order(length), self.size)

    def check_sequence(self, tensor, name, dim=1):
        """Raises ValueError unless `tensor` has a sequence dimension `dim`
        the context axis divides; `name` names the input."""
        rank = tensor.shape.rank
        if rank is None or rank <= dim or tensor.shape[dim] is None:
            return
        if tensor.shape[dim] % self.divisor:
            balance = " times 2 (load balance)" if self.load_balance else ""
            raise ValueError(
                f"Context parallelism splits input {name!r} along its "
                f"sequence dimension (dimension {dim}) over the axis "
                f"{self.axis!r} of size {self.size}{balance}, which must "
                f"divide it. Received: shape {tuple(tensor.shape)}. Pad the "
                f"sequences to a multiple of {self.divisor}.")

    def reorder_batch(self, batch, dim=1):
        """`batch` checked (`check_sequence`, and a sequence dimension at
        all), its sequence dimensions (`dim`: 2 for batches stacked by
        steps) in `order`."""
        flat = keras.tree.flatten_with_path(batch)
        tensors = [(path, t) for path, t in flat if t is not None]
        if tensors and not any(tf.convert_to_tensor(t).shape.rank > dim
                               for _, t in tensors):
            path, first = tensors[0]
            raise ValueError(
                f"Context parallelism splits inputs along their sequence "
                f"dimension (dimension 1), but no input has one. Received: "
                f"input {_name(path)!r} of shape {tuple(first.shape)}. Feed "
                f"(batch, sequence, ...) inputs, or use a mesh without the "
                f"{self.axis!r} axis for this model.")
        for path, tensor in tensors:
            tensor = tf.convert_to_tensor(tensor)
            self.check_sequence(tensor, _name(path), dim)
            if tensor.shape.rank > dim:
                self._lengths.add(tensor.shape[dim])
        if not self.load_balance:
            return batch
        return tf.nest.map_structure(
            lambda t: self._permuted(t, False, dim), batch)

    def restore(self, outputs):
        """Predictions back in natural order (inverse of `reorder_batch`):
        the outputs whose dimension 1 is as long as an input's sequence."""
        if not self.load_balance:
            return outputs
        return tf.nest.map_structure(lambda t: self._permuted(t, True),
                                     outputs)

    def _permuted(self, tensor, inverse, dim=1):
        if tensor is None or not hasattr(tensor, "shape") or len(
                tensor.shape) <= dim or tensor.shape[dim] is None:
            return tensor
        if inverse and tensor.shape[dim] not in self._lengths:
            return tensor
        if dtensor.is_dtensor(tensor):  # placed, so reordered, already
            return tensor
        order = self.order(tensor.shape[dim])
        if inverse:
            order = np.argsort(order)
        if isinstance(tensor, np.ndarray):
            return np.take(tensor, order, axis=dim)
        # On the host (numpy): a TF op here could run on the mesh's device.
        return tf.constant(np.take(tensor.numpy(), order, axis=dim))


def _name(path):
    return "/".join(str(p) for p in path) or "inputs"


def split_of(mesh, axis=DEFAULT_CONTEXT_AXIS, load_balance=False):
    """The `ContextSplit` of `mesh`'s context axis, or None when it lacks
    one (or has one of size 1)."""
    if axis not in mesh.shape or mesh.axis_size(axis) < 2:
        return None
    return ContextSplit(axis, mesh.axis_size(axis), load_balance)


def load_balance(strategy, enabled=True):
    """Turns the causal load balance on (or off) for `strategy`'s context
    axis; call before the model first trains (module docstring).

    >>> import tfpar
    >>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    >>> tfpar.context_parallel.load_balance(strategy).divisor
    8
    """
    placer = strategy.extended.input_placer
    if placer.context is None:
        raise ValueError(
            "load_balance needs a context axis of size > 1 on the strategy's "
            f"mesh. Received: mesh {strategy.mesh!r}. Add one, e.g. "
            "tfpar.Mesh({'data': 2, 'context': 4}).")
    placer.context = ContextSplit(placer.context.axis, placer.context.size,
                                  enabled)
    return placer.context


def context_in_step():
    """The `ContextSplit` of the strategy whose step is being traced, or
    None (no step, no context axis)."""
    extended = step_context.step_extended()
    if extended is None:
        return None
    return getattr(extended.input_placer, "context", None)


# -- attention across the split (patches of Keras' MultiHeadAttention) ------


def _batch_spec(tensor, extended):
    """The data axis when it splits the batch
    (`ParallelDims.batch_split`), else whole: context-parallel attention
    decides once (`ulysses_attention.choose` and `attend` are given it)."""
    return extended.dims.batch_split(tensor.shape[0]) or dtensor.UNSHARDED


def _along_sequence(tensor, sequence_spec, extended):
    """`tensor` (batch, sequence, ...) laid out with the batch as the
    inputs, the sequence `sequence_spec` (the context axis: split;
    UNSHARDED: gathered), every other dimension whole."""
    specs = [_batch_spec(tensor, extended), sequence_spec]
    specs += [dtensor.UNSHARDED] * (tensor.shape.rank - 2)
    mesh = extended.registry.placement_mesh.dtensor_mesh
    return dtensor.relayout(tensor, dtensor.Layout(specs, mesh))


def _pinned(tensor, sequence_spec, extended):
    """`tensor` (batch, sequence, heads, dim) laid out with the sequence
    `sequence_spec` (the context axis: split; UNSHARDED: an all-gather over
    it), the batch as the inputs, the heads as they are (split over the
    model axis by tensor parallelism, or whole). Gradient: DTensor's."""
    specs = [_batch_spec(tensor, extended), sequence_spec, dtensor.MATCH]
    specs += [dtensor.UNSHARDED] * (tensor.shape.rank - 3)
    mesh = extended.registry.placement_mesh.dtensor_mesh
    return dtensor.relayout(tensor, dtensor.Layout(specs, mesh))


def split_along_sequence(tensor, rank):
    """`tensor` (batch, sequence, ...) of rank `rank` laid out as a
    context-parallel step places its inputs: the batch split over the data
    axis (when it splits it), the sequence (dimension 1) over the context
    axis, the rest whole; None when no step splits sequences (no context
    axis, `generate()`, an eager call, a pipeline stage without the axis),
    when `tensor` has another rank (a (batch,) id's (batch, hidden) lookup
    has no sequence) or when the context axis does not divide dimension 1.

    What a hidden-split Embedding's ids and gathered lookups are relaid out
    to beside a context axis (`tfpar.styles`): a lookup is per token,
    y[b, s, :] = table[ids[b, s], :], so the (b/data, s/context) block of y
    needs only that block of the ids and the table's hidden columns; the
    hidden gather is then an all-gather over the model axis alone.
    Gathering the sequence too (what a data-only step does) leaves the
    residual stream whole on every context coordinate, and DTensor 2.21
    fails to compile the backward pass when attention reads that stream and
    a residual adds to it (tests/dtensor_context_lookup_repro.py).

    Example (outside a step, nothing to lay out):

    >>> import tensorflow as tf
    >>> split_along_sequence(tf.zeros((2, 8), tf.int32), 2) is None
    True
    """
    split = context_in_step()
    extended = step_context.step_extended()
    if (split is None or not step_context.in_spmd_step()
            or extended.registry.placement_mesh is None
            or tensor.shape.rank != rank or rank < 2
            or tensor.shape[1] is None or tensor.shape[1] % split.size):
        return None
    mesh = extended.registry.placement_mesh.dtensor_mesh
    if split.axis not in mesh.dim_names:
        return None
    return _along_sequence(tensor, split.axis, extended)


class FactoredMask(blockwise.BlockMasks):
    """An attention mask kept in factors, never as a (batch, q, s) tensor:
    a `blockwise_attention.BlockMasks` without its dense part, i.e.
    `key_valid` (batch, s) and `query_valid` (batch, q) bool vectors
    (padding: False where masked; None: all valid), causal and a sliding
    `window` by global position (fields and checks: `BlockMasks`'). The
    patched mask builders (Keras' `_compute_attention_mask`, keras-hub's
    decoders) return one in a step on a context-split mesh, the attention
    layer hands it unchanged to its `_compute_attention`, and
    `attend_across_context` builds each key tile's mask from it inside
    `blockwise_attention`: O(s) bytes of mask per sample instead of
    s/cp × s. What it adds for Keras' layers: Keras' argument order, a
    tensor form (`__tf_tensor__`) and `with_window`.

    >>> FactoredMask(key_valid=None, causal=True, window=4)
    FactoredMask(causal=True, window=4, key_valid=None, query_valid=None)
    """

    def __init__(self, key_valid=None, causal=False, window=None,
                 query_valid=None):
        super().__init__(causal, window, key_valid=key_valid,
                         query_valid=query_valid)

    def __tf_tensor__(self, dtype=None, name=None):
        """As a tensor: ones (batch, q, 1). keras-hub's Gemma attention
        reads `mask == 0` over the keys to zero the rows that see no key;
        blockwise attention gives such rows 0 already, so no row is to be
        zeroed again (self-attention: q = s, the validity vectors' length)."""
        rows = self.query_valid if self.query_valid is not None else (
            self.key_valid)
        if rows is None:
            raise ValueError(
                "A FactoredMask without validity vectors has no shape to "
                "convert to a tensor. Received: " + repr(self) + ". Give "
                "key_valid (e.g. all True) to a mask a layer reads.")
        return tf.expand_dims(tf.ones_like(rows, dtype or tf.int32,
                                           name=name), -1)

    def with_window(self, window):
        """The same mask, causal, seeing keys p_i - p_j < `window` only."""
        return FactoredMask(self.key_valid, True, window, self.query_valid)


def factored_or_none(key_valid, causal, window=None, query_valid=None):
    """A `FactoredMask`, or None when it would mask nothing."""
    mask = FactoredMask(key_valid, causal, window, query_valid)
    return None if mask.empty else mask


def _pinned_vector(valid, sequence_spec, extended):
    """A (batch, s) validity vector as bool, the batch as the inputs, the
    sequence `sequence_spec` (split, or gathered: b·s bools)."""
    return _along_sequence(tf.cast(valid, tf.bool), sequence_spec, extended)


def _mask_options(mask, causal, split, extended, query_spec=None):
    """`blockwise_attention`'s mask arguments for `mask`: a dense (batch,
    q, s) tensor split by query rows (quadratic: s/cp × s per sample), or
    a `FactoredMask`'s vectors (keys gathered, queries laid out by
    `query_spec`: split over the context axis unless given)."""
    if not isinstance(mask, FactoredMask):
        return {"causal": causal, "mask": None if mask is None
                else _pinned_mask(mask, split, extended)}
    options = {"causal": causal or mask.causal, "window": mask.window}
    if mask.key_valid is not None:
        options["key_valid"] = _pinned_vector(mask.key_valid,
                                              dtensor.UNSHARDED, extended)
    if mask.query_valid is not None:
        options["query_valid"] = _pinned_vector(
            mask.query_valid, split.axis if query_spec is None
            else query_spec, extended)
    return options


def _pinned_mask(mask, split, extended):
    """An attention mask (batch or 1, queries, keys) split like the
    queries: each device keeps the rows of its queries."""
    return _along_sequence(mask, split.axis, extended)


def _check_attention(layer, query, training, return_scores):
    """Raises a ValueError naming `layer` for what context parallelism
    cannot split."""
    problem = None
    if return_scores:
        problem = ("return_attention_scores=True (the whole score matrix is "
                   "what blockwise attention never builds)")
    elif query.shape.rank != 4 or tuple(layer._attention_axes) != (1,):  # noqa: SLF001
        problem = (f"attention over axes {layer._attention_axes} of a rank-"  # noqa: SLF001
                   f"{query.shape.rank} query (only the sequence, axis 1)")
    elif layer.dropout > 0 and training:
        problem = f"dropout={layer.dropout} on the attention probabilities"
    if problem:
        raise ValueError(
            f"Context parallelism cannot split layer {layer.name!r} "
            f"({type(layer).__name__}) along the sequence: {problem}. Use "
            "dropout=0.0, default attention axes, no attention scores, or a "
            "mesh without a context axis.")


def _context_attention(original, hooks):
    """`MultiHeadAttention._compute_attention` in a step on a mesh with a
    context axis: the keys and values gathered over it, the queries kept
    split, `blockwise_attention` by global position (module docstring).
    Elsewhere Keras' own."""

    def _compute_attention(self, query, key, value, attention_mask=None,
                           training=None, return_attention_scores=False,
                           use_causal_mask=False):
        split = context_in_step()
        if split is None or not step_context.in_spmd_step():
            return original(self, query, key, value, attention_mask,
                            training, return_attention_scores,
                            use_causal_mask=use_causal_mask)
        _check_attention(self, query, training, return_attention_scores)
        output = attend_across_context(
            split, query, key, value, scale=self._inverse_sqrt_key_dim,  # noqa: SLF001
            causal=use_causal_mask, mask=attention_mask)
        return output, None

    return _compute_attention


def attend_across_context(split, query, key, value, scale, causal, mask=None,
                          kv_groups=1, **options):
    """`blockwise_attention` of a step on a context-split mesh (`split`):
    the (batch, s, heads, dim) keys and values gathered over the context
    axis, the queries and the (batch, s, s) bool `mask` (or None) kept
    split by query rows, key blocks of s/cp, masks by global position
    (`split.order`); `options` go to `blockwise_attention` (`soft_cap`).
    The output is split like the queries. `mask` may be a `FactoredMask`
    instead: its key-validity vector gathered (b·s bools), its query one
    kept split, each key tile's mask built from them inside
    `blockwise_attention`, so no s/cp × s mask exists; a dense `mask` is
    held whole by query rows (s/cp × s per sample: quadratic).

    Grouped-query attention (`kv_groups` query heads per key/value head,
    keys and values given already repeated to the query heads, head u a
    copy of key/value head u // kv_groups): one copy of each key/value head
    is kept (a per-token einsum with a one-hot selector, no communication),
    only those heads are gathered (kv_groups times fewer bytes), and the
    copies are made again on the gathered keys; the gradient of the
    repetition sums the copies, so it reaches the same key/value heads."""
    extended = step_context.step_extended()
    factored = isinstance(mask, FactoredMask)
    batch = _batch_spec(query, extended)
    if ulysses.choose(extended, split.axis, query, batch, kv_groups,
                      None if factored else mask) == "ulysses":
        return _attend_by_heads(split, query, key, value, scale, causal,
                                mask, options, extended, batch)
    query = _pinned(query, split.axis, extended)
    key, value = (_gathered_heads(t, kv_groups, extended)
                  for t in (key, value))
    options.update(_mask_options(mask, causal, split, extended))
    output = blockwise.blockwise_attention(
        query, key, value, split.order(query.shape[1]),
        split.order(key.shape[1]), scale=scale,
        block_size=key.shape[1] // split.size, **options)
    return _pinned(output, split.axis, extended)


def _attend_by_heads(split, query, key, value, scale, causal, mask,
                     options, extended, batch):
    """`attend_across_context` by the Ulysses exchange (heads split instead
    of keys gathered, `ulysses_attention`): every device attends with all
    s query rows, so a `FactoredMask`'s vectors are gathered whole (b·s
    bools each) and a dense mask is ulysses' to place; `batch` is the
    batch dimension's spec (`_batch_spec`)."""
    factored = isinstance(mask, FactoredMask)
    if factored:
        options = dict(options, **_mask_options(
            mask, causal, split, extended, query_spec=dtensor.UNSHARDED))
    else:
        options = dict(options, causal=causal)

    def attention(q, k, v, m):  # all s rows, stored order, heads/cp
        return blockwise.blockwise_attention(
            q, k, v, split.order(q.shape[1]), split.order(k.shape[1]),
            scale=scale, mask=m, block_size=k.shape[1] // split.size,
            **options)
    return ulysses.attend(
        query, key, value, None if factored else mask, attention,
        functools.partial(
            extended.all_to_all, mesh_axis=split.axis,
            batch_axis=None if batch == dtensor.UNSHARDED else batch),
        batch, extended.registry.placement_mesh.dtensor_mesh)


def _gathered_heads(tensor, kv_groups, extended):
    """(batch, s, heads, dim) repeated `kv_groups` times per key/value head:
    the key/value heads alone gathered over the context axis, repeated
    again (`attend_across_context`)."""
    if kv_groups == 1:
        return _pinned(tensor, dtensor.UNSHARDED, extended)
    batch, length, heads, dim = tensor.shape
    grouped = tf.reshape(tensor, (-1, length, heads // kv_groups, kv_groups,
                                  dim))
    first = tf.one_hot(0, kv_groups, dtype=tensor.dtype)  # copy 0 of each
    kv_heads = tf.einsum("bskgh,g->bskh", grouped, first)
    kv_heads = _pinned(kv_heads, dtensor.UNSHARDED, extended)
    return tf.repeat(kv_heads, kv_groups, axis=2)


def _context_grouped_attention(original, hooks):
    """`GroupedQueryAttention._compute_attention` in a step on a mesh with
    a context axis: `attend_across_context` gathering the key/value heads
    only (`kv_groups`). Elsewhere Keras' own."""

    def _compute_attention(self, query, key, value, attention_mask=None,
                           training=None, use_causal_mask=False):
        split = context_in_step()
        if split is None or not step_context.in_spmd_step():
            return original(self, query, key, value, attention_mask,
                            training, use_causal_mask=use_causal_mask)
        if self.dropout > 0 and training:
            raise ValueError(
                f"Context parallelism cannot split layer {self.name!r} "
                f"(GroupedQueryAttention) along the sequence: dropout="
                f"{self.dropout} on the attention probabilities. Use "
                "dropout=0.0 or a mesh without a context axis.")
        if self.sliding_window is not None and split.load_balance:
            raise ValueError(
                f"Context parallelism cannot load balance layer "
                f"{self.name!r} (GroupedQueryAttention): its sliding_window="
                f"{self.sliding_window} mask is by natural position. Turn "
                "load balance off (load_balance(strategy, False)).")
        output = attend_across_context(
            split, query, key, value, scale=self._inverse_sqrt_head_dim,  # noqa: SLF001
            causal=use_causal_mask or attention_mask is not None and getattr(
                self, "_context_causal", False), mask=attention_mask,
            kv_groups=self.num_repeats)
        return output, None

    return _compute_attention


def _context_causal_flag(original, hooks):
    """`GroupedQueryAttention.call` noting whether its mask is causal (so
    that `_compute_attention` skips the key blocks no query sees)."""

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        self._context_causal = bool(kwargs.get("use_causal_mask"))  # noqa: SLF001
        return original(self, *args, **kwargs)

    return call


def _both_valid(first, second):
    """The keys valid in both (batch, s) masks (either may be None)."""
    if first is None or second is None:
        return second if first is None else first
    return tf.logical_and(tf.cast(first, tf.bool), tf.cast(second, tf.bool))


def _factored_attention_mask(original, hooks):
    """`_compute_attention_mask` of Keras' `MultiHeadAttention` and
    `GroupQueryAttention` in a step on a context-split mesh: the inputs'
    Keras masks (query, value, key) and the causal flag as a
    `FactoredMask`, which `call` hands to `_compute_attention` (patched
    above). A given `attention_mask` or a sliding window: Keras' own
    (dense) mask."""

    def _compute_attention_mask(self, query, value, query_mask=None,
                                value_mask=None, key_mask=None,
                                attention_mask=None, use_causal_mask=False):
        window = getattr(self, "_sliding_window", None) or getattr(
            self, "sliding_window", None)
        if (context_in_step() is None or not step_context.in_spmd_step()
                or attention_mask is not None or window is not None):
            return original(self, query, value, query_mask=query_mask,
                            value_mask=value_mask, key_mask=key_mask,
                            attention_mask=attention_mask,
                            use_causal_mask=use_causal_mask)
        return factored_or_none(_both_valid(value_mask, key_mask),
                                use_causal_mask, query_valid=query_mask)

    return _compute_attention_mask


def _context_causal_mask(original, hooks):
    """`MultiHeadAttention._compute_causal_mask` by global position when the
    sequence is load balanced (Keras' own mask assumes natural order)."""

    def _compute_causal_mask(self, query, value=None):
        split = context_in_step()
        if split is None or not step_context.in_spmd_step():
            return original(self, query, value)
        value = query if value is None else value
        allowed = split.order(query.shape[1])[:, None] >= split.order(
            value.shape[1])[None, :]
        return tf.constant(allowed[None])

    return _compute_causal_mask


def _sequence_split_in_step(*tensors):
    """Whether a step on a context-split mesh runs and every tensor is a
    dense one of rank >= 3 (batch, sequence, ...)."""
    return (step_context.in_spmd_step() and context_in_step() is not None
            and all(isinstance(t, tf.Tensor) and t.shape.rank is not None
                    and t.shape.rank >= 3 for t in tensors))


def _per_token_matmul(original, hooks):
    """`keras.ops.matmul(x, kernel)` of a (batch, sequence, ..., in) x as an
    einsum on a context-split mesh: Keras' TF backend writes it as
    `tf.tensordot`, which reshapes x to (batch·sequence, in), and DTensor
    2.21 all-gathers the sequence to merge the two split dimensions (Dense
    layers then computed on the whole sequence on every device)."""

    def matmul(x1, x2):
        if (_sequence_split_in_step(x1) and len(getattr(x2, "shape", ()))
                == 2 and x1.dtype == x2.dtype):
            dims = "abcdefgh"[:x1.shape.rank - 1]
            return tf.einsum(f"{dims}i,io->{dims}o", x1,
                             tf.convert_to_tensor(x2))
        return original(x1, x2)

    return matmul


def _per_token_sparse_crossentropy(original, hooks):
    """`sparse_categorical_crossentropy` of (batch, sequence, classes)
    outputs as -Σ one_hot(target) · log_softmax(output) on a context-split
    mesh: TF's fused op reshapes to (batch·sequence, classes), which DTensor
    2.21 can do only by all-gathering the sequence (as `_per_token_matmul`)."""

    def sparse_categorical_crossentropy(target, output, from_logits=False,
                                        axis=-1):
        if axis != -1 or not _sequence_split_in_step(output):
            return original(target, output, from_logits=from_logits,
                            axis=axis)
        target = tf.convert_to_tensor(target)
        if target.shape.rank == output.shape.rank and target.shape[-1] == 1:
            target = tf.squeeze(target, axis=-1)
        if from_logits:
            log_probs = tf.nn.log_softmax(output, axis=-1)
        else:
            log_probs = tf.math.log(tf.clip_by_value(
                output, keras.backend.epsilon(), 1 - keras.backend.epsilon()))
        chosen = tf.one_hot(tf.cast(target, tf.int32), output.shape[-1],
                            dtype=log_probs.dtype)
        return -tf.reduce_sum(chosen * log_probs, axis=-1)

    return sparse_categorical_crossentropy


def _multi_head_attention():
    return keras.layers.MultiHeadAttention


def _grouped_query_attention():
    return keras.layers.GroupQueryAttention


def _keras_numpy():
    return _compat.keras_module("backend.tensorflow.numpy")


def _keras_nn():
    return _compat.keras_module("backend.tensorflow.nn")


PATCHES = (
    _compat.Patch("mha_context_attention", _multi_head_attention,
                  "_compute_attention", _context_attention),
    _compat.Patch("mha_context_causal_mask", _multi_head_attention,
                  "_compute_causal_mask", _context_causal_mask),
    _compat.Patch("mha_context_factored_mask", _multi_head_attention,
                  "_compute_attention_mask", _factored_attention_mask),
    _compat.Patch("gqa_context_factored_mask", _grouped_query_attention,
                  "_compute_attention_mask", _factored_attention_mask),
    _compat.Patch("gqa_context_attention", _grouped_query_attention,
                  "_compute_attention", _context_grouped_attention),
    _compat.Patch("gqa_context_causal_flag", _grouped_query_attention,
                  "call", _context_causal_flag),
    _compat.Patch("gqa_context_causal_mask", _grouped_query_attention,
                  "_compute_causal_mask", _context_causal_mask),
    _compat.Patch("per_token_matmul", _keras_numpy, "matmul",
                  _per_token_matmul),
    _compat.Patch("per_token_sparse_crossentropy", _keras_nn,
                  "sparse_categorical_crossentropy",
                  _per_token_sparse_crossentropy),
)
