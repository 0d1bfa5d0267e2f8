"""Context parallelism: sequences split over a `context` mesh axis.

A plain Keras causal transformer (MultiHeadAttention, tests/context_models)
trains on data × context meshes in parity with one device from the same
weights and data; each device holds only its (b/data, s/context) block of
the inputs, and attention is computed blockwise (no device holds an
s/cp × s score matrix), read from the compiled step.
"""

import contextlib
import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar import blockwise_attention
from tfpar import context_keras_hub
from tfpar import context_parallel
from tfpar.inputs import host_batch

import context_models
import fuzzing
import hub_models
import models

SEQ, BATCH, N = 32, 16, 32
CONFIG = dict(vocab=32, seq_len=SEQ, dim=32, heads=4, layers=1)


def compile_model(model, optimizer="adam"):
    model.compile(
        optimizer=(keras.optimizers.Adam(3e-3) if optimizer == "adam"
                   else keras.optimizers.SGD(0.1)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def train(strategy, weights, x, y, optimizer="adam", build=None):
    """(model, per-batch losses): built from `weights` (in `strategy`'s
    scope unless None), 2 epochs in order."""
    build = build or (lambda: context_models.causal_transformer(**CONFIG))
    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    model.set_weights(weights)
    compile_model(model, optimizer)
    losses = models.BatchLosses()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[losses])
    return model, losses.losses


@pytest.fixture(scope="module")
def corpus():
    return context_models.weights_and_corpus(CONFIG, N, SEQ)


@pytest.fixture(scope="module")
def one_device(corpus):
    weights, x, y = corpus
    return train(None, weights, x, y)


assert_parity = context_models.assert_parity


def test_causal_transformer_data2_context4_parity_and_split(corpus,
                                                             one_device):
    weights, x, y = corpus
    reference, ref_losses = one_device
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    with tfpar.communication.capture() as programs:
        model, losses = train(strategy, weights, x, y)
    assert_parity(reference, ref_losses, model, losses)

    # Each device holds its (b/data, s/context) block of every input.
    placed = strategy.extended.input_placer.place(
        host_batch({"tokens": x["tokens"][:BATCH]}))["tokens"]
    blocks = dtensor.unpack(placed)
    block = SEQ // 4
    for device, got in enumerate(blocks):
        d, c = divmod(device, 4)
        np.testing.assert_array_equal(
            got.numpy(), x["tokens"][d * 8:(d + 1) * 8,
                                     c * block:(c + 1) * block])

    # Attention is blockwise: score blocks (b/data, heads, s/cp, s/cp) per
    # device, never a (.., s/cp, s) matrix; the norms and MLP keep s/cp.
    report = programs.train_report()
    scores = {n: s for n, s in report.forward_shapes(r"b0_attn").items()
              if len(s) == 4 and n.endswith("Einsum")}
    assert (8, 4, block, block) in scores.values(), scores
    assert all(s[-1] < SEQ for s in scores.values()), scores
    per_token = {n: s for n, s in report.forward_shapes(
        r"(b0_ln\d|b0_up|b0_down|ln_f|lm_head)(_\d+)?/").items()
        if len(s) == 3}
    assert per_token and {s[1] for s in per_token.values()} == {block}, (
        per_token)


def test_blockwise_attention_counts_unmasked_blocks():
    """In (query block, key block) pairs of s/(2cp) rows: without balance
    device r needs 4r+3 of them (the last one 5 times the first one's);
    with it every device needs 2cp+1 = 9. One SPMD
    program computes all of them on every device (see
    tests/dtensor_ring_permute_repro.py: DTensor 2.21 cannot branch per
    device)."""
    keys = np.arange(64)
    natural = context_parallel.ContextSplit("context", 4)
    balanced = context_parallel.ContextSplit("context", 4, load_balance=True)
    count = blockwise_attention.unmasked_block_counts
    assert count(natural.positions_per_device(64), keys, 8) == [3, 7, 11, 15]
    assert count(balanced.positions_per_device(64), keys, 8) == [9] * 4
    # With balance, the unmasked (query, key) pairs are equal too.
    pairs = [int(np.sum(p[:, None] >= keys[None, :]))
             for p in balanced.positions_per_device(64)]
    assert len(set(pairs)) == 1, pairs


def test_sequence_the_axis_does_not_divide_is_refused_naming_the_input():
    placer = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "context": 4})).extended.input_placer
    x = {"tokens": np.zeros((4, 6), "int32")}
    with pytest.raises(ValueError, match=r"'tokens'.*size 4.*\(4, 6\)"):
        placer.place(host_batch(x))
    with pytest.raises(ValueError, match=r"no input has one.*\(4,\)"):
        placer.place(host_batch({"features": np.zeros((4,), "float32")}))
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    context_parallel.load_balance(strategy)
    with pytest.raises(ValueError, match=r"times 2 \(load balance\)"):
        strategy.extended.input_placer.place(
            host_batch({"tokens": np.zeros((4, 12), "int32")}))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_load_balance_parity_and_predictions_in_order(corpus, optimizer):
    weights, x, y = corpus
    reference, ref_losses = train(None, weights, x, y, optimizer)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    context_parallel.load_balance(strategy)
    model, losses = train(strategy, weights, x, y, optimizer)
    assert_parity(reference, ref_losses, model, losses)
    want = reference.predict(x, batch_size=BATCH, verbose=0)
    got = model.predict(x, batch_size=BATCH, verbose=0)
    assert models.relative_error(want, got) < 1e-4


@pytest.mark.slow
def test_sgd_data2_context4(corpus):
    weights, x, y = corpus
    reference, ref_losses = train(None, weights, x, y, "sgd")
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    model, losses = train(strategy, weights, x, y, "sgd")
    assert_parity(reference, ref_losses, model, losses)


@pytest.mark.slow
def test_context2_model2_data2_with_auto_rules(corpus, one_device):
    weights, x, y = corpus
    reference, ref_losses = one_device
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "context": 2, "model": 2}))

    def build():
        model = context_models.causal_transformer(**CONFIG)
        strategy.apply_rules(model, tfpar.auto_rules(model,
                                                     mesh=strategy.mesh))
        return model

    model, losses = train(strategy, weights, x, y, build=build)
    assert_parity(reference, ref_losses, model, losses)


@pytest.mark.slow
def test_padded_sequences(corpus):
    """Embedding(mask_zero=True): Keras' padding mask reaches attention
    (query and key masks) and the loss; padded tails of random length."""
    weights, x, y = corpus
    rng = np.random.RandomState(1)
    x = dict(x, tokens=x["tokens"].copy())
    for row, length in enumerate(rng.randint(SEQ // 2, SEQ + 1, size=N)):
        x["tokens"][row, length:] = 0

    def build():
        return context_models.causal_transformer(**CONFIG, mask_zero=True)

    x["tokens"][:, 0] = np.maximum(x["tokens"][:, 0], 1)
    reference, ref_losses = train(None, weights, x, y, build=build)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    model, losses = train(strategy, weights, x, y, build=build)
    assert_parity(reference, ref_losses, model, losses)


@pytest.mark.slow
def test_attention_dropout_is_refused_naming_the_layer(corpus):
    weights, x, y = corpus
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    with pytest.raises(ValueError, match=r"'b0_attn'.*dropout=0.1"):
        train(strategy, weights, x, y, build=lambda: (
            context_models.causal_transformer(**CONFIG, dropout=0.1)))


@pytest.mark.slow
def test_saved_activations_at_most_0_4_of_data_parallel(corpus):
    """Same samples per device (8): data=2 alone vs data=2 × context=4, at
    a sequence of 64; read from the compiled steps."""
    seq = 64
    x, y = context_models.corpus(BATCH, seq_len=seq)
    config = dict(CONFIG, seq_len=seq)
    saved = {}
    for axes in ({"data": 2}, {"data": 2, "context": 4}):
        devices = tfpar.mesh.default_devices()[:int(np.prod(list(
            axes.values())))]
        strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes, devices=devices))
        with strategy.scope():
            model = context_models.causal_transformer(**config)
        compile_model(model)
        with tfpar.communication.capture() as programs:
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        saved[len(axes)] = programs.train_report().saved_activation_bytes
    assert saved[2] <= 0.4 * saved[1], saved


def test_auto_rules_on_a_data_context_mesh_split_no_weight():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    with strategy.scope():
        model = context_models.causal_transformer(**CONFIG)
        rules = tfpar.auto_rules(model, mesh=strategy.mesh)
        strategy.apply_rules(model, rules)
    assert dict(rules.items()) == {}


@pytest.mark.slow
def test_mixed_bfloat16_within_the_precision_of_one_device(corpus):
    """The oracle of test_mixed_precision: the mesh's mixed_bfloat16 run is
    within SLACK times one device's own mixed-vs-float32 difference of one
    device's mixed_bfloat16 run (blockwise attention computes in float32,
    Keras' attention in bfloat16), per weight and for the losses."""
    weights, x, y = corpus
    slack = 3.0

    def run(strategy, policy):
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(policy)
        try:
            model, losses = train(strategy, weights, x, y, "sgd")
            return [w.numpy() for w in model.weights], losses
        finally:
            keras.config.set_dtype_policy(previous)

    exact, exact_losses = run(None, "float32")
    one, one_losses = run(None, "mixed_bfloat16")
    mesh, mesh_losses = run(tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "context": 4})), "mixed_bfloat16")
    assert models.relative_error(one_losses, mesh_losses) <= slack * max(
        models.relative_error(exact_losses, one_losses), 1e-4)
    for i, (e, o, m) in enumerate(zip(exact, one, mesh)):
        precision = max(models.relative_error(e, o), 1e-4)
        assert models.relative_error(o, m) <= slack * precision, i


@pytest.mark.parametrize("balance", [
    False, pytest.param(True, marks=pytest.mark.slow)])
def test_group_query_attention_gathers_only_key_value_heads(corpus, balance):
    """Keras' GroupQueryAttention (4 query, 1 key/value head) in parity;
    the keys and values gathered over the context axis in the forward pass
    hold the key/value heads only: (b/data, s, 1, dim) per device, read
    from the compiled step."""
    _, x, y = corpus

    def build():
        return context_models.causal_transformer(**CONFIG, kv_heads=1)

    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    reference, ref_losses = train(None, weights, x, y, build=build)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    if balance:
        context_parallel.load_balance(strategy)
    with tfpar.communication.capture() as programs:
        model, losses = train(strategy, weights, x, y, build=build)
    assert_parity(reference, ref_losses, model, losses)
    # DTensor gathers as an all-reduce (purpose "all-gather"). Forward:
    # keys and values one (b/data, s, 1 head, dim) float32 gather each,
    # not the 4 repeated query heads (4 times the bytes).
    gathers = [c.bytes for c in programs.train_report().select(
        purpose="all-gather", axes=("context",), phase="forward")]
    kv_bytes = 8 * SEQ * 1 * (CONFIG["dim"] // CONFIG["heads"]) * 4
    assert gathers.count(kv_bytes) == 2 and max(gathers) == kv_bytes, (
        gathers)


# -- keras-hub decoders (tfpar/context_keras_hub.py) -------------------------


def assert_hub_parity(kind, balance=False, mesh=None, build=None):
    """`kind` on `mesh` (default data=2 × context=4), load balanced or
    not, built by `build(strategy)` (a `train_hub` builder; None: its
    own), in parity with one device (the suite's check: 1e-4 relative, or
    float32's own noise where the exact gradient is 0, from a float64
    run)."""
    x, y = context_models.hub_corpus(32)
    keras.utils.set_random_seed(0)
    weights = context_models.hub_causal_lm(kind).get_weights()
    want = context_models.train_hub(kind, None, weights, x, y)
    # keras-hub 0.32's Mixtral does not train in float64 (its MoE block
    # multiplies float64 by float32): its oracle is the plain 1e-4.
    exact = None if kind == "mixtral" else context_models.train_hub(
        kind, None, weights, x, y, policy="float64")
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(
        mesh or {"data": 2, "context": 4}))
    if balance:
        context_parallel.load_balance(strategy)
    got = context_models.train_hub(
        kind, strategy, weights, x, y,
        **({} if build is None else {"build": build(strategy)}))
    fuzzing.assert_parity(want[0], got[0], want[1], got[1], exact=exact)


@pytest.mark.slow
@pytest.mark.parametrize("kind,balance", [
    ("llama3", True), ("mistral", False), ("mistral", True),
    ("mixtral", True), ("gemma", True), ("gpt2", False), ("gpt2", True)])
def test_hub_decoders_parity(kind, balance):
    """Adam on data=2 × context=4 (padded rows). Llama 3 and Gemma
    without load balance, and on context=2 × model=2 × data=2, SGD and
    mixed_bfloat16: tests/test_context_hub_matrix.py."""
    assert_hub_parity(kind, balance)


def test_mixtral_pipelined_over_context_attends_blockwise():
    """keras-hub Mixtral (its experts over data) as a PipelineModel of 2
    micro-batches on data=2 × pipe=2 × context=2, Adam: in parity with one
    device. Its attention and masks are patched as Mistral's (a copy of
    them); left to DTensor, a stage's step did not compile ("EmitAllScatter
    ... not more sharded", a planner candidate)."""
    def build(strategy):
        del strategy
        return lambda kind: tfpar.PipelineModel(
            context_models.hub_causal_lm(kind), num_microbatches=2)

    assert_hub_parity("mixtral", mesh={"data": 2, "pipe": 2, "context": 2},
                      build=build)


class WrappedAttention(keras.layers.Layer):
    """A user's attention block around Keras MultiHeadAttention (split
    over the context axis by global position)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.MultiHeadAttention(2, 8)

    def call(self, x):
        return self.inner(x, x, use_causal_mask=True)


def test_load_balance_refuses_attention_it_does_not_split():
    """Load balance reorders each sequence over the context axis: an
    attention layer tfpar does not split by global position (keras-hub
    Qwen3-MoE's) would mask by local position, silently (8e-4 from one
    device's loss when it ran). Refused before the first step (or the
    eager call that builds the model), naming the layer; without the
    balance the same model trains in parity (DTensor runs that attention
    unsplit); a user's block around Keras' attention is accepted."""
    x, y = hub_models.data("qwen3_moe", batch=8)
    weights = hub_models.build("qwen3_moe").get_weights()

    def compiled(strategy):
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = hub_models.build("qwen3_moe")
            model.set_weights(weights)
            model.compile(optimizer="sgd", loss=hub_models.loss("qwen3_moe"))
        return model

    def data_context():
        return tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))

    balanced = data_context()
    model = compiled(balanced)  # built (a call) before the balance is on
    context_parallel.load_balance(balanced)
    refused = (r"Layer 'transformer_layer_\d/self_attention' "
               r"\(Qwen3MoeAttention\).*load_balance\(strategy, False\)")
    with pytest.raises(ValueError, match=refused):
        model.fit(x, y, batch_size=8, verbose=0)
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)
    with pytest.raises(ValueError, match=refused):  # a call builds it
        compiled(balanced)
    expected, got = (compiled(strategy).fit(
        x, y, batch_size=8, shuffle=False, verbose=0).history["loss"]
        for strategy in (None, data_context()))
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    ids = keras.Input((16,), dtype="int32")
    h = WrappedAttention(name="block")(keras.layers.Embedding(8, 8)(ids))
    model = keras.Model(ids, h)
    split = context_parallel.ContextSplit("context", 4, load_balance=True)
    context_keras_hub.check_load_balance(model, split)  # accepted
