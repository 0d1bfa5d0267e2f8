"""Context parallelism with packed sequences: a Keras causal transformer
(MultiHeadAttention) whose rows pack several documents, given segment ids
and per-document positions as inputs, its attention mask "same segment"
(query i sees key j iff segment[i] == segment[j]) merged with the causal
one by Keras.

The segment ids are an input with a sequence dimension, so tfpar splits
them over the context axis like the tokens and, under load balance,
reorders them with the tokens (`ContextSplit.reorder_batch`): the mask the
model builds from them is then in the stored order of its queries and
keys, and attention masks by global position (`attend_across_context`).
Parity with one device on data=2 × context=4, with and without load
balance."""

import keras
import numpy as np
import pytest

import tfpar
from tfpar import context_parallel

import context_models
import models

SEQ, VOCAB, DIM, HEADS, N, BATCH = 32, 32, 32, 4, 32, 16


def packed_transformer():
    """tokens, per-document positions, segment ids -> next-token logits;
    attention within a segment and causal."""
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    positions = keras.Input((SEQ,), dtype="int32", name="positions")
    segments = keras.Input((SEQ,), dtype="int32", name="segment_ids")
    h = keras.layers.Embedding(VOCAB, DIM, name="tok_embed")(tokens)
    h = h + keras.layers.Embedding(SEQ, DIM, name="pos_embed")(positions)
    same_segment = keras.ops.equal(keras.ops.expand_dims(segments, 2),
                                   keras.ops.expand_dims(segments, 1))
    a = keras.layers.LayerNormalization(name="ln1")(h)
    a = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS, name="attn")(
        a, a, attention_mask=same_segment, use_causal_mask=True)
    h = h + a
    m = keras.layers.LayerNormalization(name="ln2")(h)
    m = keras.layers.Dense(2 * DIM, activation="gelu", name="up")(m)
    h = h + keras.layers.Dense(DIM, name="down")(m)
    logits = keras.layers.Dense(VOCAB, name="lm_head")(
        keras.layers.LayerNormalization(name="ln_f")(h))
    return keras.Model({"tokens": tokens, "positions": positions,
                        "segment_ids": segments}, logits, name="packed")


def packed_corpus(n, seed=0):
    """Rows of 2 to 4 documents of random lengths, each counting upward
    from its own random start; labels are the next token of a document
    (its last token predicts its first, a label like any other)."""
    rng = np.random.RandomState(seed)
    tokens = np.zeros((n, SEQ), "int32")
    labels = np.zeros((n, SEQ), "int32")
    positions = np.zeros((n, SEQ), "int32")
    segments = np.zeros((n, SEQ), "int32")
    for row in range(n):
        cuts = np.sort(rng.choice(np.arange(1, SEQ), rng.randint(1, 4),
                                  replace=False))
        for doc, (start, stop) in enumerate(zip(
                np.r_[0, cuts], np.r_[cuts, SEQ])):
            counting = (rng.randint(VOCAB) + np.arange(stop - start + 1)) % (
                VOCAB)
            tokens[row, start:stop] = counting[:-1]
            labels[row, start:stop] = counting[1:]
            positions[row, start:stop] = np.arange(stop - start)
            segments[row, start:stop] = doc + 1
    return {"tokens": tokens, "positions": positions,
            "segment_ids": segments}, labels


def train(strategy, weights, x, y):
    if strategy is None:
        model = packed_transformer()
    else:
        with strategy.scope():
            model = packed_transformer()
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    losses = models.BatchLosses()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[losses])
    return model, losses.losses


@pytest.fixture(scope="module")
def packed():
    x, y = packed_corpus(N)
    keras.utils.set_random_seed(0)
    weights = packed_transformer().get_weights()
    reference, losses = train(None, weights, x, y)
    return weights, x, y, reference, losses


@pytest.mark.parametrize("balance", [
    True, pytest.param(False, marks=pytest.mark.slow)])
def test_packed_sequences_data2_context4_parity(packed, balance):
    weights, x, y, reference, ref_losses = packed
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    if balance:
        context_parallel.load_balance(strategy)
    with tfpar.communication.capture() as programs:
        model, losses = train(strategy, weights, x, y)
    context_models.assert_parity(reference, ref_losses, model, losses)
    # Attention stays blockwise under the segment mask: score blocks of
    # (b/data, heads, s/cp, s/cp) per device, no (.., s/cp, s) scores.
    scores = {n: s for n, s in programs.train_report().forward_shapes(
        r"attn").items() if len(s) == 4 and n.endswith("Einsum")}
    block = SEQ // 4
    assert (BATCH // 2, HEADS, block, block) in scores.values(), scores
    assert all(s[-1] < SEQ for s in scores.values()), scores
    want = reference.predict(x, batch_size=BATCH, verbose=0)
    got = model.predict(x, batch_size=BATCH, verbose=0)
    assert models.relative_error(want, got) < 1e-4


def test_the_segment_mask_matters(packed):
    """The oracle is not blind to segments: the same weights without the
    segment mask (one segment per row) predict other logits."""
    _, x, _, reference, _ = packed
    whole = dict(x, segment_ids=np.ones_like(x["segment_ids"]))
    assert models.relative_error(
        reference.predict(x, batch_size=BATCH, verbose=0),
        reference.predict(whole, batch_size=BATCH, verbose=0)) > 1e-2
