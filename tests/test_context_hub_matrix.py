"""Context parallelism on keras-hub decoders: the training matrix.

Llama 3 (grouped-query: 4 query / 2 key-value heads, rotary positions) and
Gemma (2 layers: logit soft-caps, a sliding window of 12 < the sequence of
32 on its first layer, post norms) train on data=2 × context=4 and on
context=2 × model=2 × data=2, with `tfpar.auto_rules` applied, in parity
with one device from the same weights and data: Adam and plain SGD with
the suite's check (`fuzzing.assert_parity`: 1e-4 relative, or float32's
own noise where a float64 run shows the exact value is rounding noise),
and `mixed_bfloat16` with the oracle of test_mixed_precision
(`context_models.assert_within_bf16_precision`). The data
(`context_models.hub_corpus`) holds padded rows: half the rows end in
padding (padding_mask 0) from a random position in the second half, so
the devices holding one row's blocks see different padding. A test also
checks each device holds its head block of every attention projection
with a model axis (and whole weights without), from the variables' shards.

One case runs in the default profile; the rest are `slow`."""

import keras
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar import layout as layout_lib

import context_models
import fuzzing
import models

MESHES = {
    "data2_context4": {"data": 2, "context": 4},
    "context2_model2_data2": {"context": 2, "model": 2, "data": 2},
}
DEFAULT = ("gemma", "context2_model2_data2", "sgd")


def _cases():
    for kind in ("llama3", "gemma"):
        for mesh in MESHES:
            for mode in ("adam", "sgd", "mixed_bfloat16"):
                marks = () if (kind, mesh, mode) == DEFAULT else (
                    pytest.mark.slow,)
                yield pytest.param(kind, mesh, mode, marks=marks,
                                   id=f"{kind}-{mesh}-{mode}")


@pytest.fixture(scope="module")
def corpus():
    return context_models.hub_corpus(32)


def initial_weights(kind):
    keras.utils.set_random_seed(0)
    return context_models.hub_causal_lm(kind).get_weights()


def with_auto_rules(strategy, built):
    """A `build(kind)` for `train_hub` applying `auto_rules` on
    `strategy`'s mesh (none split on data × context: weights replicate
    over the context axis; the model axis splits Megatron-style); the
    model is appended to `built`."""
    def build(kind):
        model = context_models.hub_causal_lm(kind)
        strategy.apply_rules(model, tfpar.auto_rules(model,
                                                     mesh=strategy.mesh))
        built.append(model)
        return model
    return build


def assert_split(strategy, model, kind, mesh):
    """Inputs split over the context axis; every device holds whole
    weights on data × context, and its head block of every attention
    projection (query, key, value, output) with a model axis."""
    assert strategy.extended.input_placer.context.size == mesh["context"]
    specs = {w.path: layout_lib.spec_of(dtensor.fetch_layout(w.value))
             for w in model.weights}
    for weight in model.weights:  # each device: exactly its block
        models.assert_one_block_per_device(weight, specs[weight.path])
    shrunk = {path for path, spec in specs.items() if any(spec)}
    projections = {w.path for w in model.weights
                   if "attention/" in w.path and w.path.endswith("/kernel")}
    if "model" in mesh:
        assert len(projections) == 4 * {"llama3": 1, "gemma": 2}[kind] and (
            projections <= shrunk), (projections, shrunk)
        assert all(specs[p].count("model") == 1 for p in projections)
    else:
        assert not shrunk, shrunk


@pytest.mark.parametrize("kind,mesh,mode", list(_cases()))
def test_hub_decoder_trains_in_parity(corpus, kind, mesh, mode):
    x, y = corpus
    weights = initial_weights(kind)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESHES[mesh]))
    built = []
    build = with_auto_rules(strategy, built)
    train = context_models.train_hub
    if mode == "mixed_bfloat16":
        # Plain SGD: Adam's normalised steps would turn bfloat16 rounding
        # of near-zero gradients into full-size steps on both sides.
        exact = train(kind, None, weights, x, y, "sgd", policy="float32")
        one = train(kind, None, weights, x, y, "sgd", policy=mode)
        got = train(kind, strategy, weights, x, y, "sgd", policy=mode,
                    build=build)
        context_models.assert_within_bf16_precision(exact, one, got)
    else:
        want = train(kind, None, weights, x, y, mode)
        exact = train(kind, None, weights, x, y, mode, policy="float64")
        got = train(kind, strategy, weights, x, y, mode, build=build)
        fuzzing.assert_parity(want[0], got[0], want[1], got[1], exact=exact)
    assert_split(strategy, built[0], kind, MESHES[mesh])
