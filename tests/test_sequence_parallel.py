"""Sequence parallelism (Megatron-SP) on the GPT example.

With `auto_rules(model, mesh=mesh, sequence_parallel=True)` the residual
stream, the norms and the embeddings' outputs are split along the sequence
over the model axis: each device holds (b/data, s/model, h) of them. The
training step must still equal single-device Keras, and the activations the
step keeps for its backward pass must shrink. Both are read from the
compiled (SPMD-expanded) step that `fit` runs.
"""

import re
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import tfpar

import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

GPT = dict(vocab=32, seq_len=8, dim=32, heads=8, layers=1)
DATA, MODEL, BATCH = 2, 4, 16


@pytest.fixture(scope="module")
def single_device():
    x, y = gpt.toy_corpus(32, vocab=GPT["vocab"], seq_len=GPT["seq_len"])
    keras.utils.set_random_seed(0)
    weights = gpt.build_gpt(**GPT).get_weights()
    model, losses = gpt.train(None, weights, x, y, BATCH, 2, **GPT)
    return weights, x, y, model, losses


def build(weights, sequence_parallel):
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": DATA, "model": MODEL}))
    with strategy.scope():
        model = gpt.build_gpt(**GPT)
        model.set_weights(weights)
        strategy.apply_rules(model, tfpar.auto_rules(
            model, mesh=strategy.mesh, sequence_parallel=sequence_parallel))
        gpt.compile_gpt(model)
    return model


def sequence_dims(report, layer_pattern):
    """{node: dimension 1} of the rank-3 forward ops under the layers."""
    return {name: shape[1]
            for name, shape in report.forward_shapes(layer_pattern).items()
            if len(shape) == 3}


def test_gpt_sequence_parallel_parity_and_split_activations(single_device):
    weights, x, y, reference, ref_losses = single_device
    model = build(weights, sequence_parallel=True)
    losses = models.BatchLosses()
    with tfpar.communication.capture() as programs:
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[losses])
    assert models.relative_error(ref_losses, losses.losses) < 1e-4
    for a, b in zip(reference.weights, model.weights):
        if a.path.endswith("attn/key/bias"):
            continue  # analytically zero gradient: noise only (see test_tensor_parallel)
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path

    sp = programs.train_report()
    s, b, h = GPT["seq_len"], BATCH // DATA, GPT["dim"]
    # The norms compute on (b/data, s/model, h) per device ...
    norms = sequence_dims(sp, r"(^|/)(b0_ln1|b0_ln2|ln_f)(_\d+)?/")
    assert norms and set(norms.values()) == {s // MODEL}, norms
    # ... and so do the residual adds between them (h + a, h + m).
    residual = {n: shape for n, shape in sp.forward_shapes(r"/Add(_\d+)?$").items()
                if len(shape) == 3}
    assert residual and set(residual.values()) == {(b, s // MODEL, h)}, residual
    # Column-parallel layers still see the whole sequence (it is gathered).
    assert set(sequence_dims(sp, r"(^|/)b0_up(_\d+)?/").values()) == {s}

    # Same step without sequence parallelism: norms hold the whole sequence
    # and the activations kept for the backward pass are larger.
    tp = tfpar.communication_report(build(weights, False), x[:BATCH], y[:BATCH])
    assert set(sequence_dims(tp, r"(^|/)(b0_ln1|b0_ln2|ln_f)(_\d+)?/").values()) == {s}
    assert sp.saved_activation_bytes < tp.saved_activation_bytes

    def kept(report):
        return {name: int(np.prod(shape)) * dtype.size
                for name, (shape, dtype) in report.saved_activations.items()}
    # The tensors the norms and residual adds keep for the backward pass
    # are (b/data, s/model, h): each 1/model of its size without SP.
    in_region = re.compile(r"^[^/]+/((b0_ln\d|ln_f)(_\d+)?/|Add(_\d+)?:)")
    sp_kept, tp_kept = kept(sp), kept(tp)
    common = [n for n in sp_kept.keys() & tp_kept.keys() if in_region.search(n)]
    assert len(common) >= 3 * 4 + 2, sorted(common)
    for name in common:
        assert sp_kept[name] * MODEL == tp_kept[name], name

    # Megatron-SP's pattern per layer: forward, the sequence is gathered
    # before the attention and before the MLP (g) and the row-parallel
    # partial sums are reduced, then split by sequence (g-bar); backward,
    # the reverse. Plus one gather before the replicated head (forward and
    # backward). DTensor on CPU runs each as an all-reduce (module
    # docstring of tfpar.communication).
    layers = GPT["layers"]

    def purposes(phase):
        return [c.purpose for c in sp.select(axes=("model",), phase=phase)
                if "_embed" not in c.name]
    assert purposes("forward").count("all-gather") == 2 * layers + 1
    assert purposes("forward").count("all-reduce") == 2 * layers
    assert purposes("backward").count("all-gather") == 2 * layers + 1
    assert purposes("backward").count("reduce-scatter") == 2 * layers


def test_sequence_parallel_errors_name_the_argument():
    model = gpt.build_gpt(vocab=32, seq_len=6, dim=32, heads=8, layers=1)
    with pytest.raises(ValueError, match=r"'tok_embed'.*sequence length 6.*multiple of 4"):
        tfpar.auto_rules(model, axis_size=4, sequence_parallel=True)
    tfpar.auto_rules(model, axis_size=2, sequence_parallel=True)  # 6 % 2 == 0
    mlp = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="up"),
                            keras.layers.Dense(8, name="down"),
                            keras.layers.Dense(2, name="head")], name="mlp")
    with pytest.raises(ValueError, match=r"\(batch, sequence, features\).*'mlp/up'.*rank=2"):
        tfpar.auto_rules(mlp, axis_size=2, sequence_parallel=True)
    with pytest.raises(TypeError, match="sequence_parallel='yes'"):
        tfpar.auto_rules(mlp, axis_size=2, sequence_parallel="yes")
    with pytest.raises(TypeError, match=r"ColumnParallel\(sequence_parallel\).*Received: sequence_parallel=1"):
        tfpar.ColumnParallel(sequence_parallel=1)
    with pytest.raises(TypeError, match=r"SequenceParallel\(gather_output\)"
                       r".*Received: gather_output='yes'"):
        tfpar.SequenceParallel(gather_output="yes")


def test_sequence_parallel_plan_and_styles():
    model = gpt.build_gpt(**GPT)
    rules = dict(tfpar.auto_rules(model, axis_size=4, sequence_parallel=True).items())
    assert rules["b0_up"] == tfpar.ColumnParallel(sequence_parallel=True)
    assert rules["b0_down"] == tfpar.RowParallel(sequence_parallel=True)
    assert rules["b0_attn"] == tfpar.ColumnParallel(sequence_parallel=True)
    assert rules["tok_embed"] == tfpar.ColumnParallel(sequence_parallel=True)
    assert rules["b0_ln1"] == rules["ln_f"] == tfpar.SequenceParallel()
    assert "lm_head" not in rules  # the head stays replicated
    assert tfpar.ColumnParallel(sequence_parallel=True) != tfpar.ColumnParallel()
    assert repr(tfpar.RowParallel(sequence_parallel=True)) == (
        "RowParallel(axis='model', sequence_parallel=True)")
    ln = model.get_layer("b0_ln1")
    assert tfpar.SequenceParallel().spec_for(ln, "gamma", (32,)) == (None,)
