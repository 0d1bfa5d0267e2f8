"""Context parallelism and keras-hub Llama 3: `generate()` on a
context-split mesh, plain SGD and `mixed_bfloat16` training in parity.

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
import fuzzing
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


# -- Llama 3 training: plain SGD, mixed_bfloat16 -------------------------


def train_llama3(strategy, weights, x, y, policy=None):
    """(losses, weights) of Llama 3 from `weights`, plain SGD(0.1), one
    epoch in order of 2 batches (in `strategy`'s scope unless None), under
    the dtype policy `policy` (float64 also sets floatx: the rounding-free
    reference of `fuzzing.assert_parity`)."""
    previous = keras.config.dtype_policy(), keras.config.floatx()
    if policy:
        keras.config.set_dtype_policy(policy)
        if policy == "float64":
            keras.config.set_floatx(policy)
    try:
        if strategy is None:
            model = context_models.hub_causal_lm("llama3")
        else:
            with strategy.scope():
                model = context_models.hub_causal_lm("llama3")
        model.set_weights([w.astype(model.weights[i].dtype)
                           for i, w in enumerate(weights)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        losses = models.BatchLosses()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                  callbacks=[losses])
        return np.array(losses.losses), [w.numpy().astype("float64")
                                         for w in model.weights]
    finally:
        keras.config.set_dtype_policy(previous[0])
        keras.config.set_floatx(previous[1])


@pytest.fixture(scope="module")
def llama3_data():
    x, y = context_models.hub_corpus(32)
    keras.utils.set_random_seed(0)
    weights = context_models.hub_causal_lm("llama3").get_weights()
    return weights, x, y


@pytest.mark.slow
def test_llama3_sgd_data2_context4_parity(llama3_data):
    weights, x, y = llama3_data
    want = train_llama3(None, weights, x, y)
    exact = train_llama3(None, weights, x, y, policy="float64")
    got = train_llama3(tfpar.ParallelStrategy(tfpar.Mesh(MESH)), weights, x,
                       y)
    fuzzing.assert_parity(want[0], got[0], want[1], got[1], exact=exact)


@pytest.mark.slow
@pytest.mark.parametrize("balance", [False, True])
def test_llama3_mixed_bfloat16_data2_context4(llama3_data, balance):
    """The oracle of test_mixed_precision (and test_context_parallel's):
    the mesh's mixed_bfloat16 run is within SLACK times one device's own
    mixed-vs-float32 difference of one device's mixed_bfloat16 run, per
    weight and for the losses (blockwise attention accumulates in
    float32, keras-hub's attention softmax in float32 too, its matmuls in
    bfloat16)."""
    weights, x, y = llama3_data
    slack = 3.0
    exact = train_llama3(None, weights, x, y, policy="float32")
    one = train_llama3(None, weights, x, y, policy="mixed_bfloat16")
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESH))
    if balance:
        context_parallel.load_balance(strategy)
    mesh = train_llama3(strategy, weights, x, y, policy="mixed_bfloat16")
    assert np.all(np.isfinite(mesh[0]))
    assert models.relative_error(one[0], mesh[0]) <= slack * max(
        models.relative_error(exact[0], one[0]), 1e-4), (one[0], mesh[0])
    for i, (e, o, m) in enumerate(zip(exact[1], one[1], mesh[1])):
        precision = max(models.relative_error(e, o), 1e-4)
        assert models.relative_error(o, m) <= slack * precision, (
            i, models.relative_error(o, m), precision)
