"""Why tfpar's steps join Keras' concatenate on a non-negative axis with the
joined dimension whole (`tfpar.spmd_ops.concat_whole_along_axis`).

On TF 2.21 DTensor concatenates each device's blocks when a consumer splits
the joined dimension and the axis is negative (a wrong result, no error),
and refuses the same split for a non-negative axis
(tests/dtensor_concat_axis_repro.py, which also sweeps the other ops that
take an axis). If the repro's assertions start failing on a newer TF,
DTensor lays the concat out itself and the pin can go.

Keras' `Concatenate()` joins on axis -1, so any consumer splitting the
joined features met it: a row-parallel Dense after a Concatenate trained
away from one device (first loss 1.99 for one device's 1.80 on data=2 x
model=4; in a pipeline stage too), and so did a recomputed
BatchNormalization with gamma split (tests/test_fuzz_models.py).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar

import dtensor_concat_axis_repro as repro
import models

RTOL = 1e-4


def test_negative_axis_concat_is_wrong_and_pinned_one_is_right():
    assert repro.concat_case() == {
        "concat(axis=-1) * g": "wrong",
        "concat(axis=1) * g": "fails: Concat op SPMD with concat dimension in "
                              "sharded dimension is not supported.",
        "relayout(concat(axis=-1), whole columns) * g": "right",
    }


@pytest.mark.slow  # 22 ops: 4 CPU-minutes (19 min of wall time under load 23)
def test_sweep_of_axis_ops_finds_only_concat_silently_wrong():
    found = repro.sweep(list(repro.OPS))
    wrong = {name: [c for c, r in results.items() if r == "wrong"]
             for name, results in found.items()}
    assert {name for name, cases in wrong.items() if cases} == {"concat"}
    # Only the negative spelling, only where the consumer splits the
    # joined dimension (the output's dimension `axis`).
    assert all(axis < 0 and out_dim == axis % len(shape)
               for shape, axis, _, out_dim in wrong["concat"])
    # Elsewhere DTensor refuses as often for either spelling.
    for name, results in found.items():
        fails = [c[1] < 0 for c, r in results.items()
                 if r.startswith("fails")]
        if name != "concat":
            assert fails.count(True) == fails.count(False), name


class TFConcat(keras.layers.Layer):
    """A user's own layer joining with TF's op: `tf.concat(..., axis=-1)`."""

    def call(self, inputs):
        return tf.concat(inputs, axis=-1)


def joined(join=keras.layers.Concatenate):
    """Features and a branch of three Dense layers joined on axis -1 (by
    Keras' Concatenate, or `join`), then a Dense (`out`) whose kernel the
    rules split by rows."""
    features = keras.Input((8,), name="features")
    h = features
    for i in range(3):
        h = keras.layers.Dense(8, activation="tanh", name=f"d{i}")(h)
    h = join(name="join")([features, h])
    return keras.Model(features, keras.layers.Dense(3, name="out")(h))


def train(strategy, build, weights):
    """(per-batch losses, weights) after two epochs of plain SGD."""
    rng = np.random.RandomState(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")
    losses, model = models.train_sgd_in_order(strategy, build, weights, x, y)
    return losses, model.get_weights(), model


@pytest.fixture(scope="module")
def one_device():
    keras.utils.set_random_seed(0)
    weights = joined().get_weights()
    return weights, train(None, joined, weights)


def assert_parity(want, got, block):
    """Losses and weights within RTOL; every device holds only its `block`
    (rows) of `out`'s (16, 3) kernel."""
    assert models.relative_error(want[0], got[0]) < RTOL, (want[0], got[0])
    for a, b in zip(want[1], got[1]):
        assert models.relative_error(a, b) < RTOL
    kernel = got[2].get_layer("out").kernel.value.read_value()
    assert {tuple(b.shape) for b in dtensor.unpack(kernel)} == {(block, 3)}


ROWS = {"out/kernel": ("model", None)}


# Keras' Concatenate is slow here: tests/test_fuzz_models.py's default case
# joins with it; both reach TF's ConcatV2, where tfpar pins the join. A raw
# tf.concat(axis=-1) trained 0.29/0.18 for one device's 0.91/0.26 on
# data=2 x model=4 before the pin moved from Keras' concatenate to ConcatV2.
@pytest.mark.parametrize("join", [
    pytest.param(keras.layers.Concatenate, marks=pytest.mark.slow),
    TFConcat], ids=["keras", "tf.concat"])
def test_concatenate_into_row_parallel_dense_matches_one_device(
        one_device, join):
    weights, want = one_device
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=ROWS)
    assert_parity(want, train(strategy, lambda: joined(join), weights),
                  block=4)


def test_concatenate_outside_a_step_is_keras_own():
    """Eagerly and in a tf.function that is not a tfpar step (no mesh to
    pin on), Keras' concatenate (TF's ConcatV2) under a strategy joins as
    Keras does."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=ROWS)
    a, b = np.ones((2, 3), "float32"), np.zeros((2, 1), "float32")
    with strategy.scope():
        eager = keras.ops.concatenate([a, b], axis=-1)
        traced = tf.function(
            lambda: keras.ops.concatenate([a, b], axis=-1))()
    for got in (eager, traced):
        assert not dtensor.is_dtensor(got)
        np.testing.assert_array_equal(got, np.concatenate([a, b], -1))


# Slow (37 s each under load 23): the default run pins a Concatenate inside
# a pipeline stage in tests/test_pipeline.py::
# test_gradients_of_integer_inputs_and_embeddings[1f1b] (whole consumer).
@pytest.mark.slow
@pytest.mark.parametrize("schedule,virtual", [
    ("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("1f1b", 2)])  # 2: interleaved
def test_pipeline_stage_concatenate_into_row_parallel_dense(
        one_device, schedule, virtual):
    """The join and the row-parallel Dense on the last part, on the last
    stage's own sub-mesh of pipe=2 x data=2 x model=2 (interleaved: four
    parts, one Dense each before)."""
    weights, want = one_device
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"pipe": 2, "data": 2, "model": 2}), rules=ROWS)
    boundaries = ["d1"] if virtual == 1 else ["d1", "d2", "join"]
    assert_parity(want, train(strategy, lambda: tfpar.PipelineModel(
        joined(), num_microbatches=2, schedule=schedule,
        virtual_stages=virtual, stage_boundaries=boundaries), weights),
        block=8)


class ClassToken(keras.layers.Layer):
    """ViT's class token: a learned vector joined before the sequence
    (axis 1 of a rank-3 batch), as keras-hub's ViTPatchingAndEmbedding."""

    def build(self, input_shape):
        self.token = self.add_weight(shape=(1, 1, input_shape[-1]),
                                     name="token")

    def call(self, x):
        token = tf.tile(self.token, [tf.shape(x)[0], 1, 1])
        return keras.ops.concatenate([token, x], axis=1)


def sequence_joined():
    """Rank-3 joins: a class token along the sequence (axis 1), then the
    sequence with itself along the features (axis -1) into `down`, whose
    kernel the rules split by rows; `up` splits the features first."""
    x = keras.Input((4, 8), name="tokens")
    h = keras.layers.Dense(8, activation="tanh", name="up")(x)
    h = ClassToken(name="cls")(h)
    h = TFConcat(name="join")([h, x[:, :1, :] + h])
    h = keras.layers.Dense(4, activation="tanh", name="down")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(
        keras.layers.Flatten()(h)))


# Regression: from rank 3 the pin's layout kept every other dimension as
# laid out (a MATCH each), which DTensor 2.21 refuses ("Attempted to shard
# two or more tensor dimensions over mesh dimension match"): keras-hub's
# ViT failed to trace on data=2 x model=4 under every plan
# (benchmarks/hub_model_plans.py found it; the suite's joins were rank 2).
def test_rank_3_concatenates_match_one_device():
    keras.utils.set_random_seed(0)
    weights = sequence_joined().get_weights()
    rng = np.random.RandomState(0)
    x = rng.normal(size=(32, 4, 8)).astype("float32")
    y = rng.normal(size=(32, 3)).astype("float32")
    want, single = models.train_sgd_in_order(None, sequence_joined,
                                             weights, x, y)
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 4}),
        rules={"up/kernel": (None, "model"), "down/kernel": ("model", None)})
    got, model = models.train_sgd_in_order(strategy, sequence_joined,
                                           weights, x, y)
    assert models.relative_error(want, got) < RTOL, (want, got)
    for a, b in zip(single.get_weights(), model.get_weights()):
        assert models.relative_error(a, b) < RTOL
    kernel = model.get_layer("down").kernel.value.read_value()
    assert {tuple(b.shape) for b in dtensor.unpack(kernel)} == {(4, 4)}
