"""Real models as pipelines: nested functional models inlined, weights tied
across stages, keras-hub causal LMs (tests/hub_models.py) against one
device: same per-step losses and final weights within 1e-4 relative."""

import re
import warnings

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar

import hub_models
import models

RTOL = 1e-4


def nested_mlp():
    """outer ⊃ middle ⊃ inner: two levels of functional models as layers."""
    x = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="a0")(x)
    inner = keras.Model(x, keras.layers.Dense(16, activation="tanh",
                                              name="a1")(h), name="inner")
    y = keras.Input((8,), name="y")
    h = inner(y)
    h = keras.layers.Dense(16, activation="relu", name="b0")(h)
    middle = keras.Model(y, keras.layers.Dense(16, name="b1")(h), name="middle")
    z = keras.Input((8,), name="z")
    h = keras.layers.Dense(8, name="c0")(middle(z))
    return keras.Model(z, h, name="outer")


def tied_mlp():
    """A layer called first and last: its weights read on two stages."""
    x = keras.Input((8,))
    shared = keras.layers.Dense(8, name="shared")
    h = keras.layers.Dense(8, activation="tanh", name="mid")(shared(x))
    return keras.Model(x, shared(h), name="tied")


def fit(model, weights, x, y, optimizer, loss="mse", batch_size=16):
    model.set_weights(weights)
    model.compile(optimizer=optimizer, loss=loss)
    losses = models.BatchLosses()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
              verbose=0, callbacks=[losses])
    return losses.losses, [np.asarray(w) for w in model.get_weights()]


def assert_same(want, got):
    assert len(want[0]) == len(got[0]) >= 2
    assert models.relative_error(want[0], got[0]) < RTOL
    assert len(want[1]) == len(got[1])
    for a, b in zip(want[1], got[1]):
        assert models.relative_error(a, b) < RTOL


def mlp_data():
    rng = np.random.RandomState(0)
    return (rng.normal(size=(32, 8)).astype("float32"),
            rng.normal(size=(32, 8)).astype("float32"))


@pytest.mark.parametrize("schedule", [
    "1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_nested_models_are_inlined_and_cut_by_path(schedule):
    keras.utils.set_random_seed(0)
    weights = nested_mlp().get_weights()
    x, y = mlp_data()
    want = fit(nested_mlp(), weights, x, y, "sgd")
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 4, "data": 2}))
    with strategy.scope():
        pipe = tfpar.PipelineModel(
            nested_mlp(), num_microbatches=4, schedule=schedule,
            stage_boundaries=["middle/inner/a1", "middle/b0", "c0"])
    assert [s.layer_names for s in pipe.stages] == [
        ["middle/inner/a0"], ["middle/inner/a1"], ["middle/b0", "middle/b1"],
        ["c0"]]
    report = pipe.split_report()
    assert "middle/inner/a0..middle/inner/a0" in report
    assert "middle/b0..middle/b1" in report
    assert_same(want, fit(pipe, weights, x, y, "sgd"))
    # Each inner layer's weights live on its own stage only.
    kernel = pipe.get_layer("middle").get_layer("b1").kernel
    assert dtensor.fetch_layout(kernel.value).mesh == \
        strategy.stage_meshes[2].dtensor_mesh


def test_unknown_or_ambiguous_inner_names_are_clear_errors():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        with pytest.raises(ValueError, match=r"\['middle/nope'\] that the "
                           r"model does not have.*nested ones by path.*"
                           r"'middle/inner/a1'"):
            tfpar.PipelineModel(nested_mlp(), num_microbatches=2,
                                stage_boundaries=["middle/nope"])
        # A bare inner name is fine when unique.
        pipe = tfpar.PipelineModel(nested_mlp(), num_microbatches=2,
                                   stage_boundaries=["b0"])
        assert pipe.stages[1].layer_names[0] == "middle/b0"


@pytest.mark.parametrize("schedule", [
    "1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_weights_tied_across_stages_train_as_on_one_device(schedule):
    keras.utils.set_random_seed(1)
    weights = tied_mlp().get_weights()
    x, y = mlp_data()
    want = fit(tied_mlp(), weights, x, y, keras.optimizers.Adam(1e-3))
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        pipe = tfpar.PipelineModel(tied_mlp(), num_microbatches=2,
                                   schedule=schedule, stage_boundaries=["mid"])
    got = fit(pipe, weights, x, y, keras.optimizers.Adam(1e-3))
    assert_same(want, got)
    # One weight (get_weights, checkpoints): held and updated on stage 0;
    # stage 1 holds a persistent copy (tests/test_pipeline_tied.py), equal
    # to it bit for bit after training.
    assert len(pipe.weights) == len(tied_mlp().weights) == 4
    shared = pipe.get_layer("shared")
    assert pipe.stages[1].guests == [shared]
    assert dtensor.fetch_layout(shared.kernel.value).mesh == \
        strategy.stage_meshes[0].dtensor_mesh
    assert [c.weight for c in pipe.ties.copies] == [shared.kernel,
                                                    shared.bias]
    for copy in pipe.ties.copies:
        assert dtensor.fetch_layout(copy.variable.value).mesh == \
            strategy.stage_meshes[1].dtensor_mesh
        np.testing.assert_array_equal(np.asarray(copy.weight),
                                      np.asarray(copy.variable))
    assert "reads tied weights of ['shared']" in pipe.split_report()


def test_a_tie_that_cannot_be_honoured_says_why():
    """A layer with state updated by its calls (BatchNormalization's moving
    statistics) cannot be called on two stages."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        x = keras.Input((8,))
        norm = keras.layers.BatchNormalization(name="norm")
        h = keras.layers.Dense(8, name="mid")(norm(x))
        model = keras.Model(x, norm(h))
        with pytest.raises(ValueError, match=r"'norm' is called on stage 1 "
                           r"and on an earlier stage, and has state"):
            tfpar.PipelineModel(model, num_microbatches=2,
                                stage_boundaries=["mid"])


# -- keras-hub causal LMs ----------------------------------------------------

# Tensor parallelism inside the stages is planned by `tfpar.auto_rules` on
# the built model (no hand-written rule) and laid out by `apply_rules`
# before the model is cut; each stage's weights keep their spec on its
# sub-mesh (`VariableRegistry.move_to`).
HUB_BATCH = 8
# A key bias shifts every attention logit of a query alike and softmax
# ignores such a shift: its true gradient is zero, so both runs hold only
# rounding noise there (1e-9, amplified by Adam's 1/|g|): compared
# absolutely, as in tests/test_keras_hub.py.
ZERO_GRADIENT = re.compile(r".*/key/bias")


def hub_pipeline(name, axes, schedule, m=2):
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes))
    with strategy.scope():
        model = hub_models.build(name)
        if "model" in axes:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # layers kept whole
                strategy.apply_rules(
                    model, tfpar.auto_rules(model, mesh=strategy.mesh))
        pipe = tfpar.PipelineModel(model, num_microbatches=m,
                                   schedule=schedule)
    return strategy, pipe


def hub_parity(name, axes, schedule, m=2):
    """Trains `name` as a pipeline of m micro-batches (global batches of
    HUB_BATCH·m/2, two steps) and on one device; checks they agree."""
    batch = HUB_BATCH * m // 2
    x, y = hub_models.data(name, batch=2 * batch)
    weights = hub_models.build(name).get_weights()

    def run(model):
        # Adam at 1e-3: its first steps divide by |g|, which turns the
        # micro-batch rounding (1e-7) of near-zero gradients into 1e-4 of
        # a weight at 1e-2.
        return fit(model, weights, x, y, keras.optimizers.Adam(1e-3),
                   hub_models.loss(name), batch)

    plain = hub_models.build(name)
    want = run(plain)  # the one-device run, kept for generate
    strategy, pipe = hub_pipeline(name, axes, schedule, m)
    got = run(pipe)
    assert len(want[0]) == len(got[0]) >= 2
    assert models.relative_error(want[0], got[0]) < RTOL, (want[0], got[0])
    paths = [w.path for w in pipe.weights]
    assert paths == [w.path for w in plain.weights]
    for path, a, b in zip(paths, want[1], got[1]):
        if ZERO_GRADIENT.fullmatch(path):
            assert np.abs(a - b).max() < RTOL, path  # noise (see above)
        else:
            assert models.relative_error(a, b) < RTOL, path
    # The backbone is inlined and cut inside; the output head (the last
    # part) reads the token embedding's weights, held on stage 0 and, when
    # the last part is on another stage, as a persistent copy there, equal
    # bit for bit to the weight after training.
    assert len(pipe.stages) == pipe.schedule.num_parts and all(
        "backbone" in path.split("/")[0] for s in pipe.stages
        for path in s.layer_names)
    embedding = pipe.get_layer("token_embedding")
    assert pipe.stages[-1].guests == [embedding]
    assert dtensor.fetch_layout(embedding.embeddings.value).mesh == \
        strategy.stage_meshes[0].dtensor_mesh
    last = pipe.parts[-1]
    copies = pipe.ties.copies
    assert [c.weight for c in copies] == (
        [] if last.mesh is pipe.parts[0].mesh else
        embedding.trainable_weights)
    for copy in copies:
        assert copy.holder is last and dtensor.fetch_layout(
            copy.variable.value).mesh == last.mesh.dtensor_mesh
        for a, b in zip(dtensor.unpack(copy.weight.value.read_value()),
                        dtensor.unpack(copy.variable.value.read_value())):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    # predict runs through the pipeline and matches one device.
    copy = hub_models.build(name)
    copy.set_weights(pipe.get_weights())
    np.testing.assert_allclose(
        pipe.predict(x, batch_size=batch, verbose=0),
        copy.predict(x, batch_size=batch, verbose=0), rtol=1e-4,
        atol=1e-5)
    return pipe, plain


@pytest.mark.slow  # zero-bubble at run time: tests/test_pipeline_zero_bubble.py
def test_llama_gqa_causal_lm_pipelined_with_zero_bubble():
    """The default profile's representative: LlamaCausalLM (8 query, 2
    key/value heads) on pipe=2 × data=4 with ZB-H1 (nested backbone, the
    output head tied to the input embedding's stage, split backwards)."""
    hub_parity("llama_gqa", {"pipe": 2, "data": 4}, "zb-h1")


@pytest.mark.slow
def test_llama_gqa_causal_lm_pipelined_with_zbv():
    """ZB-V on a real model: 4 parts in a V, the embedding (part 0) and
    its tied output head (part 3) both on stage 0; m = 4 >= 2p - 1."""
    pipe, _ = hub_parity("llama_gqa", {"pipe": 2, "data": 4}, "zbv", m=4)
    assert pipe.parts[0].mesh is pipe.parts[3].mesh


HUB_MESHES = {"2x4": {"pipe": 2, "data": 4},
              "2x2x2": {"pipe": 2, "data": 2, "model": 2}}
# The matrix: 3 models × 2 meshes × 2 schedules. The default profile runs
# grouped-query Llama with auto_rules inside the stages and 1F1B; the
# rest is slow.
HUB_CASES = [
    (name, mesh, schedule) if (name, mesh, schedule) == (
        "llama_gqa", "2x2x2", "1f1b") else
    pytest.param(name, mesh, schedule, marks=pytest.mark.slow)
    for name in ("llama_gqa", "gpt2", "gemma") for mesh in HUB_MESHES
    for schedule in ("gpipe", "1f1b")]


@pytest.mark.parametrize("name,mesh,schedule", HUB_CASES)
def test_hub_causal_lms_pipelined(name, mesh, schedule):
    axes = HUB_MESHES[mesh]
    pipe, _ = hub_parity(name, axes, schedule)
    if "model" in axes:
        # auto_rules' tensor parallelism is real inside the stages: each
        # device of a stage holds half of an MLP kernel and half of the
        # attention query heads (one dimension halved), on its stage.
        kernels = [w for w in pipe.weights if re.fullmatch(
            r".*(feedforward_intermediate_dense|ffw_gating|query)/kernel",
            w.path)]
        assert len(kernels) == 4  # two layers × (MLP, query)
        for kernel in kernels:
            blocks = dtensor.unpack(kernel.value.read_value())
            halved = [a // b for a, b in zip(kernel.shape, blocks[0].shape)]
            assert halved.count(2) == 1 and halved.count(1) == len(
                halved) - 1, (kernel.path, halved)
            assert len(blocks) == 4  # the devices of one stage


@pytest.mark.slow
def test_generate_runs_unpipelined_on_the_wrapped_model():
    """`generate` is not pipelined: `PipelineModel.generate` copies the
    trained weights into an unpipelined copy of the wrapped keras-hub model
    (one device) and generates there, greedily the same tokens as the model
    trained on one device."""
    pipe, plain = hub_parity("gpt2", {"pipe": 2, "data": 2, "model": 2},
                             "1f1b")
    ids = np.zeros((2, hub_models.SEQ_LEN), "int32")
    ids[:, :3] = [[5, 9, 2], [7, 1, 3]]
    mask = np.zeros_like(ids, bool)
    mask[:, :3] = True
    prompt = {"token_ids": ids, "padding_mask": mask}
    got = pipe.generate(prompt, max_length=hub_models.SEQ_LEN,
                        stop_token_ids=None, sampler="greedy")
    plain.compile(sampler="greedy")  # keras-hub's default draws (top-k)
    want = plain.generate(prompt, max_length=hub_models.SEQ_LEN,
                          stop_token_ids=None)
    assert got["token_ids"].shape == (2, hub_models.SEQ_LEN)
    assert len(pipe.weights) == len(plain.weights)  # the copy is not tracked
    np.testing.assert_array_equal(got["token_ids"], want["token_ids"])
    np.testing.assert_array_equal(got["token_ids"][:, :3], ids[:, :3])
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope(), pytest.raises(RuntimeError,
                                         match=r"outside the scope"):
        pipe.generate(prompt, max_length=hub_models.SEQ_LEN)
