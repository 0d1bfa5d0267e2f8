"""Property: a PipelineModel with random stage count, micro-batch count,
schedule, virtual stages and stage boundaries trains in parity with one
device, or is refused with a clear error before the first step.

Drawn: p in {2, 4} stages (the rest of the 8 devices a data axis), m in
{1, 2, 3, 4, 8} micro-batches, schedule gpipe / 1f1b / an unknown name,
virtual stages 1-3, boundaries: none (balanced by parameters) or random
layer names (possibly unsorted, repeated or unknown), and the model: an
MLP, or padded token sequences whose Keras mask (`Embedding(mask_zero=
True)`) attention reads from its inputs wherever the cuts fall (masks
were lost at a cut until 2026-12-07).
"""

import hypothesis
import keras
import numpy as np
from hypothesis import strategies as st

import tfpar

import fuzzing
import models

DEPTH, N, BATCH = 6, 32, 16
NAMES = [f"dense{i}" for i in range(DEPTH)] + ["head"]
MASKED_NAMES = ["embed", "dense0", "attend", "dense1", "dense2", "pool",
                "head"]

CASES = st.tuples(
    st.sampled_from([2, 4]),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.sampled_from(["gpipe", "1f1b", "zigzag"]),
    st.integers(1, 3),
    st.one_of(st.none(), st.lists(
        st.sampled_from(sorted(set(NAMES[1:] + MASKED_NAMES[1:]))
                        + ["nowhere"]), min_size=1, max_size=6)),
    st.sampled_from(["mlp", "masked"]),
)


def mlp():
    return keras.Sequential([keras.Input((8,))] + [
        keras.layers.Dense(8, activation="tanh", name=name)
        for name in NAMES[:-1]] + [keras.layers.Dense(3, name="head")])


def masked():
    """Token ids (0: padding) through a mask_zero Embedding; the attention
    (no biases: a key bias has no gradient, only float32 noise) reads the
    mask from its inputs, the pooling from its mask argument."""
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(12, 8, mask_zero=True, name="embed")(tokens)
    h = keras.layers.Dense(8, activation="tanh", name="dense0")(h)
    h = keras.layers.MultiHeadAttention(2, 4, use_bias=False,
                                        name="attend")(h, h)
    h = keras.layers.Dense(8, activation="tanh", name="dense1")(h)
    h = keras.layers.Dense(8, activation="tanh", name="dense2")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(tokens, keras.layers.Dense(3, name="head")(h))


def _inputs(model_kind, rng):
    if model_kind == "mlp":
        return rng.normal(size=(N, 8)).astype("float32")
    tokens = rng.randint(1, 12, size=(N, 6)).astype("int32")
    tokens[:, 4:] = 0
    tokens[::3, 2:] = 0
    return tokens


def check_pipeline(case):
    stages, micro, schedule, virtual, boundaries, model_kind = case
    build = mlp if model_kind == "mlp" else masked
    rng = np.random.RandomState(0)
    x = _inputs(model_kind, rng)
    y = rng.normal(size=(N, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    single = build()
    weights = single.get_weights()
    want_losses, want_weights = fuzzing.train(single, x, y, weights,
                                              models.BatchLosses())

    def build_and_train(losses, built):
        strategy = tfpar.ParallelStrategy(
            tfpar.Mesh({"pipe": stages, "data": 8 // stages}))
        with strategy.scope():
            pipe = tfpar.PipelineModel(
                build(), num_microbatches=micro, schedule=schedule,
                stage_boundaries=boundaries, virtual_stages=virtual)
        built(pipe)
        return fuzzing.train(pipe, x, y, weights, losses)

    if fuzzing.parity_or_refused(build_and_train, weights, want_losses,
                                 want_weights) is None:
        return
    hypothesis.event(f"trained in parity: {schedule}, {model_kind}")


test_random_pipeline_trains_in_parity_or_is_refused, \
    test_random_pipeline_trains_in_parity_or_is_refused_long = \
    fuzzing.fast_and_long(check_pipeline, CASES, fast_examples=2)
