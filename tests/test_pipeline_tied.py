"""Weights tied across pipeline stages held as persistent copies
(`tfpar.pipeline.tied`, Megatron-LM's tied embeddings): a tiny causal LM
whose token embedding (stage 0) is also its output head (stage 1).

Against one device on the same weights and data: per-step losses and final
weights within 1e-4 relative. Beyond parity: the copy on the later stage
is bit-equal to the weight after every step (every device's block read),
it lives on that stage's devices only, laid out as the weight, with its
optimizer slots there; the step sends no tied weight forward (only the
summed gradients, once per step); `get_weights`, `save_weights` and
checkpoints see one weight, and restoring fills every copy."""

import collections
import json
import os
import re

import keras
import keras_hub
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar.pipeline.runner import PipelineRunner

import models

RTOL = 1e-4
VOCAB, DIM, SEQ = 16, 8, 4
EMBEDDING = "token_embedding/embeddings"


def tiny_lm():
    """tokens -> embedding -> mid -> top -> the embedding reversed (tied
    head): cut before "top", the embedding is read on both stages."""
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    embedding = keras_hub.layers.ReversibleEmbedding(
        VOCAB, DIM, name="token_embedding")
    h = keras.layers.Dense(DIM, activation="tanh", name="mid")(
        embedding(tokens))
    h = keras.layers.Dense(DIM, activation="tanh", name="top")(h)
    return keras.Model(tokens, embedding(h, reverse=True), name="tiny_lm")


def lm_data(n=64):
    rng = np.random.RandomState(0)
    return (rng.randint(0, VOCAB, size=(n, SEQ)).astype("int32"),
            rng.randint(0, VOCAB, size=(n, SEQ)).astype("int32"))


OPTIMIZERS = {
    "sgd-momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-2),
}
MESHES = {"2x4": {"pipe": 2, "data": 4},
          "2x4-fsdp": {"pipe": 2, "data": 4},   # with fsdp=True
          "2x2x2": {"pipe": 2, "data": 2, "model": 2}}


def blocks(variable):
    """Every device's block of a DTensor variable, as host arrays."""
    return [b.numpy() for b in dtensor.unpack(variable.value.read_value())]


def assert_bit_equal(pipe):
    """Each copy holds, device by device, exactly its weight's blocks."""
    assert pipe.ties.copies
    for copy in pipe.ties.copies:
        home, mine = blocks(copy.weight), blocks(copy.variable)
        assert len(home) == len(mine)
        for a, b in zip(home, mine):
            np.testing.assert_array_equal(a, b)


class CopiesBitEqual(keras.callbacks.Callback):
    """Checks the copies after every training step."""

    def __init__(self, pipe):
        super().__init__()
        self.pipe, self.checked = pipe, 0

    def on_train_batch_end(self, batch, logs=None):
        assert_bit_equal(self.pipe)
        self.checked += 1


def fit(model, weights, optimizer, callbacks=(), batch_size=16):
    x, y = lm_data()
    model.set_weights(weights)
    model.compile(optimizer=OPTIMIZERS[optimizer](),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    losses = models.BatchLosses()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
              verbose=0, callbacks=[losses, *callbacks])
    return losses.losses, [np.asarray(w) for w in model.get_weights()]


def pipeline(mesh, m=2, **kwargs):
    # On the model axis the embedding is split over the vocabulary, so the
    # copy (laid out as the weight) holds half the rows per device; under
    # fsdp a quarter (split over data, gathered where it is read).
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh(MESHES[mesh]), fsdp=mesh.endswith("fsdp"),
        rules={EMBEDDING: ("model", None)} if "model" in MESHES[mesh] else
        None)
    with strategy.scope():
        pipe = tfpar.PipelineModel(tiny_lm(), num_microbatches=m,
                                   stage_boundaries=["top"], **kwargs)
    return strategy, pipe


def assert_same(want, got):
    assert len(want[0]) == len(got[0]) == 4  # four steps
    assert models.relative_error(want[0], got[0]) < RTOL, (want[0], got[0])
    assert len(want[1]) == len(got[1])
    for a, b in zip(want[1], got[1]):
        assert models.relative_error(a, b) < RTOL


def initial_weights():
    keras.utils.set_random_seed(1)
    return tiny_lm().get_weights()


@pytest.mark.parametrize("mesh,optimizer", [
    ("2x2x2", "adam"),
    pytest.param("2x4", "sgd-momentum", marks=pytest.mark.slow),
    pytest.param("2x4", "adam", marks=pytest.mark.slow),
    pytest.param("2x2x2", "sgd-momentum", marks=pytest.mark.slow),
    pytest.param("2x4-fsdp", "adam", marks=pytest.mark.slow)])
def test_tied_copies_train_as_on_one_device_and_stay_bit_equal(mesh,
                                                                 optimizer):
    weights = initial_weights()
    want = fit(tiny_lm(), weights, optimizer)
    strategy, pipe = pipeline(mesh)
    check = CopiesBitEqual(pipe)
    got = fit(pipe, weights, optimizer, [check])
    assert_same(want, got)
    assert check.checked == 4
    # The copy: on stage 1's devices, laid out as the weight on stage 0.
    embedding = pipe.get_layer("token_embedding").embeddings
    [copy] = pipe.ties.copies
    assert copy.weight is embedding and copy.holder is pipe.parts[1]
    assert copy.variable.path == \
        "tied_copy_on_part_1/token_embedding_embeddings"
    home_layout = dtensor.fetch_layout(embedding.value)
    copy_layout = dtensor.fetch_layout(copy.variable.value)
    assert home_layout.mesh == strategy.stage_meshes[0].dtensor_mesh
    assert copy_layout.mesh == strategy.stage_meshes[1].dtensor_mesh
    assert copy_layout.sharding_specs == home_layout.sharding_specs
    rows = {"2x4": VOCAB, "2x4-fsdp": VOCAB // 4, "2x2x2": VOCAB // 2}[mesh]
    assert [b.shape for b in blocks(copy.variable)] == [(rows, DIM)] * 4
    # Its optimizer slots live on stage 1 (the holder's optimizer), the
    # weight's on stage 0.
    stage1 = pipe.parts[1].optimizer
    slots = [v for v in stage1.variables
             if v.name.startswith("tied_copy_on_part_1_token_embedding")]
    assert len(slots) == (2 if optimizer == "adam" else 1)
    for slot in slots:
        assert dtensor.fetch_layout(slot.value).mesh == \
            strategy.stage_meshes[1].dtensor_mesh
    # One weight for Keras: the copy is not among the model's variables.
    assert len(pipe.weights) == len(tiny_lm().weights)
    assert all("tied_copy" not in w.path for w in pipe.variables)


def test_per_step_tied_weights_hold_no_copy_and_train_alike():
    """tied_weights="per_step": the later stage receives the weight in
    every forward instead of holding a copy; same results."""
    weights = initial_weights()
    want = fit(tiny_lm(), weights, "adam")
    strategy, pipe = pipeline("2x4", tied_weights="per_step")
    assert pipe.ties.copies == [] and pipe.parts[1].copies == []
    assert_same(want, fit(pipe, weights, "adam"))
    # The copy's memory: a stage-1 device holds the whole (VOCAB, DIM)
    # copy (replicated on pipe=2 × data=4) with persistent copies, and
    # Adam's two slots of it; stage 0's devices hold the same either way.
    persistent, other = pipeline("2x4")
    fit(other, weights, "adam")
    held = [s.memory_per_device() for s in (strategy, persistent)]
    stage0, stage1 = (s.devices[0] for s in strategy.stage_meshes)
    copy = VOCAB * DIM * 4
    assert held[1][stage1]["params"] - held[0][stage1]["params"] == copy
    assert held[1][stage0] == held[0][stage0]
    slots = {k: held[1][stage1][k] - held[0][stage1].get(k, 0)
             for k in held[1][stage1] if k != "params"}
    assert sum(slots.values()) == 2 * copy, held


def test_bad_tied_weights_mode_is_a_clear_error():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESHES["2x4"]))
    with strategy.scope(), pytest.raises(
            ValueError, match=r"tied_weights\) must be one of \('persistent'"
            r", 'per_step'\).*Received: tied_weights='copies'"):
        tfpar.PipelineModel(tiny_lm(), num_microbatches=2,
                            tied_weights="copies")


def tied_sends(pipe, m):
    """{scope kind: (number of moves, bytes moved)} of the compiled
    training step: each tied move is one name scope
    "tied_<what>_<k>_to_<k'>"."""
    x, y = lm_data(n=16 * m // 2)
    runner = PipelineRunner(pipe, "train")
    graph = runner._function("train").get_concrete_function(
        runner._place(x, 0, m, True), runner._place((y, None), -1, m, True),
        True).graph
    scopes = {}
    for op in graph.get_operations():
        match = re.search(r"tied_(weight|grad|sum)_(\d)_to_(\d)(_\d+)?/",
                          op.name)
        # A move: a relayout onto the target stage's devices (copy_to_mesh).
        if match and op.type == "Relayout" and all(
                d in op.get_attr("layout").decode()
                for d in pipe.parts[int(match[3])].mesh.devices):
            scopes[op.name[:match.end()]] = (
                f"tied_{match[1]}", 4 * int(np.prod(op.outputs[0].shape)))
    moves = collections.defaultdict(lambda: [0, 0])
    for kind, size in scopes.values():
        moves[kind][0] += 1
        moves[kind][1] += size
    return {kind: tuple(v) for kind, v in moves.items()}


@pytest.mark.parametrize("m", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_tied_weight_is_not_sent_forward_every_step(m):
    """Persistent copies: per step, one move of the copy's summed gradient
    to stage 0 and one of the total back, whatever m; per_step: the weight
    forward and its gradient back in every micro-batch. Each move carries
    the whole (VOCAB, DIM) float32 embedding or its gradient."""
    weights = initial_weights()
    size = VOCAB * DIM * 4
    for mode, want in (
            ("persistent", {"tied_grad": (1, size), "tied_sum": (1, size)}),
            ("per_step", {"tied_weight": (m, m * size),
                          "tied_grad": (m, m * size)})):
        _, pipe = pipeline("2x4", m=m, tied_weights=mode)
        fit(pipe, weights, "sgd-momentum")  # builds optimizers, metrics
        assert tied_sends(pipe, m) == want, mode


def test_checkpoints_and_weights_see_one_weight_and_fill_every_copy(
        tmp_path):
    weights = initial_weights()
    _, pipe = pipeline("2x4")
    fit(pipe, weights, "adam")
    trained = pipe.get_weights()
    assert len(trained) == len(weights)
    # tfpar checkpoints: the embedding and its slots once, no copy.
    path = tfpar.save_checkpoint(pipe, tmp_path / "ckpt")
    with open(os.path.join(path, "manifest.json")) as f:
        keys = [r["key"] for r in json.load(f)["variables"]]
    assert EMBEDDING in keys and f"{EMBEDDING}:momentum" in keys
    assert not [k for k in keys if "tied_copy" in k]
    # Restored onto another mesh (tensor-parallel stages): both the weight
    # and its copy, and the copy's slots, hold the saved values.
    _, other = pipeline("2x2x2")
    other.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    tfpar.restore_checkpoint(other, path)
    for a, b in zip(trained, other.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert_bit_equal(other)
    [copy] = other.ties.copies
    for name in ("momentum", "velocity"):
        home, mine = [
            [v for v in part.optimizer.variables if v.name == prefix + name]
            for part, prefix in ((other.parts[0], "token_embedding_"
                                  "embeddings_"),
                                 (other.parts[1], "tied_copy_on_part_1_"
                                  "token_embedding_embeddings_"))]
        np.testing.assert_array_equal(np.asarray(home[0]),
                                      np.asarray(mine[0]))
        assert np.abs(np.asarray(mine[0])).max() > 0  # trained, not zeros
    # ... and onto one device, a plain Keras model.
    plain = tiny_lm()
    plain.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    tfpar.restore_checkpoint(plain, path)
    for a, b in zip(trained, plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Keras' own weight files: one weight, and loading fills the copy.
    pipe.save_weights(tmp_path / "lm.weights.h5")
    plain = tiny_lm()
    plain.load_weights(tmp_path / "lm.weights.h5")
    for a, b in zip(trained, plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    _, fresh = pipeline("2x4")
    fresh.load_weights(tmp_path / "lm.weights.h5")
    assert_bit_equal(fresh)
    # set_weights fills it as well.
    fresh.set_weights(weights)
    assert_bit_equal(fresh)
    np.testing.assert_array_equal(
        np.asarray(fresh.ties.copies[0].variable), weights[0])


# -- one weight held by two different layers (PyTorch-style tying) -----------


class TiedHead(keras.layers.Layer):
    """Logits h @ E^T where E is another layer's weight, as PyTorch ties
    `lm_head.weight = embed.weight`: this layer holds E too."""

    def __init__(self, embeddings, **kwargs):
        super().__init__(**kwargs)
        self.embeddings = embeddings  # tracked: one of this layer's weights

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.embeddings))


def shared_lm():
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    embedding = keras.layers.Embedding(VOCAB, DIM, name="token_embedding")
    h = keras.layers.Dense(DIM, activation="tanh", name="mid")(
        embedding(tokens))
    h = keras.layers.Dense(DIM, activation="tanh", name="top")(h)
    return keras.Model(tokens, TiedHead(embedding.embeddings, name="head")(h),
                       name="shared_lm")


@pytest.mark.parametrize("schedule", [
    "1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_a_weight_held_by_layers_of_two_stages_is_tied(schedule):
    """The embedding's weight, also held by the head on stage 1: held and
    updated on stage 0 (its first holder), a persistent copy on stage 1,
    as for a layer called twice."""
    keras.utils.set_random_seed(2)
    weights = shared_lm().get_weights()
    assert len(weights) == 5  # the shared weight once
    want = fit(shared_lm(), weights, "adam")
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESHES["2x2x2"]),
                                      rules={EMBEDDING: ("model", None)})
    with strategy.scope():
        pipe = tfpar.PipelineModel(shared_lm(), num_microbatches=2,
                                   schedule=schedule,
                                   stage_boundaries=["top"])
    embedding = pipe.get_layer("token_embedding").embeddings
    assert pipe.stages[1].shared == [embedding]
    assert "reads tied weights ['token_embedding/embeddings']" in \
        pipe.split_report()
    assert all(w is not embedding for w in pipe.parts[1].weights)
    check = CopiesBitEqual(pipe)
    assert_same(want, fit(pipe, weights, "adam", [check]))
    assert check.checked == 4
    [copy] = pipe.ties.copies
    assert copy.weight is embedding and copy.holder is pipe.parts[1]
    assert dtensor.fetch_layout(embedding.value).mesh == \
        strategy.stage_meshes[0].dtensor_mesh
    assert dtensor.fetch_layout(copy.variable.value).mesh == \
        strategy.stage_meshes[1].dtensor_mesh


class Counting(keras.layers.Dense):
    """A Dense layer also holding a given non-trainable variable."""

    def __init__(self, counter, **kwargs):
        super().__init__(8, **kwargs)
        self.counter = counter


def test_state_held_by_layers_of_two_stages_cannot_be_tied():
    """A non-trainable variable (state that calls update) held by layers
    of two stages: a clear error."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESHES["2x4"]))
    with strategy.scope():
        counter = keras.Variable(0.0, trainable=False, name="counter")
        x = keras.Input((8,))
        h = keras.layers.Dense(8, name="mid")(Counting(counter,
                                                       name="first")(x))
        model = keras.Model(x, Counting(counter, name="second")(h))
        with pytest.raises(ValueError, match=r"\['counter'\] are held by "
                           r"layer\(s\) \['second'\] of stage 1 and by a "
                           r"layer of an earlier stage, and are state"):
            tfpar.PipelineModel(model, num_microbatches=2,
                                stage_boundaries=["mid"])
