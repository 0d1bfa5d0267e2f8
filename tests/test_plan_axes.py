"""tfpar.plan searches the expert axis (mixture-of-experts models, both
placements) and the context axis (long sequences): a memory limit that
only such a split meets makes the plan choose it, its `strategy()` trains
in parity with one device, and `explain()` names the axis and its costs.
"""

import dataclasses
import itertools
import re

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar import experts
from tfpar.planner import hardware
from tfpar.planner import measure
from tfpar.planner import roofline

import hub_models

# A described 8-device host (the numbers only steer the search).
HOST = tfpar.Cluster(num_hosts=1, devices_per_host=8, device_memory=1e9,
                     device_flops=1e10, intra_host_bandwidth=1e9,
                     inter_host_bandwidth=1e9)
VOCAB, HIDDEN = 64, 32
COUNTER = re.compile(r"_\d+(?=/|$)")


def language_model(seq, mixture, blocks=1, aux_loss=0.01):
    """Token ids -> embedding -> `blocks` × (causal attention -> (8
    experts, top 2 | a dense MLP)) -> logits, every layer named (CI's
    workers share Keras' name counter; the first block's names carry no
    suffix)."""
    ids = keras.Input((seq,), dtype="int32", name="ids")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(ids)
    for b in range(blocks):
        n = f"_{b}" if b else ""
        a = keras.layers.MultiHeadAttention(2, HIDDEN // 2, name=f"attn{n}")(
            x, x, use_causal_mask=True)
        x = keras.layers.Add(name=f"res1{n}")([x, a])
        if mixture:
            m = tfpar.layers.MixtureOfExperts(
                8, 2, 128, aux_loss_coef=aux_loss, name=f"moe{n}")(x)
        else:
            m = keras.layers.Dense(64, activation="relu", name=f"up{n}")(x)
            m = keras.layers.Dense(HIDDEN, name=f"down{n}")(m)
        x = keras.layers.Add(name=f"res2{n}")([x, m])
    return keras.Model(ids, keras.layers.Dense(VOCAB, name="head")(x),
                       name="lm")


def only_the_split_fits(plan, axis):
    """Every costed candidate without the split is rejected for memory:
    the reason the plan splits."""
    others = [c for c in plan.candidates if c.estimate is not None
              and not (c.expert_axis if axis == "expert"
                       else c.axes.get("context", 1) > 1)]
    assert others and all("does not fit" in (c.rejected or "")
                          for c in others)


def train_beside_one_device(plan, build, batch, seq, samples=4):
    """(planned model, one-device model, planned losses, one-device
    losses) of one epoch with SGD from the same weights and tokens."""
    keras.utils.set_random_seed(0)
    reference = build()
    weights = reference.get_weights()
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (samples, seq)).astype("int32")
    y = rng.integers(0, VOCAB, (samples, seq)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference.compile(optimizer="sgd", loss=loss)
    expected = reference.fit(x, y, batch_size=batch, shuffle=False,
                             verbose=0).history["loss"]
    with plan.strategy().scope():
        model = build()
        model.set_weights(weights)
        model = plan.apply(model)
        model.compile(optimizer="sgd", loss=loss)
    got = model.fit(x, y, batch_size=batch, shuffle=False,
                    verbose=0).history["loss"]
    return model, reference, got, expected, x


def assert_parity(model, reference, got, expected):
    """Losses and every weight within 1e-4 relative; weights in the same
    order (paths without Keras' name counters: keras-hub numbers its
    blocks per build)."""
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    assert len(model.weights) == len(reference.weights)
    for a, b in zip(model.weights, reference.weights):
        assert COUNTER.sub("", a.path) == COUNTER.sub("", b.path)
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4,
                                   atol=1e-6, err_msg=a.path)


def test_memory_limit_makes_the_plan_split_experts_and_it_trains(tmp_path):
    """Adam's state of the expert banks (8 × 3 × 32 × 128) on every device
    does not fit 500 kB; splitting the banks over the devices does."""
    def build():
        return language_model(16, mixture=True)

    plan = tfpar.plan(build, 16, cluster=HOST, memory_per_device=5e5)
    assert plan.expert_axis is not None, plan.explain()
    only_the_split_fits(plan, "expert")
    facts = plan.estimate.split_axes["expert"]
    assert facts["bank_bytes"] * facts["size"] == pytest.approx(
        facts["bank_bytes_whole"])
    assert facts["bank_bytes_whole"] == 8 * 3 * HIDDEN * 128 * 4
    assert facts["exchange_bytes"] > 0
    text = plan.explain()
    assert "Expert axis: 8 experts (top 2, dropless)" in text
    assert "token exchanges" in text
    model, reference, got, expected, x = train_beside_one_device(
        plan, build, 16, 16, samples=32)
    # The first step's routing cannot flip under float32 noise (~1e-7).
    moe_input = keras.Model(reference.input,
                            reference.get_layer("res1").output)(x)
    probs = np.asarray(experts.router_probabilities(
        np.asarray(moe_input) @ reference.get_layer("moe")
        .router_kernel.numpy()))
    ordered = -np.sort(-probs, axis=-1)
    assert (ordered[..., 1] - ordered[..., 2]).min() > 1e-6
    assert_parity(model, reference, got, expected)
    size = facts["size"]
    bank = model.get_layer("moe").up_kernel
    assert {tuple(b.shape) for b in dtensor.unpack(bank.value.read_value())
            } == {(8 // size, HIDDEN, 128)}
    measured = plan.strategy().memory_per_device()
    assert max(sum(v.values()) for v in measured.values()) <= 5e5
    plan.save(tmp_path / "plan.json")
    loaded = tfpar.Plan.load(tmp_path / "plan.json")
    assert (loaded.expert_axis, loaded.axes) == (plan.expert_axis, plan.axes)
    assert loaded.estimate.split_axes == plan.estimate.split_axes


def test_only_a_pipeline_with_split_experts_fits_and_it_trains():
    """Two mixture-of-experts blocks, Adam (the plan's default): at 600 kB
    per device neither an expert split alone (both blocks' banks on each
    device) nor a pipeline alone fits; a pipe of 2 with the banks split 4
    ways does, over the data axis (GShard's placement, the fastest) or a
    separate expert axis. The plan is a PipelineModel whose stages split
    their banks over data, trained with SGD in parity with one device (the
    aux loss off: under a pipeline it is each micro-batch's)."""
    def build():
        return language_model(16, mixture=True, blocks=2, aux_loss=0.0)

    plan = tfpar.plan(build, 16, cluster=HOST, memory_per_device=6e5)
    assert (plan.axes, plan.expert_axis) == (
        {"data": 4, "pipe": 2}, "data"), plan.explain()
    usable = [c for c in plan.candidates if c.rejected is None]
    assert all(c.axes["pipe"] == 2 and c.expert_axis for c in usable)
    assert {c.expert_axis for c in usable} == {"data", "expert"}
    assert any(c.axes["pipe"] > 1 and not c.expert_axis
               and c.estimate is not None for c in plan.candidates)
    assert "Expert axis: 8 experts (top 2, dropless) split 4 ways over " \
        "the data axis" in plan.explain()
    model, reference, got, expected, _ = train_beside_one_device(
        plan, build, 16, 16, samples=32)
    assert isinstance(model, tfpar.PipelineModel)
    assert [p.mesh.shape for p in model.parts] == [{"data": 4}] * 2
    bank = model.get_layer("moe").up_kernel
    assert {tuple(b.shape) for b in dtensor.unpack(bank.value.read_value())
            } == {(2, HIDDEN, 128)}
    assert_parity(model, reference, got, expected)


def test_memory_limit_makes_the_plan_split_the_sequence_and_it_trains():
    """Two sequences of 256 tokens on 8 devices: the data axis takes at
    most 2, the heads a model axis of at most 2; only splitting the
    sequence keeps the activations (the 256 × 256 scores) under 600 kB."""
    def build():
        return language_model(256, mixture=False)

    plan = tfpar.plan(build, 2, cluster=HOST, memory_per_device=6e5)
    assert plan.axes.get("context", 1) > 1, plan.explain()
    only_the_split_fits(plan, "context")
    facts = plan.estimate.split_axes["context"]
    assert facts["activation_bytes"] < facts["activation_bytes_whole"]
    assert "Context axis: the sequence of 256 split" in plan.explain()
    assert plan.strategy().extended.dims.context_axis == "context"
    assert_parity(*train_beside_one_device(plan, build, 2, 256)[:4])


def test_only_experts_and_context_together_fit_and_both_placements_train():
    """A mixture-of-experts model on two sequences of 256 tokens: at 1.2 MB
    per device neither splitting the sequence alone (Adam's state of the
    whole banks on every device) nor the banks alone (the 256 × 256
    scores) fits; every candidate that fits splits both. The plan (the
    banks over the data axis, the sequence over context) and the best
    candidate with a separate expert axis each train in parity with one
    device (SGD), each device holding its experts' share of the banks."""
    def build():
        return language_model(256, mixture=True)

    plan = tfpar.plan(build, 2, cluster=HOST, memory_per_device=1.2e6)
    usable = [c for c in plan.candidates if c.rejected is None]
    assert usable and all(c.expert_axis and c.axes.get("context", 1) > 1
                          for c in usable), plan.explain()
    assert any(c.estimate is not None and c.rejected
               and (c.expert_axis or c.axes.get("context", 1) > 1)
               and not (c.expert_axis and c.axes.get("context", 1) > 1)
               for c in plan.candidates)
    text = plan.explain()
    assert "Expert axis: 8 experts" in text
    assert "Context axis: the sequence of 256 split" in text
    separate = next(c for c in usable if c.expert_axis == "expert")
    for chosen in (plan, measure.candidate_plan(separate, build, 2)):
        facts = chosen.estimate.split_axes
        assert set(facts) == {"expert", "context"}
        model, reference, got, expected, _ = train_beside_one_device(
            chosen, build, 2, 256)
        assert_parity(model, reference, got, expected)
        assert chosen.strategy().extended.dims.context_axis == "context"
        # The experts dimension split (fsdp may split another over
        # data × context besides).
        bank = model.get_layer("moe").up_kernel
        assert {b.shape[0] for b in dtensor.unpack(
            bank.value.read_value())} == {8 // facts["expert"]["size"]}


def test_planned_experts_beside_a_model_axis_keep_their_split_and_train():
    """Found 2026-12-07: every planned candidate with a model axis and a
    separate expert axis (data 2 × model 2 × expert 2) of a model with
    `tfpar.layers.MixtureOfExperts` failed at `Plan.apply` ("no weight is
    split over" the expert axis): `auto_rules` plans the attention over
    "model" and leaves the banks to the layer, which lays them out itself
    (`keras.Variable(layout=)`), and `apply_rules` re-laid every weight no
    rule names whole. A weight's own Keras layout now wins there as when
    it was made. The suite's hole: no planned candidate with both axes
    was trained."""
    def build():
        return language_model(16, mixture=True)

    plan = tfpar.plan(build, 16, cluster=HOST, memory_per_device=1e9)
    chosen = next(c for c in plan.candidates if c.rejected is None
                  and c.axes == {"data": 2, "pipe": 1, "model": 2,
                                 "expert": 2} and not c.fsdp)
    planned = measure.candidate_plan(chosen, build, 16)
    model, reference, got, expected, _ = train_beside_one_device(
        planned, build, 16, 16, samples=32)
    assert_parity(model, reference, got, expected)
    bank = model.get_layer("moe").up_kernel
    assert dtensor.fetch_layout(bank.value).sharding_specs[0] == "expert"
    assert {tuple(b.shape) for b in dtensor.unpack(bank.value.read_value())
            } == {(4, HIDDEN, 128)}


def test_pipelined_sequence_splits_with_and_without_experts_train():
    """Found 2026-12-07, training every split candidate the planner
    offers: with a pipe axis, no candidate with a context axis compiled
    for this model (causal attention straight on its embedding):
    micro-batches and the activations sent between stages were split
    over data only, and a received activation that attention split over
    context and a residual add read too did not compile on DTensor 2.21
    (`RelayoutLike`). They are now split along the sequence over the
    context axis as the strategy places a step's inputs
    (`collectives.sequence_split`). A pipelined data 2 × context 2 plan
    of the dense model, and of the mixture of experts with its banks over
    data, train in parity with one device; fsdp beside a context axis in
    pipeline stages is not offered (`runner.check_context_with_fsdp`)."""
    def build(mixture):
        return lambda: language_model(256, mixture=mixture, blocks=2,
                                      aux_loss=0.0)

    for mixture, expert_axis in ((False, None), (True, "data")):
        plan = tfpar.plan(build(mixture), 4, cluster=HOST,
                          memory_per_device=1e9)
        pipelined = [c for c in plan.candidates
                     if c.axes.get("pipe", 1) > 1
                     and c.axes.get("context", 1) > 1]
        assert pipelined and not any(c.fsdp for c in pipelined)
        chosen = next(c for c in pipelined if c.rejected is None
                      and c.axes == {"data": 2, "pipe": 2, "model": 1,
                                     "context": 2}
                      and c.expert_axis == expert_axis and not c.recompute)
        planned = measure.candidate_plan(chosen, build(mixture), 4)
        assert_parity(*train_beside_one_device(
            planned, build(mixture), 4, 256, samples=8)[:4])


MOE = roofline.Transformer(layers=4, hidden=1024, heads=16, seq=2048,
                           vocab=32000, ffn=3584, gated=True, dropout=False,
                           tied=False, position_embedding=False, experts=8,
                           top_k=2)


def test_expert_exchange_bytes_and_time_by_the_issues_formula():
    """Issue 36 item 5's formula: tokens × hidden × top-k × capacity
    factor × dtype bytes per device and exchange (a true all-to-all's
    block), dispatched and combined, forward and backward: 4 per block.
    tfpar's exchange (collectives.all_to_all under DTensor 2.21) is a
    gather of the e devices' blocks, e times that message, and DTensor
    runs the gather as an all-reduce of zero-padded blocks (ring
    2(e-1)/e of the message) unless fsdp on a one-axis mesh makes it a
    real gather ((e-1)/e)."""
    hw = hardware.PRESETS["h100-sxm"]
    e, b, cf = 8, 2, 1.25
    folded = roofline.Parallel(data=e, expert=e, expert_on_data=True,
                               microbatch=b, capacity_factor=cf)
    tokens = b * MOE.seq
    formula = tokens * MOE.hidden * MOE.top_k * cf * MOE.compute_bytes
    sizes = roofline.expert_exchange_bytes(MOE, folded)
    assert sizes == {"forward": 2 * e * formula, "backward": 2 * e * formula}
    host = roofline.Network(devices_per_host=8)  # one host of 8
    forward, backward, _ = roofline._exchanges(MOE, folded, host, hw)
    alpha, beta = roofline.link(host, hw, e, 1)         # NVLink
    ring = 2 * (e - 1) * alpha + 2 * (e - 1) / e * e * formula / beta
    assert forward == backward == pytest.approx(2 * ring)
    real = dataclasses.replace(folded, fsdp=True)
    assert roofline.gather_kind(real) == "all-gather"
    forward, _, _ = roofline._exchanges(MOE, real, host, hw)
    assert forward == pytest.approx(
        2 * ((e - 1) * alpha + (e - 1) / e * e * formula / beta))
    # A separate axis: the outputs' all-reduce (T·h) forward; backward its
    # gradient's all-reduce and the combine weights' gradient gathered
    # (T·E·C float32).
    separate = dataclasses.replace(folded, data=2, expert=4,
                                   expert_on_data=False)
    cap = roofline.capacity(MOE, separate)
    outputs = tokens * MOE.hidden * MOE.compute_bytes
    assert roofline.expert_exchange_bytes(MOE, separate) == {
        "forward": outputs,
        "backward": outputs + tokens * MOE.experts * cap * 4}


@pytest.mark.slow
def test_a_planned_keras_hub_mixtral_splits_its_banks_and_trains():
    """keras-hub Mixtral (8 experts; tests/hub_models.py): the best
    candidate of each expert placement the plan costs, applied
    (auto_rules' bank rules through Plan.apply), splits the banks and
    trains 2 steps of SGD as one device does (data seed 1: the router
    margins test_moe_keras_hub asserts for it)."""
    whole = tfpar.plan(hub_models.MOE_BUILDERS["mixtral"], 16,
                       cluster=HOST, sequence_length=hub_models.SEQ_LEN)
    for placement, pipelined in itertools.product(("expert", "data"),
                                                  (False, True)):
        best = next(c for c in whole.candidates if c.expert_axis == placement
                    and c.rejected is None
                    and (c.axes["pipe"] > 1) == pipelined)
        check_mixtral_candidate(measure.candidate_plan(
            best, hub_models.MOE_BUILDERS["mixtral"], 16))


def check_mixtral_candidate(plan):
    """`plan` trains Mixtral in parity with one device, banks split (a
    pipelined plan: with Keras' gradient accumulation over its
    micro-batches, as Mixtral's aux loss is each micro-batch's)."""
    weights = hub_models.build("mixtral").get_weights()
    x, y = hub_models.data("mixtral", batch=32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    steps = plan.num_microbatches if "pipe" in plan.axes else 1

    def fit(model):
        model.set_weights(weights)
        return model

    reference = fit(hub_models.build("mixtral"))
    reference.compile(optimizer=keras.optimizers.SGD(
        gradient_accumulation_steps=steps if steps > 1 else None), loss=loss)
    expected = reference.fit(x, y, batch_size=16 // steps, shuffle=False,
                             verbose=0).history["loss"]
    with plan.strategy().scope():
        model = plan.apply(fit(hub_models.build("mixtral")))
        model.compile(optimizer="sgd", loss=loss)
    got = model.fit(x, y, batch_size=16, shuffle=False,
                    verbose=0).history["loss"]
    assert_parity(model, reference, got, expected)
    size = plan.estimate.split_axes["expert"]["size"]
    banks = [w for w in model.weights if "experts" in w.path]
    assert banks
    for bank in banks:
        assert {b.shape[0] for b in dtensor.unpack(bank.value.read_value())
                } == {8 // size}, bank.path


def test_no_context_axis_for_attention_tfpar_does_not_split():
    """keras-hub Qwen3-MoE's attention is not split over a context axis by
    tfpar (DTensor would gather it whole): every context candidate is
    rejected naming the layer. Mixtral's is split (patched as
    Mistral's): its context candidates are costed."""
    for name, offered in (("qwen3_moe", False), ("mixtral", True)):
        plan = tfpar.plan(lambda n=name: hub_models.build(n), 8,
                          cluster=HOST, memory_per_device=1e9,
                          sequence_length=hub_models.SEQ_LEN)
        context = [c for c in plan.candidates
                   if c.axes.get("context", 1) > 1]
        assert context, name
        if offered:
            assert any(c.rejected is None for c in context), name
        else:
            assert all(re.fullmatch(
                r"layer 'transformer_layer_\d/self_attention' "
                r"\(Qwen3MoeAttention\) computes attention tfpar does not "
                r"split over a context axis", c.rejected) for c in context)


def test_experts_beside_sequence_parallelism_are_planned_and_train():
    """The search pairs an expert axis (both placements) with sequence
    parallelism over the model axis (never with a context axis: one
    sequence split, `ParallelDims`): an MoE's data × model × expert plan
    with sequence-parallel rules trains in parity with one device, its
    banks split over the expert axis."""
    def build():
        return language_model(16, mixture=True, aux_loss=0.0)

    plan = tfpar.plan(build, 8, cluster=HOST, memory_per_device=1e9)
    offered = [c for c in plan.candidates if c.rejected is None
               and c.sequence_parallel and c.expert_axis]
    assert {c.expert_axis for c in offered} == {"expert", "data"}
    assert not any(c.axes.get("context", 1) > 1 for c in offered)
    chosen = next(c for c in offered if c.axes["pipe"] == 1
                  and c.axes["model"] == 2 and c.axes.get("expert") == 2
                  and not c.fsdp and c.recompute is None)
    planned = measure.candidate_plan(chosen, build, 8)
    model, reference, got, expected, _ = train_beside_one_device(
        planned, build, 8, 16, samples=16)
    assert_parity(model, reference, got, expected)
    banks = [w for w in model.weights if "moe" in w.path and len(w.shape) == 3]
    assert banks and all(
        "expert" in dtensor.fetch_layout(w.value).sharding_specs
        for w in banks)
