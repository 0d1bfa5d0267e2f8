"""The output head a plan emits is the head it costs: split over the
vocabulary (`auto_rules(vocab_parallel=True)`, `tfpar.VocabParallel`)
where the model axis divides the vocabulary, else whole — in the roofline
(`roofline.Parallel.head`), in `tfpar.plan`'s rules and candidates, and in
`tfpar.estimate` of a Keras model."""

import dataclasses
import os
import re
import sys

import keras
import keras_hub
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar.planner import cost
from tfpar.planner import hardware
from tfpar.planner import measure
from tfpar.planner import profile
from tfpar.planner import roofline
from tfpar.planner import search
from tfpar.planner import transformer

import models
import test_plan_axes as axes_tests
import test_plans_train as trained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import build_gpt  # noqa: E402

# One DGX-style host of 8 GPUs: the roofline costs the plan (no self-check,
# planned in a second).
A100 = tfpar.Cluster.preset("a100-80gb")
SEQ = 32


def gpt(vocab):
    """A builder of examples/gpt.py's GPT (a Dense head) of `vocab`."""
    return lambda: build_gpt(vocab=vocab, seq_len=SEQ, dim=64, heads=8,
                             layers=2)


def test_a_whole_head_costs_t_times_the_logits_of_a_split_one():
    """Per device, a replicated head runs all T·V·h of the logits' GEMMs
    (forward and two gradients: 6·T·V·h per micro-batch), a vocabulary-
    parallel one 1/t of them; a hidden-split one runs 1/t of the FLOPs
    but holds the whole logits and all-reduces them. Megatron's
    vocabulary-parallel head stays the default (the published rows)."""
    model = roofline.Transformer(layers=4, hidden=1024, heads=16, seq=1024,
                                 vocab=51200, tied=False,
                                 embedding_head=False)
    t, batch = 4, 64
    split = roofline.Parallel(data=2, model=t, microbatch=4)
    assert split.head == "vocab" and not split.table_gradient_gemm
    hw = hardware.PRESETS["a100-80gb"]
    heads = {h: dataclasses.replace(split, head=h) for h in roofline.HEADS}
    steps = {h: roofline.step_time(model, cfg, hw, batch)
             for h, cfg in heads.items()}
    m = roofline.microbatches(split, batch)
    logits = 6.0 * 4 * model.seq * model.vocab * model.hidden * m
    executed = {h: s["executed_flops"] for h, s in steps.items()}
    assert executed["replicated"] - executed["vocab"] == pytest.approx(
        logits * (1 - 1 / t))
    assert executed["hidden"] == pytest.approx(executed["vocab"])
    assert steps["replicated"]["total"] > steps["vocab"]["total"]
    assert steps["hidden"]["model"] > steps["vocab"]["model"]
    # A model without a vocabulary head ("none") runs no logits at all.
    assert executed["vocab"] - executed["none"] == pytest.approx(logits / t)
    memory = {h: roofline.memory(model, cfg, batch)["workspace"]
              for h, cfg in heads.items()}
    assert memory["none"] == 0
    fp32_logits = 8.0 * 4 * model.seq * model.vocab
    for head in ("replicated", "hidden"):
        assert memory[head] - memory["vocab"] == pytest.approx(
            fp32_logits * (1 - 1 / t))
    # The replicated head's V·h weights are whole on every device.
    params = {h: roofline.memory(model, cfg, batch)["params"]
              for h, cfg in heads.items()}
    assert params["replicated"] - params["vocab"] == pytest.approx(
        model.vocab * model.hidden * (1 - 1 / t) * model.param_bytes)


def test_plan_splits_the_head_only_where_the_model_axis_divides_the_vocabulary(
        tmp_path):
    """A vocabulary of 4098: model=2 divides it (VocabParallel rules,
    candidates marked vocab-parallel, a context axis beside it too, but
    not with sequence parallelism), model=4 does not (whole, and its
    estimate is tfpar.estimate's of a whole head)."""
    builder = gpt(4098)
    # 3 MB per device: the model must be split (7.8 MB on data alone).
    plan = tfpar.plan(builder, 16, cluster=A100, memory_per_device=3e6,
                      check=False)
    costed = [c for c in plan.candidates if c.estimate is not None]
    flags = {}
    for c in costed:
        key = (c.axes["model"], c.sequence_parallel, "context" in c.axes)
        flags.setdefault(key, set()).add(c.vocab_parallel)
    assert flags[2, False, False] == {True}
    assert flags[2, False, True] == {True}  # beside a context axis too
    # model=4, sequence parallelism, no model axis: whole.
    assert flags[4, False, False] == flags[2, True, False] == {False}
    assert flags[1, False, False] == {False}
    assert plan.axes.get("model") == 2 and plan.vocab_parallel
    rules = dict(plan.rules.items())
    assert rules[re.escape("lm_head")] == tfpar.VocabParallel()
    assert "Output head: vocabulary-parallel" in plan.explain()
    assert "vocab-parallel" in repr(plan)
    path = os.path.join(str(tmp_path), "plan.json")
    plan.save(path)
    loaded = tfpar.Plan.load(path)
    assert loaded.vocab_parallel and dict(loaded.rules.items()) == rules
    whole = next(c for c in costed if c.axes == {"data": 2, "pipe": 1,
                                                 "model": 4}
                 and not (c.fsdp or c.recompute or c.sequence_parallel))
    estimate = tfpar.estimate(builder, 16, cluster=A100,
                              axes={"data": 2, "model": 4})
    assert whole.estimate.step_time_s == pytest.approx(estimate.step_time_s)
    assert estimate.step_time_s == tfpar.estimate(
        builder, 16, cluster=A100, axes={"data": 2, "model": 4},
        vocab_parallel=False).step_time_s
    with pytest.raises(ValueError, match=r"vocab_parallel=True.*4098.*4"):
        tfpar.estimate(builder, 16, cluster=A100,
                       axes={"data": 2, "model": 4}, vocab_parallel=True)
    # On model=2 the estimate of the split head is lower than a whole one.
    axes = {"data": 4, "model": 2}
    split_head = tfpar.estimate(builder, 16, cluster=A100, axes=axes)
    whole_head = tfpar.estimate(builder, 16, cluster=A100, axes=axes,
                                vocab_parallel=False)
    assert split_head.executed_flops < whole_head.executed_flops
    assert (split_head.memory_per_device["workspace"]
            < whole_head.memory_per_device["workspace"])


def test_a_plan_keeps_a_head_whole_where_no_model_axis_divides_vocab():
    """A vocabulary of 4097 (odd): the chosen plan's model axis of 2 leaves
    the head whole — no rule for it, explain() says why — and its estimate
    is tfpar.estimate's of that configuration, which costs it whole."""
    builder = gpt(4097)
    plan = tfpar.plan(builder, 16, cluster=A100, memory_per_device=4e6,
                      check=False)
    assert plan.axes == {"data": 2, "pipe": 2, "model": 2}, plan
    assert not plan.vocab_parallel
    assert not [p for p in dict(plan.rules.items()) if "lm_head" in p]
    assert ("Output head: whole on every device of model=2 (its 4097 "
            "logits computed whole, and costed whole): model=2 does not "
            "divide the vocabulary") in plan.explain()
    given = dict(axes=plan.axes, num_microbatches=plan.num_microbatches,
                 sequence_parallel=plan.sequence_parallel, fsdp=plan.fsdp,
                 recompute=plan.recompute)
    assert plan.estimate.step_time_s == pytest.approx(tfpar.estimate(
        builder, 16, cluster=A100, **given).step_time_s)
    assert plan.estimate.step_time_s == pytest.approx(tfpar.estimate(
        builder, 16, cluster=A100, vocab_parallel=False, **given).step_time_s)


def test_tfpars_tied_table_gradient_is_costed_as_it_runs():
    """tfpar's vocabulary-split tied table (`vocab_parallel.lookup`) beside
    Megatron-LM's: its gradient a one-hot GEMM (2·T·V/t·h FLOPs more per
    micro-batch, its T × V/t one-hot held meanwhile) and its block summed
    over the data axis once more (V/t·h), apart from the projection's."""
    model = roofline.Transformer(layers=4, hidden=1024, heads=16, seq=1024,
                                 vocab=51200)
    assert model.tied
    t, batch, b = 4, 64, 4
    megatron = roofline.Parallel(data=2, model=t, microbatch=b)
    tfpars = dataclasses.replace(megatron, table_gradient_gemm=True)
    assert roofline.head_layout(model, t, True) == {
        "head": "vocab", "table_gradient_gemm": True}
    hw = hardware.PRESETS["a100-80gb"]
    steps = [roofline.step_time(model, cfg, hw, batch)
             for cfg in (megatron, tfpars)]
    m = batch // (2 * b)
    tokens = b * model.seq
    assert steps[1]["executed_flops"] - steps[0]["executed_flops"] == (
        pytest.approx(m * 2 * tokens * model.vocab / t * model.hidden))
    data = [roofline.communication_bytes(model, cfg, batch)["data"]
            for cfg in (megatron, tfpars)]
    assert data[1] - data[0] == pytest.approx(
        model.vocab / t * model.hidden * model.compute_bytes)
    memory = [roofline.memory(model, cfg, batch)["workspace"]
              for cfg in (megatron, tfpars)]
    assert memory[1] - memory[0] == pytest.approx(
        tokens * model.vocab / t * model.compute_bytes)
    assert steps[1]["data"] >= steps[0]["data"]


def test_a_keras_hub_head_is_read_as_the_embedding_s_projection():
    """GPT-2's tied table makes the logits (an MLP as wide as the
    vocabulary is not a head): without vocab_parallel it is split by
    hidden (partial logits all-reduced), with it gathered for lookups."""
    estimate = {vp: tfpar.estimate(trained.small_gpt2, 16, cluster=A100,
                                   axes={"data": 2, "model": 4},
                                   sequence_length=SEQ, vocab_parallel=vp)
                for vp in (True, False)}
    model = estimate[True].communication_bytes_by_axis["model"]
    whole = estimate[False].communication_bytes_by_axis["model"]
    # per micro-batch of 8 samples: the partial logits' all-reduce (T·V)
    # against the table's gather (V·h), each in float32
    tokens, vocab, hidden = 8 * SEQ, trained.VOCAB, 64
    activation = tokens * hidden * 4
    assert whole - model == pytest.approx(
        tokens * vocab * 4 - (vocab * hidden * 4 - activation))


def trains_like_one_device(plan, builder):
    """`plan.apply(builder())` under `plan.strategy()` after two steps of
    SGD (global batch 16, vocabulary 1024), checked against one device's
    from the same weights and data."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1024, (32, SEQ)).astype("int32")
    y = rng.integers(0, 1024, (32, SEQ))
    keras.utils.set_random_seed(0)
    weights = builder().get_weights()
    want = trained.fit(builder(), weights, x, y, 16,
                       keras.optimizers.SGD(0.5))
    with plan.strategy().scope():
        model = plan.apply(builder())
    got = trained.fit(model, weights, x, y, 16, keras.optimizers.SGD(0.5))
    trained.assert_same(want, got)
    return model


def test_a_vocab_parallel_plan_trains_like_one_device():
    """The plan's strategy builds the GPT, `Plan.apply` lays its head out
    over the vocabulary (with fsdp and recomputation, each block
    recomputed whole), and two steps of fit match one device's. The
    candidate is the planner's own and fits the budget, but is not its
    first choice: since blocks are recomputed whole (2026-12-06) a
    pipelined one fits too and is faster."""
    builder = gpt(1024)
    searched = tfpar.plan(builder, 16, cluster=A100, memory_per_device=2e6,
                          check=False)
    candidate = next(c for c in searched.candidates
                     if c.label == "data4×pipe1×model2 vocab-parallel fsdp "
                                   "recompute")
    assert candidate.estimate.total_memory <= 2e6
    plan = measure.candidate_plan(candidate, builder, 16)
    assert plan.vocab_parallel and plan.axes == {"data": 4, "model": 2}, (
        plan)
    model = trains_like_one_device(plan, builder)
    # Each device holds its 512 of the 1024 vocabulary columns of the head
    # (fsdp may split the hidden rows over data too).
    kernel = model.get_layer("lm_head").kernel
    blocks = dtensor.unpack(kernel.value.read_value())
    assert len(blocks) == 8
    assert {b.shape[1] for b in blocks} == {512}, [b.shape for b in blocks]


def fit_beside_a_context_axis(rules):
    """Fits axes_tests' language model (embed, attention, MLP, head) once
    on data=2 × model=2 × context=2 with `rules` ({layer path: style})."""
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 2, "context": 2}))
    rng = np.random.default_rng(0)
    x = rng.integers(0, axes_tests.VOCAB, (2, 256)).astype("int32")
    y = rng.integers(0, axes_tests.VOCAB, (2, 256)).astype("int32")
    with strategy.scope():
        model = axes_tests.language_model(256, mixture=False)
        strategy.apply_rules(model, tfpar.LayoutRules(rules))
        model.compile(optimizer="sgd", loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
    return model.fit(x, y, batch_size=2, verbose=0)


def test_beside_a_context_axis_a_split_head_and_embedding_train():
    """Why plans split the head beside a context axis too
    (`tfpar.planner.transformer.vocab_parallel`): a `VocabParallel` head
    and the model's hidden-split Keras `Embedding` compile and train on
    data=2 × model=2 × context=2, alone and together. The embedding did
    not compile there until its lookup kept the sequence split over the
    context axis (`context_parallel.split_along_sequence`; parity and
    blocks: tests/test_context_embedding.py), and the planner kept the
    head whole so as not to rank those model × context candidates ahead
    of the data × context plan that trained."""
    for rules in ({"head": tfpar.VocabParallel()},
                  {"embed": tfpar.ColumnParallel()},
                  {"embed": tfpar.ColumnParallel(),
                   "head": tfpar.VocabParallel()}):
        history = fit_beside_a_context_axis(rules)
        assert np.isfinite(history.history["loss"]).all(), rules


def test_a_head_layout_not_known_is_refused_naming_it():
    with pytest.raises(ValueError,
                       match=r"Parallel\(head\).*'vocab_parallel'"):
        roofline.Parallel(model=2, head="vocab_parallel")
    with pytest.raises(ValueError, match=r"vocab_parallel\) must be None, "
                       r"True or False.*Received: vocab_parallel=1"):
        tfpar.estimate(gpt(4098), 16, cluster=A100,
                       axes={"data": 4, "model": 2}, vocab_parallel=1)


def bert():
    """A keras-hub BERT backbone: vocabulary 1024, hidden 64, 2 layers."""
    return keras_hub.models.BertBackbone(
        vocabulary_size=1024, num_layers=2, num_heads=4, hidden_dim=64,
        intermediate_dim=128, max_sequence_length=SEQ)


def bert_classifier():
    return keras_hub.models.BertTextClassifier(bert(), num_classes=2,
                                               preprocessor=None)


def test_a_classifier_is_costed_without_logits_by_plan_and_estimate():
    """A BERT classifier has no vocabulary head (its token embedding is
    looked up once, its last kernel makes 2 outputs): tfpar.estimate
    costs no logits — the masked LM on the same backbone (a tied reverse
    projection inside keras-hub's MaskedLMHead, split over the
    vocabulary) costs 6·T·V·h/t FLOPs more and the table gradient's
    one-hot GEMM (2·T·V·h/t), the fp32 logits and the one-hot ids
    (T·V/t) — and tfpar.plan splits no head and costs a model-axis
    candidate as tfpar.estimate does."""
    def masked_lm():
        return keras_hub.models.BertMaskedLM(bert(), preprocessor=None)

    read = {name: transformer.transformer_of(profile.profile_model(
        profile.build_without_weights(build), SEQ))
        for name, build in (("cls", bert_classifier), ("mlm", masked_lm))}
    assert not read["cls"].lm_head and read["mlm"].lm_head
    assert read["mlm"].tied
    axes = {"data": 2, "model": 4}
    none, tied = (tfpar.estimate(build, 16, cluster=A100, axes=axes,
                                 sequence_length=SEQ)
                  for build in (bert_classifier, masked_lm))
    tokens, vocab, hidden, t = 8 * SEQ, 1024, 64, 4  # float32 (4 bytes)
    assert tied.executed_flops - none.executed_flops == pytest.approx(
        (6 + 2) * tokens * vocab * hidden / t)
    assert none.memory_per_device["workspace"] == 0
    assert tied.memory_per_device["workspace"] == pytest.approx(
        8 * tokens * vocab / t + 4 * tokens * vocab / t)
    with pytest.raises(ValueError, match="has no vocabulary head"):
        tfpar.estimate(bert_classifier, 16, cluster=A100, axes=axes,
                       sequence_length=SEQ, vocab_parallel=True)
    plan = tfpar.plan(bert_classifier, 16, cluster=A100,
                      sequence_length=SEQ, check=False)
    costed = [c for c in plan.candidates if c.estimate is not None]
    assert not any(c.vocab_parallel for c in costed)
    assert not any(isinstance(s, tfpar.VocabParallel)
                   for s in dict(plan.rules.items()).values())
    assert "Output head" not in plan.explain()
    split = next(c for c in costed if c.axes == {"data": 2, "pipe": 1,
                                                 "model": 4}
                 and not (c.fsdp or c.recompute or c.sequence_parallel))
    assert split.estimate.step_time_s == pytest.approx(none.step_time_s)


class HandTiedHead(keras.layers.Layer):
    """A tied output projection written by hand: logits = h · Eᵀ with the
    embedding layer's own table E (no keras-hub layer)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, hidden):
        return keras.ops.matmul(
            hidden, keras.ops.transpose(self.embedding.embeddings))


def one_block_lm(hand_written):
    """A one-block causal LM (vocabulary 1024, hidden 64) whose logits
    use its token table: through `HandTiedHead` over a plain Embedding,
    or keras-hub's ReversibleEmbedding called with reverse=True."""
    tokens = keras.Input((SEQ,), dtype="int32")
    table = (keras.layers.Embedding(1024, 64, name="tokens") if hand_written
             else keras_hub.layers.ReversibleEmbedding(1024, 64,
                                                       name="tokens"))
    h = table(tokens)
    a = keras.layers.MultiHeadAttention(4, 16, name="attention")(
        h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization(name="norm")(h + a)
    up = keras.layers.Dense(256, activation="gelu", name="up")(h)
    h = h + keras.layers.Dense(64, name="down")(up)
    logits = (HandTiedHead(table, name="head")(h) if hand_written
              else table(h, reverse=True))
    return keras.Model(tokens, logits)


def test_a_tied_projection_written_by_hand_is_read_as_the_head():
    """A layer of the user's holding the embedding layer and projecting
    onto its table is a tied head (the table's layer runs again:
    `transformer.vocab_head`). `tfpar.estimate` costs it as keras-hub's
    tied ReversibleEmbedding laid out as tfpar's plans lay each out: the
    same FLOPs, memory, bytes and time on data 8, and on data 2 × model 4
    as the hub head kept whole (auto_rules splits the hub head over the
    vocabulary, not the hand-written one: `head_rules`); asked to split
    it, an error saying why."""
    head = transformer.vocab_head(profile.profile_model(one_block_lm(True)))
    assert (head.vocab, head.tied, head.embedding) == (1024, True, True)

    def estimate(hand_written, axes, vocab_parallel=None):
        return tfpar.estimate(lambda: one_block_lm(hand_written), 16,
                              cluster=A100, axes=axes, sequence_length=SEQ,
                              vocab_parallel=vocab_parallel)

    split = {"data": 2, "model": 4}
    for hand, hub in ((estimate(True, {"data": 8}),
                       estimate(False, {"data": 8})),
                      (estimate(True, split),
                       estimate(False, split, vocab_parallel=False))):
        assert hand.executed_flops == hub.executed_flops
        assert hand.memory_per_device == hub.memory_per_device
        assert (hand.communication_bytes_by_axis
                == hub.communication_bytes_by_axis)
        assert hand.step_time_s == hub.step_time_s
    assert estimate(False, split).communication_bytes_by_axis["model"] < (
        estimate(True, split).communication_bytes_by_axis["model"])
    with pytest.raises(ValueError, match="does not split this model's head"):
        estimate(True, split, vocab_parallel=True)


def test_a_plan_keeps_a_hand_written_tied_head_whole_and_trains():
    """auto_rules splits keras-hub's and Dense heads only: the plan's
    model-axis candidate of the hand-written head splits the table by
    hidden (the head's partial logits all-reduced), is not labelled
    vocab-parallel, is costed as keras-hub's tied head laid out so, and
    trains as one device does. (Before, the embedding's table was taken
    for the head layer's own, which holds the embedding: auto_rules gave
    the head a rule that matched no weight, and applying the plan failed.)"""
    builder = lambda: one_block_lm(True)  # noqa: E731
    plan = tfpar.plan(builder, 16, cluster=A100, check=False,
                      sequence_length=SEQ)
    candidate = next(c for c in plan.candidates
                     if c.axes == {"data": 2, "pipe": 1, "model": 4}
                     and not (c.fsdp or c.recompute or c.sequence_parallel))
    assert not candidate.vocab_parallel
    applied = measure.candidate_plan(candidate, builder, 16)
    assert isinstance(dict(applied.rules.items())["tokens"],
                      tfpar.ColumnParallel), applied.rules
    layouts = {}
    for hand_written in (True, False):
        model = profile.build_without_weights(
            lambda: one_block_lm(hand_written))  # noqa: B023
        layout = search._layout(profile.profile_model(model, SEQ), model, 4)
        layouts[hand_written] = cost.estimate(
            layout.whole_head(), [0], d=2, p=1, m=1, schedule="1f1b",
            fsdp=False, recompute=None, batch=16, cluster=LOCAL, slots=2)
    assert layouts[True].breakdown == layouts[False].breakdown
    assert layouts[True].memory_per_device == layouts[False].memory_per_device
    model = trains_like_one_device(applied, builder)
    blocks = dtensor.unpack(model.get_layer("tokens").embeddings.value
                            .read_value())
    assert {tuple(b.shape) for b in blocks} == {(1024, 16)}


def bert_masked_lm():
    """keras-hub's BERT masked LM (vocabulary 1024, hidden 64, 2 layers),
    without dropout (one device's and the mesh's masks differ)."""
    return keras_hub.models.BertMaskedLM(keras_hub.models.BertBackbone(
        vocabulary_size=1024, num_layers=2, num_heads=4, hidden_dim=64,
        intermediate_dim=128, max_sequence_length=SEQ, dropout=0.0),
        preprocessor=None)


def test_a_masked_lms_head_is_split_over_the_vocabulary_and_trains():
    """keras-hub's MaskedLMHead projects onto the token embedding it holds
    and adds its own (vocab,) bias: the plan's model-axis candidate splits
    the table by vocabulary (`VocabParallel`) and the bias with it (a raw
    spec: the head's dense transform and norm stay whole), and trains as
    one device does (SGD; Adam amplifies the float32 rounding of the
    head's norm to 1.2e-4 here); each device holds 256 of the 1024 rows
    and bias entries."""
    plan = tfpar.plan(bert_masked_lm, 16, cluster=A100, check=False,
                      sequence_length=SEQ)
    candidate = next(c for c in plan.candidates
                     if c.axes == {"data": 2, "pipe": 1, "model": 4}
                     and not (c.fsdp or c.recompute or c.sequence_parallel))
    assert candidate.vocab_parallel
    applied = measure.candidate_plan(candidate, bert_masked_lm, 16)
    rules = dict(applied.rules.items())
    assert isinstance(rules["token_embedding"], tfpar.VocabParallel)
    assert rules["mlm_head/output_bias"] == ("model",)
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 1024, (32, SEQ)).astype("int32"),
         "segment_ids": np.zeros((32, SEQ), "int32"),
         "padding_mask": np.ones((32, SEQ), bool),
         "mask_positions": rng.integers(0, SEQ, (32, 4)).astype("int32")}
    y = rng.integers(0, 1024, (32, 4))
    keras.utils.set_random_seed(0)
    weights = bert_masked_lm().get_weights()

    def fit(model):
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        losses = models.BatchLosses()
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0,
                  callbacks=[losses])
        return losses.losses, {w.path: np.asarray(w) for w in model.weights}

    want = fit(bert_masked_lm())
    with applied.strategy().scope():
        model = applied.apply(bert_masked_lm())
    trained.assert_same(want, fit(model))
    for weight, shape in ((model.backbone.token_embedding.embeddings,
                           (256, 64)),
                          (model.get_layer("mlm_head").weights[0], (256,))):
        blocks = dtensor.unpack(weight.value.read_value())
        assert {tuple(b.shape) for b in blocks} == {shape}, weight.path


# A described 8-device host: the α-β cost path (no roofline).
LOCAL = tfpar.Cluster(num_hosts=1, devices_per_host=8, device_memory=1e9,
                      device_flops=1e10, intra_host_bandwidth=1e9,
                      inter_host_bandwidth=1e9)


def local_estimates(t, whole_head=False):
    """{"lm", "backbone"}: the α-β `Estimate` of keras-hub's GPT-2 task
    (its tied table makes the logits) and of its backbone alone (no
    head) on data 8/t × model t, one micro-batch, as the planner lays
    them out (the head split over the vocabulary where it can be, or
    whole)."""
    found = {}
    for name, build in (("lm", trained.small_gpt2),
                        ("backbone", lambda: trained.small_gpt2().backbone)):
        model = profile.build_without_weights(build)
        layout = search._layout(profile.profile_model(model, SEQ), model, t)
        layout = layout.whole_head() if whole_head else layout
        found[name] = cost.estimate(
            layout, [0], d=8 // t, p=1, m=1, schedule="1f1b", fsdp=False,
            recompute=None, batch=16, cluster=LOCAL, slots=2)
        found[name + "_layout"] = layout
    return found


def test_the_local_cost_counts_a_tied_reverse_projection_s_flops():
    """The profile holds no FLOPs for a tied table's second call (the
    logits' T × V × h GEMM): the local cost adds them, 3 passes of
    2·s·V·h per sample on 2 samples per device (data 8)."""
    found = local_estimates(1)
    extra = found["lm"].breakdown["compute"] - found[
        "backbone"].breakdown["compute"]
    assert extra == pytest.approx(3 * 2 * 2 * SEQ * trained.VOCAB * 64
                                  / LOCAL.device_flops)


def test_the_local_cost_all_reduces_a_hidden_split_head_s_logits():
    """An embedding head split over the hidden dimension makes partial
    logits, all-reduced over the model axis: T·V float32 values per
    sample, 4 samples per device (data 4 × model 2)."""
    found = local_estimates(2, whole_head=True)
    assert not found["lm_layout"].vocab_parallel
    model = {name: found[name].communication_bytes_by_axis["model"]
             for name in ("lm", "backbone")}
    assert model["lm"] - model["backbone"] == pytest.approx(
        4 * SEQ * trained.VOCAB * 4)


def test_the_local_cost_sums_a_vocabulary_parallel_tied_tables_lookup():
    """A tied table split over the vocabulary is looked up as Megatron-LM
    does (`vocab_parallel.lookup`): an all-reduce of the lookup's T·h
    output over the model axis (the backbone's hidden-split lookup
    gathers T·h instead), with no gather of the V·h table; the logits
    made from the table's vocabulary split add their input gradient's
    all-reduce (T·h; keras-hub Gemma's compiled step:
    tests/test_planner.py); the table's gradient a one-hot GEMM
    (2·T·V/t·h FLOPs per device, backward only)."""
    found = local_estimates(2)
    assert found["lm_layout"].vocab_parallel
    model = {name: found[name].communication_bytes_by_axis["model"]
             for name in ("lm", "backbone")}
    lookup = input_gradient = 4 * SEQ * 64 * 4  # 4 samples per device
    assert model["lm"] - model["backbone"] == pytest.approx(
        lookup - lookup + input_gradient)
    extra = found["lm"].breakdown["compute"] - found[
        "backbone"].breakdown["compute"]
    assert extra == pytest.approx((3 * 2 + 2) * 4 * SEQ * trained.VOCAB * 64
                                  / 2 / LOCAL.device_flops)
    assert found["lm"].memory_per_device["workspace"] == 0
    assert found["backbone"].memory_per_device["workspace"] == 0
