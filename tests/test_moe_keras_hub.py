"""keras-hub mixture-of-experts models train under `tfpar.auto_rules` with
their expert banks split over an `expert` mesh axis, in parity with one
device.

Small Mixtral, Qwen3-MoE and GPT-OSS models (tests/hub_models.py) and
Qwen-MoE and Qwen3.5-MoE ones with a gated shared expert (here; 8
experts, top-2) are planned by `auto_rules` with no hand-written rule:
every expert bank `[experts, in, out]` (and GPT-OSS' `[experts, out]`
biases) is split along its experts dimension over "expert" (each device
holds E/n whole experts, checked block by block with `dtensor.unpack`),
the routers stay whole, the attention and shared experts are split over
"model" when the mesh has one. On such a mesh the blocks dispatch their
tokens (`tfpar.experts.moe`, dropless) automatically; `mask_experts`
keeps keras-hub's masked computation (every local expert on every token,
DTensor summing the experts dimension over "expert"). The per-step
losses (the load-balancing aux loss included, where the model has one)
and the final weights equal one device's (keras-hub's masked blocks)
within 1e-4 (Adam: the suite's link-by-link check,
`test_keras_hub.check_adam`).

Routing must not flip between the runs: a callback on the one-device run
reads every router's probabilities before each step (with that step's
weights and batch) and asserts that the k-th and (k+1)-th largest are
apart by more than `ROUTER_MARGIN`, far above the float32 noise of the
parallel run (~1e-7). Under mixed_bfloat16 the layouts' rounding moves
router probabilities by ~1e-2 (Mixtral), so Mixtral's bfloat16 data are
chosen with gaps above 2e-2 (`wide_margin_data`).

The default profile trains Mixtral (Adam), GPT-OSS and Qwen-MoE (SGD) on
data=2 x expert=4 with automatic dispatch and reads the exchanges of the
experts-on-data placement; the matrices (every model, data=2 x expert=2 x
model=2, the masked opt-out, mixed_bfloat16) are `slow`.
"""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import keras_hub
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar

import hub_models
import models
import test_keras_hub

MESHES = {"2x4": {"data": 2, "expert": 4},
          "2x2x2": {"data": 2, "expert": 2, "model": 2}}
BATCH, STEPS = test_keras_hub.BATCH, test_keras_hub.STEPS
TOP_K = 2
# The k-th and (k+1)-th router probabilities of every token differ by more
# than this: 100 x the float32 differences of two layouts of the same step.
ROUTER_MARGIN = 1e-5
# Layers whose outputs are router logits (Mixtral, Qwen3-MoE: softmax then
# top-k; GPT-OSS: top-k of the logits, the same experts).
ROUTER_NAMES = ("sparse_feedforward_gate_dense", "router_dense",
                "router_gate")
# The weights of the expert banks, per model.
# Data seeds whose router margins hold at every step of every optimizer
# (asserted in check_parity; seed 1 left a 1.9e-7 gap in Qwen3-MoE's
# second Adam step; measured minimum gaps: Mixtral seed 1 3.3e-4,
# Qwen3-MoE seed 5 1.6e-5, GPT-OSS seed 3 7.8e-5).
DATA_SEEDS = {"qwen3_moe": 5, "gpt_oss": 3, "qwen_moe": 1,
              "qwen3_5_moe": 1}
# Under mixed_bfloat16 (float32 router logits from bfloat16 hidden
# states): GPT-OSS' seed 3 trains to a 5.4e-6 gap at its second step;
# seed 7's minimum is 3.4e-4.
BFLOAT16_DATA_SEEDS = {"gpt_oss": 7}
BLOCK_COUNTER = re.compile(r"(?<=moe_block)_\d+")
# Under mixed_bfloat16 the routers' input hidden states carry bfloat16
# rounding, and it differs between layouts (a row-parallel attention output
# sums bfloat16 partial sums over "model"; one device rounds its matmul
# once): Mixtral on data=2 x expert=2 x model=2, two SGD steps, moved a
# router probability 8.6e-3 from one device's (one device's own bfloat16
# vs float32: 4.1e-3), enough to flip a token whose 2nd and 3rd
# probabilities were 1.3e-3 apart (expert 3 -> 7 at its second step).
# Mixtral's bfloat16 tests train on sequences whose every gap is above
# this. (Qwen3-MoE's and GPT-OSS' routers start nearly uniform: 99% of
# random sequences have a smallest gap under 1.8e-3 and 7.3e-3, none of
# 8192 clears 2e-2; their bfloat16 tests keep their data seeds and the
# float32 margin.)
BF16_ROUTER_MARGINS = {"mixtral": 2e-2}
# ... chosen among this many random sequences (`wide_margin_data`).
BF16_SEQUENCE_POOL = 8192
# A bfloat16 run on a mesh is within this factor of one device's own
# bfloat16-vs-float32 difference (per weight and for the losses) of one
# device's bfloat16 run, or within the suite's bfloat16 tolerance 2e-2.
BF16_SLACK = 3.0


def router_gaps(model, x):
    """The smallest gap between the k-th and (k+1)-th router probability
    (float32 logits, as `RouterMargin`) of each sequence of `x` over its
    tokens and MoE layers (the routers see [tokens, hidden]), `model` run
    once on one device."""
    recorded, sequences = [], len(x["token_ids"])
    layers = routers(model)
    for layer in layers:
        layer.call = _recording(layer, recorded)
    try:
        model(x, training=False)
    finally:
        for layer in layers:
            del layer.call
    gaps = []
    for logits in recorded:
        probs = np.sort(keras.ops.convert_to_numpy(keras.ops.softmax(
            keras.ops.cast(logits, "float32"))), -1)
        gap = probs[..., -TOP_K] - probs[..., -TOP_K - 1]
        gaps.append(gap.reshape(sequences, -1).min(axis=-1))
    return np.min(gaps, axis=0)


def wide_margin_data(name, optimizer, margin, pool=BF16_SEQUENCE_POOL):
    """STEPS batches (x, y) of BATCH sequences each, taken in order from
    `pool` random ones: before each step, those whose router gaps
    (`router_gaps`, one device dispatching, the current dtype policy)
    exceed `margin` with the weights `optimizer` has trained to on the
    batches before (gaps move by more than 2e-2 in one SGD step: chosen
    at the initial weights only, the second batch fell to 8.7e-4)."""
    x, y = hub_models.data(name, batch=pool, seed=DATA_SEEDS.get(name, 1))
    model = build_moe(name)
    tfpar.moe_keras_hub.dispatch_experts(model)
    model.compile(optimizer=test_keras_hub.OPTIMIZERS[optimizer](),
                  loss=hub_models.loss(name), weighted_metrics=[])
    chosen = np.zeros(pool, bool)
    order = []
    for _ in range(STEPS):
        wide = (router_gaps(model, x) > margin) & ~chosen
        keep = np.flatnonzero(wide)[:BATCH]
        assert len(keep) == BATCH, (name, optimizer, len(keep), margin)
        model.train_on_batch({k: v[keep] for k, v in x.items()}, y[keep])
        chosen[keep] = True
        order.extend(keep)
    return {k: v[order] for k, v in x.items()}, y[order]


def use_wide_margin_data(name, optimizer, margin, monkeypatch):
    """`hub_models.data` gives `train` `wide_margin_data` (chosen under
    mixed_bfloat16) for `name` in this test."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        x, y = wide_margin_data(name, optimizer, margin)
    finally:
        keras.config.set_dtype_policy(previous)
    data = hub_models.data
    monkeypatch.setattr(hub_models, "data", lambda n, batch=16, seed=1: (
        (x, y) if (n, batch) == (name, BATCH * STEPS) else data(n, batch,
                                                                  seed)))


def check_adam_bfloat16(name, exact, reference, model):
    """Adam under mixed_bfloat16, link by link (as `check_adam` in
    float32): each step's gradients on the mesh (`model`) within
    BF16_SLACK times one device's own bfloat16-vs-float32 gradient
    difference (`reference` vs `exact`), or 2e-2, of one device's; each
    run's weights are Keras' Adam of its own gradients (float64 replay,
    1e-5 relative). Returns each step's largest gradient error and bound."""
    grads = [test_keras_hub.step_gradients(run)
             for run in (exact, reference, model)]
    initial = dict(zip([w.path for w in reference.weights],
                       build_moe(name).get_weights()))
    worst = [(0.0, 0.0)] * STEPS
    for e, a, b in zip(exact.trainable_weights, reference.trainable_weights,
                       model.trainable_weights):
        assert same_weight(e.path, a.path) and same_weight(a.path, b.path)
        for t, (ge, ga, gb) in enumerate(zip(
                grads[0][e.path], grads[1][a.path], grads[2][b.path])):
            error = models.relative_error(ga[0], gb[0])
            bound = max(2e-2, BF16_SLACK * models.relative_error(ge[0],
                                                                 ga[0]))
            assert error <= bound, (a.path, t, error, bound)
            worst[t] = max(worst[t], (error, bound))
        for run, recorded in ((a, grads[1][a.path]), (b, grads[2][b.path])):
            replay, _ = test_keras_hub.adam_replay(initial[a.path], recorded)
            assert models.relative_error(replay, run.numpy()) < 1e-5, (
                run.path)
    return worst


def assert_within_bfloat16_precision(reference, ref_losses, model, losses,
                                     exact, exact_losses):
    """The mesh's mixed_bfloat16 run (`model`, `losses`) against one
    device's (`reference`, `ref_losses`), bounded by one device's own
    distance from its float32 run (`exact`, `exact_losses`):
    error <= max(2e-2, BF16_SLACK * error(float32, one device))."""
    def bound(exact_value, want):
        return max(2e-2, BF16_SLACK * models.relative_error(exact_value,
                                                            want))

    assert np.all(np.isfinite(losses)), losses
    assert models.relative_error(ref_losses, losses) <= bound(
        exact_losses, ref_losses), (ref_losses, losses, exact_losses)
    for e, a, b in zip(exact.weights, reference.weights, model.weights):
        assert same_weight(a.path, b.path), (a.path, b.path)
        error = models.relative_error(a.numpy(), b.numpy())
        assert error <= bound(e.numpy(), a.numpy()), (
            a.path, error, bound(e.numpy(), a.numpy()))
BANK_NAMES = {"mixtral": 3, "qwen3_moe": 2, "gpt_oss": 4, "qwen_moe": 2,
              "qwen3_5_moe": 2}


def _qwen_moe():
    """Qwen-MoE: a shared expert gated by a sigmoid, top-k not normalised."""
    backbone = keras_hub.models.QwenMoeBackbone(
        vocabulary_size=hub_models.VOCAB, num_layers=2, num_query_heads=8,
        num_key_value_heads=4, hidden_dim=32, intermediate_dim=64,
        moe_intermediate_dim=32, shared_expert_intermediate_dim=32,
        num_experts=8, top_k=TOP_K, norm_top_k_prob=False)
    return keras_hub.models.QwenMoeCausalLM(backbone, preprocessor=None)


def _qwen3_5_moe():
    """Qwen3.5-MoE with full attention only (its linear-attention layers
    have nothing to do with experts), a gated shared expert."""
    backbone = keras_hub.models.Qwen3_5MoeBackbone(
        vocabulary_size=hub_models.VOCAB, num_layers=2, num_query_heads=8,
        num_key_value_heads=4, head_dim=8, hidden_dim=32,
        moe_intermediate_dim=32, shared_expert_intermediate_size=32,
        num_experts=8, top_k=TOP_K, layer_types=["full_attention"] * 2)
    return keras_hub.models.Qwen3_5MoeCausalLM(backbone, preprocessor=None)


_HUB_BUILD = hub_models.build  # check_adam reads hub_models.build
SHARED_EXPERT_BUILDERS = {"qwen_moe": _qwen_moe, "qwen3_5_moe": _qwen3_5_moe}
ALL_MOE = hub_models.MOE_LMS + tuple(SHARED_EXPERT_BUILDERS)


def build_moe(name):
    """hub_models' MoE model `name` or a shared-expert one, built with
    seeded weights; GPT-OSS' router and expert biases (zeros at init) set
    to seeded random values so that their paths count."""
    if name not in SHARED_EXPERT_BUILDERS:
        model = _HUB_BUILD(name)
    else:
        keras.utils.set_random_seed(0)
        model = SHARED_EXPERT_BUILDERS[name]()
    rng = np.random.default_rng(7)
    for weight in model.weights:
        if name == "gpt_oss" and weight.path.endswith("bias") and (
                "/experts/" in weight.path or "/router/" in weight.path):
            weight.assign(0.2 * rng.standard_normal(weight.shape))
    return model


def routers(model):
    return [layer for layer in model._flatten_layers()  # noqa: SLF001
            if layer.name in ROUTER_NAMES]


class RouterMargin(keras.callbacks.Callback):
    """Before each training batch, runs the (one-device) model eagerly on
    that batch with the current weights, records every router's logits and
    keeps the smallest gap between the k-th and (k+1)-th probabilities."""

    def __init__(self, x):
        super().__init__()
        self.x, self.margins = x, []

    def on_train_batch_begin(self, batch, logs=None):
        recorded = []
        layers = routers(self.model)
        for layer in layers:
            layer.call = _recording(layer, recorded)
        try:
            self.model({k: v[batch * BATCH:(batch + 1) * BATCH]
                        for k, v in self.x.items()}, training=False)
        finally:
            for layer in layers:
                del layer.call
        assert len(recorded) == len(layers) > 0
        for logits in recorded:
            probs = np.sort(keras.ops.convert_to_numpy(
                keras.ops.softmax(keras.ops.cast(logits, "float32"))), -1)
            self.margins.append(float(np.min(
                probs[..., -TOP_K] - probs[..., -TOP_K - 1])))


def _recording(layer, recorded):
    """`layer.call`, recording its logits as the dispatched blocks route:
    in float32 (x W (+ b) from the layer's input, `tfpar.experts.moe`),
    also under mixed precision, where the layer's own are bfloat16."""
    call = layer.call

    def wrapped(inputs, *args, **kwargs):
        out = call(inputs, *args, **kwargs)
        logits = keras.ops.matmul(keras.ops.cast(inputs, "float32"),
                                  keras.ops.cast(layer.kernel, "float32"))
        if layer.use_bias:
            logits = logits + keras.ops.cast(layer.bias, "float32")
        if layer.compute_dtype == "float32":  # the float32 run: its own
            np.testing.assert_allclose(keras.ops.convert_to_numpy(logits),
                                       keras.ops.convert_to_numpy(out),
                                       rtol=1e-4, atol=1e-5)
        recorded.append(logits)
        return out
    return wrapped


def auto(model, mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers kept whole: named elsewhere
        return tfpar.auto_rules(model, mesh=mesh)


def train(name, optimizer, mesh_shape=None, policy=None, dispatch=None):
    """(model, per-step losses, strategy, router margins) after STEPS
    batches of fit (margins only for the one-device run). `dispatch`:
    keyword arguments of `tfpar.moe_keras_hub.dispatch_experts`, "masked"
    (`mask_experts`: the blocks' masked computation on every mesh) or None
    (the default: dropless dispatch on a mesh with an expert axis, the
    masked computation on one device)."""
    weights = build_moe(name).get_weights()
    x, y = hub_models.data(name, batch=BATCH * STEPS,
                           seed=DATA_SEEDS.get(name, 1))
    strategy = None if mesh_shape is None else tfpar.ParallelStrategy(
        tfpar.Mesh(mesh_shape))
    margin = RouterMargin(x)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy or "float32")
    try:
        def build():
            model = build_moe(name)
            model.set_weights(weights)
            if dispatch == "masked":
                assert tfpar.moe_keras_hub.mask_experts(model) == 2
            elif dispatch is not None:
                assert tfpar.moe_keras_hub.dispatch_experts(
                    model, **dispatch) == 2
            if strategy is not None:
                strategy.apply_rules(model, auto(model, strategy.mesh))
            model.compile(optimizer=test_keras_hub.OPTIMIZERS[optimizer](),
                          loss=hub_models.loss(name), weighted_metrics=[])
            return model

        with strategy.scope() if strategy else _nothing():
            model = build()
        losses = models.BatchLosses()
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[losses] + ([margin] if strategy is None else []))
    finally:
        keras.config.set_dtype_policy(previous)
    return model, losses.losses, strategy, margin.margins


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check_banks_split(name, model, strategy):
    """Every expert bank weight is split along its experts dimension over
    "expert": each device holds exactly its E/n experts (dtensor.unpack)."""
    size = strategy.mesh.axis_size("expert")
    banks = [w for w in model.weights
             if w.path.split("/")[-2] == "experts"]
    assert len(banks) == BANK_NAMES[name] * 2, [w.path for w in banks]
    for weight in banks:
        spec = ("expert",) + (None,) * (len(weight.shape) - 1)
        models.assert_one_block_per_device(weight, spec)
        blocks = dtensor.unpack(weight.value.read_value())
        assert {b.shape[0] for b in blocks} == {weight.shape[0] // size}
        assert all(tuple(b.shape[1:]) == tuple(weight.shape[1:])
                   for b in blocks), weight.path


def same_weight(path, other):
    """Paths of the same weight in two builds: keras-hub names its MoE
    blocks with a per-process counter (`mixtral_sparse_moe_block_6`)."""
    return BLOCK_COUNTER.sub("", path) == BLOCK_COUNTER.sub("", other)


def check_parity(name, optimizer, mesh_id, policy=None, dispatch=None,
                 reference_dispatch=None):
    """The model on `mesh_id` (its blocks dispatching with `dispatch`, or
    masked) against one device (dispatching with `reference_dispatch`, or
    masked)."""
    reference, ref_losses, _, margins = train(
        name, optimizer, policy=policy, dispatch=reference_dispatch)
    assert len(margins) == STEPS * 2  # two MoE layers, every step
    assert min(margins) > ROUTER_MARGIN, margins  # routing cannot flip
    model, losses, strategy, _ = train(name, optimizer, MESHES[mesh_id],
                                       policy=policy, dispatch=dispatch)
    tolerance = 1e-4 if policy is None else 2e-2
    assert models.relative_error(ref_losses, losses) < tolerance, (
        ref_losses, losses)
    for a, b in zip(reference.weights, model.weights):
        assert same_weight(a.path, b.path), (a.path, b.path)
        if optimizer == "adam" and a.trainable and policy is None:
            continue  # check_adam below
        if test_keras_hub.ZERO_GRADIENT.fullmatch(a.path):
            assert np.abs(a.numpy() - b.numpy()).max() < tolerance, a.path
            continue
        assert models.relative_error(a.numpy(), b.numpy()) < tolerance, (
            a.path)
    if optimizer == "adam" and policy is None:
        with pytest.MonkeyPatch.context() as patch:
            # check_adam rebuilds the initial weights: this file's build.
            patch.setattr(hub_models, "build", lambda n, seed=0: build_moe(n))
            if name in ("gpt_oss", "qwen_moe"):
                # GPT-OSS' attention sinks add a logit per head to the
                # softmax, and Qwen-MoE rotates its keys (RoPE) after
                # their bias, so a key bias shifts the probabilities: its
                # gradient is real (1.2e-4 and 2.1e-4 measured), not the
                # rounding noise test_keras_hub assumes.
                patch.setattr(test_keras_hub, "ZERO_GRADIENT",
                              re.compile(r"(?!)"))
            test_keras_hub.check_adam(name, reference, model)
    check_banks_split(name, model, strategy)
    return strategy


def test_mixtral_data2_expert4_adam():
    """The default case: Mixtral, data=2 x expert=4, Adam; its blocks
    dispatch (automatic on a mesh with an expert axis) against keras-hub's
    masked blocks on one device."""
    check_parity("mixtral", "adam", "2x4")


def test_gpt_oss_dispatch_data2_expert4():
    """GPT-OSS' blocks (biased router, clamped-GLU experts with biases, set
    non-zero) dispatch on data=2 x expert=4, SGD, against its masked
    blocks on one device."""
    check_parity("gpt_oss", "sgd", "2x4")


def test_qwen_moe_shared_expert_dispatch_data2_expert4():
    """Qwen-MoE (routed experts dispatched, the sigmoid-gated shared expert
    added; top-k weights not normalised) on data=2 x expert=4, SGD, against
    one device; its aux loss is in the compared losses."""
    check_parity("qwen_moe", "sgd", "2x4")


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh_id", [
    (name, mesh_id) for name in ALL_MOE for mesh_id in MESHES])
def test_dispatch_matrix(name, mesh_id):
    """Automatic dropless dispatch with Adam against the masked block on
    one device, and (Mixtral) capacity_factor=1.0 (tokens dropped) against
    one device's dispatch with the same capacity. (Qwen3-MoE's capped run
    trains to a router gap of 5e-6 at its second step with data seed 5,
    below ROUTER_MARGIN: not compared.)"""
    if (name, mesh_id) != ("mixtral", "2x4"):  # the default test's case
        check_parity(name, "adam", mesh_id)
    if name == "mixtral":
        capped = {"capacity_factor": 1.0}
        check_parity(name, "sgd", mesh_id, dispatch=capped,
                     reference_dispatch=capped)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_oss", "qwen_moe"])
def test_capacity_factor_parity_data2_expert4(name):
    """capacity_factor=1.25 (assignments past an expert's capacity
    dropped: GPT-OSS' token keeps its residual, Qwen-MoE's its shared
    expert too) on data=2 x expert=4, SGD, against one device dispatching
    with the same capacity (the same dispatch groups: one per sequence)."""
    capped = {"capacity_factor": 1.25}
    check_parity(name, "sgd", "2x4", dispatch=capped,
                 reference_dispatch=capped)
    model = build_moe(name)  # the capacity binds: the first batch drops
    tfpar.moe_keras_hub.dispatch_experts(model, **capped)
    x, _ = hub_models.data(name, batch=BATCH, seed=DATA_SEEDS.get(name, 1))
    model(x)
    assert sum(int(block.tfpar_dropped) for block in model._flatten_layers()  # noqa: SLF001
               if hasattr(block, "tfpar_dropped")) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh_id,optimizer", [
    (name, mesh_id, "sgd") for name in hub_models.MOE_LMS
    for mesh_id in MESHES] + [("mixtral", "2x4", "adam")])
def test_dispatch_mixed_bfloat16(name, mesh_id, optimizer, monkeypatch):
    """Under mixed_bfloat16, Mixtral's, Qwen3-MoE's and GPT-OSS'
    dispatching blocks (router, aux loss, dispatch and combine in float32)
    on data=2 x expert=4 and data=2 x expert=2 x model=2 (and Mixtral with
    Adam) against one device dispatching (keras-hub 0.32's own masked
    blocks fail to train under mixed_bfloat16: Mixtral's and Qwen3-MoE's
    aux loss multiplies bfloat16 probabilities by a float32 mask).

    Routing cannot flip: bfloat16 rounding of the routers' input differs
    between layouts and moves Mixtral's router probabilities by ~1e-2
    (measured 8.6e-3 on data=2 x expert=2 x model=2), so with the float32
    margin (1e-5) a Mixtral token flipped there (expert 3 -> 7, 2nd and
    3rd probabilities 1.3e-3 apart) and its token embedding ended 9.2e-2
    from one device's. Mixtral trains on sequences whose gaps exceed
    BF16_ROUTER_MARGINS at every step (`wide_margin_data`); Qwen3-MoE and
    GPT-OSS on their seeds with the float32 margin (BF16_ROUTER_MARGINS'
    comment). The oracle is one device's own bfloat16 noise (as
    test_context_parallel's bfloat16 test): every weight and the losses
    within BF16_SLACK times one device's mixed_bfloat16-vs-float32
    difference, or within 2e-2 (Mixtral's token embedding on one device
    is itself 2.2e-2 from float32 after two SGD steps; the mesh 2.3e-2
    from one device). Adam normalises each gradient by its own size and
    turns bfloat16 rounding of small gradients into steps of the
    learning rate: one device's bfloat16 Adam run ends up to 0.63
    (relative) from its float32 run, the mesh 0.56 from one device; so
    Adam is also checked link by link (`check_adam_bfloat16`: step 1's
    gradients 2.5e-2 from one device's, bound 5.3e-2). Limit: after
    Adam's first step the layouts' router probabilities differ by up to
    2.3e-2, above the margin (no flip measured: the same experts for
    every token on both runs), and the float32 run routes some tokens
    differently at step 2, which loosens the step-2 bounds."""
    margin = BF16_ROUTER_MARGINS.get(name)
    if margin is None:  # the float32 margin on the bfloat16 data seeds
        margin = ROUTER_MARGIN
        monkeypatch.setitem(DATA_SEEDS, name, BFLOAT16_DATA_SEEDS.get(
            name, DATA_SEEDS.get(name, 1)))
    else:
        use_wide_margin_data(name, optimizer, margin, monkeypatch)
    exact, exact_losses, _, _ = train(name, optimizer, dispatch={})
    reference, ref_losses, _, margins = train(
        name, optimizer, policy="mixed_bfloat16", dispatch={})
    assert len(margins) == STEPS * 2  # two MoE layers, every step
    assert min(margins) > margin, margins  # routing cannot flip
    model, losses, strategy, _ = train(name, optimizer, MESHES[mesh_id],
                                       policy="mixed_bfloat16", dispatch={})
    assert_within_bfloat16_precision(reference, ref_losses, model, losses,
                                     exact, exact_losses)
    if optimizer == "adam":
        check_adam_bfloat16(name, exact, reference, model)
    check_banks_split(name, model, strategy)


def test_dispatch_drops_past_capacity_and_refuses_bad_input():
    """A capacity of one slot per expert drops assignments (counted); a
    model with no dispatchable block and a bad factor are errors."""
    model = hub_models.build("mixtral")
    tfpar.moe_keras_hub.dispatch_experts(model, capacity_factor=0.1)
    x, _ = hub_models.data("mixtral", batch=2)
    whole = model(x)
    blocks = [b for b in model._flatten_layers()  # noqa: SLF001
              if hasattr(b, "tfpar_dropped")]
    assert len(blocks) == 2
    # 8 tokens x top-2 = 16 assignments, 8 experts x 1 slot per sequence.
    assert all(int(b.tfpar_dropped) >= 16 for b in blocks)
    assert whole.shape == (2, hub_models.SEQ_LEN, hub_models.VOCAB)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        tfpar.moe_keras_hub.dispatch_experts(model, capacity_factor=0)
    with pytest.raises(ValueError, match="no keras-hub MoE block"):
        tfpar.moe_keras_hub.dispatch_experts(hub_models.build("gpt2"))
    with pytest.raises(ValueError, match="mask_experts found no keras-hub"):
        tfpar.moe_keras_hub.mask_experts(hub_models.build("gpt2"))


@pytest.mark.slow
@pytest.mark.parametrize("name,mesh_id,optimizer", [
    (name, mesh_id, optimizer) for name in ALL_MOE
    for mesh_id in MESHES for optimizer in ("sgd", "adam")])
def test_masked_parity_matrix(name, mesh_id, optimizer):
    """The opt-out (`mask_experts`): the blocks' own masked computation,
    banks split over "expert", against one device."""
    check_parity(name, optimizer, mesh_id, dispatch="masked")


def test_auto_rules_plan_banks_routers_and_qwen3_attention():
    """The plan itself: banks over "expert", routers in no rule and named
    in no warning, Qwen3-MoE's attention (behind its query/key norms) over
    "model", and no tensor-parallel rule on a mesh without "model"."""
    model = hub_models.build("qwen3_moe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rules = dict(tfpar.auto_rules(model, mesh=tfpar.Mesh(
            MESHES["2x2x2"])).items())
    assert not any("sparse_feedforward_gate_dense" in str(w.message)
                   or "self_attention/query" in str(w.message)
                   for w in caught), [str(w.message) for w in caught]
    plain = {k.replace("\\", ""): v for k, v in rules.items()}
    for layer in (0, 1):
        prefix = f"transformer_layer_{layer}/"
        block = "qwen3_sparse_moe_block" + ("_1" if layer else "")
        for bank in ("gate", "output"):
            assert plain[f"{prefix}{block}/experts/expert_feedforward_"
                         f"{bank}_dense"] == ("expert", None, None)
        for proj in ("query", "key", "value"):
            assert repr(plain[f"{prefix}self_attention/{proj}"]) == (
                "ColumnParallel(axis='model')")
        assert repr(plain[f"{prefix}self_attention/attention_output"]) == (
            "RowParallel(axis='model')")
    assert not any("gate_dense" in k and "experts" not in k for k in plain)
    only_experts = auto(model, tfpar.Mesh(MESHES["2x4"]))
    assert {spec for _, spec in only_experts.items()} == {
        ("expert", None, None)}


def test_experts_the_axis_does_not_divide_are_an_error():
    model = hub_models.build("mixtral")
    with pytest.raises(ValueError, match="num_experts=8.*expert.*size 3"):
        tfpar.auto_rules(model, mesh=tfpar.Mesh(
            {"data": 2, "expert": 3}, devices=[f"CPU:{i}" for i in range(6)]))


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", [None, {}])
def test_mixtral_generate_data2_expert4(dispatch):
    """`generate()` (greedy, KV cache) on data=2 x expert=4 with automatic
    rules, the blocks masked or dispatching: the tokens one device
    generates, and `predict`'s logits within 1e-4."""
    rng = np.random.default_rng(3)
    lengths = np.array([5, 2, 3, 4, 2, 5, 3, 4])
    mask = np.arange(hub_models.SEQ_LEN)[None] < lengths[:, None]
    ids = rng.integers(1, hub_models.VOCAB, mask.shape).astype("int32")
    x = {"token_ids": np.where(mask, ids, 0), "padding_mask": mask}
    reference = hub_models.build("mixtral")
    reference.compile(sampler="greedy")
    want = reference.generate(x, stop_token_ids=None)["token_ids"]
    want_logits = reference.predict(x, verbose=0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESHES["2x4"]))
    with strategy.scope():
        model = hub_models.build("mixtral")
        model.set_weights(reference.get_weights())
        if dispatch is not None:
            tfpar.moe_keras_hub.dispatch_experts(model, **dispatch)
        strategy.apply_rules(model, auto(model, strategy.mesh))
        model.compile(sampler="greedy")
    got = model.generate(x, stop_token_ids=None)["token_ids"]
    np.testing.assert_array_equal(got, want)
    assert models.relative_error(
        want_logits, model.predict(x, verbose=0)) < 1e-4
    check_banks_split("mixtral", model, strategy)


def exchange_report(mesh_shape, **strategy_options):
    """The `CommunicationReport` of Mixtral's compiled SGD step (batch 8,
    dispatching automatically) on `mesh_shape`."""
    keras.utils.set_random_seed(0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(mesh_shape),
                                      **strategy_options)
    with strategy.scope():
        model = hub_models.build("mixtral")
        strategy.apply_rules(model, auto(model, strategy.mesh))
        model.compile(optimizer="sgd", loss=hub_models.loss("mixtral"))
    x, y = hub_models.data("mixtral", batch=8)
    return tfpar.communication_report(model, x, y)


def exchanges(report, axis, tokens):
    """(phase, purpose, multiplier, scope) of Mixtral's exchanges (hidden
    32, 8 experts, top 2, dropless) over `axis`, `tokens` per device."""
    found = report.expert_exchanges(axis, tokens=tokens, hidden=32,
                                    num_experts=8, top_k=TOP_K)
    # Dropless: a slot per expert per token, capacity factor 8 / 2.
    assert found.formula_bytes == tokens * 32 * TOP_K * 4.0 * 4
    assert "capacity factor 4 (dropless)" in found.formula, found.formula
    assert str(found).count("\n") == len(found.rows) + 1
    return [(r.collective.phase, r.collective.purpose, r.multiplier,
             _EXCHANGE_SCOPES.search(r.collective.name).group(1))
            for r in found.rows]


_EXCHANGE_SCOPES = re.compile(r"/(dispatch|expert_ffn|combine)/")


def test_exchanges_over_the_data_axis_carrying_experts_next_to_formula():
    """expert_axis="data" on data=8 (one sequence of 8 tokens a device):
    per block, forward, the slots out and back, each an all-gather of
    every device's slots (8 x the formula: DTensor 2.21's gather-based
    exchange); backward, the reverse of the second."""
    report = exchange_report({"data": 8}, expert_axis="data")
    per_block = [("forward", "all-gather", 8.0, "dispatch"),
                 ("forward", "all-gather", 8.0, "expert_ffn")]
    got = exchanges(report, "data", tokens=hub_models.SEQ_LEN)
    assert got == per_block * 2 + [("backward", "all-gather", 8.0,
                                    "combine")] * 2, got


@pytest.mark.slow
def test_exchanges_over_a_separate_expert_axis_next_to_formula():
    """data=2 x expert=4 (4 sequences a device): no slot moves; per block
    the combine's all-reduce of the outputs, tokens x hidden (1 / (top_k x
    capacity factor) = 1/8 of the formula), backward the input gradient's
    (the same) and the combine weights' gradient gathered (tokens x
    experts x capacity: 1/4)."""
    report = exchange_report({"data": 2, "expert": 4})
    got = exchanges(report, "expert", tokens=4 * hub_models.SEQ_LEN)
    assert sorted(got) == sorted(
        [("forward", "all-reduce", 1 / 8, "combine")] * 2
        + [("backward", "all-reduce", 1 / 8, "dispatch"),
           ("backward", "all-gather", 1 / 4, "combine")] * 2), got


@pytest.mark.slow  # a child process importing TF: ~10 s
def test_new_axes_in_front_of_an_expert_split_fail_and_expand_dims_does_not():
    """GPT-OSS' per-expert biases are split over "expert"; indexing them
    with new axes (`bias[None, :, None, :]`) fails to lay out in DTensor
    2.21 (tests/dtensor_newaxis_slice_repro.py, pure TF + DTensor, in a
    child process: in a compiled keras-hub step it crashed the process),
    so tfpar.moe_keras_hub broadcasts them with `expand_dims`, which gives
    the right values. If the repro prints "newaxis: right" on a newer TF,
    the indexing may come back."""
    repro = Path(__file__).with_name("dtensor_newaxis_slice_repro.py")
    result = subprocess.run([sys.executable, str(repro)], capture_output=True,
                            text=True, timeout=300)
    lines = result.stdout.strip().splitlines()
    assert lines[-2:-1] and lines[-2].startswith("newaxis: failed, ") and (
        lines[-1] == "expand_dims: right"), (
        result.stdout + result.stderr[-2000:])
