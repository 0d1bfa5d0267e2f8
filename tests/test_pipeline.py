"""Pipeline parallelism: PipelineModel against single-device Keras.

The model (x -> d0 -> d1 -> add(d1, d0) -> ln -> d2 -> drop -> scale ->
out) has a skip connection, a weight regulariser, a LayerNormalization and
a custom layer. With the pipeline axis p in {2, 4}, m in {1, 4, 8}
micro-batches and both schedules, one epoch of Adam (two batches of 32)
gives the single-device per-batch losses and final weights within 1e-4
relative, alone (pipe × data) and with data and model axes together.
"""

import collections
import functools
import itertools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar
from tfpar.pipeline import ordering
from tfpar.pipeline.runner import PipelineRunner
from tfpar.training import StagedModel

import models

RTOL = 1e-4
BATCH = 32
LAYERS = ["d0", "d1", "add", "ln", "d2", "drop", "scale", "out"]
SLOW = pytest.mark.slow  # long profile only: python3 dev.py test-all

TP_RULES = {r".*d0/kernel": (None, "model"), r".*d0/bias": ("model",),
            r".*d1/kernel": ("model", None),
            r".*d2/kernel": (None, "model"), r".*d2/bias": ("model",),
            r".*out/kernel": ("model", None)}


def build():
    x = keras.Input((16,), name="x")
    h0 = keras.layers.Dense(32, activation="relu", name="d0")(x)
    h1 = keras.layers.Dense(32, activation="relu", name="d1")(h0)
    h = keras.layers.Add(name="add")([h1, h0])           # skip connection
    h = keras.layers.LayerNormalization(name="ln")(h)
    h = keras.layers.Dense(
        32, activation="relu", name="d2",
        kernel_regularizer=keras.regularizers.L2(1e-3))(h)
    h = models.InferenceDropout(0.2, name="drop")(h)
    h = models.Scale(name="scale")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h), name="net")


@functools.lru_cache(maxsize=None)
def initial_weights():
    keras.utils.set_random_seed(0)
    return tuple(build().get_weights())


def train(model):
    model.set_weights(list(initial_weights()))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                  metrics=["mae"])
    losses = models.BatchLosses()
    x, y = models.mlp_data()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                        verbose=0, callbacks=[losses])
    return {"losses": losses.losses, "mae": history.history["mae"],
            "weights": [np.asarray(w) for w in model.get_weights()]}


@functools.lru_cache(maxsize=None)
def reference():
    return train(build())


def pipeline(axes, rules=None, **kwargs):
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules)
    with strategy.scope():
        pipe = tfpar.PipelineModel(build(), **kwargs)
    return strategy, pipe


def assert_parity(result):
    expected = reference()
    assert len(result["losses"]) == len(expected["losses"]) == 2
    assert models.relative_error(expected["losses"], result["losses"]) < RTOL
    assert models.relative_error(expected["mae"], result["mae"]) < RTOL
    for want, got in zip(expected["weights"], result["weights"]):
        assert models.relative_error(want, got) < RTOL


# The default profile runs 4 of the 12 cases (each stage count, micro-batch
# count and schedule at least once); `dev.py test-all` runs them all.
_DEFAULT_PIPE_CASES = {(2, 4, "1f1b"), (4, 8, "1f1b"), (4, 1, "gpipe")}


@pytest.mark.parametrize("stages,microbatches,schedule", [
    pytest.param(*case, marks=() if case in _DEFAULT_PIPE_CASES
                 else pytest.mark.slow)
    for case in itertools.product([2, 4], [1, 4, 8], ["gpipe", "1f1b"])])
def test_parity_pipe_by_data(stages, microbatches, schedule):
    _, pipe = pipeline({"pipe": stages, "data": 8 // stages},
                       num_microbatches=microbatches, schedule=schedule)
    assert_parity(train(pipe))


@pytest.mark.parametrize("axes,microbatches,schedule", [
    ({"pipe": 2, "data": 2, "model": 2}, 4, "1f1b"),
    pytest.param({"pipe": 2, "data": 2, "model": 2}, 8, "gpipe", marks=SLOW),
    ({"data": 2, "pipe": 2, "model": 2}, 1, "1f1b"),
    pytest.param({"pipe": 4, "model": 2}, 8, "1f1b", marks=SLOW),
])
def test_parity_with_data_and_model_axes(axes, microbatches, schedule):
    strategy, pipe = pipeline(axes, rules=TP_RULES,
                              num_microbatches=microbatches,
                              schedule=schedule)
    assert_parity(train(pipe))
    # Tensor parallelism inside the stages is real: d0's kernel is split
    # over the model axis on its stage's devices.
    kernel = pipe.get_layer("d0").kernel
    blocks = dtensor.unpack(kernel.value.read_value())
    assert [tuple(c.shape) for c in blocks] == \
        [(16, 16)] * strategy.stage_meshes[0].size


def test_each_stage_holds_only_its_own_weights():
    strategy, pipe = pipeline({"pipe": 4, "data": 2}, num_microbatches=2,
                              stage_boundaries=["d1", "d2", "drop"])
    pipe.compile(optimizer="adam", loss="mse")
    stages = pipe.stages
    assert [s.layer_names for s in stages] == [
        ["d0"], ["d1", "add", "ln"], ["d2"], ["drop", "scale", "out"]]
    memory = strategy.memory_per_device()
    for stage, mesh in zip(stages, strategy.stage_meshes):
        for layer in stage.layers:
            for weight in layer.weights:
                devices = dtensor.fetch_layout(weight.value).mesh.local_devices()
                assert [d.split("device:")[-1] for d in devices] == \
                    list(mesh.devices)
        params = sum(int(np.prod(w.shape)) * 4 for layer in stage.layers
                     for w in layer.trainable_weights)
        for device in mesh.devices:
            assert memory[device]["params"] == params
    x, y = models.mlp_data()
    pipe.fit(x, y, batch_size=16, verbose=0)
    memory = strategy.memory_per_device()
    for stage, mesh in zip(stages, strategy.stage_meshes):
        params = sum(int(np.prod(w.shape)) * 4 for layer in stage.layers
                     for w in layer.trainable_weights)
        for device in mesh.devices:  # Adam: two slots per weight, same place
            assert memory[device]["optimizer"] == 2 * params


def test_activations_and_gradients_cross_stages():
    """The compiled step moves one activation forward and one gradient back
    per micro-batch and stage boundary (CopyToMesh between sub-meshes)."""
    _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=4,
                       stage_boundaries=["d2"])
    pipe.compile(optimizer="adam", loss="mse")
    x, y = models.mlp_data(n=32)
    pipe.fit(x, y, batch_size=32, verbose=0)  # builds optimizers, metrics
    runner = PipelineRunner(pipe, "train")
    xs = runner._place(x, 0, 4, True)
    targets = runner._place((y, None), -1, 4, True)
    graph = runner._function("train").get_concrete_function(
        xs, targets, True).graph
    # Each transfer is one name scope holding a relayout onto the target
    # stage's devices (DTensor's copy_to_mesh).
    sends = collections.Counter()
    for op in graph.get_operations():
        match = re.search(r"send_(\d)_to_(\d)(_\d+)?/", op.name)
        if match and op.type == "Relayout":
            target = tfpar.Mesh({"pipe": 2, "data": 4}).submesh(
                "pipe", int(match[2])).devices
            if all(d in op.get_attr("layout").decode() for d in target):
                sends[op.name[:match.end()]] += 1  # the whole scope
    forward = [k for k in sends if "send_0_to_1" in k]
    backward = [k for k in sends if "send_1_to_0" in k]
    assert len(forward) == len(backward) == 4   # one per micro-batch


def test_pipeline_model_is_a_staged_model_of_parts():
    """The strategy, checkpoints and reports find the pipeline by its
    protocol; each part owns its mesh, weights and optimizer."""
    strategy, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=2)
    assert isinstance(pipe, StagedModel)
    assert [part.mesh for part in pipe.parts] == strategy.stage_meshes
    assert sum(len(part.weights) for part in pipe.parts) == len(
        pipe.trainable_weights)
    pipe.compile(optimizer="adam", loss="mse")
    optimizers = pipe.stage_optimizers  # made on first use
    assert [part.optimizer for part in pipe.parts] == optimizers
    assert optimizers[-1] is pipe.optimizer


def test_skip_connection_is_carried_across_stages():
    _, pipe = pipeline({"pipe": 4, "data": 2}, num_microbatches=4,
                       stage_boundaries=["d1", "add", "d2"])
    received = [[t.name for t in s.inputs] for s in pipe.stages]
    assert len(received[1]) == 1 and len(received[2]) == 2  # d1 out + d0 out
    assert "receives" in pipe.split_report()
    assert_parity(train(pipe))


def test_balanced_split_and_report():
    _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=2)
    params = [s.num_params for s in pipe.stages]
    assert sum(params) == sum(int(np.prod(w.shape)) for w in pipe.weights)
    report = pipe.split_report()
    assert "stage 0 on CPU:0..CPU:3" in report and "stage 1 on CPU:4..CPU:7" in report
    assert f"{params[0]:,} params" in report
    # Balancing by measured time also gives a valid split.
    _, timed = pipeline({"pipe": 2, "data": 4}, num_microbatches=2,
                        balance="time")
    assert sum(len(s.layers) for s in timed.stages) == len(LAYERS)


def test_evaluate_predict_and_partial_last_batch_match_single_device():
    x, y = models.mlp_data(n=100)  # batches 32, 32, 32, 4
    single = build()
    single.set_weights(list(initial_weights()))
    single.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=4)
    pipe.set_weights(list(initial_weights()))
    pipe.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    want = single.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    got = pipe.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert models.relative_error(want.history["loss"], got.history["loss"]) < RTOL
    assert models.relative_error(single.evaluate(x, y, verbose=0),
                                 pipe.evaluate(x, y, verbose=0)) < RTOL
    assert models.relative_error(single.predict(x, verbose=0),
                                 pipe.predict(x, verbose=0)) < RTOL
    assert models.relative_error(single(x[:8]), pipe(x[:8])) < RTOL
    assert pipe.get_layer("d2") is pipe.wrapped.get_layer("d2")


def test_timeline_follows_the_data_flow():
    _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=4,
                       schedule="1f1b", record_timeline=True)
    pipe.compile(optimizer="adam", loss="mse")
    x, y = models.mlp_data(n=32)
    pipe.fit(x, y, batch_size=32, verbose=0)
    timeline = pipe.last_timeline
    starts = {(e.stage, e.kind, e.microbatch): e.start for e in timeline}
    ends = {(e.stage, e.kind, e.microbatch): e.end for e in timeline}
    assert len(ends) == len(timeline) == 2 * 2 * 4
    assert all(e.start <= e.end for e in timeline)
    # Only what data flow guarantees: an action span runs from its first to
    # its last matmul over the stage's devices. Stage 1's forward needs
    # stage 0's activations, so it starts and ends later; every matmul of
    # stage 0's backward needs the input gradient stage 1's backward
    # computes, so it starts later (its end is not ordered: stage 1's last
    # weight-gradient matmul may run after stage 0's backward).
    for i in range(4):
        assert starts[(0, "F", i)] < starts[(1, "F", i)]
        assert ends[(0, "F", i)] < ends[(1, "F", i)]
        assert starts[(1, "B", i)] < starts[(0, "B", i)]


def test_dropout_trains_inside_a_stage():
    """Dropout in training: its seed generator moves to its stage with the
    weights (it stayed on the host and DTensor failed to compile the step:
    "All inputs to `tf_device.Cluster` must have same mesh"), and it draws
    one seed per micro-batch forward pass."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        x = keras.Input((16,))
        h = keras.layers.Dense(32, name="d1")(x)
        h = keras.layers.Dropout(0.5, seed=3, name="drop")(h)
        pipe = tfpar.PipelineModel(
            keras.Model(x, keras.layers.Dense(3, name="d2")(h)),
            num_microbatches=2)
        pipe.compile(optimizer="sgd", loss="mse")
    x, y = models.mlp_data()
    history = pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    seed = pipe.get_layer("drop").seed_generator.state
    stage = {p: s for p, s, _ in strategy.placements()}
    assert dtensor.fetch_layout(seed.value).mesh in [
        mesh.dtensor_mesh for mesh in strategy.stage_meshes]
    assert seed.path in stage
    np.testing.assert_array_equal(seed.numpy(), [3, 4 * 2])  # 4 steps × m


def test_a_model_without_a_graph_is_rejected():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        model = models.subclassed()
        with pytest.raises(ValueError, match="Sequential or functional"):
            tfpar.PipelineModel(model, num_microbatches=2)


def test_shared_layer_across_a_boundary_is_tied():
    """Issue 18 turned this former error into a tie: the layer lives on
    stage 0, stage 1 reads its weights (tests/test_pipeline_nested.py
    checks the parity)."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        x = keras.Input((8,))
        shared = keras.layers.Dense(8, name="shared")
        h = keras.layers.Dense(8, name="mid")(shared(x))
        model = keras.Model(x, shared(h))
        pipe = tfpar.PipelineModel(model, num_microbatches=2,
                                   stage_boundaries=["mid"])
    assert pipe.stages[1].guests == [shared]
    assert "reads tied weights of ['shared']" in pipe.split_report()


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_microbatches=2, stage_boundaries=["d1", "nope", "out"]),
     "'nope'.*does not"),
    (dict(num_microbatches=2, stage_boundaries=["d2", "d1", "ln"]),
     "graph order"),
    (dict(num_microbatches=2, stage_boundaries=["d2"]), "needs 3 name"),
    (dict(num_microbatches=2, schedule="zigzag"), "unknown schedule"),
    (dict(num_microbatches=0), "num_microbatches"),
    (dict(num_microbatches=2, balance="flops"), "balance"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 4, "data": 2}))
    with strategy.scope():
        model = build()
        with pytest.raises((ValueError, TypeError), match=match):
            tfpar.PipelineModel(model, **kwargs)


def test_more_stages_than_layers_is_a_clear_error():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 4, "data": 2}))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(4, name="a"),
                                  keras.layers.Dense(4, name="b")])
        with pytest.raises(ValueError, match="at least one layer per stage"):
            tfpar.PipelineModel(model, num_microbatches=2)


def test_batch_not_divisible_by_microbatches_times_data_is_rejected():
    _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=4)
    pipe.compile(optimizer="adam", loss="mse")
    before = [w.copy() for w in pipe.get_weights()]
    x, y = models.mlp_data(n=48)
    with pytest.raises(ValueError, match=r"batch size 24 .*\(4\) × the data "
                                         r"axis 'data' \(4\) = 16"):
        pipe.fit(x, y, batch_size=24, verbose=0)
    for a, b in zip(before, pipe.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_plain_model_on_a_pipeline_mesh_and_pipe_rules_are_errors():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        model = build()
        model.compile(optimizer="adam", loss="mse")
    x, y = models.mlp_data(n=32)
    with pytest.raises(ValueError, match="tfpar.PipelineModel"):
        model.fit(x, y, batch_size=32, verbose=0)
    with pytest.raises(ValueError, match="pipeline axis 'pipe'"):
        tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}),
                               rules={r".*d0/kernel": ("pipe", None)})
    with pytest.raises(ValueError, match="strategy.scope"):
        tfpar.PipelineModel(build(), num_microbatches=2)


@pytest.mark.parametrize("schedule", [
    "1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_gradients_of_integer_inputs_and_embeddings(schedule):
    """Token ids (int32) are carried to a later stage; the embedding's
    sparse gradient is summed over micro-batches (with zb-h1: it comes out
    of W, split off the backward)."""
    def lm():
        tokens = keras.Input((6,), dtype="int32", name="tokens")
        e = keras.layers.Embedding(20, 8, name="embed")(tokens)
        h = keras.layers.Dense(8, activation="tanh", name="mix")(e)
        h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
        # tokens reach the last stage too (a skip of an integer input).
        count = keras.layers.Lambda(
            lambda t: keras.ops.cast(keras.ops.sum(t, axis=1, keepdims=True),
                                     "float32") / 100.0, name="count")(tokens)
        h = keras.layers.Concatenate(name="cat")([h, count])
        return keras.Model(tokens, keras.layers.Dense(2, name="head")(h))

    keras.utils.set_random_seed(3)
    weights = lm().get_weights()
    rng = np.random.RandomState(1)
    x = rng.randint(0, 20, size=(32, 6)).astype("int32")
    y = rng.normal(size=(32, 2)).astype("float32")

    def fit(model):
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    want = fit(lm())
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        pipe = tfpar.PipelineModel(lm(), num_microbatches=2,
                                   stage_boundaries=["pool"],
                                   schedule=schedule)
    for a, b in zip(want, fit(pipe)):
        assert models.relative_error(a, b) < RTOL


def test_an_ordering_token_from_a_nan_leaves_token_ids_whole():
    """A stage's actions are chained by adding a zero computed from the
    previous action's results (`ordering`); after a diverged step that
    zero is NaN, which cast to int32 is its most negative value: token
    ids must stay what they are (floats turn NaN, as the step's would)."""
    token = ordering.token_of([tf.constant([[1.0], [np.nan]])], rows=2)
    ids, values = ordering.after(
        [tf.constant([[3, 4], [5, 6]], tf.int32), tf.ones((2, 2))], token)
    assert ids.numpy().tolist() == [[3, 4], [5, 6]]
    assert np.isnan(values.numpy()[1]).all() and (values.numpy()[0] == 1).all()


def test_a_diverging_pipeline_of_token_ids_reports_nan_like_one_device():
    """SGD(0.1) on a residual stack diverges (losses ~1e15, then NaN) on
    one device; the pipeline reports the same losses instead of failing
    with "indices[0,0] = -2147483618 is not in [0, 20)" in its next
    micro-batch's Embedding (found 2026-12-06)."""
    def build():
        tokens = keras.Input((8,), dtype="int32")
        h = keras.layers.Embedding(20, 16, name="emb")(tokens)
        for i in range(4):
            h = h + keras.layers.Dense(16, name=f"x{i}")(h)
            h = h + keras.layers.Dense(16, name=f"d{i}")(h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        return keras.Model(tokens, keras.layers.Dense(1, name="out")(h))

    rng = np.random.RandomState(0)
    x = rng.randint(1, 20, (32, 8)).astype("int32")
    y = rng.normal(size=(32, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    weights = build().get_weights()

    def fit(model):
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        losses = models.BatchLosses()
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[losses])
        return np.array(losses.losses)

    want = fit(build())
    assert np.isnan(want[-1]) and want[-2] > 1e12  # it does diverge
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"pipe": 2}, devices=["CPU:0", "CPU:1"]))
    with strategy.scope():
        got = fit(tfpar.PipelineModel(build(), 2, schedule="1f1b"))
    np.testing.assert_allclose(got, want, rtol=1e-3, equal_nan=True)


def compiled(model):
    """`model` from the initial weights, compiled as the resume tests do."""
    model.set_weights(list(initial_weights()))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def fit(model):
    """One epoch of `mlp_data()` in order; the per-batch losses."""
    x, y = models.mlp_data()
    losses = models.BatchLosses()
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[losses])
    return losses.losses


@pytest.mark.parametrize("first,second", [
    # Save from pipe=2 × data=2 × model=2, resume on pipe=4 × data=2.
    pytest.param(({"pipe": 2, "data": 2, "model": 2},
                  dict(rules=TP_RULES, num_microbatches=4)),
                 ({"pipe": 4, "data": 2}, dict(num_microbatches=2)),
                 marks=SLOW),
    # An interleaved pipeline (optimizer state of four parts) resumes on a
    # plain one.
    (({"pipe": 2, "data": 4}, dict(num_microbatches=2, virtual_stages=2)),
     ({"pipe": 2, "data": 4}, dict(num_microbatches=2))),
], ids=["3d-to-pipe4", "interleaved-to-plain"])
def test_checkpoint_resumes_on_another_pipeline_and_loads_into_plain_keras(
        tmp_path, first, second):
    """Save mid-training from one pipeline, resume on another: the
    per-batch losses and weights are those of uninterrupted single-device
    training; the same checkpoint loads into a plain model."""
    x, _ = models.mlp_data()

    single = compiled(build())
    want = fit(single) + fit(single)
    (first_axes, first_kwargs), (second_axes, second_kwargs) = first, second
    _, first = pipeline(first_axes, **first_kwargs)
    got = fit(compiled(first))
    tfpar.save_checkpoint(first, tmp_path)
    _, second = pipeline(second_axes, **second_kwargs)
    compiled(second)
    assert tfpar.restore_checkpoint(second, tmp_path) == 2
    got += fit(second)
    assert models.relative_error(want, got) < RTOL
    for a, b in zip(single.get_weights(), second.get_weights()):
        assert models.relative_error(a, b) < RTOL
    plain = compiled(build())
    tfpar.restore_checkpoint(plain, tmp_path, optimizer=False)
    assert models.relative_error(first.predict(x, verbose=0),
                                 plain.predict(x, verbose=0)) < RTOL


def test_compile_without_optimizer_evaluates_and_global_clipnorm_is_refused():
    _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=2)
    single = build()
    single.set_weights(pipe.get_weights())
    single.compile(loss="mse", metrics=["mae"])
    pipe.compile(loss="mse", metrics=["mae"])  # evaluation only
    x, y = models.mlp_data(n=32)
    assert models.relative_error(single.evaluate(x, y, verbose=0),
                                 pipe.evaluate(x, y, verbose=0)) < RTOL
    with pytest.raises(ValueError, match="global_clipnorm=1.0"):
        pipe.compile(optimizer=keras.optimizers.SGD(global_clipnorm=1.0),
                     loss="mse")


def test_weights_wait_on_the_host_until_the_pipeline_places_them():
    """On a pipeline mesh a model is built on the host (no device holds a
    weight, eager calls run there), and PipelineModel then sends each
    stage's weights straight to its own devices."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        model = build()
        x, _ = models.mlp_data(n=8)
        assert model(x).shape == (8, 3)
        assert all(v["params"] == 0
                   for v in strategy.memory_per_device().values())
        assert not any(dtensor.is_dtensor(w.value) for w in model.weights)
        pipe = tfpar.PipelineModel(model, num_microbatches=2,
                                   stage_boundaries=["d2"])
    assert all(dtensor.is_dtensor(w.value.read_value()) for w in pipe.weights)
    memory = strategy.memory_per_device()
    assert memory["CPU:0"]["params"] + memory["CPU:4"]["params"] == 4 * sum(
        int(np.prod(w.shape)) for w in pipe.weights)


def test_keras_saving_of_a_pipeline(tmp_path):
    """save_weights/load_weights round-trip; model.save writes the plain
    wrapped model, which loads and predicts the same."""
    _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=2)
    pipe.compile(optimizer="adam", loss="mse")
    x, y = models.mlp_data(n=32)
    callback = keras.callbacks.ModelCheckpoint(tmp_path / "best.keras")
    pipe.fit(x, y, batch_size=16, verbose=0, callbacks=[callback])
    want = pipe.predict(x, verbose=0)
    pipe.save_weights(tmp_path / "w.weights.h5")
    pipe.set_weights([np.zeros_like(w) for w in pipe.get_weights()])
    pipe.load_weights(tmp_path / "w.weights.h5")
    assert models.relative_error(want, pipe.predict(x, verbose=0)) < RTOL
    loaded = keras.models.load_model(
        tmp_path / "best.keras",
        custom_objects={"InferenceDropout": models.InferenceDropout,
                        "Scale": models.Scale})
    assert not isinstance(loaded, tfpar.PipelineModel)
    assert models.relative_error(want, loaded.predict(x, verbose=0)) < RTOL


def test_steps_per_execution_and_validation_data():
    x, y = models.mlp_data()

    def fit(model):
        model.set_weights(list(initial_weights()))
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                      steps_per_execution=2)
        history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0,
                            validation_data=(x[:32], y[:32]))
        return history.history

    want = fit(build())
    _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=2)
    got = fit(pipe)
    for key in ("loss", "val_loss"):
        assert models.relative_error(want[key], got[key]) < RTOL


# -- interleaved stages (virtual_stages > 1) ----------------------------------


@pytest.mark.parametrize("axes,microbatches,schedule,virtual", [
    ({"pipe": 2, "data": 4}, 4, "1f1b", 2),
    pytest.param({"pipe": 4, "data": 2}, 4, "1f1b", 2,  # one layer a part
                 marks=SLOW),
    pytest.param({"pipe": 2, "data": 4}, 2, "gpipe", 3, marks=SLOW),
    pytest.param({"pipe": 1, "data": 8}, 2, "1f1b", 2,  # parts share a mesh
                 marks=SLOW),
])
def test_interleaved_parity(axes, microbatches, schedule, virtual):
    _, pipe = pipeline(axes, num_microbatches=microbatches, schedule=schedule,
                       virtual_stages=virtual)
    assert len(pipe.stages) == axes["pipe"] * virtual
    assert pipe.virtual_stages == pipe.schedule.virtual_stages == virtual
    assert_parity(train(pipe))


@SLOW  # interleaved: test_interleaved_parity; tensor-parallel stages: test_parity_with_data_and_model_axes
def test_interleaved_parity_with_tensor_parallel_parts():
    strategy, pipe = pipeline({"pipe": 2, "data": 2, "model": 2},
                              rules=TP_RULES, num_microbatches=2,
                              virtual_stages=2,
                              stage_boundaries=["d1", "ln", "drop"])
    assert_parity(train(pipe))
    # d0 (part 0) and d2 (part 2) both sit on stage 0, split over "model".
    for name in ("d0", "d2"):
        blocks = dtensor.unpack(pipe.get_layer(name).kernel.value.read_value())
        assert [tuple(c.shape) for c in blocks] == \
            [(16 if name == "d0" else 32, 16)] * 4
        devices = dtensor.fetch_layout(
            pipe.get_layer(name).kernel.value).mesh.local_devices()
        assert [d.split("device:")[-1] for d in devices] == \
            list(strategy.stage_meshes[0].devices)


def test_interleaved_parts_live_on_their_stage():
    """Part k sits on stage k mod p: its weights and its own optimizer's
    slots on that stage's devices only; the report names part and chunk."""
    strategy, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=2,
                              virtual_stages=2,
                              stage_boundaries=["d1", "d2", "drop"])
    pipe.compile(optimizer="adam", loss="mse")
    assert [s.layer_names for s in pipe.stages] == [
        ["d0"], ["d1", "add", "ln"], ["d2"], ["drop", "scale", "out"]]
    report = pipe.split_report().splitlines()
    assert report[2].startswith("part 2 (stage 0, chunk 1) on CPU:0..CPU:3")
    assert report[3].startswith("part 3 (stage 1, chunk 1) on CPU:4..CPU:7")
    x, y = models.mlp_data()
    pipe.fit(x, y, batch_size=16, verbose=0)
    memory = strategy.memory_per_device()
    for s, mesh in enumerate(strategy.stage_meshes):
        params = sum(int(np.prod(w.shape)) * 4
                     for part in pipe.stages[s::2] for layer in part.layers
                     for w in layer.trainable_weights)
        for part in pipe.stages[s::2]:
            for weight in (w for layer in part.layers for w in layer.weights):
                devices = dtensor.fetch_layout(weight.value).mesh.local_devices()
                assert [d.split("device:")[-1] for d in devices] == \
                    list(mesh.devices)
        for device in mesh.devices:
            assert memory[device]["params"] == params
            assert memory[device]["optimizer"] == 2 * params  # Adam m, v
    assert len(pipe.stage_optimizers) == 4


@SLOW  # interleaved transfers also shown by test_interleaved_parity
def test_interleaved_crosses_the_stages_v_times():
    """With v = 2 on two stages a micro-batch goes stage 0 -> 1 -> 0 -> 1:
    three transfers forward and three back per micro-batch, each onto the
    devices of the receiving part's stage. (The cut keeps d0's skip
    connection inside part 1 and d2's regularisation loss in the last
    part: nothing else moves.)"""
    _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=2,
                       virtual_stages=2, stage_boundaries=["d1", "ln", "d2"])
    pipe.compile(optimizer="adam", loss="mse")
    x, y = models.mlp_data(n=32)
    pipe.fit(x, y, batch_size=32, verbose=0)
    runner = PipelineRunner(pipe, "train")
    graph = runner._function("train").get_concrete_function(
        runner._place(x, 0, 2, True), runner._place((y, None), -1, 2, True),
        True).graph
    scopes = collections.Counter()
    mesh = tfpar.Mesh({"pipe": 2, "data": 4})
    for op in graph.get_operations():
        match = re.search(r"send_(\d)_to_(\d)(_\d+)?/", op.name)
        if match and op.type == "Relayout":
            # Part k lives on stage k mod 2: a copy onto those devices.
            target = mesh.submesh("pipe", int(match[2]) % 2).devices
            if all(d in op.get_attr("layout").decode() for d in target):
                scopes[(match[1], match[2], op.name[:match.end()])] += 1
    pairs = collections.Counter((a, b) for a, b, _ in scopes)
    assert pairs == {("0", "1"): 2, ("1", "2"): 2, ("2", "3"): 2,
                     ("1", "0"): 2, ("2", "1"): 2, ("3", "2"): 2}


@SLOW  # test_evaluate_predict_and_partial_last_batch_match_single_device
def test_interleaved_partial_last_batch_evaluate_and_predict():
    """100 samples at batch 32: the last batch of 4 runs m = 4 micro-batches
    of one sample (1f1b: p | m); 99 samples leave 3, run as looped GPipe
    (interleaved 1F1B needs p | m). Both as on one device."""
    _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=4,
                       virtual_stages=2)
    runner = PipelineRunner(pipe, "train")
    assert runner._schedule_for(4) is pipe.schedule
    assert (runner._schedule_for(2).name, runner._schedule_for(3).name) == (
        "1f1b", "gpipe")
    assert runner._schedule_for(3).virtual_stages == 2
    for n in (100, 99):
        x, y = models.mlp_data(n=n)
        single = build()
        single.set_weights(list(initial_weights()))
        single.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=4,
                           virtual_stages=2)
        pipe.set_weights(list(initial_weights()))
        pipe.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        want = single.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        got = pipe.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        assert models.relative_error(want.history["loss"],
                                     got.history["loss"]) < RTOL
        for a, b in zip(single.get_weights(), pipe.get_weights()):
            assert models.relative_error(a, b) < RTOL
    assert models.relative_error(single.evaluate(x, y, verbose=0),
                                 pipe.evaluate(x, y, verbose=0)) < RTOL
    assert models.relative_error(single.predict(x, verbose=0),
                                 pipe.predict(x, verbose=0)) < RTOL


# Was intermittent (issue 17): the first part's last backward now and then
# missing from the timeline (or, before, an action starting before the step:
# ops TF evaluates while compiling the step and DTensor's relayouts of
# constants, left out by `profiler.executed_timeline`). The recorder stopped
# the profiler when the step's logs were ready — they need only the forward
# passes, while the first stage's last backward and update were still
# running. It now waits for every stage's devices (`runner._wait_for_every_part`):
# 24 of 24 steps right under load ~15, 11 of 15 before.
def test_interleaved_timeline_follows_the_data_flow():
    _, pipe = pipeline({"pipe": 2, "data": 4}, num_microbatches=2,
                       virtual_stages=2, record_timeline=True)
    pipe.compile(optimizer="adam", loss="mse")
    x, y = models.mlp_data(n=32)
    timelines = []  # one step per fit, 4 times (the bug showed in ~1 of 4)
    for _ in range(4):
        pipe.fit(x, y, batch_size=32, verbose=0)
        timelines.append(pipe.last_timeline)
    assert len(timelines) == 4
    for timeline in timelines:
        starts = {(e.chunk * 2 + e.stage, e.kind, e.microbatch): e.start
                  for e in timeline}
        assert len(starts) == len(timeline) == 4 * 2 * 2, sorted(starts)
        assert {(e.stage, e.chunk) for e in timeline} == {
            (0, 0), (1, 0), (0, 1), (1, 1)}
        for k in range(3):  # part k+1 needs part k's activations, and back
            for i in range(2):
                assert starts[(k, "F", i)] < starts[(k + 1, "F", i)]
                assert starts[(k + 1, "B", i)] < starts[(k, "B", i)]


@pytest.mark.parametrize("axes,kwargs,match", [
    ({"pipe": 4, "data": 2}, dict(num_microbatches=6, virtual_stages=2),
     r"multiple of num_stages \(4\)\. Received: num_microbatches=6"),
    ({"pipe": 4, "data": 2}, dict(num_microbatches=4, virtual_stages=3),
     r"3 × 4 = 12 parts.*only 8 layer\(s\).*virtual_stages <= 2"),
    ({"pipe": 2, "data": 4}, dict(num_microbatches=2, virtual_stages=0),
     r"virtual_stages\) needs an int >= 1.*virtual_stages=0"),
    ({"pipe": 2, "data": 4}, dict(num_microbatches=2, virtual_stages=2,
                                  stage_boundaries=["d2"]),
     r"needs 3 name\(s\) for 4 stages/parts"),
])
def test_interleaved_bad_arguments_are_clear_errors(axes, kwargs, match):
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes))
    with strategy.scope():
        model = build()
        with pytest.raises(ValueError, match=match):
            tfpar.PipelineModel(model, **kwargs)
