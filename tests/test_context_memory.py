"""Context parallelism keeps activation memory linear in the sequence.

At a fixed context size the compiled step's saved activations per device
(the forward tensors the backward pass reads, `tfpar.memory_report`) must
grow linearly with the sequence length s: blockwise attention keeps Q, K,
V, O and the row statistics, O(s/cp + s) per row of heads, and recomputes
each (s/cp × s/cp) probability block in the backward pass. Anything of
s/cp × s elements kept between the passes (score or probability blocks, a
mask) makes doubling s multiply them by ~3 or more at these sizes; linear
gives 2. (Before the recomputation was made to wait for the gradient, TF's
executor computed it in the forward pass and kept every block: 2.96× from
256 to 512 tokens in benchmarks/context.py.)
"""

import keras
import numpy as np
import pytest

import tfpar

import context_models

# Many heads and a small width: the s/cp × s terms, if any, dominate.
CONFIG = dict(vocab=32, dim=32, heads=8, layers=1)
SHORT = 64
GROWTH_LIMIT = 2.2  # of the saved activations when s doubles (linear: 2)


def saved_activation_bytes(seq_len, balance=False, **config):
    """The largest device's saved activations of one step of the causal
    transformer on data=2 × context=4, two sequences of `seq_len`."""
    keras.utils.set_random_seed(0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "context": 4}))
    if balance:
        tfpar.context_parallel.load_balance(strategy)
    with strategy.scope():
        model = context_models.causal_transformer(
            **dict(CONFIG, **config), seq_len=seq_len)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    x, y = context_models.corpus(2, seq_len=seq_len)
    if config.get("mask_zero"):  # padded tails; the first token kept
        x = dict(x, tokens=x["tokens"].copy())
        x["tokens"][0, seq_len // 2:] = 0
        x["tokens"][:, 0] = np.maximum(x["tokens"][:, 0], 1)
    report = tfpar.memory_report(model, x, y)
    return max(row["activations"] for row in report.values())


def assert_linear(**config):
    short, long = (saved_activation_bytes(s, **config)
                   for s in (SHORT, 2 * SHORT))
    assert 0 < short and long <= GROWTH_LIMIT * short, (short, long,
                                                        long / short)


def test_causal_attention_activations_grow_linearly_in_the_sequence():
    assert_linear()


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    dict(mask_zero=True), dict(kv_heads=2), dict(balance=True),
    dict(kv_heads=2, mask_zero=True, balance=True)],
    ids=["padded", "grouped_query", "load_balanced", "all"])
def test_activations_grow_linearly_with_masks_and_grouped_queries(config):
    assert_linear(**config)
