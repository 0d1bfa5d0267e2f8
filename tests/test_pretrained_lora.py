"""LoRA fine-tuning of a loaded keras-hub model on data=2 x model=4 (issue 37).

A small causal LM's backbone is saved (a keras-hub preset, or a Hugging Face
checkpoint with `tfpar.pretrained.export_to_transformers`), loaded under a
`tfpar.ParallelStrategy` whose rules come from a builder
(`tfpar.auto_rules(lambda: ...from_preset(path, load_weights=False))`),
then `backbone.enable_lora(rank)` runs in the strategy's scope AFTER the
load, on every attention and MLP projection (column- and row-parallel
Dense and EinsumDense layers). Two steps of fit equal one device's doing
the same: per-step losses, LoRA weights (Adam: the suite's link-by-link
check, `test_keras_hub.check_adam`; SGD: 1e-4 relative) and the frozen
weights, unchanged.

Layout: each LoRA factor follows its kernel W (`tfpar.layout.
lora_factor_spec`): A = W's spec on its leading dimensions, B = W's spec
on the output dimension, the rank whole — A replicated and B split on the
output for a column-parallel Dense, A split on the input and B replicated
for a row-parallel one (Megatron/NeMo's convention), so Keras' merged
kernel W + A @ B is formed in W's layout with no communication. Each
device holds only its block of every factor (`dtensor.unpack`), and the
frozen kernels get no optimizer slot.

Default profile: Llama3 from a preset with Adam; Gemma from a Hugging Face
checkpoint, and SGD, are slow.
"""

import argparse
import collections
import importlib
import sys
from pathlib import Path

import keras
import keras_hub
import numpy as np
import pytest

import tfpar

import hub_models
import models
import test_keras_hub as hub
from fuzzing import RTOL, relative_error

RANK = 4
# Standard deviations of the LoRA factors' seeded values: about Keras' he
# uniform for A; B small but not Keras' zeros (which give A no gradient at
# step 1). Much larger factors (1.0) swamp the kernels and saturate Gemma's
# attention, where float32 itself is 1e-3 off float64 (one device too).
SCALE = {"lora_kernel_a": 0.3, "lora_kernel_b": 0.1}
MESH = {"data": 2, "model": 4}
# (backbone, causal LM, backbone arguments, LoRA targets, how it is saved):
# every attention projection (column-parallel query/key/value, row-parallel
# output) and every MLP projection (column-parallel gates, row-parallel out).
FAMILIES = {
    "llama3": (
        keras_hub.models.Llama3Backbone, keras_hub.models.Llama3CausalLM,
        dict(vocabulary_size=hub_models.VOCAB, num_layers=1,
             num_query_heads=8, num_key_value_heads=8, hidden_dim=64,
             intermediate_dim=128),
        ["query", "key", "value", "attention_output",
         "feedforward_gate_dense", "feedforward_intermediate_dense",
         "feedforward_output_dense"],
        "preset"),
    "gemma": (
        keras_hub.models.GemmaBackbone, keras_hub.models.GemmaCausalLM,
        dict(vocabulary_size=hub_models.VOCAB, num_layers=2,
             num_query_heads=8, num_key_value_heads=8, hidden_dim=64,
             intermediate_dim=128, head_dim=8),
        ["query", "key", "value", "attention_output", "ffw_gating",
         "ffw_gating_2", "ffw_linear"],
        "transformers"),
}


def save_pretrained(family, path):
    """Saves a seeded one-device backbone of `family` at `path` (a preset
    or a Hugging Face checkpoint); returns the loader's builder, which
    builds the backbone without weights."""
    backbone_cls, _, arguments, _, route = FAMILIES[family]
    keras.utils.set_random_seed(0)
    backbone = backbone_cls(**arguments)
    if route == "preset":
        backbone.save_to_preset(path)
        return lambda: backbone_cls.from_preset(path, load_weights=False)
    tfpar.pretrained.export_to_transformers(backbone, path)
    return lambda: tfpar.pretrained.transformers_backbone(path)


def is_lora(path):
    return path.rsplit("/", 1)[-1] in tfpar.layout.LORA_FACTORS


def lora_values(family, build, path):
    """{LoRA weight path: seeded values}: B is not left at Keras' zeros,
    or step 1 would give A no gradient."""
    backbone = build()
    tfpar.pretrained.load_weights(backbone, path)
    backbone.enable_lora(RANK, target_layer_names=FAMILIES[family][3])
    rng = np.random.default_rng(2)
    return {w.path: (SCALE[w.path.rsplit("/", 1)[-1]]
                     * rng.normal(size=w.shape)).astype("float32")
            for w in backbone.weights if is_lora(w.path)}


def fine_tune(family, optimizer, build, path, lora, strategy=None):
    """(causal LM, per-step losses, frozen weights as loaded): load, then
    enable LoRA (in `strategy`'s scope when given), 2 steps of fit."""
    _, lm_cls, _, targets, _ = FAMILIES[family]
    x, y = hub_models.data("llama", batch=2 * hub.BATCH)

    def load_and_enable():
        backbone = build()
        tfpar.pretrained.load_weights(backbone, path)
        frozen = {w.path: np.asarray(w) for w in backbone.weights}
        backbone.enable_lora(RANK, target_layer_names=targets)
        for weight in backbone.weights:
            if is_lora(weight.path):
                weight.assign(lora[weight.path])
        model = lm_cls(backbone, preprocessor=None)
        model.compile(optimizer=hub.OPTIMIZERS[optimizer](),
                      loss=hub_models.loss("llama"), weighted_metrics=[])
        load_and_enable.frozen = frozen
        return model

    model, losses = models.train_built(strategy, load_and_enable, x, y,
                                       hub.BATCH)
    return model, losses, load_and_enable.frozen


def check_lora_layout(model, strategy):
    """Each LoRA factor laid out from its kernel (`lora_factor_spec`), the
    Dense cases spelled out, each device holding only its block."""
    specs = {path: spec for path, spec, _ in strategy.placements()}
    weights = {w.path: w for w in model.weights}
    factors = [p for p in specs if is_lora(p)]
    blocks = model.backbone.num_layers
    assert len(factors) == 2 * 7 * blocks, factors  # A, B x 7 layers
    for path in factors:
        layer, _, name = path.rpartition("/")
        kernel = specs[f"{layer}/kernel"]
        assert any(kernel), (path, kernel)  # every target layer is split
        assert specs[path] == tfpar.layout.lora_factor_spec(name, kernel)
        if len(kernel) == 2:  # Dense (in, out): Megatron's convention
            column = kernel == (None, "model")
            want = {("lora_kernel_a", True): (None, None),
                    ("lora_kernel_b", True): (None, "model"),
                    ("lora_kernel_a", False): ("model", None),
                    ("lora_kernel_b", False): (None, None)}
            assert specs[path] == want[name, column], (path, kernel)
        models.assert_one_block_per_device(weights[path], specs[path])
    assert sum("model" in specs[p] for p in factors) == len(factors) // 2


SLOTS_PER_WEIGHT = {"adam": 2 + 2 * hub.STEPS,  # + GradientRecordingAdam's
                    "sgd": 0}


def check_no_frozen_slots(model, strategy, optimizer):
    """The optimizer tracks only the LoRA factors: no slot for a frozen
    weight (Keras names a slot after its weight's path), and each device
    holds slots for its blocks of the factors only."""
    trainable = {w.path for w in model.trainable_weights}
    assert trainable and all(is_lora(p) for p in trainable), trainable
    frozen = [w.path.replace("/", "_") for w in model.weights
              if not w.trainable]
    slots = [v.path for v in model.optimizer.variables]
    assert not [s for s in slots if any(f in s for f in frozen)], slots
    lora_bytes = sum(4 * int(np.prod(block)) for path, _, block
                     in strategy.placements() if is_lora(path))
    for device, kinds in strategy.memory_per_device().items():
        want = SLOTS_PER_WEIGHT[optimizer] * lora_bytes
        assert kinds["optimizer"] == want, (device, kinds, lora_bytes)


def check_parity(family, optimizer, tmp_path):
    path = str(tmp_path / family)
    build = save_pretrained(family, path)
    lora = lora_values(family, build, path)
    reference, ref_losses, ref_frozen = fine_tune(
        family, optimizer, build, path, lora)
    mesh = tfpar.Mesh(MESH)
    strategy = tfpar.ParallelStrategy(
        mesh, rules=tfpar.auto_rules(build, mesh=mesh))
    model, losses, frozen = fine_tune(family, optimizer, build, path, lora,
                                      strategy)
    assert len(losses) == hub.STEPS
    assert relative_error(ref_losses, losses) < RTOL, (ref_losses, losses)
    for a, b in zip(reference.weights, model.weights):
        assert a.path == b.path
        if not b.trainable:  # frozen: as loaded, on both
            np.testing.assert_array_equal(np.asarray(b), frozen[b.path])
            np.testing.assert_array_equal(np.asarray(a), ref_frozen[a.path])
        elif optimizer == "sgd":
            assert relative_error(np.asarray(a), np.asarray(b)) < RTOL, a.path
    np.testing.assert_equal(ref_frozen, frozen)
    if optimizer == "adam":
        hub.check_adam(family, reference, model, initial=lora)
    check_lora_layout(model, strategy)
    check_no_frozen_slots(model, strategy, optimizer)


def test_lora_llama3_preset_adam_on_data2_model4(tmp_path):
    """The default profile's case: Llama3 from a keras-hub preset, Adam."""
    check_parity("llama3", "adam", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family, optimizer", [
    ("llama3", "sgd"), ("gemma", "adam"), ("gemma", "sgd")])
def test_lora_parity_matrix(tmp_path, family, optimizer):
    check_parity(family, optimizer, tmp_path)


def model_axis_collectives(family, path, build, lora):
    """[(phase, purpose, per-device shape)] over "model" of one compiled
    training step, with LoRA on the targets or full fine-tuning."""
    _, lm_cls, _, targets, _ = FAMILIES[family]
    mesh = tfpar.Mesh(MESH)
    strategy = tfpar.ParallelStrategy(
        mesh, rules=tfpar.auto_rules(build, mesh=mesh))
    with strategy.scope():
        backbone = build()
        tfpar.pretrained.load_weights(backbone, path)
        if lora:
            backbone.enable_lora(RANK, target_layer_names=targets)
        model = lm_cls(backbone, preprocessor=None)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=hub_models.loss("llama"))
    x, y = hub_models.data("llama", batch=hub.BATCH)
    report = tfpar.communication_report(model, x, y)
    return sorted((c.phase, c.purpose, tuple(c.shape))
                  for c in report.select(axes=("model",))), backbone


@pytest.mark.slow
def test_lora_gathers_no_activation(tmp_path):
    """The LoRA step's collectives over "model" of activations (shapes led
    by the per-device batch and the sequence) are some of full
    fine-tuning's (measured: one forward all-gather fewer), and the rest
    are of LoRA factors only (the r-wide gradients of factors kept whole):
    no kernel-sized collective. Keras' `ops.matmul(A, B)` (a `tf.tensordot`
    flattening A to 2-D) made DTensor gather A forward and the
    kernel-sized gradient of A @ B backward for Llama3's (hidden, heads,
    head_dim) query/key/value kernels split on the heads, until tfpar
    formed A @ B as an einsum in a step (spmd_patches)."""
    path = str(tmp_path / "llama3")
    build = save_pretrained("llama3", path)
    full, _ = model_axis_collectives("llama3", path, build, lora=False)
    with_lora, backbone = model_axis_collectives("llama3", path, build,
                                                 lora=True)
    batch = hub.BATCH // MESH["data"]
    # A whole factor's gradient (B of a query kernel: (r, head_dim) = (4, 8))
    # can have the shape of an activation's leading (batch, sequence).
    factor_shapes = {tuple(w.shape) for w in backbone.weights
                     if w.path.endswith(("/lora_kernel_a", "/lora_kernel_b"))}
    def of_activations(collectives):
        return collections.Counter(
            c for c in collectives if c[2][:2] == (batch, hub_models.SEQ_LEN)
            and c[2] not in factor_shapes)

    activations = of_activations(with_lora)
    assert activations and not activations - of_activations(full), (
        activations, full)
    extra = [c for c in with_lora if c not in activations]
    largest = max(int(np.prod(w.shape)) for w in backbone.weights
                  if w.path.endswith(("/lora_kernel_a", "/lora_kernel_b")))
    assert extra and all(int(np.prod(shape)) <= largest
                         for _, _, shape in extra), extra


def test_lora_factors_follow_raw_kernel_rules_unless_named():
    """A raw spec rule for a Dense kernel lays out its LoRA factors too
    (row-parallel: A split on the input, B whole); a rule naming a factor
    itself wins."""
    layer = keras.layers.Dense(8, name="down")
    layer.build((None, 16))
    layer.enable_lora(2)
    rules = tfpar.LayoutRules({r".*down/kernel": ("model", None)})
    assert rules.spec_for("down/lora_kernel_a", (16, 2), layer) == (
        "model", None)
    assert rules.spec_for("down/lora_kernel_b", (2, 8), layer) == (None, None)
    named = tfpar.LayoutRules({r".*down/kernel": ("model", None),
                               r".*down/lora_kernel_a": (None, None)})
    assert named.spec_for("down/lora_kernel_a", (16, 2), layer) == (None, None)
    assert tfpar.LayoutRules({}).spec_for("down/lora_kernel_a", (16, 2),
                                          layer) is None


def test_lora_factor_spec_refuses_another_name():
    with pytest.raises(ValueError, match=r"name='kernel'"):
        tfpar.layout.lora_factor_spec("kernel", (None, "model"))


def run_pretrained_example(tmp_path, hf):
    """examples/pretrained.py's route in this process (8 virtual CPUs):
    the fine-tuned losses and the exported checkpoint's output gap."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        example = importlib.import_module("pretrained")
    finally:
        sys.path.pop(0)
    args = argparse.Namespace(data=2, model=4, rank=4, steps=2, batch_size=8,
                              seq_len=16)
    path, build = example.save_checkpoint(str(tmp_path), hf)
    backbone, losses = example.fine_tune(path, build, args)
    _, gap = example.export_and_check(backbone, str(tmp_path), args)
    return losses, gap


@pytest.mark.parametrize("hf", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_pretrained_example_fine_tunes_with_lora_and_exports(tmp_path, hf):
    """The guide's route end to end: found outside the suite, exporting a
    LoRA-enabled sharded backbone failed (its merged kernel, a split
    DTensor, could not become a host array) and so did calling the loaded
    model eagerly after leaving the scope (its embedding's style read the
    current strategy)."""
    losses, gap = run_pretrained_example(tmp_path, hf)
    assert len(losses) == 2 and all(np.isfinite(losses)), losses
    assert gap < 1e-4, gap
