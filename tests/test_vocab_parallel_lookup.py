"""`vocab_parallel.lookup`: Megatron-LM's vocab-parallel embedding lookup
of a table split by rows over the model axis (a tied head's table under
`tfpar.VocabParallel`).

Each device reads the rows it holds, the blocks are summed (one all-reduce
of the (tokens, hidden) output over the model axis), and the table's
gradient is each device's own block, summed over the data axis. Measured
here from the compiled step's collectives, beside `tf.gather`'s values and
gradients; and why the gradient is written by hand: DTensor 2.21's own
gradient of the batched gather is a whole (vocab, hidden) partial gradient
on every device, reduce-scattered over the model axis, with the ids and
the output's gradient gathered over the data axis.
"""

import hypothesis
import hypothesis.strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar
from tfpar import placement, vocab_parallel
from tfpar.reports import program as program_lib

import models

VOCAB, HIDDEN = 32, 8


@pytest.fixture(scope="module")
def strategy():
    return tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}))


def looked_up(strategy, table, ids, weights, read=None):
    """(rows, the table's gradient of sum(rows · weights), the compiled
    step's collectives) of `read(table, ids)` (default: `lookup` over
    "model") with the table split [model, None] and ids and weights
    split over the data axis along their first dimension."""
    read = read or (lambda t, i: vocab_parallel.lookup(t, i, "model"))

    def step(table, ids, weights):
        with tf.GradientTape() as tape:
            tape.watch(table)
            rows = read(table, ids)
            loss = tf.reduce_sum(rows * weights)
        return (strategy.extended.replicate(rows),
                strategy.extended.replicate(tape.gradient(loss, table)))

    traced = tf.function(lambda *a: strategy.run(step, args=a))
    placed = (placement.put(table, ("model", None), strategy.mesh),
              placement.put(ids, ("data",) + (None,) * (ids.ndim - 1),
                            strategy.mesh),
              placement.put(weights, ("data",) + (None,) * (ids.ndim),
                            strategy.mesh))
    rows, gradient = traced(*placed)
    name = traced.get_concrete_function(*placed).name
    name = name.decode() if isinstance(name, bytes) else name
    program = program_lib.program_for_traced(name)
    return (placement.fetch(rows), placement.fetch(gradient),
            program.collectives(program.backward_nodes()))


def expected(table, ids, weights):
    """tf.gather's rows and the table's gradient (rows added)."""
    gradient = np.zeros_like(table)
    np.add.at(gradient, ids, weights)
    return table[ids], gradient


def draw(rng, ids_shape):
    table = rng.normal(size=(VOCAB, HIDDEN)).astype("float32")
    ids = rng.integers(0, VOCAB, ids_shape).astype("int32")
    weights = rng.normal(size=ids_shape + (HIDDEN,)).astype("float32")
    return table, ids, weights


def test_each_device_reads_its_rows_and_the_blocks_are_summed(strategy):
    table, ids, weights = draw(np.random.default_rng(0), (4, 6))
    rows, gradient, collectives = looked_up(strategy, table, ids, weights)
    want_rows, want_gradient = expected(table, ids, weights)
    np.testing.assert_allclose(rows, want_rows, rtol=1e-6)
    np.testing.assert_allclose(gradient, want_gradient, rtol=1e-5,
                               atol=1e-6)
    # The blocks summed, (batch/data, 6, hidden) float32, over the model
    # axis, and each device's (32/4, 8) block of the table's gradient
    # summed over the data axis (the batch split over it): nothing else,
    # no gather of the (32, 8) table. (The all-gathers left out are the
    # test's own replicate of its two results.)
    mine = [(c.axes, c.purpose, c.bytes) for c in collectives
            if c.purpose != "all-gather"]
    assert mine == [(("model",), "all-reduce", 2 * 6 * HIDDEN * 4),
                    (("data",), "all-reduce", VOCAB // 4 * HIDDEN * 4)], (
        collectives)


def test_dtensor_gathers_for_the_batched_gathers_own_gradient(strategy):
    """Why `lookup` writes its gradient: the same batched gather of the
    (4, 8, 8) blocks differentiated by TensorFlow (a segment sum, whose
    output DTensor 2.21 cannot split) gives right values through a whole
    (32, 8) partial gradient per device reduce-scattered over the model
    axis, with the ids and the rows' gradient gathered over the data
    axis. If this test fails, DTensor lays that gradient out itself."""
    unsharded = dtensor.UNSHARDED

    def plain(table, ids):
        mesh = tfpar.collectives.step_mesh(ids)
        blocks = dtensor.relayout(
            tf.reshape(table, (4, VOCAB // 4, HIDDEN)),
            dtensor.Layout(["model", unsharded, unsharded], mesh))
        first = dtensor.relayout(tf.range(4) * (VOCAB // 4),
                                 dtensor.Layout(["model"], mesh))
        local = tf.expand_dims(ids, 0) - tf.reshape(first, (4, 1, 1))
        held = tf.logical_and(local >= 0, local < VOCAB // 4)
        read = tf.gather(blocks, tf.where(held, local, 0), batch_dims=1)
        return tf.reduce_sum(
            read * tf.expand_dims(tf.cast(held, read.dtype), -1), 0)

    table, ids, weights = draw(np.random.default_rng(1), (4, 6))
    rows, gradient, collectives = looked_up(strategy, table, ids, weights,
                                            plain)
    want_rows, want_gradient = expected(table, ids, weights)
    np.testing.assert_allclose(rows, want_rows, rtol=1e-6)
    np.testing.assert_allclose(gradient, want_gradient, rtol=1e-5,
                               atol=1e-6)
    backward = [(c.axes, c.purpose, c.bytes) for c in collectives
                if c.phase == "backward"]
    assert (("model",), "reduce-scatter", VOCAB * HIDDEN * 4) in backward
    # the rows' gradient, (4, 6, 8) float32, whole over the data axis
    assert (("data",), "all-gather", 4 * 6 * HIDDEN * 4) in backward


@pytest.mark.slow  # each example compiles a step (~2 s)
@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(shape=st.sampled_from([(4,), (2, 6), (2, 3, 2)]),
                  seed=st.integers(0, 2**16))
def test_lookup_is_a_gather_for_ids_of_any_rank(strategy, shape, seed):
    table, ids, weights = draw(np.random.default_rng(seed), shape)
    rows, gradient, _ = looked_up(strategy, table, ids, weights)
    want_rows, want_gradient = expected(table, ids, weights)
    np.testing.assert_allclose(rows, want_rows, rtol=1e-6)
    np.testing.assert_allclose(gradient, want_gradient, rtol=1e-5,
                               atol=1e-6)


def test_outside_a_step_it_is_a_gather():
    table, ids, _ = draw(np.random.default_rng(2), (3, 5))
    np.testing.assert_array_equal(
        vocab_parallel.lookup(tf.constant(table), tf.constant(ids), "model"),
        table[ids])


def tied_lm(mask_zero):
    """Token ids -> a tied ReversibleEmbedding (vocabulary 64, width 16;
    padding ids 0 masked when `mask_zero`) -> self-attention, which reads
    the padding mask -> the tied logits."""
    tokens = keras.Input((8,), dtype="int32")
    embed = keras.layers.ReversibleEmbedding(64, 16, mask_zero=mask_zero,
                                             name="embed")
    h = embed(tokens)
    h = h + keras.layers.MultiHeadAttention(2, 8, name="attention")(h, h)
    return keras.Model(tokens, embed(h, reverse=True))


@pytest.mark.parametrize("mask_zero, fsdp", [
    (True, False), pytest.param(False, True, marks=pytest.mark.slow)])
def test_a_tied_table_split_by_vocabulary_trains_like_one_device(mask_zero,
                                                                 fsdp):
    """A tied table under VocabParallel on data=2 x model=4 (with fsdp:
    also split over the data axis and gathered for the step): Adam,
    losses and weights as one device's; padding ids (0) masked where the
    table's output is read (the attention), so the lookup must carry
    Keras' mask; each device holds its vocabulary block."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (32, 8)).astype("int32")
    x[:, 6:] = 0  # padding
    y = rng.integers(1, 64, (32, 8)).astype("int32")
    keras.utils.set_random_seed(0)
    weights = tied_lm(mask_zero).get_weights()

    def build():
        model = tied_lm(mask_zero)
        model.set_weights(weights)
        return model

    def compiled(model):
        model.compile(optimizer=keras.optimizers.Adam(),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        return model

    reference, want = models.train_built(None, lambda: compiled(build()),
                                         x, y, 16)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      fsdp=fsdp)

    def parallel():
        model = build()
        strategy.apply_rules(model, tfpar.LayoutRules(
            {r"embed": tfpar.VocabParallel()}))
        return compiled(model)

    model, got = models.train_built(strategy, parallel, x, y, 16)
    assert models.relative_error(want, got) < 1e-4, (want, got)
    for a, b in zip(reference.weights, model.weights):
        if a.path == "attention/key/bias":  # its true gradient is zero:
            # rounding noise (both ~1e-11 here), compared absolutely
            assert np.abs(a.numpy() - b.numpy()).max() < 1e-8
            continue
        assert models.relative_error(a.numpy(), b.numpy()) < 1e-4, a.path
    table = next(w for w in model.weights if w.path == "embed/embeddings")
    models.assert_one_block_per_device(
        table, ("model", "data") if fsdp else ("model", None))
