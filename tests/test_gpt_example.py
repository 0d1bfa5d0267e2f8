"""The GPT example trains with auto_rules in parity with one device."""

import gc
import sys
from pathlib import Path

import keras
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar import spmd_patches

import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

GPT = dict(vocab=32, seq_len=8, dim=32, heads=8, layers=1)


@pytest.fixture(scope="module")
def single_device():
    x, y = gpt.toy_corpus(32, vocab=GPT["vocab"], seq_len=GPT["seq_len"])
    keras.utils.set_random_seed(0)
    weights = gpt.build_gpt(**GPT).get_weights()
    model, losses = gpt.train(None, weights, x, y, 16, 2, **GPT)
    return weights, x, y, model, losses


@pytest.mark.parametrize("model_axis", [
    pytest.param(2, marks=pytest.mark.slow), 4,
    pytest.param(8, marks=pytest.mark.slow)])
def test_gpt_parity(single_device, model_axis):
    weights, x, y, reference, ref_losses = single_device
    mesh = tfpar.Mesh({"data": 8 // model_axis, "model": model_axis})
    strategy = tfpar.ParallelStrategy(mesh)
    model, losses = gpt.train(strategy, weights, x, y, 16, 2, **GPT)
    assert models.relative_error(ref_losses, losses) < 1e-4
    for a, b in zip(reference.weights, model.weights):
        if a.path.endswith("attn/key/bias"):
            continue  # analytically zero gradient: noise only (see test_tensor_parallel)
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path
    sharded = {p: s for p, s, _ in strategy.placements("params") if any(s)}
    assert sharded["b0_attn/query/kernel"] == (None, "model", None)
    assert sharded["tok_embed/embeddings"] == (None, "model")
    memory = strategy.memory_per_device()[mesh.devices[0]]["params"]
    whole = sum(w.size * 4 for w in weights)
    split = sum(int(w.numpy().size) * 4 for w in model.weights
                if w.path in sharded)
    assert memory == whole - split + split // model_axis


@pytest.mark.parametrize("axes,sequence_parallel", [
    pytest.param({"data": 2, "model": 4}, False, marks=pytest.mark.slow),
    ({"data": 2, "model": 4}, True),
    pytest.param({"data": 8, "model": 1}, False, marks=pytest.mark.slow),
])
def test_gpt_fsdp_parity(single_device, axes, sequence_parallel):
    """fsdp on top of auto_rules (applied after building, so weights are
    re-laid out) and sequence parallelism: same losses and weights, and
    every device holds its share of the stored blocks."""
    weights, x, y, reference, ref_losses = single_device
    mesh = tfpar.Mesh(axes)
    strategy = tfpar.ParallelStrategy(mesh, fsdp=True)
    model, losses = gpt.train(strategy, weights, x, y, 16, 2,
                              sequence_parallel=sequence_parallel, **GPT)
    assert models.relative_error(ref_losses, losses) < 1e-4
    for a, b in zip(reference.weights, model.weights):
        if a.path.endswith("attn/key/bias"):
            continue  # analytically zero gradient: noise only
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path
    specs = {p: s for p, s, _ in strategy.placements("params")}
    assert specs["tok_embed/embeddings"][0] == "data"
    assert "data" in specs["b0_attn/query/kernel"]

    # What device 0 really holds of each weight, next to what it would hold
    # without the data split.
    held = sum(dtensor.unpack(v.value.read_value())[0].numpy().nbytes
               for v in model.trainable_weights)
    without_data = 0
    for variable in model.trainable_weights:
        split = 1
        for axis in specs[variable.path]:
            if axis is not None and axis != "data":
                split *= mesh.axis_size(axis)
        without_data += int(variable.numpy().size) * 4 // split
    assert strategy.memory_per_device()[mesh.devices[0]]["params"] == held
    assert held < 0.6 * without_data


@pytest.mark.parametrize("axes,sequence_parallel", [
    pytest.param({"pipe": 2, "data": 2, "model": 2}, False,
                 marks=pytest.mark.slow),
    ({"pipe": 2, "data": 2, "model": 2}, True),
    pytest.param({"pipe": 2, "model": 4}, False, marks=pytest.mark.slow),
])
def test_gpt_pipeline_with_data_and_model_axes(single_device, axes,
                                               sequence_parallel):
    """Data × pipe × model (Megatron's 3D parallelism) on the GPT, with
    auto_rules inside the stages, in parity with one device."""
    weights, x, y, reference, ref_losses = single_device
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes))
    model, losses = gpt.train(strategy, weights, x, y, 16, 2,
                              sequence_parallel=sequence_parallel,
                              num_microbatches=2, **GPT)
    assert isinstance(model, tfpar.PipelineModel)
    assert models.relative_error(ref_losses, losses) < 1e-4
    for a, b in zip(reference.weights, model.weights):
        if a.path.endswith("attn/key/bias"):
            continue  # analytically zero gradient: noise only
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path



def test_gpt_sequence_parallel_pipeline_without_data_axis_is_refused(
        single_device):
    """This combination crashes DTensor's compiler (segmentation fault):
    refused with a clear error before anything runs."""
    weights, x, y, _, _ = single_device
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "model": 4}))
    with pytest.raises(ValueError, match="needs a data axis"):
        gpt.train(strategy, weights, x, y, 16, 2, sequence_parallel=True,
                  num_microbatches=2, **GPT)


@pytest.mark.parametrize("axes", [
    {"data": 2, "model": 4},
    pytest.param({"pipe": 2, "data": 2, "model": 2}, marks=pytest.mark.slow)],
                         ids=["data2xmodel4", "pipe2xdata2xmodel2"])
def test_gpt_recompute_with_fsdp_parity(single_device, axes):
    """Every block layer recomputed (keras.RematScope, attention included)
    under auto_rules and fsdp, also inside pipeline stages: the same losses
    and weights as one device without recomputation."""
    weights, x, y, reference, ref_losses = single_device
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), fsdp=True)
    with tfpar.communication.capture() as programs:
        model, losses = gpt.train(strategy, weights, x, y, 16, 2,
                                  num_microbatches=2, recompute=True, **GPT)
    assert models.relative_error(ref_losses, losses) < 1e-4
    for a, b in zip(reference.weights, model.weights):
        if a.path.endswith("attn/key/bias"):
            continue  # analytically zero gradient: noise only
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path
    if "pipe" in axes:
        return  # several stage programs: the report below reads one
    recomputed = programs.train_report()
    with tfpar.communication.capture() as programs:
        gpt.train(tfpar.ParallelStrategy(tfpar.Mesh(axes), fsdp=True),
                  weights, x, y, 16, 1, **GPT)
    kept = programs.train_report()
    # Less kept for the backward pass; the blocks' weights gathered again
    # there (over the data axis) instead of kept whole from the forward.
    assert recomputed.saved_activation_bytes < \
        0.7 * kept.saved_activation_bytes

    def backward_gathers(report):
        # (On a two-axis mesh DTensor's CPU all-gather is an all-reduce
        # of zero-padded blocks: its purpose still says all-gather.)
        return report.count(purpose="all-gather", spans="data",
                            phase="backward")

    # (Without recomputation one attention activation is gathered there.)
    # Recomputed: also q, k, v and output projections, MLP kernels, ...,
    # each once: the block has 16 weights (MultiHeadAttention's inner
    # layers are recomputed with it, not again on their own).
    extra = backward_gathers(recomputed) - backward_gathers(kept)
    assert 8 <= extra <= 16


def test_a_constant_larger_than_dtensor_broadcasts_trains_as_one_device():
    """Found outside the suite (every GPT here had a sequence of 8 or 16):
    examples/gpt.py adds `keras.ops.arange(seq_len)` to its positions, a
    constant the functional model holds as an eager tensor; DTensor 2.21
    auto-broadcasts only small ones, so from seq_len=32 on every step
    failed ("got a regular tensor for input 2 (shape [32]) but was
    expecting a DTensor"). A step now captures it replicated on its
    mesh."""
    config = dict(GPT, seq_len=40)
    x, y = gpt.toy_corpus(16, vocab=config["vocab"], seq_len=40)
    keras.utils.set_random_seed(0)
    weights = gpt.build_gpt(**config).get_weights()
    _, want = gpt.train(None, weights, x, y, 16, 1, **config)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    captures_before = set(spmd_patches._REPLICATED_CAPTURES)
    model, got = gpt.train(strategy, weights, x, y, 16, 1, **config)
    assert models.relative_error(want, got) < 1e-4
    # The replicated copy of the constant lives as long as the constant:
    # once the model is gone, so is the cache entry (no growth for the
    # life of the process).
    assert set(spmd_patches._REPLICATED_CAPTURES) - captures_before
    del model
    keras.backend.clear_session()
    gc.collect()
    assert not set(spmd_patches._REPLICATED_CAPTURES) - captures_before
