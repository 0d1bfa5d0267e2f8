"""A plain Keras causal transformer (MultiHeadAttention) for the context
parallelism tests: its positions are an input, so a load-balanced (permuted)
sequence carries its own positions."""

import contextlib

import keras
import keras_hub
import numpy as np
import tensorflow as tf

import tfpar

import models


def causal_transformer(vocab=32, seq_len=16, dim=32, heads=4, layers=1,
                       dropout=0.0, mask_zero=False, kv_heads=None,
                       mlp_ratio=2):
    """`kv_heads`: Keras' GroupQueryAttention with that many key/value
    heads instead of MultiHeadAttention; MLPs of `mlp_ratio` × dim
    (benchmarks/context.py builds it with 4)."""
    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    positions = keras.Input((seq_len,), dtype="int32", name="positions")
    h = keras.layers.Embedding(vocab, dim, mask_zero=mask_zero,
                               name="tok_embed")(tokens)
    h = h + keras.layers.Embedding(seq_len, dim, name="pos_embed")(positions)
    for i in range(layers):
        a = keras.layers.LayerNormalization(name=f"b{i}_ln1")(h)
        if kv_heads:
            attention = keras.layers.GroupQueryAttention(
                dim // heads, heads, kv_heads, dropout=dropout,
                name=f"b{i}_attn")
        else:
            attention = keras.layers.MultiHeadAttention(
                heads, dim // heads, dropout=dropout, name=f"b{i}_attn")
        a = attention(a, a, use_causal_mask=True)
        h = h + a
        m = keras.layers.LayerNormalization(name=f"b{i}_ln2")(h)
        m = keras.layers.Dense(mlp_ratio * dim, activation="gelu",
                               name=f"b{i}_up")(m)
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


HUB_SEQ, HUB_VOCAB = 32, 64


def hub_causal_lm(kind):
    """A small keras-hub causal LM of family `kind` (random weights, no
    preprocessor, dropout 0): "llama3" (grouped-query, 4 query / 2 key-value
    heads), "mistral" (its sliding window 12 < the sequence), "gemma" (2
    layers: logit soft-caps, a sliding window of 12 on the first, Gemma 2's
    post norms), "gpt2" (learned positions), "mixtral" (2 layers of 4
    experts, top 2, its window 12; no router aux loss, which a pipeline
    computes per micro-batch)."""
    hub = keras_hub.models
    sizes = dict(vocabulary_size=HUB_VOCAB, num_layers=1, hidden_dim=32,
                 intermediate_dim=64)
    gqa = dict(sizes, num_query_heads=4, num_key_value_heads=2)
    if kind == "llama3":
        return hub.Llama3CausalLM(hub.Llama3Backbone(**gqa),
                                  preprocessor=None)
    if kind == "mistral":
        return hub.MistralCausalLM(hub.MistralBackbone(
            **gqa, sliding_window=12), preprocessor=None)
    if kind == "gemma":
        return hub.GemmaCausalLM(hub.GemmaBackbone(
            **dict(gqa, num_layers=2), head_dim=8,
            attention_logit_soft_cap=20.0, final_logit_soft_cap=30.0,
            use_sliding_window_attention=True, sliding_window_size=12,
            use_post_ffw_norm=True, use_post_attention_norm=True),
            preprocessor=None)
    if kind == "mixtral":
        return hub.MixtralCausalLM(hub.MixtralBackbone(
            **dict(gqa, num_layers=2), num_experts=4, top_k=2,
            sliding_window=12, router_aux_loss_coef=0.0), preprocessor=None)
    if kind == "gpt2":
        return hub.GPT2CausalLM(hub.GPT2Backbone(
            **sizes, num_heads=4, dropout=0.0,
            max_sequence_length=HUB_SEQ), preprocessor=None)
    raise ValueError(f"hub_causal_lm: unknown kind {kind!r}")


def hub_corpus(n, seed=0):
    """({"token_ids", "padding_mask"}, next tokens) of random tokens, the
    last rows padded at their ends (padding_mask 0)."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(1, HUB_VOCAB, (n, HUB_SEQ + 1)).astype("int32")
    mask = np.ones((n, HUB_SEQ), "int32")
    for row in range(n // 2, n):
        mask[row, rng.randint(HUB_SEQ // 2, HUB_SEQ):] = 0
    return {"token_ids": ids[:, :-1], "padding_mask": mask}, ids[:, 1:]


def assert_parity(reference, ref_losses, model, losses):
    """Losses and weights of `model` within 1e-4 of one device's. The
    attention key bias is left out: its gradient is analytically zero
    (softmax is shift invariant), and Adam normalises float32 noise there
    (as in test_sequence_parallel)."""
    assert models.relative_error(ref_losses, losses) < 1e-4, (ref_losses,
                                                              losses)
    for a, b in zip(reference.weights, model.weights):
        if a.path.endswith("attn/key/bias"):
            continue
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path


def train_hub(kind, strategy, weights, x, y, optimizer="adam", policy=None,
              build=None):
    """(losses, float64 weights) of `hub_causal_lm(kind)` trained from
    `weights`, one epoch in order of 2 batches of 16, with
    `optimizer` ("adam": Adam(3e-3), "sgd": plain SGD(0.1)); in
    `strategy`'s scope unless None; under the dtype policy `policy`
    ("float64" also sets floatx: the rounding-free reference of
    `fuzzing.assert_parity`); `build(kind)` makes the model (default
    `hub_causal_lm`). Keras' global policy and floatx are restored."""
    build = build or hub_causal_lm
    previous = keras.config.dtype_policy(), keras.config.floatx()
    if policy:
        keras.config.set_dtype_policy(policy)
        if policy == "float64":
            keras.config.set_floatx(policy)
    try:
        if strategy is None:
            model = build(kind)
        else:
            with strategy.scope():
                model = build(kind)
        model.set_weights([w.astype(model.weights[i].dtype)
                           for i, w in enumerate(weights)])
        model.compile(
            optimizer=(keras.optimizers.Adam(3e-3) if optimizer == "adam"
                       else keras.optimizers.SGD(0.1)),
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
        losses = models.BatchLosses()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[losses])
        return np.array(losses.losses), [w.numpy().astype("float64")
                                         for w in model.weights]
    finally:
        keras.config.set_dtype_policy(previous[0])
        keras.config.set_floatx(previous[1])


def assert_within_bf16_precision(exact, one, mesh, slack=3.0):
    """The oracle of test_mixed_precision: `mesh` (losses, weights) of a
    mixed_bfloat16 run is within `slack` times one device's own
    mixed-vs-float32 difference (`one` vs `exact`) of one device's
    mixed_bfloat16 run `one`, for the losses and per weight (floored at
    1e-4 relative)."""
    assert np.all(np.isfinite(mesh[0])), mesh[0]
    assert models.relative_error(one[0], mesh[0]) <= slack * max(
        models.relative_error(exact[0], one[0]), 1e-4), (one[0], mesh[0])
    for i, (e, o, m) in enumerate(zip(exact[1], one[1], mesh[1])):
        precision = max(models.relative_error(e, o), 1e-4)
        assert models.relative_error(o, m) <= slack * precision, (
            i, models.relative_error(o, m), precision)


def weights_and_corpus(config, n, seq_len):
    """(initial weights of `causal_transformer(**config)` drawn after seed
    0, x, y of `corpus(n, seq_len)`): the context tests' starting point."""
    x, y = corpus(n, seq_len=seq_len)
    keras.utils.set_random_seed(0)
    return causal_transformer(**config).get_weights(), x, y


def train_transformer(mesh, weights, x, y, **config):
    """(model, per-batch losses): `causal_transformer(**config)` from
    `weights`, built in a strategy on `mesh` (None: one device), trained 2
    epochs with Adam(3e-3) at batch 16, in order."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(mesh)) if mesh else None
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = causal_transformer(**config)
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    losses = models.BatchLosses()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[losses])
    return model, losses.losses


def values_and_gradients(attend, q, k, v, function=False):
    """[O, dQ, dK, dV] (NumPy) of `attend(q, k, v)`, the loss the sum of O
    times a fixed upstream (sin of each element's index), eagerly or in a
    `tf.function`."""
    def run(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = attend(q, k, v)
            upstream = tf.sin(tf.reshape(
                tf.range(tf.size(out), dtype=tf.float32), out.shape))
            loss = tf.reduce_sum(out * upstream)
        return [out] + tape.gradient(loss, [q, k, v])

    results = (tf.function(run) if function else run)(q, k, v)
    return [r.numpy() for r in results]
