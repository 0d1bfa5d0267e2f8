"""Qwen3.5's gated attention split over "model" (issue 36's
data=2 x expert=2 x model=2 mesh).

keras-hub's `Qwen3_5Attention` projects each head's query and output gate
together: its query kernel is (hidden, heads, 2 x head_dim), `[query |
gate]` per head, sliced apart after the projection. `auto_rules` splits
that kernel along its heads dimension (the first one the projection
makes), so each device holds whole (query, gate) head pairs and slices
them apart locally; key/value by heads, the output projection by rows.

That plan did not compile on TF 2.21: the rotate-half of the partial
rotary dimensions (a quarter of each head) stacks the two halves, and
DTensor cannot lay out the `Unpack` of that stack's gradient when the
heads are split (tests/dtensor_unpack_layout_repro.py). tfpar's steps now
stack by a concat (`tfpar.spmd_ops.stack_by_concat`); the parity of the
whole model with one device is test_moe_keras_hub's matrices
(`-m slow -k "qwen3_5_moe and 2x2x2"`).

Qwen3.5's linear-attention layers (`Qwen3_5GatedDeltaNet`, a gated delta
rule over chunks of the sequence) have no tensor-parallel pattern: they
stay whole on every device, named with the reason in auto_rules' warning.
Their Python code needs a known sequence length (`if pad_size > 0`), so
auto_rules traces such a model again with one (`_TRACE_LENGTH`) when the
symbolic trace fails.

DTensor 2.21 cannot compile their ops (`MatrixDiagV3`, the depthwise
convolution's filter gradient), so such a model does not train on a mesh
yet; the error names the op.

Slow profile (the default profile is unchanged): the repro's assertions,
the plan with each device's block of the fused query/gate kernel, and a
model with a linear-attention layer planned, its training refused.
"""

import warnings

import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar
from tfpar import spmd_ops

import dtensor_unpack_layout_repro as repro
import hub_models
import models
import test_moe_keras_hub

_INCONSISTENT = ("fails: SPMD expansion resulted in op output inconsistent "
                 "with the provided layout. Expected shape: <8,4,16,1> got "
                 "shape: <8,4,8,1>")


@pytest.mark.slow
def test_unpack_cannot_split_what_its_input_holds_whole():
    """If the first three start passing on a newer TF, DTensor lays the
    Unpack out itself and tfpar's `pack` patch can go."""
    assert repro.unpack_case() == {
        "unstack(axis=-2) into heads split": _INCONSISTENT,
        "unstack(axis=3) into heads split": _INCONSISTENT,
        "gradient of stack(axis=-2)": _INCONSISTENT,
        "gradient of concat(expand_dims, axis=3)": "right",
    }


@pytest.mark.slow
def test_stack_by_concat_is_stack():
    """The same values and gradients as `tf.stack` for every axis, of two
    values and of one; integer or scalar values go to `pack` unchanged."""
    one = tf.ones((2, 3))
    np.testing.assert_array_equal(
        spmd_ops.stack_by_concat([one], 1, tf.stack), tf.stack([one], 1))
    rng = np.random.default_rng(0)
    a, b = (tf.constant(rng.normal(size=(2, 3, 4)), tf.float32)
            for _ in range(2))
    weights = tf.constant(rng.normal(size=(2, 2, 3, 4)), tf.float32)
    for axis in range(-4, 4):
        grads = []
        for stack in (tf.stack, lambda v, x: spmd_ops.stack_by_concat(
                v, x, tf.stack)):
            with tf.GradientTape() as tape:
                tape.watch([a, b])
                y = stack([a, b], axis)
                loss = tf.reduce_sum(
                    y * tf.reshape(weights, y.shape) + y * y)
            grads.append((y, *tape.gradient(loss, [a, b])))
        for want, got in zip(*grads):
            np.testing.assert_array_equal(got.numpy(), want.numpy())
    calls = []
    spmd_ops.stack_by_concat([tf.constant([1, 2])] * 2, 0,
                             lambda v, x: calls.append((v, x)))
    spmd_ops.stack_by_concat([tf.constant(1.0)] * 2, 0,
                             lambda v, x: calls.append((v, x)))
    assert len(calls) == 2


@pytest.mark.slow
def test_auto_rules_split_the_fused_query_gate_kernel_by_heads():
    """Query (with its gate), key and value column-parallel by heads, the
    output projection row-parallel, the per-head norms whole, named in no
    warning; every device holds 4 of the 8 heads' whole (query, gate)
    pairs: its block is kernel[:, 4c:4c+4, :] (all 16 = 2 x head_dim)."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(
        test_moe_keras_hub.MESHES["2x2x2"]))
    with strategy.scope():
        model = test_moe_keras_hub.build_moe("qwen3_5_moe")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rules = tfpar.auto_rules(model, mesh=strategy.mesh)
        strategy.apply_rules(model, rules)
    assert not any("self_attention" in str(w.message) for w in caught), [
        str(w.message) for w in caught]
    plain = {k.replace("\\", ""): repr(v) for k, v in rules.items()}
    for layer in (0, 1):
        prefix = f"transformer_layer_{layer}/self_attention/"
        for proj in ("query", "key", "value"):
            assert plain[prefix + proj] == "ColumnParallel(axis='model')"
        assert plain[prefix + "attention_output"] == (
            "RowParallel(axis='model')")
        assert not any(k.startswith(prefix + "query_norm")
                       or k.startswith(prefix + "key_norm") for k in plain)
    query = next(w for w in model.weights if w.path ==
                 "transformer_layer_0/self_attention/query/kernel")
    assert tuple(query.shape) == (32, 8, 16)
    models.assert_one_block_per_device(query, (None, "model", None))
    assert {tuple(b.shape) for b in dtensor.unpack(
        query.value.read_value())} == {(32, 4, 16)}


def _qwen3_5_moe_with_linear_attention():
    """test_moe_keras_hub's Qwen3.5-MoE with its first layer a gated delta
    net (keras-hub's `linear_attention`), as Qwen3.5 interleaves them."""
    backbone = keras_hub.models.Qwen3_5MoeBackbone(
        vocabulary_size=hub_models.VOCAB, num_layers=2, num_query_heads=8,
        num_key_value_heads=4, head_dim=8, hidden_dim=32,
        moe_intermediate_dim=32, shared_expert_intermediate_size=32,
        num_experts=8, top_k=test_moe_keras_hub.TOP_K,
        layer_types=["linear_attention", "full_attention"])
    return keras_hub.models.Qwen3_5MoeCausalLM(backbone, preprocessor=None)


# The linear-attention layer's weights auto_rules keeps whole, and why.
_LINEAR_WHOLE = (
    "transformer_layer_0/linear_attn (Qwen3_5GatedDeltaNet): no plan for "
    "Qwen3_5GatedDeltaNet weights ['A_log', 'conv1d_kernel', 'dt_bias']",
    *(f"transformer_layer_0/linear_attn/{proj} (Dense): in no MLP or "
      "attention pattern" for proj in (
          "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")))


@pytest.mark.slow
def test_linear_attention_is_planned_whole_and_dtensor_refuses_its_ops(
        monkeypatch):
    """auto_rules plans a model with a linear-attention layer: the gated
    delta net whole (named, with the reason), the full attention layer
    split by heads. Training it on any batch-split mesh fails to compile in
    TF 2.21, not for the plan: DTensor has no layout propagation for the
    `MatrixDiagV3` of its `ops.eye` (and, with that replaced by a
    constant, for the `DepthwiseConv2dNativeBackpropFilter` of its causal
    convolution's gradient). The error names the op; when this test fails
    on a newer TF, the model may train: give it a parity test."""
    monkeypatch.setitem(test_moe_keras_hub.SHARED_EXPERT_BUILDERS,
                        "qwen3_5_moe", _qwen3_5_moe_with_linear_attention)
    model = test_moe_keras_hub.build_moe("qwen3_5_moe")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rules = tfpar.auto_rules(model, mesh=tfpar.Mesh(
            test_moe_keras_hub.MESHES["2x2x2"]))
    text = "\n".join(str(w.message) for w in caught)
    assert all(line in text for line in _LINEAR_WHOLE), text
    plain = {k.replace("\\", ""): repr(v) for k, v in rules.items()}
    assert not any("linear_attn" in k for k in plain)
    assert plain["transformer_layer_1/self_attention/query"] == (
        "ColumnParallel(axis='model')")
    with pytest.raises(ValueError, match=(
            r"tf\.MatrixDiagV3 op failed: .*does not implement layout "
            "propagation")):
        test_moe_keras_hub.train("qwen3_5_moe", "sgd",
                                 test_moe_keras_hub.MESHES["2x2x2"])
