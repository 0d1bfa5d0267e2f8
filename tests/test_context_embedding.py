"""A hidden-split Embedding beside a context axis.

`tfpar.ColumnParallel()` on a Keras `Embedding` splits its table (vocab,
hidden) by hidden over the model axis; each device looks up its hidden
columns and the lookup is all-gathered along the hidden dimension. Beside a
context axis the ids and the gathered lookup stay split along the sequence
as the step's inputs are, (batch/data, sequence/context): a lookup is per
token, so nothing needs the whole sequence
(`tfpar.context_parallel.split_along_sequence`). Gathering the sequence
too left the residual stream whole on every context coordinate, and DTensor
2.21 did not compile the backward pass of the language model of
tests/test_plan_axes.py (embedding, attention reading it, a residual adding
to it: tests/dtensor_context_lookup_repro.py).

Parity with one device from the same weights and tokens (losses and every
weight within 1e-4 relative, `context_models.assert_parity`), each device
holding only its hidden block of the table, the stream split along the
sequence in the compiled step. One case in the default profile; other
meshes, rules and keras-hub's GPT-2 and Llama 3 are `slow`.
"""

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar import context_parallel
from tfpar import parallel_dims
from tfpar import layout as layout_lib

import context_models
import test_context_hub_matrix as hub_matrix
import test_context_parallel as context_checks
import dtensor_context_lookup_repro as lookup_repro
import models
import test_plan_axes as axes_tests

SEQ, BATCH, N = 32, 4, 8

MEGATRON = {"embed": tfpar.ColumnParallel(), "attn": tfpar.ColumnParallel(),
            "up": tfpar.ColumnParallel(), "down": tfpar.RowParallel(),
            "head": tfpar.VocabParallel()}


def language_model():
    return axes_tests.language_model(SEQ, mixture=False)


@pytest.fixture(scope="module")
def corpus():
    """(initial weights drawn after seed 0, token ids, next-token ids)."""
    keras.utils.set_random_seed(0)
    weights = language_model().get_weights()
    rng = np.random.default_rng(0)
    x = rng.integers(0, axes_tests.VOCAB, (N, SEQ)).astype("int32")
    y = rng.integers(0, axes_tests.VOCAB, (N, SEQ)).astype("int32")
    return weights, x, y


def train(weights, x, y, mesh=None, rules=None, optimizer="adam",
          balance=False):
    """(strategy or None, model, per-batch losses): the language model
    from `weights`, built on `mesh` (None: one device) with `rules`
    ({layer: style}), one epoch of batches of BATCH in order with
    Adam(3e-3) or SGD(0.1); the causal load balance on when `balance`."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(mesh)) if mesh else None
    if strategy is None:
        model = language_model()
    else:
        if balance:
            context_parallel.load_balance(strategy)
        with strategy.scope():
            model = language_model()
            strategy.apply_rules(model, tfpar.LayoutRules(rules))
    model.set_weights(weights)
    model.compile(
        optimizer=(keras.optimizers.Adam(3e-3) if optimizer == "adam"
                   else keras.optimizers.SGD(0.1)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses = models.BatchLosses()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[losses])
    return strategy, model, losses.losses


def assert_table_split(model, mesh):
    """Each device holds exactly its (vocab, hidden/model) block of the
    table, and the table is split over the model axis only."""
    table = model.get_layer("embed").embeddings
    spec = layout_lib.spec_of(dtensor.fetch_layout(table.value))
    assert spec == (None, "model"), spec
    models.assert_one_block_per_device(table, spec)
    blocks = dtensor.unpack(table.value.read_value())
    assert len(blocks) == 8
    assert {tuple(b.shape) for b in blocks} == {
        (axes_tests.VOCAB, axes_tests.HIDDEN // mesh["model"])}


def test_split_embedding_beside_context_trains_in_parity(corpus):
    """data=2 × model=2 × context=2, the Embedding alone hidden-split (what
    tests/test_plan_vocab.py's `fit_beside_a_context_axis` did not
    compile), Adam."""
    weights, x, y = corpus
    mesh = {"data": 2, "model": 2, "context": 2}
    _, reference, want = train(weights, x, y)
    with tfpar.communication.capture() as programs:
        _, model, got = train(weights, x, y, mesh,
                              {"embed": tfpar.ColumnParallel()})
    context_models.assert_parity(reference, want, model, got)
    assert_table_split(model, mesh)
    # The stream (residual adds) keeps (batch/data, sequence/context,
    # hidden) on every device: the lookup gathered the hidden dimension only.
    stream = {n: s for n, s in programs.train_report().forward_shapes(
        r"(res1|res2)(_\d+)?/").items() if len(s) == 3}
    assert stream and set(stream.values()) == {
        (BATCH // 2, SEQ // 2, axes_tests.HIDDEN)}, stream


def test_a_lookup_without_a_sequence_is_gathered_whole_beside_context():
    """A label's embedding ((batch,) ids, (batch, hidden) lookup) has no
    sequence to keep split: split over the context axis along its hidden
    dimension instead, it added an all-gather of the broadcast label
    (ExpandDims) and turned an all-reduce of the mixing layer's gradient
    into a reduce-scatter and an all-gather."""
    seq, vocab, hidden = 8, 16, 8

    def build():
        ids = keras.Input((seq,), dtype="int32", name="ids")
        label = keras.Input((), dtype="int32", name="label")
        tokens = keras.layers.Embedding(vocab, hidden, name="tokens")(ids)
        labels = keras.layers.Embedding(10, hidden, name="labels")(label)
        mixed = keras.layers.Dense(hidden, name="mix")(
            tokens + keras.ops.expand_dims(labels, 1))
        return keras.Model({"ids": ids, "label": label},
                           keras.layers.Dense(vocab, name="out")(mixed))

    rng = np.random.default_rng(0)
    x = {"ids": rng.integers(0, vocab, (8, seq)).astype("int32"),
         "label": rng.integers(0, 10, (8,)).astype("int32")}
    y = rng.integers(0, vocab, (8, seq)).astype("int32")
    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def fit(model):
        model.set_weights(weights)
        model.compile(optimizer="sgd", loss=loss)
        return model.fit(x, y, batch_size=4, verbose=0,
                         shuffle=False).history["loss"]

    want = fit(build())
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 2, "context": 2}))
    with strategy.scope():
        model = build()
        strategy.apply_rules(model, tfpar.LayoutRules(
            {"labels": tfpar.ColumnParallel()}))
    with tfpar.communication.capture() as programs:
        got = fit(model)
    assert models.relative_error(want, got) < 1e-4, (want, got)
    moved = [(c.phase, c.purpose, c.name) for c in
             programs.train_report().select(spans="context")
             if "ExpandDims" in c.name or c.purpose == "reduce-scatter"
             and "mix" in c.name]
    assert not moved, moved


def test_sequence_parallelism_beside_a_context_axis_is_refused(
        corpus, monkeypatch):
    """A sequence-parallel style beside a context axis is a ValueError
    naming the rule before anything is laid out; without that check the
    step does not compile on DTensor 2.21 — the sequence dimension split
    over both axes where a Megatron-SP gather meets a context split."""
    weights, x, y = corpus
    mesh = {"data": 2, "model": 2, "context": 2}
    rules = {"embed": tfpar.ColumnParallel(sequence_parallel=True)}
    with pytest.raises(ValueError, match=r"Layout rule 'embed' turns on "
                       r"sequence parallelism.*context axis 'context' of "
                       r"size 2.*Received: sequence-parallel rules"):
        train(weights, x, y, mesh, rules, "sgd")
    monkeypatch.setattr(parallel_dims.ParallelDims,
                        "_check_one_sequence_split", lambda self, rules: None)
    with pytest.raises(ValueError, match=r"could not compile.*mapped to "
                       r"mesh dimension"):
        train(weights, x, y, mesh, rules, "sgd")


def test_whole_sequence_lookup_does_not_compile_on_dtensor():
    """Why the lookup keeps the context split: DTensor 2.21 fails to
    compile the gradient of attention plus a residual over a stream whole
    along the sequence beside a context axis, and compiles it split
    (tests/dtensor_context_lookup_repro.py). If the first half fails, a
    newer DTensor compiles the whole-sequence stream."""
    dmesh = lookup_repro.mesh()
    status, _ = lookup_repro.attempt("whole", dmesh)
    assert "does not match layout specified by Relayout op" in status
    status, gradient = lookup_repro.attempt("split", dmesh)
    assert status == "compiled"
    np.testing.assert_allclose(gradient, lookup_repro.one_device_gradient(),
                               rtol=1e-5, atol=1e-6)


CASES = [
    pytest.param({"model": 2, "context": 4}, {"embed": tfpar.ColumnParallel()},
                 "sgd", False, id="model2_context4-embed-sgd"),
    pytest.param({"data": 2, "model": 2, "context": 2}, MEGATRON, "adam",
                 False, id="data2_model2_context2-megatron-adam"),
    pytest.param({"data": 2, "model": 2, "context": 2},
                 {"embed": tfpar.ColumnParallel()}, "sgd", True,
                 id="data2_model2_context2-embed-sgd-balanced"),
    # The attention's 2 heads do not split 4 ways: it stays whole.
    pytest.param({"model": 4, "context": 2},
                 {k: v for k, v in MEGATRON.items() if k != "attn"}, "sgd",
                 False, id="model4_context2-megatron_but_attention-sgd"),
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,rules,optimizer,balance", CASES)
def test_split_embedding_beside_context_matrix(corpus, mesh, rules,
                                               optimizer, balance):
    weights, x, y = corpus
    _, reference, want = train(weights, x, y, optimizer=optimizer)
    _, model, got = train(weights, x, y, mesh, rules, optimizer, balance)
    context_models.assert_parity(reference, want, model, got)
    assert_table_split(model, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama3"])
def test_hub_decoders_split_embedding_beside_context(kind):
    """keras-hub GPT-2 (token and learned position tables hidden-split)
    and Llama 3 with `auto_rules` on context=2 × model=2 × data=2, Adam,
    in parity with one device (the suite's check with a float64 run); each
    device holds its hidden block of every embedding table."""
    built = []
    context_checks.assert_hub_parity(
        kind, mesh={"context": 2, "model": 2, "data": 2},
        build=lambda strategy: hub_matrix.with_auto_rules(strategy, built))
    tables = [w for w in built[0].weights if w.path.endswith("/embeddings")]
    assert len(tables) == {"gpt2": 2, "llama3": 1}[kind], tables
    for table in tables:
        spec = layout_lib.spec_of(dtensor.fetch_layout(table.value))
        assert spec == (None, "model"), (table.path, spec)
        models.assert_one_block_per_device(table, spec)
