"""Full recomputation of whole transformer blocks
(`set_recompute(model, "full")`, `tfpar.recompute_spans`): a functional
model written one Keras layer per op keeps each block's input alone, as
Megatron-LM does, instead of every layer's input; it trains as one device
does, in plain steps and in pipeline parts, and the compiled step keeps
fewer bytes than recomputing layer by layer."""

import contextlib
import os
import sys

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfpar
from tfpar import _compat
from tfpar.pipeline import split
from tfpar.recompute import recomputes_blocks, set_recompute, spans_in
from tfpar.recompute_spans import block_spans

import models
from test_selective_recompute import (SEQ, VOCAB, compile_adam,
                                      fit_capturing)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import build_gpt as example_gpt  # noqa: E402

HEADS, DIM = 4, 32


def build_gpt(blocks=2, last_mlp=True, dropout=0.1):
    """A pre-norm GPT, one Keras layer per op, whose attention drops out
    (seeds replayed across a recomputed block)."""
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, DIM, name="tok_embed")(tokens)
    for i in range(blocks):
        a = keras.layers.LayerNormalization(name=f"b{i}_ln1")(h)
        a = keras.layers.MultiHeadAttention(
            HEADS, DIM // HEADS, dropout=dropout, seed=3 + i, name=f"b{i}_attn")(
            a, a, use_causal_mask=True)
        h = h + a
        if last_mlp or i < blocks - 1:
            m = keras.layers.LayerNormalization(name=f"b{i}_ln2")(h)
            m = keras.layers.Dense(4 * DIM, activation="gelu",
                                   name=f"b{i}_up")(m)
            h = h + keras.layers.Dense(DIM, name=f"b{i}_down")(m)
    logits = keras.layers.Dense(VOCAB, name="lm_head")(
        keras.layers.LayerNormalization(name="ln_f")(h))
    return keras.Model(tokens, logits, name="gpt")


def spans(model):
    """Per block: its nodes (layer names; a Keras op by its class, whose
    automatic name depends on what ran before), inputs and outputs."""
    nodes, _, _, outputs, _ = split.model_graph(model)

    def name(node):
        layer = isinstance(node.operation, keras.layers.Layer)
        return node.operation.name if layer else type(node.operation).__name__

    return [([name(n) for n in nodes[s.start:s.stop]],
             len(s.inputs), len(s.outputs))
            for s in block_spans(nodes, outputs)]


def test_each_block_is_one_span_keeping_its_input():
    """examples/gpt.py: three blocks of seven nodes (norm, attention, add,
    norm, two Dense, add), each reading one tensor and handing one on;
    the embeddings and the head are not in a block."""
    found = spans(example_gpt(layers=3))
    assert [names for names, _, _ in found] == [
        [f"b{i}_ln1", f"b{i}_attn", "Add", f"b{i}_ln2", f"b{i}_up",
         f"b{i}_down", "Add"] for i in range(3)]
    assert [(i, o) for _, i, o in found] == [(1, 1)] * 3
    # A last block unlike the others (no MLP) is left to per-layer
    # recomputation; one attention layer, or blocks that are one layer
    # (keras-hub's), give no span.
    assert [len(n) for n, _, _ in spans(build_gpt(3, last_mlp=False))] == [
        7, 7]
    assert spans(build_gpt(1)) == []
    hub = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=HEADS,
        hidden_dim=DIM, intermediate_dim=4 * DIM, max_sequence_length=SEQ)
    assert spans(hub) == []


def train(strategy, weights, mode, blocks=2, pipe=False, dropout=0.1,
          report=False):
    """(model, per-batch losses, the step's saved activation bytes, or its
    communication report if `report`): two epochs of Adam; `mode`
    "blocks" (set_recompute "full"), "layers" (every layer recomputed on
    its own) or None."""
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build_gpt(blocks, dropout=dropout)
        model.set_weights(weights)
        if strategy:
            strategy.apply_rules(model, tfpar.auto_rules(
                model, mesh=strategy.mesh))
        if mode == "blocks":
            set_recompute(model, "full")
            assert recomputes_blocks(model)
        elif mode == "layers":
            for layer in split.model_graph(model)[1]:
                if split.weights_of(layer, trainable=True):
                    _compat.set_remat_mode(layer, "full")
        wrapped = model
        if pipe:
            model = tfpar.PipelineModel(model, 2, schedule="1f1b")
        compile_adam(model)
    losses, programs = fit_capturing(model)
    if pipe or not strategy:
        return wrapped, losses, None
    step = programs.train_report()
    return wrapped, losses, step if report else step.saved_activation_bytes


def assert_parity(reference, want, model, got):
    assert models.relative_error(want, got) < 1e-4, (want, got)
    for a, b in zip(reference.weights, model.weights):
        if a.path.endswith("attn/key/bias"):
            continue  # analytically zero gradient: noise only
        error = models.relative_error(a.numpy(), b.numpy())
        assert error < 1e-4, (a.path, error)


def test_recomputed_blocks_match_one_device_and_keep_less_than_layers():
    """data=2 × model=4: blocks recomputed whole train as one device does
    (dropout's masks replayed), and the compiled step keeps less than with
    every layer recomputed on its own, which keeps less than nothing."""
    keras.utils.set_random_seed(0)
    weights = build_gpt().get_weights()
    reference, want, _ = train(None, weights, None)
    saved = {}
    for mode in ("blocks", "layers", None):
        strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))
        model, got, saved[mode] = train(strategy, weights, mode)
        if mode == "blocks":
            assert_parity(reference, want, model, got)
    assert saved["blocks"] < saved["layers"] < saved[None], saved
    # Per device, a block's input is 8 samples × 8 tokens × 32 floats:
    # two blocks keep 16 KB of the layers' ~50 KB more.
    assert saved["layers"] - saved["blocks"] > 2 * 8 * SEQ * DIM * 4, saved


@pytest.mark.slow
def test_recomputed_blocks_gather_fsdp_weights_again_in_parity():
    """data=4 × model=2 with fsdp: the recomputation of a block reads its
    weights again, so they are gathered again in the backward pass
    (`recompute`'s variable-read dependency) instead of being kept
    gathered from the forward pass; the same training as one device.
    (Slow: layers recomputed one by one under fsdp, and their gathers
    again, are the default case, `test_gpt_example`'s.)"""
    keras.utils.set_random_seed(0)
    weights = build_gpt().get_weights()
    reference, want, _ = train(None, weights, None)
    steps = {}
    for mode in ("blocks", None):
        strategy = tfpar.ParallelStrategy(
            tfpar.Mesh({"data": 4, "model": 2}), fsdp=True)
        model, got, steps[mode] = train(strategy, weights, mode, report=True)
        if mode == "blocks":
            assert_parity(reference, want, model, got)
    gathers = {m: r.count(purpose="all-gather", spans="data",
                          phase="backward") for m, r in steps.items()}
    # Each block's weights (norms, q, k, v, output, MLP: 16) once more.
    assert gathers["blocks"] - gathers[None] >= 2 * 8, gathers


@pytest.mark.slow
def test_pipeline_parts_recompute_their_blocks_whole_in_parity():
    """pipe=2 × data=2 × model=2, four blocks cut into two parts (balanced
    by parameters: after block 2's first norm): each part runs its blocks
    as recomputed calls, the second its piece of block 2 as one too (two
    inputs: the norm's output and the residual), as one device trains
    (without dropout: a pipeline draws each micro-batch's masks apart)."""
    keras.utils.set_random_seed(0)
    weights = build_gpt(4).get_weights()
    reference, want, _ = train(None, weights, None, blocks=4, dropout=0.0)
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"pipe": 2, "data": 2, "model": 2}))
    model, got, _ = train(strategy, weights, "blocks", blocks=4, pipe=True,
                          dropout=0.0)
    parts = split.split_model(model, 2)
    assert [[(s.stop - s.start, len(s.inputs))
             for s in spans_in(model, part.nodes, part.outputs)]
            for part in parts] == [[(7, 1), (7, 1)], [(6, 2), (7, 1)]]
    assert_parity(reference, want, model, got)


def test_a_recomputed_block_that_adds_a_loss_is_refused():
    """A layer adding a loss inside a block recomputed whole would get no
    gradient for it: refused, naming the layer."""
    tokens = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM)(tokens)
    for i in range(2):
        a = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS)(h, h)
        h = keras.layers.Dense(DIM, activity_regularizer="l2",
                               name=f"regularized_{i}")(h + a)
    model = keras.Model(tokens, h)
    set_recompute(model, "full")
    model.compile(optimizer="adam", loss="mse")
    x = np.zeros((4, SEQ), "int32")
    with pytest.raises(ValueError, match="regularized_0.*add a loss"):
        model.fit(x, np.zeros((4, SEQ, DIM)), epochs=1, verbose=0)


@pytest.mark.parametrize("mode", ["blocks", "layers"])
def test_recomputation_keeps_keras_masks(mode):
    """An Embedding(mask_zero=True)'s padding mask, which attention and
    pooling read from their inputs, reaches the recomputation and the
    layers after a recomputed block: the same gradients as without
    recomputation (before, both lost it: gradients off by up to 44)."""
    tokens = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM, mask_zero=True)(tokens)
    for _ in range(2):
        a = keras.layers.LayerNormalization()(h)
        h = h + keras.layers.MultiHeadAttention(HEADS, DIM // HEADS)(a, a)
        h = h + keras.layers.Dense(DIM)(keras.layers.LayerNormalization()(h))
    model = keras.Model(tokens, keras.layers.Dense(1)(
        keras.layers.GlobalAveragePooling1D()(h)))
    x = np.random.RandomState(0).randint(1, VOCAB, (4, SEQ)).astype("int32")
    x[:, SEQ // 2:] = 0  # padding

    def gradients():
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(model(x, training=True) ** 2)
        return [tf.convert_to_tensor(g)
                for g in tape.gradient(loss, model.trainable_weights)]

    want = tf.function(gradients)()
    if mode == "blocks":
        set_recompute(model, "full")
        assert len(block_spans(*split.model_graph(model)[::3])) == 2
    else:
        tfpar.recompute.install()
        for layer in model.layers:
            if layer.trainable_weights:
                _compat.set_remat_mode(layer, "full")
    got = tf.function(gradients)()
    for weight, a, b in zip(model.trainable_weights, want, got):
        if weight.path.endswith("key/bias"):
            continue  # analytically zero gradient: noise only
        error = models.relative_error(a.numpy(), b.numpy())
        assert error < 1e-5, (weight.path, error)
