"""Selective recomputation (`tfpar.recompute.set_recompute(model,
"selective")`): each attention layer's core - QK^T, softmax, dropout,
attention over V - runs again in the backward pass instead of its s×s
tensors being kept (Korthikanti et al. 2022); the projections and every
other layer keep theirs. Trains as one device does, and the compiled step
keeps fewer bytes than without recomputation and more than with "full".
"""

import contextlib

import keras
import numpy as np
import pytest

import tfpar
from tfpar.planner import measure
from tfpar.recompute import set_recompute

import models

SEQ, HEADS, DIM, VOCAB = 8, 8, 32, 32
AXES = {"data": 2, "model": 4}
HOST = tfpar.Cluster(num_hosts=1, devices_per_host=8, device_memory=1e9,
                     device_flops=1e10, intra_host_bandwidth=1e9,
                     inter_host_bandwidth=1e9)


def build_gpt(dropout=0.1):
    """A one-block pre-norm GPT whose causal attention drops out (so the
    core holds scores, softmax, dropout mask and output: seeds replayed)."""
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, DIM, name="tok_embed")(tokens)
    a = keras.layers.LayerNormalization(name="ln1")(h)
    a = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS, dropout=dropout,
                                        seed=3, name="attn")(
        a, a, use_causal_mask=True)
    h = h + a
    m = keras.layers.LayerNormalization(name="ln2")(h)
    m = keras.layers.Dense(4 * DIM, activation="gelu", name="up")(m)
    h = h + keras.layers.Dense(DIM, name="down")(m)
    logits = keras.layers.Dense(VOCAB, name="lm_head")(
        keras.layers.LayerNormalization(name="ln_f")(h))
    return keras.Model(tokens, logits, name="gpt")


def corpus(n=32):
    start = np.random.RandomState(0).randint(0, VOCAB, size=(n, 1))
    x = (start + np.arange(SEQ + 1)[None, :]) % VOCAB
    return x[:, :-1].astype("int32"), x[:, 1:].astype("int32")


def train(strategy, mode, weights, plan=None):
    """(model, per-batch losses, captured programs) of two epochs of Adam
    with `mode` recomputation, auto_rules under `strategy` (or `plan`
    applied)."""
    if plan is not None:
        strategy = plan.strategy()
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build_gpt()
        model.set_weights(weights)
        if plan is not None:
            model = plan.apply(model)
        elif strategy:
            strategy.apply_rules(model, tfpar.auto_rules(
                model, mesh=strategy.mesh))
        if plan is None:
            set_recompute(model, mode)
        compile_adam(model)
    losses, programs = fit_capturing(model)
    return model, losses, programs


def compile_adam(model):
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))


def fit_capturing(model):
    """(per-batch losses, the captured step programs) of two epochs on
    `corpus()`."""
    losses = models.BatchLosses()
    x, y = corpus()
    with tfpar.communication.capture() as programs:
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[losses])
    return losses.losses, programs


def test_selective_recomputation_matches_one_device_and_keeps_less():
    keras.utils.set_random_seed(0)
    weights = build_gpt().get_weights()
    reference, want, _ = train(None, None, weights)
    saved = {}
    for mode in ("selective", None, "full"):
        strategy = tfpar.ParallelStrategy(tfpar.Mesh(AXES))
        model, got, programs = train(strategy, mode, weights)
        if mode == "selective":
            assert models.relative_error(want, got) < 1e-4
            for a, b in zip(reference.weights, model.weights):
                if a.path.endswith("attn/key/bias"):
                    continue  # analytically zero gradient: noise only
                error = models.relative_error(a.numpy(), b.numpy())
                assert error < 1e-4, (a.path, error)
        saved[mode] = programs.train_report()
    # The (batch, heads, s, s) tensors per device the backward pass reads:
    # the softmax and dropout outputs without recomputation, none with it.
    scores = (16 // AXES["data"], HEADS // AXES["model"], SEQ, SEQ)
    square = {m: [n for n, (shape, _) in r.saved_activations.items()
                  if tuple(shape) == scores] for m, r in saved.items()}
    assert len(square[None]) == 2, square[None]
    assert square["selective"] == [] and square["full"] == []
    nbytes = {m: r.saved_activation_bytes for m, r in saved.items()}
    assert nbytes["full"] < nbytes["selective"] < nbytes[None], nbytes


def test_a_selective_plan_applies_saves_and_trains_in_parity(tmp_path):
    plan = tfpar.plan(build_gpt, 16, cluster=HOST)
    assert {c.recompute for c in plan.candidates} == {None, "selective",
                                                      "full"}
    full_axes = {"data": 2, "pipe": 1, "model": 4}
    candidate = next(c for c in plan.candidates if c.axes == full_axes
                     and c.recompute == "selective" and not c.fsdp
                     and not c.sequence_parallel)
    assert candidate.label == ("data2×pipe1×model4 vocab-parallel selective "
                               "recompute")
    # The cost model: selective keeps less than none, more than full, and
    # runs the attention core's forward again (less than full's forward).
    same = {c.recompute: c.estimate for c in plan.candidates
            if c.axes == full_axes and not c.fsdp and not c.sequence_parallel}
    kept = {r: e.memory_per_device["activations"] for r, e in same.items()}
    assert kept["full"] < kept["selective"] < kept[None]
    seconds = {r: e.time_s["compute"] for r, e in same.items()}
    assert seconds[None] < seconds["selective"] < seconds["full"]
    applied = measure.candidate_plan(candidate, build_gpt, 16)
    applied.save(tmp_path / "plan.json")
    loaded = tfpar.Plan.load(tmp_path / "plan.json")
    assert loaded.recompute == "selective"
    keras.utils.set_random_seed(0)
    weights = build_gpt().get_weights()
    _, want, _ = train(None, None, weights)
    model, got, _ = train(None, None, weights, plan=loaded)
    assert models.relative_error(want, got) < 1e-4
    attention = model.get_layer("attn")
    assert "_compute_attention" in vars(attention)  # its core recomputed


def test_selective_needs_an_attention_core_it_knows():
    class MyAttention(keras.layers.Layer):
        def call(self, x):
            return keras.ops.softmax(x @ keras.ops.transpose(x, (0, 2, 1))) @ x

    x = keras.Input((4, 8))
    model = keras.Model(x, keras.layers.Dense(2)(MyAttention(name="mine")(x)))
    with pytest.raises(ValueError, match="'mine'.*MyAttention.*Supported"):
        set_recompute(model, "selective")
    dense = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="has none.*mode='full'"):
        set_recompute(dense, "selective")
    with pytest.raises(ValueError, match="Received: mode=True"):
        set_recompute(dense, True)
    set_recompute(model, "full")  # no attention core needed


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_keras_hub_attention_cores_recomputed_in_parity(name):
    """keras-hub's GPT-2 (CachedMultiHeadAttention) and Llama with grouped
    queries: their `_compute_attention` recomputed, auto_rules on
    data=2 × model=4, the losses of one device without recomputation."""
    import hub_models  # noqa: PLC0415 (keras-hub only for this test)

    x, y = hub_models.data(name, batch=32)
    losses = {}
    for axes in (None, AXES):
        strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes)) if axes else None
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = hub_models.build(name)
            if strategy:
                strategy.apply_rules(model, tfpar.auto_rules(
                    model, mesh=strategy.mesh))
                set_recompute(model, "selective")
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=hub_models.loss(name), weighted_metrics=[])
        batches = models.BatchLosses()
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[batches])
        losses[axes is None] = batches.losses
    assert models.relative_error(losses[True], losses[False]) < 1e-4
