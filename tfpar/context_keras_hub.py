"""Context parallelism for keras-hub decoders (Llama, Llama 3, Mistral,
Mixtral, Gemma, GPT-2).

Under a `context` mesh axis (see `context_parallel`) a keras-hub decoder
keeps its activations split along the sequence; three of its pieces see
the whole sequence and are patched here, inside a step on such a mesh only
(Keras' and keras-hub's own code runs elsewhere):

- `RotaryEmbedding` (keras-hub's, and Llama's subclass): the angle of a row
  is its global position p (`ContextSplit.order`: the natural position, or
  the load-balanced one) times each inverse frequency, and the rotation is
  x·cos + rotate_half(x)·sin with rotate_half(x) = [-x₂, x₁] = x R, R a
  constant (dim × dim) matrix: keras-hub's split/stack/reshape of the
  feature dimension, and any strided slice of it, is what DTensor 2.21
  cannot lay out on a sequence-split tensor (a failed layout, or a crash
  in its strided-slice layout inference:
  tests/dtensor_rotary_slice_repro.py).
- The decoders' self-attention masks: in a training step without a user
  `decoder_attention_mask`, the padding mask, causal and sliding window
  stay factored (`context_parallel.FactoredMask`: a (batch, s) key
  validity vector, by global position: query i sees key j iff order[i] >=
  order[j], and order[i] < order[j] + window for Mistral's, Mixtral's
  and Gemma's windows); blockwise attention builds each key tile's mask,
  so no (batch, s/cp, s) mask exists. With a user mask, keras-hub's dense
  merge and `compute_causal_mask` by global position (quadratic in s).
- The attention core (`LlamaAttention._compute_attention`,
  `MistralAttention._compute_attention`, Mixtral's copy of it): keys and
  values gathered over the context axis, `blockwise_attention` with the
  decoder's mask (`context_parallel.attend_across_context`).

`generate()` (prefill and KV-cache decoding) runs unsplit over the context
axis (`sequences_unsplit`, entered by `training.make_generate_function`):
the prompts are placed whole along the sequence (split over the data axis
only, replicated over the context axis) and the patches above step aside,
so keras-hub's cached calls run as on a mesh without a context axis.

Example:

>>> import tfpar
>>> tfpar.use_virtual_cpus(8)
>>> from tfpar import context_parallel
>>> split = context_parallel.ContextSplit("context", 2, load_balance=True)
>>> causal_mask_by_position(split, 4)[0].astype(int).tolist()
[[1, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [1, 0, 1, 1]]
"""

import contextlib
import importlib

import numpy as np
import tensorflow as tf

from tfpar import _compat
from tfpar import context_parallel
from tfpar import step_context


def _split_in_step():
    """The `ContextSplit` of the step being traced on a context-split
    mesh, else None."""
    if not step_context.in_spmd_step():
        return None
    return context_parallel.context_in_step()


@contextlib.contextmanager
def sequences_unsplit(placer):
    """Within: `placer` (the strategy's `inputs.InputPlacer`) places batches
    whole along the sequence, and a step traced sees no context split
    (`context_parallel.context_in_step()` is None), so its attention, masks
    and positions are Keras' and keras-hub's own. `generate()` runs so:
    decoding one token at a time has no sequence to split.

    >>> import tfpar
    >>> strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    >>> placer = strategy.extended.input_placer
    >>> with sequences_unsplit(placer):
    ...     print(placer.context)
    None
    >>> placer.context.size
    4
    """
    saved = placer.context
    placer.context = None
    try:
        yield
    finally:
        placer.context = saved


def causal_mask_by_position(split, length, window=None):
    """(1, length, length) bool: query row i sees key row j iff p_i >= p_j
    (and p_i < p_j + window, a sliding window), p = `split.order`."""
    positions = split.order(length)
    seen = positions[:, None] >= positions[None, :]
    if window is not None:
        seen &= positions[:, None] < positions[None, :] + window
    return seen[None]


# -- rotary position embeddings ----------------------------------------------


def _rotary_positions(original, hooks):
    """`RotaryEmbedding._compute_positions`: the global positions of the
    rows (`ContextSplit.order`) plus `start_index`."""

    def _compute_positions(self, inputs, start_index=0):
        split = _split_in_step()
        if split is None:
            return original(self, inputs, start_index)
        positions = tf.constant(split.order(inputs.shape[1]), tf.float32)
        return positions + tf.cast(start_index, tf.float32)

    return _compute_positions


def _rotate_half_matrix(dim):
    """R (dim × dim) with x R = [-x₂, x₁] (x₁, x₂ the halves of x)."""
    half = dim // 2
    rotation = np.zeros((dim, dim), np.float32)
    rotation[half:, :half] = -np.eye(half)  # -x₂ into the first half
    rotation[:half, half:] = np.eye(half)  # x₁ into the second half
    return rotation


def _rotary_apply(original, hooks):
    """`RotaryEmbedding._apply_rotary_pos_emb`: x·cos + (x R)·sin, R the
    rotate-half matrix (`_rotate_half_matrix`), an einsum over the unsplit
    feature dimension: no slice, split or stack (module docstring)."""

    def _apply_rotary_pos_emb(self, tensor, cos_emb, sin_emb):
        if _split_in_step() is None:
            return original(self, tensor, cos_emb, sin_emb)
        rotation = tf.constant(_rotate_half_matrix(tensor.shape[-1]),
                               tensor.dtype)
        dims = "abcdefgh"[:tensor.shape.rank - 1]
        rotated = tf.einsum(f"{dims}i,ij->{dims}j", tensor, rotation)
        return tensor * cos_emb + rotated * sin_emb

    return _apply_rotary_pos_emb


def _rotary_cos_sin(original, hooks):
    """`RotaryEmbedding._compute_cos_sin_embedding`: the angles p·f of
    every (row, frequency) joined as [p·f, p·f] (keras-hub's stack and
    reshape), shaped (1, s, 1.., dim) by reshapes (no strided slice)."""

    def _compute_cos_sin_embedding(self, inputs, start_index=0,
                                   positions=None):
        if _split_in_step() is None or positions is not None or (
                self.rope_type == "yarn"):
            return original(self, inputs, start_index, positions)
        inverse_freq = tf.cast(self._get_inverse_freq(inputs.shape[-1]),  # noqa: SLF001
                               tf.float32)
        positions = self._compute_positions(inputs, start_index)  # noqa: SLF001
        angles = tf.einsum("s,f->sf", positions, inverse_freq)
        angles = tf.concat([angles, angles], axis=-1)  # (s, dim)
        shape = [1, inputs.shape[1]] + [1] * (inputs.shape.rank - 3) + [
            inputs.shape[-1]]
        angles = tf.reshape(angles, shape)
        return (tf.cast(tf.cos(angles), self.compute_dtype),
                tf.cast(tf.sin(angles), self.compute_dtype))

    return _compute_cos_sin_embedding


# -- masks and attention -----------------------------------------------------


def _causal_mask(original, hooks):
    """keras-hub's `compute_causal_mask(batch, input_length, output_length,
    cache_index)` by global position in a training step (no cache)."""

    def compute_causal_mask(batch_size, input_length, output_length,
                            cache_index=0):
        split = _split_in_step()
        if (split is None or not isinstance(input_length, int)
                or input_length != output_length
                or not isinstance(cache_index, int) or cache_index):
            return original(batch_size, input_length, output_length,
                            cache_index)
        mask = tf.constant(causal_mask_by_position(split, input_length))
        return tf.broadcast_to(mask, (batch_size, output_length,
                                      input_length))

    return compute_causal_mask


def _padding_of(sequence, padding_mask):
    """keras-hub's padding (`merge_padding_and_attention_mask`): the given
    (batch, s) `padding_mask`, else the sequence's Keras mask, else None."""
    if padding_mask is not None:
        return padding_mask
    return getattr(sequence, "_keras_mask", None)


def _factored_in_training(split, cache, cache_index, attention_mask=None):
    """Whether a decoder's self-attention mask is given factored: a
    training step on a context split, no cache, no user attention mask
    (a cache index of 0 without a cache is keras-hub's plain causal
    mask, so it counts as training; any other index is decoding)."""
    return (split is not None and cache is None and attention_mask is None
            and isinstance(cache_index, (int, type(None)))
            and not cache_index)


def _decoder_mask(original, hooks):
    """`_compute_self_attention_mask` of Llama's and Mistral's decoders in
    a training step on a context split: the padding and the causal mask
    (Mistral: with its sliding window) as a `context_parallel.FactoredMask`
    (no (batch, s, s) mask; its tiles are built inside blockwise
    attention). A user `decoder_attention_mask` is merged as keras-hub
    does (dense, quadratic), then the causal band by global position."""

    def _compute_self_attention_mask(self, decoder_sequence,
                                     decoder_padding_mask,
                                     decoder_attention_mask,
                                     self_attention_cache,
                                     self_attention_cache_update_index):
        split = _split_in_step()
        window = getattr(self, "sliding_window", None)
        arguments = (decoder_sequence, decoder_padding_mask,
                     decoder_attention_mask, self_attention_cache,
                     self_attention_cache_update_index)
        if not _factored_in_training(split, self_attention_cache,
                                     self_attention_cache_update_index):
            return original(self, *arguments)
        if decoder_attention_mask is None:
            return context_parallel.FactoredMask(
                _padding_of(decoder_sequence, decoder_padding_mask),
                causal=True, window=window)
        module = importlib.import_module(type(self).__module__)
        merged = module.merge_padding_and_attention_mask(
            decoder_sequence, decoder_padding_mask, decoder_attention_mask)
        causal = tf.cast(causal_mask_by_position(
            split, decoder_sequence.shape[1], window), tf.int32)
        return tf.minimum(merged, causal)

    return _compute_self_attention_mask


def _transformer_decoder_mask(original, hooks):
    """keras-hub's `TransformerDecoder._compute_self_attention_mask` (GPT-2)
    in a training step on a context split without a user attention mask:
    a `context_parallel.FactoredMask` (padding, causal if
    `use_causal_mask`). Elsewhere keras-hub's own (its causal mask by
    global position, `_causal_mask`)."""

    def _compute_self_attention_mask(self, decoder_sequence,
                                     decoder_padding_mask,
                                     decoder_attention_mask, use_causal_mask,
                                     self_attention_cache,
                                     self_attention_cache_update_index):
        if not _factored_in_training(
                _split_in_step(), self_attention_cache,
                self_attention_cache_update_index, decoder_attention_mask):
            return original(self, decoder_sequence, decoder_padding_mask,
                            decoder_attention_mask, use_causal_mask,
                            self_attention_cache,
                            self_attention_cache_update_index)
        return context_parallel.factored_or_none(
            _padding_of(decoder_sequence, decoder_padding_mask),
            bool(use_causal_mask))

    return _compute_self_attention_mask


def _gemma_decoder_mask(original, hooks):
    """`GemmaDecoderBlock._compute_attention_mask` in a training step on a
    context split: padding and causal as a `context_parallel.FactoredMask`
    (the attention adds its sliding window, `_gemma_attention`; its
    `mask == 0` row check reads the mask as a tensor,
    `FactoredMask.__tf_tensor__`)."""

    def _compute_attention_mask(self, x, padding_mask, cache,
                                cache_update_index):
        if not _factored_in_training(_split_in_step(), cache,
                                     cache_update_index):
            return original(self, x, padding_mask, cache, cache_update_index)
        padding = _padding_of(x, padding_mask)
        if padding is None:  # all valid: a vector for keras-hub's `mask == 0`
            padding = tf.ones_like(tf.reduce_sum(x, axis=-1), tf.bool)
        return context_parallel.FactoredMask(padding, causal=True)

    return _compute_attention_mask


def _grouped_attention(original, hooks):
    """`_compute_attention(query, key, value, attention_mask)` of Llama's
    and Mistral's attention (keys and values already repeated to the query
    heads): `attend_across_context` with the decoder's mask (causal: the
    decoders' masks are), gathering the key/value heads only."""

    def _compute_attention(self, query, key, value, attention_mask=None):
        split = _split_in_step()
        if split is None:
            return original(self, query, key, value, attention_mask)
        groups = getattr(self, "num_key_value_groups", None) or getattr(
            self, "_num_key_value_groups", 1)  # Llama's / Mistral's name
        return context_parallel.attend_across_context(
            split, query, key, value, scale=self._inv_norm_factor,  # noqa: SLF001
            causal=attention_mask is not None, mask=attention_mask,
            kv_groups=groups)

    return _compute_attention


def _gemma_rope(original, hooks):
    """`GemmaAttention._apply_rope`: the rotation (patched above), then
    Gemma's interleave of the halves (out[2i] = x[i], out[2i+1] =
    x[d/2+i]) as an einsum with a permutation matrix instead of its
    split/stack/reshape."""

    def _apply_rope(self, x, start_index, positions=None):
        if _split_in_step() is None or positions is not None:
            return original(self, x, start_index, positions)
        x = self.rope_layer(x, start_index=start_index)
        dim = x.shape[-1]
        order = np.stack([np.arange(dim // 2), np.arange(dim // 2, dim)],
                         axis=-1).reshape(-1)  # out[j] = x[order[j]]
        permutation = np.zeros((dim, dim), np.float32)
        permutation[order, np.arange(dim)] = 1.0
        dims = "abcdefgh"[:x.shape.rank - 1]
        return tf.einsum(f"{dims}i,ij->{dims}j", x,
                         tf.constant(permutation, x.dtype))

    return _apply_rope


def _gemma_attention(original, hooks):
    """`GemmaAttention._compute_attention`: the keys and values repeated to
    the query heads (query head u reads key/value head u // groups, as
    Gemma's grouped einsum), the sliding window |p_i - p_j| < window by
    global position, the logit soft cap inside `blockwise_attention`."""

    def _compute_attention(self, q, k, v, attention_mask, training=False,
                           cache_update_index=0):
        split = _split_in_step()
        if split is None:
            return original(self, q, k, v, attention_mask, training,
                            cache_update_index)
        if self.dropout and training:
            raise ValueError(
                f"Context parallelism cannot split layer {self.name!r} "
                f"({type(self).__name__}) along the sequence: dropout="
                f"{self.dropout} on the attention probabilities, which "
                "blockwise attention never builds. Use dropout=0.0 or a "
                "mesh without a context axis.")
        head_dim = (self.head_dim if self.query_head_dim_normalize
                    else self.hidden_dim // self.num_query_heads)
        factored = isinstance(attention_mask, context_parallel.FactoredMask)
        if self.use_sliding_window_attention and factored:
            attention_mask = attention_mask.with_window(
                self.sliding_window_size)
        elif self.use_sliding_window_attention and (
                attention_mask is not None):
            positions = split.order(q.shape[1])
            window = np.abs(positions[:, None] - positions[None, :]) < (
                self.sliding_window_size)
            attention_mask = tf.logical_and(
                tf.cast(attention_mask, tf.bool), tf.constant(window[None]))
        groups = self.num_query_heads // self.num_key_value_heads
        k, v = (tf.repeat(t, groups, axis=2) for t in (k, v))
        return context_parallel.attend_across_context(
            split, q, k, v, scale=1.0 / np.sqrt(head_dim),
            causal=attention_mask is not None, mask=attention_mask,
            kv_groups=groups,
            soft_cap=self.logit_soft_cap)

    return _compute_attention


def _learned_positions(original, hooks):
    """keras-hub's `PositionEmbedding.call` (GPT-2) of a load-balanced
    sequence: the embeddings of the rows' global positions."""

    def call(self, inputs, start_index=0, positions=None):
        split = _split_in_step()
        if (split is None or not split.load_balance or positions is not None
                or not isinstance(start_index, int) or start_index):
            return original(self, inputs, start_index, positions)
        order = split.order(inputs.shape[-2])
        return original(self, inputs, 0, tf.constant(order, tf.int32))

    return call


def _hub_attribute(module, name):
    return _compat.optional_owner(f"keras_hub.src.{module}", name)


def _hub_module(module):
    return _compat.optional_owner(f"keras_hub.src.{module}")


_ROTARY = "layers.modeling.rotary_embedding"
_DECODERS = ("models.llama.llama_decoder",
             "models.mistral.mistral_transformer_decoder",
             "models.mixtral.mixtral_decoder",
             "models.gemma.gemma_decoder_block",
             "layers.modeling.transformer_decoder")

# The attention layers whose masks and cores a context split computes by
# global position: Keras' own (patched in `context_parallel`) and
# keras-hub's patched here (`_compute_attention` not overridden below them).
_LLAMA_ATTENTION = _hub_attribute("models.llama.llama_attention",
                                  "LlamaAttention")
_MISTRAL_ATTENTION = _hub_attribute("models.mistral.mistral_attention",
                                    "CachedMistralAttention")
_MIXTRAL_ATTENTION = _hub_attribute("models.mixtral.mixtral_attention",
                                    "CachedMixtralAttention")
_GEMMA_ATTENTION = _hub_attribute("models.gemma.gemma_attention",
                                  "CachedGemmaAttention")
_BY_GLOBAL_POSITION = (
    _compat.optional_owner("keras.layers", "MultiHeadAttention"),
    _compat.optional_owner("keras.layers", "GroupQueryAttention"),
    _LLAMA_ATTENTION, _MISTRAL_ATTENTION, _MIXTRAL_ATTENTION,
    _GEMMA_ATTENTION)


def _by_global_position(layer, owners):
    """Whether `layer` is one of `owners` (attention classes) and computes
    its attention as that class does."""
    return any(isinstance(layer, owner) and getattr(
        type(layer), "_compute_attention", None) is getattr(
            owner, "_compute_attention", None) for owner in owners)


def unsplit_attention(layers):
    """The first of `layers` (Keras layers) that computes attention in a
    way a context split does not split by global position, or None. An
    attention layer is a layer whose class name has "Attention" and no
    layer of `_BY_GLOBAL_POSITION` (with its `_compute_attention`) inside
    it (a user's block around Keras' MultiHeadAttention is split). DTensor
    runs such a layer correctly on a context axis, unsplit: it gathers what
    the layer reads, with (s/cp × s) scores per device."""
    owners = tuple(owner for owner in (find() for find in _BY_GLOBAL_POSITION)
                   if owner is not _compat.Absent)
    for layer in layers:
        if "Attention" in type(layer).__name__ and not any(
                _by_global_position(inner, owners)
                for inner in _compat.all_layers(layer)):
            return layer
    return None


def check_load_balance(model, split):
    """Raises ValueError naming the first attention layer of `model` whose
    mask tfpar does not compute by global position (`unsplit_attention`),
    when the strategy's context split `split` (a
    `context_parallel.ContextSplit`, or None) load-balances. The balance
    reorders each sequence (`ContextSplit.order`); such a layer builds its
    causal mask by local position and would silently attend to other
    tokens than on one device (keras-hub Qwen3-MoE and GPT-OSS trained
    8e-4 and 1.7e-3 from one device's loss). Without the balance DTensor
    runs it correctly, unsplit."""
    if split is None or not split.load_balance:
        return
    layer = unsplit_attention(_compat.all_layers(model, include_self=False))
    if layer is None:
        return
    raise ValueError(
        f"Layer {layer.path!r} ({type(layer).__name__}) computes its "
        "attention in a way tfpar does not split over the context "
        f"axis {split.axis!r}, and load_balance reorders each sequence "
        "there: its causal mask, by local position, would attend to "
        "other tokens than on one device. Received: "
        "context_parallel.load_balance(strategy) with this layer. Use "
        "load_balance(strategy, False) (DTensor then runs the layer "
        "unsplit, correctly), or Keras MultiHeadAttention / "
        "GroupQueryAttention or a keras-hub Llama, Mistral, Mixtral, "
        "Gemma or GPT-2 decoder.")


PATCHES = (
    _compat.Patch("hub_rotary_positions", _hub_attribute(
        _ROTARY, "RotaryEmbedding"), "_compute_positions", _rotary_positions),
    _compat.Patch("hub_rotary_apply", _hub_attribute(
        _ROTARY, "RotaryEmbedding"), "_apply_rotary_pos_emb", _rotary_apply),
    _compat.Patch("hub_rotary_cos_sin", _hub_attribute(
        _ROTARY, "RotaryEmbedding"), "_compute_cos_sin_embedding",
        _rotary_cos_sin),
    *(_compat.Patch(f"hub_causal_mask_{module}", _hub_module(module),
                    "compute_causal_mask", _causal_mask)
      for module in _DECODERS),
    _compat.Patch("hub_llama_attention", _LLAMA_ATTENTION,
        "_compute_attention", _grouped_attention),
    _compat.Patch("hub_mistral_attention", _MISTRAL_ATTENTION,
        "_compute_attention", _grouped_attention),
    _compat.Patch("hub_mixtral_attention", _MIXTRAL_ATTENTION,
        "_compute_attention", _grouped_attention),
    _compat.Patch("hub_llama_mask", _hub_attribute(
        "models.llama.llama_decoder", "LlamaTransformerDecoder"),
        "_compute_self_attention_mask", _decoder_mask),
    _compat.Patch("hub_mistral_mask", _hub_attribute(
        "models.mistral.mistral_transformer_decoder",
        "MistralTransformerDecoder"), "_compute_self_attention_mask",
        _decoder_mask),
    _compat.Patch("hub_mixtral_mask", _hub_attribute(
        "models.mixtral.mixtral_decoder", "MixtralTransformerDecoder"),
        "_compute_self_attention_mask", _decoder_mask),
    _compat.Patch("hub_transformer_decoder_mask", _hub_attribute(
        "layers.modeling.transformer_decoder", "TransformerDecoder"),
        "_compute_self_attention_mask", _transformer_decoder_mask),
    _compat.Patch("hub_gemma_mask", _hub_attribute(
        "models.gemma.gemma_decoder_block", "GemmaDecoderBlock"),
        "_compute_attention_mask", _gemma_decoder_mask),
    _compat.Patch("hub_gemma_rope", _GEMMA_ATTENTION,
        "_apply_rope", _gemma_rope),
    _compat.Patch("hub_gemma_attention", _GEMMA_ATTENTION,
        "_compute_attention", _gemma_attention),
    _compat.Patch("hub_learned_positions", _hub_attribute(
        "layers.modeling.position_embedding", "PositionEmbedding"), "call",
        _learned_positions),
)
"""Installed with the strategy's patches (`tfpar.patches.install`)."""
