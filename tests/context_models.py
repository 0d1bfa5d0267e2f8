"""A plain Keras causal transformer (MultiHeadAttention) for the context
parallelism tests: its positions are an input, so a load-balanced (permuted)
sequence carries its own positions."""

import keras
import numpy as np


def causal_transformer(vocab=32, seq_len=16, dim=32, heads=4, layers=1,
                       dropout=0.0, mask_zero=False):
    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    positions = keras.Input((seq_len,), dtype="int32", name="positions")
    h = keras.layers.Embedding(vocab, dim, mask_zero=mask_zero,
                               name="tok_embed")(tokens)
    h = h + keras.layers.Embedding(seq_len, dim, name="pos_embed")(positions)
    for i in range(layers):
        a = keras.layers.LayerNormalization(name=f"b{i}_ln1")(h)
        a = keras.layers.MultiHeadAttention(
            heads, dim // heads, dropout=dropout, name=f"b{i}_attn")(
                a, a, use_causal_mask=True)
        h = h + a
        m = keras.layers.LayerNormalization(name=f"b{i}_ln2")(h)
        m = keras.layers.Dense(2 * dim, activation="gelu", name=f"b{i}_up")(m)
        h = h + keras.layers.Dense(dim, name=f"b{i}_down")(m)
    h = keras.layers.LayerNormalization(name="ln_f")(h)
    logits = keras.layers.Dense(vocab, name="lm_head")(h)
    return keras.Model({"tokens": tokens, "positions": positions}, logits,
                       name="causal_transformer")


def corpus(n, vocab=32, seq_len=16, seed=0):
    """({"tokens", "positions"}, next tokens): sequences counting upward."""
    start = np.random.RandomState(seed).randint(0, vocab, size=(n, 1))
    x = (start + np.arange(seq_len + 1)[None, :]) % vocab
    positions = np.tile(np.arange(seq_len, dtype="int32"), (n, 1))
    return ({"tokens": x[:, :-1].astype("int32"), "positions": positions},
            x[:, 1:].astype("int32"))
