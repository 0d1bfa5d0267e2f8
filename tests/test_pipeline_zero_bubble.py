"""Zero-bubble schedules run: B (input gradients) and W (weight gradients)
split over one forward, in parity with 1F1B and one device (ZB-H1, ZB-H2,
and ZB-V with two parts per stage in a V).

The model (x -> d0 -> d1 -> add(d1, d0) -> ln -> d2 -> scale -> out) has a
skip connection, a LayerNormalization, a layer called twice (shared `d1`
in stage 0: W sums over its calls) and a custom layer; sparse embedding
gradients split off are checked in tests/test_pipeline.py (zb-h1 case).
"""

import functools

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar

import models

RTOL = 1e-4
BATCH = 32


def build(regularize=False):
    x = keras.Input((16,), name="x")
    h0 = keras.layers.Dense(32, activation="relu", name="d0")(x)
    shared = keras.layers.Dense(32, activation="tanh", name="d1")
    h1 = shared(shared(h0))                                # two calls
    h = keras.layers.Add(name="add")([h1, h0])           # skip connection
    h = keras.layers.LayerNormalization(name="ln")(h)
    h = keras.layers.Dense(
        32, activation="relu", name="d2",
        kernel_regularizer=keras.regularizers.L2(1e-3) if regularize else None)(h)
    h = models.Scale(name="scale")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h), name="net")


@functools.lru_cache(maxsize=None)
def initial_weights():
    keras.utils.set_random_seed(0)
    return tuple(build().get_weights())


def train(model, optimizer="adam"):
    model.set_weights(list(initial_weights()))
    model.compile(optimizer=keras.optimizers.Adam(0.01) if optimizer == "adam"
                  else keras.optimizers.SGD(0.1), loss="mse")
    losses = models.BatchLosses()
    x, y = models.mlp_data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[losses])
    return losses.losses, [np.asarray(w) for w in model.get_weights()]


@functools.lru_cache(maxsize=None)
def reference(optimizer="adam"):
    return train(build(), optimizer)


def pipeline(axes, **kwargs):
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes))
    with strategy.scope():
        return tfpar.PipelineModel(build(), **kwargs)


def assert_same(want, got):
    assert len(want[0]) == len(got[0]) == 2
    assert models.relative_error(want[0], got[0]) < RTOL
    for a, b in zip(want[1], got[1]):
        assert models.relative_error(a, b) < RTOL


@pytest.mark.parametrize("axes,schedule,m,boundaries", [
    pytest.param({"pipe": 2, "data": 4}, "zb-h1", 4, None,
                 marks=pytest.mark.slow),
    pytest.param({"pipe": 2, "data": 4}, "zb-h2", 4, None,
                 marks=pytest.mark.slow),
    pytest.param({"pipe": 4, "data": 2}, "zb-h1", 4, ["add", "d2", "out"],
                 marks=pytest.mark.slow),
    ({"pipe": 4, "data": 2}, "zb-h2", 8, ["add", "d2", "out"]),
])
def test_zero_bubble_parity_with_one_device_and_1f1b(axes, schedule, m,
                                                     boundaries):
    pipe = pipeline(axes, num_microbatches=m, schedule=schedule,
                    stage_boundaries=boundaries)
    assert pipe.schedule.split_backward
    assert_same(reference(), train(pipe))


def test_zbv_parity_with_one_device_and_its_v():
    """ZB-V: the model cut into 4 parts, stage 0 holding parts 0 and 3 (the
    first and the last: loss, metrics and the compiled optimizer live on
    stage 0), stage 1 parts 1 and 2 (the turn of the V, no transfer)."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        pipe = tfpar.PipelineModel(build(), num_microbatches=4,
                                   schedule="zbv")
    assert pipe.schedule.name == "zbv" and pipe.virtual_stages == 2
    stages = [strategy.stage_meshes.index(part.mesh) for part in pipe.parts]
    assert stages == [0, 1, 1, 0]
    assert "part 3 (stage 0, chunk 1)" in pipe.split_report()
    assert_same(reference(), train(pipe))
    out = pipe.get_layer("out").kernel
    assert dtensor.fetch_layout(out.value).mesh == \
        strategy.stage_meshes[0].dtensor_mesh


@pytest.mark.slow
def test_zbv_on_four_stages_equals_one_device():
    """p = 4: eight parts of a deeper MLP in a V (stage s: parts s, 7 - s),
    m = 8 >= 2p - 1, Adam."""
    def deep():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((16,))] + [
            keras.layers.Dense(16, activation="tanh", name=f"d{i}")
            for i in range(7)] + [keras.layers.Dense(3, name="out")])

    weights = deep().get_weights()
    x, y = models.mlp_data()

    def fit(model):
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        losses = models.BatchLosses()
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[losses])
        return losses.losses, [np.asarray(w) for w in model.get_weights()]

    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 4, "data": 2}))
    with strategy.scope():
        pipe = tfpar.PipelineModel(deep(), num_microbatches=8,
                                   schedule="zbv")
    assert [strategy.stage_meshes.index(part.mesh) for part in pipe.parts
            ] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert_same(fit(deep()), fit(pipe))


@pytest.mark.slow
@pytest.mark.parametrize("schedule,m", [("zb-h1", 2), ("zbv", 4)])
def test_zero_bubble_equals_1f1b_with_plain_sgd(schedule, m):
    one = train(pipeline({"pipe": 2, "data": 4}, num_microbatches=m,
                         schedule="1f1b"), "sgd")
    zb = train(pipeline({"pipe": 2, "data": 4}, num_microbatches=m,
                        schedule=schedule), "sgd")
    assert_same(reference("sgd"), zb)
    assert_same(one, zb)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb-h2", "zbv"])
def test_partial_last_batch_runs_the_same_order_with_fewer_microbatches(
        schedule):
    pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=4,
                    schedule=schedule)
    x, y = models.mlp_data()
    pipe.set_weights(list(initial_weights()))
    pipe.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain = build()
    plain.set_weights(list(initial_weights()))
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y = x[:34], y[:34]  # last batch of 2: m = 2 < 2p - 1, same order
    for model in (pipe, plain):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), pipe.get_weights()):
        assert models.relative_error(a, b) < RTOL


def test_clear_errors_before_training():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 4, "data": 2}))
    with strategy.scope():
        with pytest.raises(ValueError, match=r"'zb-h2' needs num_microbatches"
                           r" >= 2 × num_stages - 1 = 7.*num_microbatches=4"):
            tfpar.PipelineModel(build(), num_microbatches=4, schedule="zb-h2")
        with pytest.raises(ValueError, match=r"'zb-h1' needs num_microbatches"
                           r" >= num_stages = 4.*num_microbatches=2"):
            tfpar.PipelineModel(build(), num_microbatches=2, schedule="zb-h1")
        with pytest.raises(ValueError, match=r"'zbv' needs num_microbatches"
                           r" >= 2 × num_stages - 1 = 7.*num_microbatches=4"):
            tfpar.PipelineModel(build(), num_microbatches=4, schedule="zbv")
        with pytest.raises(ValueError, match=r"schedule='zbv' cuts the model "
                           r"into 2 × stages = 8 parts.*only 7 layer"):
            tfpar.PipelineModel(build(), num_microbatches=8, schedule="zbv")
        with pytest.raises(ValueError, match=r"layer\(s\) \['d2'\] have weight"
                           r" or activity regularizers.*cannot be separated"
                           r".*schedule='1f1b'"):
            tfpar.PipelineModel(build(regularize=True), num_microbatches=4,
                                schedule="zb-h1")


def test_a_layer_adding_losses_in_call_is_refused_when_tracing():
    class Penalty(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

        def call(self, x):
            self.add_loss(keras.ops.sum(self.w ** 2))
            return x * self.w

    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        x = keras.Input((4,))
        h = Penalty(name="penalty")(keras.layers.Dense(4, name="a")(x))
        model = keras.Model(x, keras.layers.Dense(1, name="b")(h))
        pipe = tfpar.PipelineModel(model, num_microbatches=2,
                                   schedule="zb-h1")
        pipe.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"\['penalty'\] add losses in call"):
        pipe.fit(np.zeros((16, 4)), np.zeros((16, 1)), batch_size=16,
                 verbose=0)
