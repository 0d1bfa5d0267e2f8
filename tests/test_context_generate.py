"""Context parallelism and keras-hub Llama 3: `generate()` on a
context-split mesh, and load-balanced `mixed_bfloat16` training in parity
(the training matrix: tests/test_context_hub_matrix.py).

`generate()` runs unsplit over the context axis
(`context_keras_hub.sequences_unsplit`): prompts placed whole along the
sequence, split over the data axis only, prefill and KV-cache decoding
by keras-hub's own code. The tokens must equal one device's (greedy), and
the same model's `predict` (sequence split, blockwise attention) and
training still run split after it."""

import keras
import numpy as np
import pytest

import tfpar
from tfpar import context_parallel

import context_models
import models

MESH = {"data": 2, "context": 4}


def prompts(batch=8, seed=3):
    """Right-padded prompts of 2 to 5 tokens in HUB_SEQ slots."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 6, batch)
    lengths[0] = 5
    mask = np.arange(context_models.HUB_SEQ)[None] < lengths[:, None]
    ids = rng.integers(1, context_models.HUB_VOCAB, mask.shape).astype(
        "int32")
    return {"token_ids": np.where(mask, ids, 0), "padding_mask": mask}


def check_generate(balance, mesh=MESH, auto_rules=False):
    keras.utils.set_random_seed(0)
    reference = context_models.hub_causal_lm("llama3")
    reference.compile(sampler="greedy")
    x = prompts()
    want = reference.generate(x, stop_token_ids=None)["token_ids"]
    want_logits = reference.predict(x, batch_size=8, verbose=0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(mesh))
    if balance:
        context_parallel.load_balance(strategy)
    with strategy.scope():
        model = context_models.hub_causal_lm("llama3")
        if auto_rules:
            strategy.apply_rules(model, tfpar.auto_rules(
                model, mesh=strategy.mesh))
    model.set_weights(reference.get_weights())
    model.compile(sampler="greedy")
    got = model.generate(x, stop_token_ids=None)["token_ids"]
    np.testing.assert_array_equal(got, want)
    # Generation filled every slot after the prompts with new tokens.
    assert not np.array_equal(got, x["token_ids"])
    np.testing.assert_array_equal(got[x["padding_mask"]],
                                  x["token_ids"][x["padding_mask"]])
    # The placer splits sequences again after generate(); predict (the
    # sequence split, blockwise attention) gives one device's logits.
    assert strategy.extended.input_placer.context.size == mesh["context"]
    got_logits = model.predict(x, batch_size=8, verbose=0)
    assert models.relative_error(want_logits, got_logits) < 1e-4


@pytest.mark.parametrize("balance", [
    False, pytest.param(True, marks=pytest.mark.slow)])
def test_llama3_generate_on_data2_context4_is_one_devices(balance):
    check_generate(balance)


@pytest.mark.slow
def test_llama3_generate_on_context2_model2_data2_with_auto_rules():
    check_generate(True, {"data": 2, "context": 2, "model": 2},
                   auto_rules=True)


# -- Llama 3 training, load balanced, mixed_bfloat16 ----------------------
# (unbalanced, SGD and Adam, on data=2 × context=4 and on
# context=2 × model=2 × data=2: tests/test_context_hub_matrix.py)


@pytest.mark.slow
def test_llama3_mixed_bfloat16_load_balanced_data2_context4():
    """The oracle of test_mixed_precision (and test_context_parallel's,
    `context_models.assert_within_bf16_precision`), plain SGD: blockwise
    attention accumulates in float32, keras-hub's attention softmax in
    float32 too, its matmuls in bfloat16; the load-balanced order on top."""
    x, y = context_models.hub_corpus(32)
    keras.utils.set_random_seed(0)
    weights = context_models.hub_causal_lm("llama3").get_weights()

    def train(strategy, policy):
        return context_models.train_hub("llama3", strategy, weights, x, y,
                                        "sgd", policy=policy)

    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESH))
    context_parallel.load_balance(strategy)
    context_models.assert_within_bf16_precision(
        train(None, "float32"), train(None, "mixed_bfloat16"),
        train(strategy, "mixed_bfloat16"))
