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

Slow profile (the default profile is unchanged): the repro's assertions,
and the plan with each device's block of the fused query/gate kernel.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar
from tfpar import spmd_ops

import dtensor_unpack_layout_repro as repro
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
    query = next(w for w in model.weights
                 if w.path == "transformer_layer_0/self_attention/query/kernel")
    assert tuple(query.shape) == (32, 8, 16)
    models.assert_one_block_per_device(query, (None, "model", None))
    assert {tuple(b.shape) for b in dtensor.unpack(
        query.value.read_value())} == {(32, 4, 16)}
