"""Sparse gradients (rows looked up by an Embedding) under every Keras
optimizer in its default configuration, on every kind of mesh.

Keras' TF optimizers apply an IndexedSlices gradient with scatter ops and
divide it by dense accumulators inside a dynamic-shape `tf.cond`; DTensor
2.21 lays out neither. Plain `SGD()` with an Embedding used to fail in
`fit` on every mesh, data=8 included ("'tf.ResourceScatterSub' op does not
implement layout propagation"), and Adagrad/RMSprop/Adadelta/Adafactor with a
hidden-split table ("SPMD expansion resulted in op output inconsistent with
the provided layout"). Oracle: the same two epochs on one device.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpar

import models

OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adadelta", "Adafactor", "Adagrad",
              "Adamax", "Ftrl", "Lamb", "Lion", "Nadam", "RMSprop", "Muon"]
# name -> (mesh axes, rules, fsdp)
MESHES = {
    "data8": ({"data": 8}, {}, False),
    "data8_fsdp": ({"data": 8}, {}, True),  # table rows split over data
    "data2_model4_hidden": ({"data": 2, "model": 4},
                            {r".*embed/embeddings": (None, "model")}, False),
    "data2_model4_vocab": ({"data": 2, "model": 4},
                           {r".*embed/embeddings": ("model", None)}, False),
    "data2_model4_fsdp": ({"data": 2, "model": 4},
                          {r".*embed/embeddings": (None, "model")}, True),
}
VOCAB, SEQ, HIDDEN = 16, 5, 8


def _build():
    return keras.Sequential([
        keras.Input((SEQ,), dtype="int32"),
        keras.layers.Embedding(VOCAB, HIDDEN, name="embed"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1, name="head"),
    ])


def _data():
    rng = np.random.default_rng(0)
    # Few rows, many look-ups: every batch repeats rows, so the repeated
    # rows' slices must be summed exactly as one device sums them.
    return (rng.integers(0, VOCAB, (16, SEQ)),
            rng.random((16, 1)).astype("float32"))


def _train(optimizer_name, strategy=None):
    keras.utils.set_random_seed(1)
    x, y = _data()
    scope = strategy.scope() if strategy else tf.init_scope()
    with scope:
        model = _build()
        model.compile(optimizer=getattr(keras.optimizers, optimizer_name)(),
                      loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                        shuffle=False)
    return history.history["loss"], model.get_weights(), model


def _assert_parity(optimizer_name, mesh_name):
    losses, weights, _ = _train(optimizer_name)
    axes, rules, fsdp = MESHES[mesh_name]
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules,
                                      fsdp=fsdp)
    got_losses, got_weights, model = _train(optimizer_name, strategy)
    np.testing.assert_allclose(got_losses, losses, rtol=1e-4)
    for want, got in zip(weights, got_weights):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # The table really is split as the rules and fsdp say.
    spec = dict((p, s) for p, s, _ in strategy.placements("params"))
    table = next(s for p, s in spec.items() if p.endswith("embed/embeddings"))
    if fsdp or rules:
        assert table != (None, None), (mesh_name, table)
    # Each device holds only its block of the table (and of its slots).
    embeddings = model.get_layer("embed").embeddings
    models.assert_one_block_per_device(embeddings, table)
    for slot in model.optimizer.variables:
        if tuple(slot.shape) == tuple(embeddings.shape):
            models.assert_one_block_per_device(slot, table)
    return model


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_every_default_optimizer_on_a_hidden_split_table(optimizer_name):
    """The hardest common case: batch split over data, table over model."""
    _assert_parity(optimizer_name, "data2_model4_hidden")


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_plain_sgd_on_every_mesh(mesh_name):
    """The seven-line report: plain SGD, an Embedding, any mesh."""
    _assert_parity("SGD", mesh_name)


@pytest.mark.parametrize("mesh_name", ["data8", "data8_fsdp",
                                       "data2_model4_vocab"])
@pytest.mark.parametrize("optimizer_name", ["Adagrad", "RMSprop"])
def test_scatter_optimizers_on_other_meshes(optimizer_name, mesh_name):
    _assert_parity(optimizer_name, mesh_name)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_every_optimizer_on_every_mesh(optimizer_name, mesh_name):
    _assert_parity(optimizer_name, mesh_name)


@pytest.mark.parametrize("spec", [(None, "model"), ("data", None)])
def test_scatter_update_writes_the_rows(spec):
    """`variable.scatter_update(IndexedSlices)` inside a step (Keras'
    `optimizer.assign` with a sparse value) replaces exactly those rows."""
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 4}),
        rules={r"table": spec})
    with strategy.scope():
        table = keras.Variable(np.zeros((8, 4), "float32"), name="table")

    @tf.function
    def step():
        def update():
            table.value.scatter_update(tf.IndexedSlices(
                tf.constant([[1.0] * 4, [2.0] * 4]), tf.constant([5, 2]),
                tf.constant([8, 4])))
            table.value.scatter_add(tf.IndexedSlices(
                tf.constant([[1.0] * 4, [1.0] * 4]), tf.constant([2, 2]),
                tf.constant([8, 4])))
        strategy.run(update)

    step()
    want = np.zeros((8, 4), "float32")
    want[5], want[2] = 1.0, 4.0  # 2 written, then 1 + 1 added
    np.testing.assert_array_equal(np.asarray(table.value), want)


@pytest.mark.parametrize("optimizer_name", ["SGD", "Adagrad"])
def test_scatter_optimizers_in_pipeline_stages(optimizer_name):
    """Each stage's optimizer copy applies its stage's sparse gradient."""
    def build():
        return keras.Sequential([
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, HIDDEN, name="embed"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(HIDDEN, name="mid"),  # stage 1 begins here
            keras.layers.Dense(1, name="head"),
        ])

    x, y = _data()
    keras.utils.set_random_seed(1)
    reference = build()
    reference.compile(optimizer=getattr(keras.optimizers, optimizer_name)(),
                      loss="mse")
    initial = reference.get_weights()
    want = reference.fit(x, y, batch_size=8, epochs=2, verbose=0,
                         shuffle=False).history["loss"]
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"pipe": 2, "data": 2, "model": 2}),
        rules={r".*embed/embeddings": (None, "model")})
    with strategy.scope():
        model = build()
        model.set_weights(initial)
        model = tfpar.PipelineModel(model, num_microbatches=2)
        model.compile(optimizer=getattr(keras.optimizers, optimizer_name)(),
                      loss="mse")
    got = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                    shuffle=False).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
