"""The Ulysses exchange of context attention (tfpar/ulysses_attention.py).

A plain Keras causal transformer (MultiHeadAttention, 4 heads) trains on
data=2 × context=4 with the exchange forced to "ulysses" in parity with one
device; the compiled step's collectives over the context axis are the
moves of q, k, v and the output (each, on TF 2.21, an all-gather of the
(b/data, s, heads, dim) block, then a slice), against the "gather" mode's
two key/value gathers: the bytes of both modes, read from the compiled
steps, equal `exchange_bytes`' formulas. "auto" picks the smaller (on TF
2.21 "gather"), and a forced "ulysses" where the heads do not divide over
the axis is an error naming the layer.
"""

import keras
import numpy as np
import pytest

import tfpar
from tfpar import context_parallel
from tfpar import ulysses_attention

import context_models
import fuzzing
import test_context_parallel as base

SEQ, BATCH, CONFIG = base.SEQ, base.BATCH, base.CONFIG
HEAD_DIM = CONFIG["dim"] // CONFIG["heads"]


def mesh_strategy(mode, balance=False):
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    if balance:
        context_parallel.load_balance(strategy)
    context_parallel.set_attention_exchange(strategy, mode)
    return strategy


def context_gathers(programs, phase):
    """[bytes] of the all-gathers over the context axis alone in `phase`
    of the captured training step."""
    return [c.bytes for c in programs.train_report().select(
        purpose="all-gather", axes=("context",), phase=phase)]


@pytest.fixture(scope="module")
def corpus():
    return context_models.weights_and_corpus(CONFIG, BATCH, SEQ)


def train_once(strategy, weights, x, y):
    """(model, losses): test_context_parallel's training, one epoch (2
    batches of 16, Adam)."""
    build = lambda: context_models.causal_transformer(**CONFIG)  # noqa: E731
    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    model.set_weights(weights)
    base.compile_model(model)
    losses = base.models.BatchLosses()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[losses])
    return model, losses.losses


@pytest.mark.parametrize("mode", [
    "ulysses", pytest.param("auto", marks=pytest.mark.slow)])
def test_parity_and_the_bytes_of_each_exchange(corpus, mode):
    """"ulysses" forced, and "auto" (the default: "gather" on TF 2.21, the
    same as tests/test_context_parallel.py's default case): in parity with
    one device; the context all-gathers and score blocks of the step."""
    weights, x, y = corpus
    reference, ref_losses = train_once(None, weights, x, y)
    with tfpar.communication.capture() as programs:
        model, losses = train_once(mesh_strategy(mode), weights, x, y)
    base.assert_parity(reference, ref_losses, model, losses)
    gathers = context_gathers(programs, "forward")
    scores = {s for n, s in programs.train_report().forward_shapes(
        r"b0_attn").items() if len(s) == 4 and n.endswith("Einsum")}
    # Per device and forward pass, (b/data = 8, s, heads, dim) float32
    # blocks: Ulysses moves q, k, v and the output, each gathered whole
    # then sliced; gather gathers k and v. Nothing larger moves (the rest:
    # two 2 KiB gathers outside attention, in both modes).
    block = 8 * SEQ * CONFIG["heads"] * HEAD_DIM * 4
    moves = {"ulysses": 4, "auto": 2}[mode]
    assert gathers.count(block) == moves and max(gathers) == block, gathers
    # exchange_bytes counts what each device sends: (cp-1)/cp of each.
    want = ulysses_attention.exchange_bytes(8, SEQ, CONFIG["heads"],
                                            CONFIG["heads"], HEAD_DIM, 4, 4)
    assert want[{"ulysses": "ulysses", "auto": "gather"}[mode]] == (
        moves * block * 3 / 4)
    # Score blocks: Ulysses (b/data, heads/cp = 1, all s queries, s/cp
    # keys); gather (b/data, heads, s/cp queries, s/cp keys).
    shape = {"ulysses": (8, 1, SEQ, SEQ // 4),
             "auto": (8, CONFIG["heads"], SEQ // 4, SEQ // 4)}[mode]
    assert shape in scores, scores
    print(f"{mode}: context all-gathers per device, forward: {gathers}")


def test_auto_picks_gather_on_this_tensorflow_and_ulysses_if_true():
    # Multi-head, cp=4: Ulysses sends 4·block/cp·f, gather 2·block.
    sizes = ulysses_attention.exchange_bytes(8, 32, 4, 4, 8, 4, 4)
    assert sizes["gather"] < sizes["ulysses"]  # f = cp on TF 2.21
    true = ulysses_attention.exchange_bytes(8, 32, 4, 4, 8, 4, 4,
                                            all_to_all_is_gather=False)
    assert true["ulysses"] == true["gather"] / 2
    # Grouped-query 4:1 at cp=4 (cp <= 2·kv_groups): gather even then.
    gqa = ulysses_attention.exchange_bytes(8, 32, 4, 1, 8, 4, 4,
                                           all_to_all_is_gather=False)
    assert gqa["gather"] < gqa["ulysses"]


def test_forced_ulysses_with_indivisible_heads_names_the_layer(corpus):
    _, x, y = corpus
    strategy = mesh_strategy("ulysses")
    with strategy.scope():
        model = context_models.causal_transformer(**dict(CONFIG, heads=2))
    base.compile_model(model)
    with pytest.raises(ValueError, match=r"b0_attn.*2 query heads do not "
                       r"divide over the context axis 'context' of size 4"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


def test_modes_are_checked_and_set_per_strategy_or_process():
    with pytest.raises(ValueError, match=r"mode must be one of.*'ring'"):
        context_parallel.set_attention_exchange(None, "ring")
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    with pytest.raises(ValueError, match=r"needs a context axis"):
        context_parallel.set_attention_exchange(strategy, "ulysses")
    previous = context_parallel.set_attention_exchange(None, "gather")
    try:
        other = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
        assert ulysses_attention.exchange_of(other.extended) == "gather"
        assert context_parallel.set_attention_exchange(
            other, "ulysses") == "gather"
        assert ulysses_attention.exchange_of(other.extended) == "ulysses"
    finally:
        context_parallel.set_attention_exchange(None, previous)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_ulysses_load_balanced_parity(corpus, optimizer):
    """Load balance: the gathered sequence is in the stored (balanced)
    order, its masks by those global positions."""
    weights, x, y = corpus
    reference, ref_losses = base.train(None, weights, x, y, optimizer)
    model, losses = base.train(mesh_strategy("ulysses", balance=True),
                               weights, x, y, optimizer)
    base.assert_parity(reference, ref_losses, model, losses)


@pytest.mark.slow
def test_ulysses_padded_sequences(corpus):
    """A padding mask (batch, s, s) made whole on every device."""
    weights, x, y = corpus
    rng = np.random.RandomState(1)
    x = dict(x, tokens=x["tokens"].copy())
    for row, length in enumerate(rng.randint(SEQ // 2, SEQ + 1,
                                             size=len(x["tokens"]))):
        x["tokens"][row, length:] = 0
    x["tokens"][:, 0] = np.maximum(x["tokens"][:, 0], 1)

    def build():
        return context_models.causal_transformer(**CONFIG, mask_zero=True)

    reference, ref_losses = base.train(None, weights, x, y, build=build)
    model, losses = base.train(mesh_strategy("ulysses"), weights, x, y,
                               build=build)
    base.assert_parity(reference, ref_losses, model, losses)


@pytest.mark.slow
@pytest.mark.parametrize("balance", [False, True])
def test_ulysses_keras_hub_llama3(balance):
    """Grouped-query (4 query, 2 key/value heads; the keys moved repeated
    to the 4 query heads) on data=2 × context=4."""
    x, y = context_models.hub_corpus(32)
    keras.utils.set_random_seed(0)
    weights = context_models.hub_causal_lm("llama3").get_weights()
    want = context_models.train_hub("llama3", None, weights, x, y)
    exact = context_models.train_hub("llama3", None, weights, x, y,
                                     policy="float64")
    with tfpar.communication.capture() as programs:
        got = context_models.train_hub(
            "llama3", mesh_strategy("ulysses", balance), weights, x, y)
    fuzzing.assert_parity(want[0], got[0], want[1], got[1], exact=exact)
    # q, k, v (k and v repeated to the 4 query heads) and the output moved:
    # (b/data = 8, s, 4 heads, dim 8) float32, each gathered whole.
    block = 8 * context_models.HUB_SEQ * 4 * 8 * 4
    assert context_gathers(programs, "forward").count(block) == 4
