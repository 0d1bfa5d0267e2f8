"""Vocabulary-parallel logits and cross-entropy: auto_rules(vocab_parallel=True).

Measured on TF 2.21: with the output head split over the vocabulary, Keras'
`SparseCategoricalCrossentropy(from_logits=True)` runs
`SparseSoftmaxCrossEntropyWithLogits`, and DTensor expands it on the local
(tokens, vocab/k) logits with three all-reduces of (tokens, 1) over the
model axis (max, sum of exp, target logit): Megatron-LM's vocab-parallel
cross-entropy, with no patch. These tests hold it to that: parity with one
device, each device holding its vocab shard of the head, and no collective
of the compiled step gathering the logits.
"""

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar
from tfpar import vocab_parallel

import hub_models
import models
import test_generate as generation
import test_keras_hub as hub_checks

MESH = {"data": 2, "model": 4}
# Tokens per device in one step of hub_checks.train: the batch split over
# "data", the whole sequence.
TOKENS = hub_checks.BATCH // 2 * hub_models.SEQ_LEN
LOSS_OP = r"compile_loss/.*SparseSoftmaxCrossEntropyWithLogits"
LOGITS_OPS = re.compile(
    r"^compile_loss/|token_embedding[^/]*/(Tensordot|MatMul|einsum)")
TABLE_READ = re.compile(r"token_embedding[^/]*/GatherV2/ReadVariableOp/")


def vocab_plan(model, mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers kept whole: not checked here
        return tfpar.auto_rules(model, mesh=mesh, vocab_parallel=True)


def loss_logits_shapes(report):
    """The per-device shapes of the (tokens, vocab) tensors the loss op
    keeps for the backward pass (softmax - one_hot(target): the gradient
    of the loss with respect to the logits)."""
    return {shape for name, (shape, _) in report.saved_activations.items()
            if re.search(LOSS_OP, name) and len(shape) == 2 and shape[1] > 1}


def check_vocab_split(name, optimizer):
    """Trains `name` on data=2 x model=4 with the vocab-parallel plan beside
    one device (hub_checks' parity checks: losses, weights, Adam's chain),
    checks every device holds only its vocab block of the head, and that
    the compiled step never gathers the logits. Returns the report."""
    reference, ref_losses, _ = hub_checks.train(name, optimizer)
    with tfpar.communication.capture() as programs:
        model, losses, _ = hub_checks.train(name, optimizer, MESH, vocab_plan)
    assert models.relative_error(ref_losses, losses) < 1e-4, (ref_losses,
                                                              losses)
    for a, b in zip(reference.weights, model.weights):
        assert a.path == b.path
        if optimizer == "adam" and a.trainable:
            continue  # hub_checks.check_adam below
        if hub_checks.ZERO_GRADIENT.fullmatch(a.path):
            assert np.abs(a.numpy() - b.numpy()).max() < 1e-4, a.path
            continue
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path
    if optimizer == "adam":
        hub_checks.check_adam(name, reference, model)
    tables = {w.path.rsplit("/", 1)[-1]: w for w in model.weights
              if "token_embedding/" in w.path}
    untied = "reverse_embeddings" in tables
    # The logits table split by vocabulary: (hidden, vocab) by columns when
    # untied (the lookup table then by hidden), else (vocab, hidden) by rows.
    logits_table = tables["reverse_embeddings" if untied else "embeddings"]
    vocab_dim = 1 if untied else 0
    spec = [None, None]
    spec[vocab_dim] = "model"
    models.assert_one_block_per_device(logits_table, tuple(spec))
    for block in dtensor.unpack(logits_table.value.read_value()):
        assert block.shape[vocab_dim] == hub_models.VOCAB // 4
    if untied:
        models.assert_one_block_per_device(tables["embeddings"],
                                           (None, "model"))
    report = programs.train_report()
    assert loss_logits_shapes(report) == {(TOKENS, hub_models.VOCAB // 4)}
    # Forward, the logits' collectives (named by DTensor after the head's
    # projection or the loss op) are the three (tokens, 1) all-reduces of
    # the max, the sum of exp and the target logit.
    logits = [c for c in report.select(phase="forward", spans="model")
              if LOGITS_OPS.search(c.name)]
    assert [(c.kind, c.shape) for c in logits] == [
        ("all-reduce", (TOKENS, 1))] * 3, report
    # Nothing of the head, the loss or the table is gathered, forward or
    # backward. (The gathers left are those of the default plan,
    # hidden-split lookups' and Llama's first residual adds.) A tied
    # table's lookup is Megatron-LM's vocab-parallel embedding
    # (vocab_parallel.lookup): where DTensor 2.21 alone gathered the
    # (vocab, hidden) table for it and summed its whole gradient over the
    # data axis, the step sums each device's (vocab/4, hidden) block.
    gathers = report.select(purpose="all-gather", spans="model")
    assert not [c for c in gathers if LOGITS_OPS.search(c.name)], report
    assert not [c for c in report.collectives
                if TABLE_READ.search(c.name)], report
    whole_table = (hub_models.VOCAB, logits_table.shape[1 - vocab_dim])
    data_sums = [c.shape for c in report.select(spans="data")]
    assert whole_table not in data_sums, report
    if not untied:
        assert (hub_models.VOCAB // 4, whole_table[1]) in data_sums, report
        lookups = [(c.kind, c.shape) for c in report.select(spans="model")
                   if "vocab_parallel_lookup/" in c.name]
        assert lookups == [("all-reduce", (TOKENS // hub_models.SEQ_LEN,
                                           hub_models.SEQ_LEN,
                                           whole_table[1]))], report
    return report


def test_gpt2_tied_head_trains_split_over_the_vocabulary():
    """GPT-2 (tied ReversibleEmbedding), plain SGD, data=2 x model=4."""
    check_vocab_split("gpt2", "sgd")


@pytest.mark.slow
@pytest.mark.parametrize("name,optimizer", [
    ("gpt2", "adam"), ("llama", "sgd"), ("llama", "adam"), ("gemma", "sgd")])
def test_vocab_split_matrix(name, optimizer):
    """Tied (GPT-2, Gemma) and untied (Llama) heads, SGD and Adam."""
    check_vocab_split(name, optimizer)


@pytest.mark.slow
def test_whole_logits_plan_computes_the_loss_on_whole_logits():
    """The default plan, for comparison (GPT-2, data=2 x model=4): the loss
    keeps (tokens, vocab) per device and the hidden-split tied head
    all-reduces the whole (tokens, vocab) logits; the vocab plan keeps a
    quarter and all-reduces 3 x (tokens, 1) (check_vocab_split)."""
    with tfpar.communication.capture() as programs:
        hub_checks.train("gpt2", "sgd", MESH, hub_checks.auto)
    report = programs.train_report()
    assert loss_logits_shapes(report) == {(TOKENS, hub_models.VOCAB)}
    # The tied head, split by hidden, all-reduces whole partial logits.
    logits = [c for c in report.select(phase="forward", spans="model")
              if LOGITS_OPS.search(c.name)]
    assert [(c.kind, c.shape) for c in logits] == [
        ("all-reduce", (TOKENS, hub_models.VOCAB))], report


def lm(vocab, name="head"):
    tokens = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(64, 16, name="embed")(tokens)
    h = keras.layers.Dense(16, activation="relu", name="mid")(h)
    return keras.Model(tokens, keras.layers.Dense(vocab, name=name)(h))


def test_heads_are_planned_split_over_the_vocabulary_only_when_asked():
    """A Dense head is VocabParallel with vocab_parallel=True and absent
    (whole) by default; so is a keras-hub ReversibleEmbedding head, whose
    specs split the vocabulary (tied: the table; untied: the reverse
    table, the lookup table by hidden)."""
    model = lm(32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = dict(tfpar.auto_rules(model, axis_size=4).items())
        split = dict(tfpar.auto_rules(model, axis_size=4,
                                      vocab_parallel=True).items())
    assert not [p for p in default if "head" in p]
    assert split[re.escape("head")] == tfpar.VocabParallel()
    assert split[re.escape("embed")] == tfpar.ColumnParallel()
    style = tfpar.VocabParallel()
    head = model.get_layer("head")
    assert style.spec_for(head, "kernel", (16, 32)) == (None, "model")
    assert style.spec_for(head, "bias", (32,)) == ("model",)
    for name, untied in (("gpt2", False), ("llama", True)):
        lm_model = hub_models.build(name)
        rules = dict(vocab_plan(lm_model, tfpar.Mesh(MESH)).items())
        assert rules[re.escape("token_embedding")] == style
        table = lm_model.backbone.token_embedding
        shape = (hub_models.VOCAB, 32)
        assert style.spec_for(table, "embeddings", shape) == (
            (None, "model") if untied else ("model", None))
        assert style.spec_for(table, "reverse_embeddings", shape[::-1]) == (
            None, "model")


def test_a_vocabulary_the_axis_does_not_divide_is_refused_naming_the_head():
    model = lm(30, name="logits_head")
    with pytest.raises(ValueError, match=r"'logits_head'.*vocabulary of 30"):
        tfpar.auto_rules(model, axis_size=4, vocab_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        tfpar.auto_rules(model, axis_size=2, vocab_parallel=True,
                         sequence_parallel=True)
    with pytest.raises(TypeError, match="vocab_parallel"):
        tfpar.auto_rules(model, axis_size=2, vocab_parallel="yes")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_with_the_head_split_over_the_vocabulary(name):
    """keras-hub generate (greedy, KV cache) and predict on data=2 x model=4
    with the Megatron rules plus a VocabParallel head (rules known before
    build): the tokens of one device, logits within 1e-4."""
    weights, want, want_logits = generation.one_device(name, "greedy", 8)
    rules = tfpar.LayoutRules({
        **generation.megatron_rules(name, 4),
        r".*token_embedding": tfpar.VocabParallel()})
    strategy, model = generation.under_strategy(name, "data_model", rules)
    model.set_weights(weights)
    model.compile(sampler="greedy")
    x = generation.prompts(8)
    got = model.generate(x, stop_token_ids=None)
    np.testing.assert_array_equal(got["token_ids"], want)
    np.testing.assert_allclose(model.predict(x, verbose=0), want_logits,
                               rtol=1e-4, atol=1e-6)
    table = model.backbone.token_embedding.weights[-1]  # the logits table
    blocks = {tuple(b.shape) for b in dtensor.unpack(table.value.read_value())}
    assert len(blocks) == 1 and hub_models.VOCAB // 4 in blocks.pop()


def test_argmax_by_reductions_is_tf_argmax():
    """The first largest value's index, NaN skipped, as tf.argmax on CPU:
    rows drawn from values with ties, +-0.0, +-inf and NaN."""
    rng = np.random.default_rng(0)
    values = [0.0, -0.0, 1.0, -1.0, 2.0, np.nan, np.inf, -np.inf]
    for width in (1, 2, 3, 7):
        x = rng.choice(values, size=(400, width)).astype("float32")
        np.testing.assert_array_equal(
            vocab_parallel.argmax_by_reductions(tf.constant(x)).numpy(),
            tf.argmax(x, axis=-1, output_type=tf.int32).numpy())


def test_accuracy_of_vocab_split_logits_matches_one_device_ungathered():
    """Keras' sparse categorical accuracy (its `ops.argmax`) of logits split
    over the vocabulary, on data=2 x model=4: the losses and accuracies of
    one device, and no collective over "model" gathers the logits (without
    tfpar's argmax DTensor gathered all (tokens, vocab) of them)."""
    keras.utils.set_random_seed(0)
    weights = lm(32).get_weights()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (32, 8)).astype("int32")
    y = rng.integers(0, 32, (32, 8)).astype("int32")

    def build(strategy=None):
        model = lm(32)
        model.set_weights(weights)
        if strategy is not None:
            strategy.apply_rules(model, tfpar.LayoutRules({
                "embed": tfpar.ColumnParallel(), "head": tfpar.VocabParallel()}))
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True),
                      metrics=[keras.metrics.SparseCategoricalAccuracy("acc")])
        return model

    reference = build()
    want = reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESH))
    with tfpar.communication.capture() as programs:
        with strategy.scope():
            model = build(strategy)
        got = model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for key in ("loss", "acc"):
        assert models.relative_error(want.history[key],
                                     got.history[key]) < 1e-6, key
    assert want.history["acc"][0] > 0  # the metric counted something
    report = programs.train_report()
    gathers = report.select(purpose="all-gather", spans="model")
    assert [c.shape for c in gathers] == [(8, 8, 16)], report  # the lookup
