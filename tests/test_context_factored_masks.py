"""Attention masks reach blockwise attention factored, never as s/cp × s.

A keras-hub decoder merges its (batch, s) padding mask with the causal
mask into a (batch, s, s) tensor: on a context-split mesh a device would
hold (batch/data, s/cp, s) of it per layer, quadratic in the sequence. In
a step on such a mesh tfpar's patches keep it factored instead
(`context_parallel.FactoredMask`: a key-validity vector, causal and
sliding window by global position, a query-validity vector) and
`blockwise_attention` builds each key tile's mask inside the tile chain.

The compiled step of a keras-hub Llama 3 with padded rows on data=2 ×
context=4 is read (`tfpar.reports.program.keras_program`: the expanded
per-device program): no tensor has an s/cp × s (or larger) pair of
dimensions, and the largest mask tensor (bool or int32, rank >= 3) grows
linearly with s (doubling s: 2×, not 4×). Before, the merged mask
(1, s/cp, s) int32 and the causal constant (1, s, s) bool were there.
Parity of the factored path: the keras-hub matrix
(tests/test_context_hub_matrix.py, padded rows) and, here, blockwise
attention against dense attention on the same masks.
"""

import types

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import blockwise_attention
from tfpar import context_keras_hub
from tfpar import context_parallel
from tfpar.reports import program as program_lib

import context_models

MESH = {"data": 2, "context": 4}
TILE = 16  # keys per tile: constant over the lengths below (s/cp >= 16)
VOCAB = 40  # no dimension of the model equals s/cp or s (16 .. 128)


def compiled_shapes(seq_len):
    """[(shape, dtype)] of every output of the expanded per-device training
    step of a keras-hub Llama 3 (grouped-query) on data=2 × context=4, two
    rows of `seq_len` tokens, the second padded from its middle."""
    keras.utils.set_random_seed(0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESH))
    with strategy.scope():
        model = keras_hub_llama3()
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), weighted_metrics=[])
    rng = np.random.RandomState(0)
    ids = rng.randint(1, VOCAB, (2, seq_len + 1)).astype("int32")
    padding = np.ones((2, seq_len), "int32")
    padding[1, seq_len // 2:] = 0
    x = {"token_ids": ids[:, :-1], "padding_mask": padding}
    program = program_lib.keras_program(model, x, ids[:, 1:])
    return [size for node in program.nodes.values()
            for size in (program_lib.output_size(node, i)
                         for i in range(len(program_lib.output_shapes(node))))
            if size is not None]


def keras_hub_llama3():
    return keras_hub.models.Llama3CausalLM(keras_hub.models.Llama3Backbone(
        vocabulary_size=VOCAB, num_layers=1, hidden_dim=48,
        intermediate_dim=80, num_query_heads=4, num_key_value_heads=2),
        preprocessor=None)


def quadratic(shapes, seq_len):
    """The shapes with a pair of dimensions (s/cp, s) or (s, s), in that
    order: a per-device slice of an s × s matrix (no dimension of the
    model's weights equals s/cp or s: `keras_hub_llama3`)."""
    rows = seq_len // MESH["context"]
    return [shape for shape, _ in shapes
            if any(a in (rows, seq_len) and b == seq_len
                   for i, a in enumerate(shape) for b in shape[i + 1:])]


def largest_mask_bytes(shapes):
    """Bytes of the largest bool or int32 tensor of rank >= 3 (masks; the
    token ids and padding vectors are rank 2)."""
    return max((program_lib.nbytes(shape, dtype) for shape, dtype in shapes
                if dtype in (tf.bool, tf.int32) and len(shape) >= 3),
               default=0)


def test_llama3_padding_mask_never_quadratic_and_linear(monkeypatch):
    monkeypatch.setattr(blockwise_attention, "TILE_KEYS", TILE)
    short, long = 64, 128
    shapes = {s: compiled_shapes(s) for s in (short, long)}
    for s, found in shapes.items():
        assert not quadratic(found, s), (s, sorted(set(quadratic(found, s))))
    masks = {s: largest_mask_bytes(found) for s, found in shapes.items()}
    assert 0 < masks[short] and masks[long] <= 2.2 * masks[short], masks


def dense_reference(q, k, v, positions, scale, allowed):
    """Keras' softmax attention with the bool mask `allowed` (b, q, s);
    rows seeing no key give 0."""
    scores = tf.einsum("btnh,bsnh->bnts", q, k) * scale
    scores += tf.where(allowed[:, None], 0.0, blockwise_attention.MASKED)
    out = tf.einsum("bnts,bsnh->btnh", tf.nn.softmax(scores), v)
    return out * np.any(allowed, -1)[..., None, None].astype("float32")


@pytest.mark.parametrize("window", [None, 5])
def test_factored_masks_match_the_dense_mask(window):
    """key_valid, query_valid, causal by permuted (load-balanced)
    positions and a sliding window: the values and dQ, dK, dV of the dense
    mask they stand for (tiles of 3 keys in blocks of 8)."""
    q, k, v = (tf.random.stateless_normal((2, 16, 2, 4), (i, 1))
               for i in range(3))
    positions = np.array([0, 1, 14, 15, 2, 3, 12, 13,
                          4, 5, 10, 11, 6, 7, 8, 9])
    key_valid = np.ones((2, 16), bool)
    key_valid[1, positions >= 11] = False  # padded tail, stored permuted
    query_valid = key_valid.copy()
    allowed = positions[:, None] >= positions[None, :]
    if window is not None:
        allowed &= positions[:, None] - positions[None, :] < window
    allowed = allowed[None] & key_valid[:, None, :] & query_valid[:, :, None]

    def factored(q, k, v):
        return blockwise_attention.blockwise_attention(
            q, k, v, positions, positions, scale=0.5, block_size=8,
            tile_size=3, key_valid=key_valid, query_valid=query_valid,
            window=window)

    def dense(q, k, v):
        return dense_reference(q, k, v, positions, 0.5, allowed)

    gradients = context_models.values_and_gradients
    for got, want in zip(gradients(factored, q, k, v),
                         gradients(dense, q, k, v)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_window_without_causal_is_refused_naming_it():
    q = tf.zeros((1, 4, 1, 2))
    with pytest.raises(ValueError, match=r"window=3 with causal=False"):
        blockwise_attention.blockwise_attention(
            q, q, q, np.arange(4), np.arange(4), scale=1.0, causal=False,
            window=3)


def test_factored_mask_is_block_masks_tile_for_tile():
    """`FactoredMask` (what Keras layers carry) is a `BlockMasks` without
    its dense part: from the same vectors, causal band and window, each
    key tile's mask is the one blockwise attention builds, equal to the
    dense mask's tile; a window without causal is refused by the same
    check; `factored_or_none` is None exactly when it masks nothing."""
    positions = np.array([0, 1, 6, 7, 2, 3, 4, 5])  # load-balanced order
    key_valid = np.ones((2, 8), bool)
    key_valid[1, positions >= 5] = False
    query_valid = key_valid.copy()
    allowed = (positions[:, None] >= positions[None, :]) & (
        positions[:, None] - positions[None, :] < 3)
    allowed = allowed[None] & key_valid[:, None, :] & query_valid[:, :, None]
    factored = context_parallel.FactoredMask(
        tf.constant(key_valid), causal=True, query_valid=tf.constant(
            query_valid)).with_window(3)
    plain = blockwise_attention.BlockMasks(
        True, 3, key_valid=tf.constant(key_valid),
        query_valid=tf.constant(query_valid))
    anchor = tf.zeros((2, 8, 1, 1))  # Q: (batch, q, heads, dim)
    for start, stop in [(0, 3), (3, 6), (6, 8)]:
        want = np.where(allowed[:, None, :, start:stop], 0.0,
                        blockwise_attention.MASKED)
        for masks in (factored, plain):
            got = blockwise_attention._additive_mask(  # noqa: SLF001
                anchor, positions, positions[start:stop],
                masks.block(start, stop))
            np.testing.assert_array_equal(
                np.broadcast_to(got, want.shape), want)
    with pytest.raises(ValueError,
                       match=r"FactoredMask.*window=3 with causal=False"):
        context_parallel.FactoredMask(window=3)
    assert context_parallel.factored_or_none(None, False) is None
    assert context_parallel.factored_or_none(None, True).empty is False


def test_sliding_window_skips_blocks_out_of_reach():
    """Queries 12..15 with a window of 4 see keys 9..15: key blocks [0, 4)
    and [4, 8) are skipped."""
    assert blockwise_attention.visible_blocks(
        np.arange(12, 16), np.arange(16), 4, causal=True, window=4) == [
            (8, 12), (12, 16)]


@pytest.mark.slow
def test_keras_mha_padding_mask_never_quadratic():
    """A Keras MultiHeadAttention fed Keras' padding mask (Embedding
    mask_zero) on data=2 × context=4: its factored mask (query and key
    vectors) leaves no s/cp × s tensor in the compiled step."""
    seq_len = 256
    keras.utils.set_random_seed(0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESH))
    with strategy.scope():
        model = context_models.causal_transformer(
            vocab=VOCAB, dim=32, heads=4, layers=1, seq_len=seq_len,
            mask_zero=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    x, y = context_models.corpus(2, seq_len=seq_len, vocab=VOCAB)
    x = dict(x, tokens=x["tokens"].copy())
    x["tokens"][1, seq_len // 2:] = 0
    program = program_lib.keras_program(model, x, y)
    shapes = [size for node in program.nodes.values()
              for size in (program_lib.output_size(node, i) for i in range(
                  len(program_lib.output_shapes(node)))) if size is not None]
    assert not quadratic(shapes, seq_len)


def test_one_rule_decides_training_masks_for_every_decoder():
    """Llama/Mistral, GPT-2 and Gemma decoders factor their mask under one
    rule: a context split, no cache, no user mask, and a cache index that
    is absent or 0 (keras-hub's plain causal mask); a tensor index or a
    cache is decoding and keeps keras-hub's own mask."""
    decide = context_keras_hub._factored_in_training
    split = object()
    assert decide(split, None, None) and decide(split, None, 0)
    assert not decide(None, None, None)  # no context split
    assert not decide(split, tf.zeros((1, 2, 2)), None)  # a cache
    assert not decide(split, None, 3)  # decoding at position 3
    assert not decide(split, None, tf.constant(0))  # traced: decoding
    assert not decide(split, None, None, attention_mask=tf.ones((1, 2, 2)))


@pytest.mark.parametrize("index,factored", [(None, True), (0, True),
                                            (3, False)])
def test_llama_decoders_mask_follows_the_one_rule(monkeypatch, index,
                                                  factored):
    """Llama/Mistral's patched `_compute_self_attention_mask` on a context
    split (as in a step): a cache index of 0 without a cache is training
    (a FactoredMask, no call of keras-hub's own), 3 is decoding (keras-
    hub's own). Before the one rule, index 0 fell back to the dense mask."""
    monkeypatch.setattr(context_keras_hub, "_split_in_step", object)
    calls = []
    patched = context_keras_hub._decoder_mask(
        lambda *args: calls.append(args) or "keras-hub's", None)
    sequence = tf.zeros((2, 8, 4))
    got = patched(types.SimpleNamespace(), sequence, tf.ones((2, 8), "int32"),
                  None, None, index)
    assert isinstance(got, context_parallel.FactoredMask) == factored, got
    assert bool(calls) != factored, calls
