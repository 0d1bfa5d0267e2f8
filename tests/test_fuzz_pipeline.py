"""Property: a PipelineModel with random stage count, micro-batch count,
schedule, virtual stages and stage boundaries trains in parity with one
device, or is refused with a clear error before the first step.

Drawn: p in {2, 4} stages (the rest of the 8 devices a data axis), m in
{1, 2, 3, 4, 8} micro-batches, schedule gpipe / 1f1b / an unknown name,
virtual stages 1-3, boundaries: none (balanced by parameters) or random
layer names (possibly unsorted, repeated or unknown).
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

CASES = st.tuples(
    st.sampled_from([2, 4]),
    st.sampled_from([1, 2, 3, 4, 8]),
    st.sampled_from(["gpipe", "1f1b", "zigzag"]),
    st.integers(1, 3),
    st.one_of(st.none(), st.lists(
        st.sampled_from(NAMES[1:] + ["nowhere"]), min_size=1, max_size=6)),
)


def mlp():
    return keras.Sequential([keras.Input((8,))] + [
        keras.layers.Dense(8, activation="tanh", name=name)
        for name in NAMES[:-1]] + [keras.layers.Dense(3, name="head")])


def check_pipeline(case):
    stages, micro, schedule, virtual, boundaries = case
    rng = np.random.RandomState(0)
    x = rng.normal(size=(N, 8)).astype("float32")
    y = rng.normal(size=(N, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    single = mlp()
    weights = single.get_weights()
    want_losses, want_weights = fuzzing.train(single, x, y, weights,
                                              models.BatchLosses())

    def build_and_train(losses, built):
        strategy = tfpar.ParallelStrategy(
            tfpar.Mesh({"pipe": stages, "data": 8 // stages}))
        with strategy.scope():
            pipe = tfpar.PipelineModel(
                mlp(), num_microbatches=micro, schedule=schedule,
                stage_boundaries=boundaries, virtual_stages=virtual)
        built(pipe)
        return fuzzing.train(pipe, x, y, weights, losses)

    if fuzzing.parity_or_refused(build_and_train, weights, want_losses,
                                 want_weights) is None:
        return
    hypothesis.event(f"trained in parity: {schedule}")


test_random_pipeline_trains_in_parity_or_is_refused, \
    test_random_pipeline_trains_in_parity_or_is_refused_long = \
    fuzzing.fast_and_long(check_pipeline, CASES, fast_examples=2)
