"""A Keras model read as the transformer dimensions the roofline costs
(`roofline.Transformer`): its attention layers are the blocks.

>>> transformer_of(profile_model(build_without_weights(build_gpt)))
Transformer(layers=24, hidden=2304, heads=24, ...)
"""

import collections
import dataclasses

import keras
import numpy as np

from tfpar.planner import profile as profile_lib
from tfpar.planner import roofline


def read(profile):
    """`transformer_of(profile)`, or None for a model without attention."""
    try:
        return transformer_of(profile)
    except ValueError:
        return None


def transformer_of(profile):
    """The `roofline.Transformer` of a profiled Keras model: its
    self-attention layers are the blocks, its cross-attention layers (an
    encoder-decoder's, `profile.Op.cross_attention`) part of theirs; a
    ValueError for a model without attention."""
    cross = [sub for op in profile.ops for sub in op.cross_attention]
    crossing = {id(sub) for sub in cross}
    # Per op, its self-attention layers; the ops holding one are where
    # each block starts.
    selfs = [[sub for sub in profile_lib.sublayers(op.layer)
              if profile_lib.is_attention(sub) and id(sub) not in crossing]
             for op in profile.ops]
    attention = [sub for held in selfs for sub in held]
    starts = [i for i, held in enumerate(selfs) if held]
    if not attention:
        raise ValueError(
            f"tfpar.estimate costs transformer stacks: model "
            f"{profile.name!r} has no attention layer. Use tfpar.plan for "
            "other models.")
    hidden = profile_lib.attention_hidden(attention[0])
    heads = _heads(attention[0])
    key_dim = profile_lib.attention_width(attention[0]) // heads
    vocab, token_tables, positions = _embeddings(profile, hidden)
    head = vocab_head(profile, hidden)
    inside = {id(sub) for layer in attention + cross
              for sub in profile_lib.sublayers(layer)}
    ups, downs = collections.Counter(), collections.Counter()
    for op in profile.ops:
        for w in op.weights:
            if w.flops and not w.conv and id(w.owner) not in inside:
                i = profile_lib.in_width(w.owner, w.shape)
                o = profile_lib.out_width(w.owner, w.shape)
                if i == hidden and o not in (hidden, vocab):
                    ups[o] += 1
                elif o == hidden and i not in (hidden, vocab):
                    downs[i] += 1
    ffn, gated = _mlp(ups, downs, hidden, len(attention))
    cross_share = len(cross) / len(attention)  # cross attentions per block
    experts, top_k, expert_width, expert_gated = _experts(profile)
    if experts:
        ffn, gated = expert_width, float(expert_gated)
    return roofline.Transformer(
        layers=len(attention), hidden=hidden, heads=heads,
        seq=max(profile.ops[i].tokens for i in starts),
        vocab=vocab, ffn=ffn, kv_heads=_kv_heads(attention[0], heads),
        key_dim=0 if key_dim * heads == hidden else key_dim,
        gated=gated, dropout=_dropout(profile),
        # Without a head: whether no reverse table of its own is held.
        tied=head.tied if head else not _reverse_table(
            profile, *_token_table(_tables(profile, hidden))),
        embedding_head=head is None or head.embedding,
        lm_head=head is not None, position_embedding=positions,
        token_tables=token_tables,
        experts=experts,
        top_k=top_k,
        cross_attention=cross_share,
        # the blocks holding a cross attention are a decoder's, causal;
        # the encoder's are not
        causal=min(1.0, cross_share) if cross else True,
        compute_bytes=profile.compute_itemsize,
        **_stored_and_trained(profile),
        **_kept_per_block(profile, starts, hidden))


def _stored_and_trained(profile):
    """{param_bytes, trainable_share} of `roofline.Transformer`: the
    weights' bytes per element and the share of elements that train,
    each weighted by the weights' sizes (int8 kernels of Keras'
    `quantize("int8")`: ~1 byte; a LoRA fine-tune: a small share)."""
    weights = list({w.path: w for op in profile.ops
                    for w in op.weights}.values())
    sizes = [float(np.prod(w.shape)) for w in weights]
    total = sum(sizes) or 1.0
    return {"param_bytes": sum(s * w.itemsize for s, w in zip(
                sizes, weights)) / total,
            "trainable_share": sum(s for s, w in zip(sizes, weights)
                                   if w.trainable) / total}


def _mlp(ups, downs, hidden, blocks):
    """(MLP width f, the share of MLPs that are gated) from the kernels
    outside attention that read the model width h (`ups`: {output width:
    kernels}) and that write it (`downs`: {input width: kernels}). f is
    the down projections' width; an up kernel f wide is one projection,
    one 2f wide a gate and an up projection fused (Moonshine's decoder);
    an MLP with two is gated. An encoder-decoder may mix them (Moonshine:
    plain encoder MLPs, gated decoder ones). Without down projections,
    the widest-used up width, gated if there are two per block."""
    if not downs:
        ffn, kernels = ups.most_common(1)[0] if ups else (4 * hidden, 0)
        return ffn, float(kernels >= 2 * blocks)
    ffn, mlps = downs.most_common(1)[0]
    kernels = ups[ffn] + 2 * ups[2 * ffn]
    return ffn, min(1.0, max(0.0, kernels / mlps - 1.0))


def _kept_per_block(profile, starts, hidden):
    """{kept_hidden, kept_wide} of `roofline.Transformer`: the outputs of
    the layers from one attention layer to the next (`starts`: the ops
    holding them; one block's worth, averaged over the blocks), h wide or
    wider (widths over h summed), those read only inside a block that
    `set_recompute(model, "full")` recomputes whole left out
    (`Op.in_block`); a block that is one layer (keras-hub's), or one
    recomputed whole, keeps one output. One block alone: Megatron's
    (1, 0)."""
    if len(starts) < 2:
        return {}
    kept_hidden = kept_wide = 0.0
    for op in profile.ops[starts[0]:starts[-1]]:
        if op.in_block:  # recomputed with its block, not kept
            continue
        width = op.outputs / (max(op.tokens, 1) * profile.compute_itemsize)
        if width > hidden:
            kept_wide += width / hidden
        else:
            kept_hidden += width / hidden
    blocks = len(starts) - 1
    return {"kept_hidden": kept_hidden / blocks,
            "kept_wide": kept_wide / blocks}


def _experts(profile):
    """(experts E, top-k, expert MLP width, gated) of the model's first
    mixture-of-experts layer — one with integer `num_experts`, `top_k` and
    `intermediate_dim` (keras-hub's Mixtral, Qwen3-MoE and GPT-OSS blocks,
    `tfpar.layers.MixtureOfExperts`) — or (0, 0, 0, False). Every block is
    taken to route its MLP so (true of those models)."""
    for layer in profile.layers_by_path.values():
        values = [getattr(layer, name, None)
                  for name in ("num_experts", "top_k", "intermediate_dim")]
        if all(isinstance(v, int) and not isinstance(v, bool)
               for v in values):
            return (*values, bool(getattr(layer, "gated", True)))
    return 0, 0, 0, False


def _heads(layer):
    heads = profile_lib.num_heads(layer)
    if heads is not None:
        return heads
    raise ValueError(f"tfpar.estimate cannot read the heads of attention "
                     f"layer {layer.name!r} ({type(layer).__name__}).")


def _kv_heads(layer, heads):
    for name in ("num_key_value_heads", "_num_key_value_heads"):
        if isinstance(getattr(layer, name, None), int):
            return getattr(layer, name)
    return heads


def _embeddings(profile, hidden):
    """(vocabulary V, token tables, whether a position table exists) of
    the tables of width `hidden`: those with V rows are token tables (an
    encoder-decoder may hold one for each side: T5Gemma), any other a
    position table."""
    tables = _tables(profile, hidden)
    if not tables:
        raise ValueError(f"tfpar.estimate found no token embedding of width "
                         f"{hidden} in model {profile.name!r}.")
    vocab = max(w.shape[0] for _, w in tables)
    token_tables = sum(w.shape[0] == vocab for _, w in tables)
    return vocab, token_tables, token_tables < len(tables)


def _tables(profile, hidden=None):
    """[(op index, Weight)] of the 2-D `embeddings` tables (of width
    `hidden` when given)."""
    return [(i, w) for i, op in enumerate(profile.ops) for w in op.weights
            if w.path.rsplit("/", 1)[-1] == "embeddings"
            and len(w.shape) == 2 and hidden in (None, w.shape[1])]


@dataclasses.dataclass(frozen=True)
class Head:
    """A model's vocabulary head (`vocab_head`): the op indices of the
    token table's lookup and of the logits' projection, whether the
    logits reuse the table (tied) and whether the embedding layer makes
    them (tied, or an untied ReversibleEmbedding's reverse table) rather
    than a Dense head."""

    vocab: int
    table_op: int
    logits_op: int
    tied: bool
    embedding: bool


def vocab_head(profile, hidden=None):
    """The one rule of whether a profiled model computes logits over a
    vocabulary — `tfpar.estimate`, `tfpar.plan`'s layouts and its cost
    model all ask it. The token table is the largest 2-D `embeddings`
    weight (of width `hidden` when given, V rows). A head exists iff
    the table's layer runs again after its lookup (a reverse
    projection: keras-hub's ReversibleEmbedding called with
    reverse=True, tied or with its own reverse table, or held by a head
    layer such as MaskedLMHead), or the model's last kernel makes V
    outputs (a Dense head; an MLP as wide as the vocabulary is not
    one). Else None: a classifier, a bare backbone — no logits.

    >>> vocab_head(profile_model(gpt2_causal_lm)).tied
    True
    """
    tables = _tables(profile, hidden)
    if not tables:
        return None
    table_op, table = _token_table(tables)
    vocab = table.shape[0]
    for i, op in enumerate(profile.ops[table_op + 1:], table_op + 1):
        if any(w.path == table.path for layer in op.reuses
               for w in layer.weights):
            return Head(vocab, table_op, i,
                        tied=not _reverse_table(profile, table_op, table),
                        embedding=True)
    kernels = [(i, w) for i, op in enumerate(profile.ops)
               for w in op.weights if w.flops]
    if kernels and not _is_embedding(kernels[-1][1].owner) and (
            profile_lib.out_width(kernels[-1][1].owner, kernels[-1][1].shape)
            == vocab):
        return Head(vocab, table_op, kernels[-1][0], tied=False,
                    embedding=False)
    return None


def _token_table(tables):
    """(op index, Weight) of the token table: the most rows."""
    return max(tables, key=lambda found: found[1].shape[0])


def _reverse_table(profile, table_op, table):
    """Whether the token table's layer (`table`, looked up by op
    `table_op`) owns a kernel of its own (an untied ReversibleEmbedding's
    `reverse_embeddings`), called or not."""
    layer_path = table.path.rsplit("/", 1)[0]
    return any(w.flops and w.path.rsplit("/", 1)[0] == layer_path
               for w in profile.ops[table_op].weights)


def _is_embedding(layer):
    return getattr(layer, "embeddings", None) is not None


def _dropout(profile):
    for layer in profile.layers_by_path.values():
        rate = getattr(layer, "rate", None) if isinstance(
            layer, keras.layers.Dropout) else getattr(layer, "_dropout", None)
        if isinstance(rate, (int, float)) and rate > 0:
            return True
    return False


def vocab_parallel(model, t, sequence_parallel):
    """Whether tfpar's plans split the head of `model` (a
    `roofline.Transformer`) over the vocabulary on a model axis of size t
    (`auto_rules(vocab_parallel=True)`, style `VocabParallel`): when it
    has a vocabulary head (`vocab_head`: `lm_head`) and t > 1
    divides its vocabulary, without sequence parallelism (which auto_rules
    does not combine with it), beside a context axis too (a hidden-split
    embedding keeps the sequence split there:
    `context_parallel.split_along_sequence`). Else the head is costed and
    laid out whole (`roofline.head_layout`)."""
    return (model.lm_head and t > 1 and not sequence_parallel
            and model.vocab % t == 0)
