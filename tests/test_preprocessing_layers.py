"""Keras' preprocessing layers inside a model under a ParallelStrategy
(data 8), against one device: per-step losses, final weights and
predictions within 1e-4 relative.

Found on 2026-12-07: Discretization (TF's `Bucketize`) and
CategoryEncoding's "count" and "multi_hot" (TF's `DenseBincount`) did not
compile ("op does not implement layout propagation"); tfpar's stand-ins
in a step (`spmd_ops.digitize_by_comparison`, Keras' own portable
encoding: `spmd_patches._portable_encoding_in_step`) give the same values.
StringLookup and IntegerLookup hold a lookup table, which no DTensor step
can run: refused before training with the fix (apply the layer in the
input pipeline), and that fix trains as one device.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import models

N = 32


def _data():
    rng = np.random.RandomState(0)
    return {"ids": rng.randint(0, 20, size=(N, 4)).astype("int64"),
            "values": rng.normal(size=(N, 4)).astype("float32"),
            "y": rng.normal(size=(N, 3)).astype("float32")}


def build(kind):
    """Inputs -> the preprocessing layer -> Dense -> Dense(3)."""
    data = _data()
    if kind in ("count", "multi_hot"):
        inputs = keras.Input((4,), dtype="int64")
        h = keras.layers.CategoryEncoding(num_tokens=20,
                                          output_mode=kind)(inputs)
    elif kind == "integer_lookup":
        inputs = keras.Input((4,), dtype="int64")
        h = keras.layers.Flatten()(keras.layers.Embedding(12, 4)(
            keras.layers.IntegerLookup(vocabulary=list(range(10)))(inputs)))
    else:
        inputs = keras.Input((4,))
        if kind == "discretization":
            h = keras.layers.Flatten()(keras.layers.Embedding(4, 4)(
                keras.layers.Discretization(
                    bin_boundaries=[-1.0, 0.0, 1.0])(inputs)))
        else:  # "normalization"
            normalize = keras.layers.Normalization()
            normalize.adapt(data["values"])
            h = normalize(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="mid")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(h))


def _inputs(kind):
    data = _data()
    return data["values"] if kind in ("discretization",
                                      "normalization") else data["ids"]


def trained(kind, axes=None):
    keras.utils.set_random_seed(0)
    weights = build(kind).get_weights()
    model = models.built_on(lambda: build(kind), axes)
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = _inputs(kind), _data()["y"]
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                        verbose=0)
    return (history.history["loss"], model.get_weights(),
            model.predict(x, batch_size=16, verbose=0))


@pytest.mark.parametrize("kind", [
    "discretization", "count",
    pytest.param("multi_hot", marks=pytest.mark.slow),
    pytest.param("normalization", marks=pytest.mark.slow)])
def test_a_preprocessing_layer_trains_as_one_device(kind):
    want, got = trained(kind), trained(kind, {"data": 8})
    assert models.relative_error(np.array(want[0]), np.array(got[0])) < 1e-4
    for a, b in zip(want[1], got[1]):
        assert models.relative_error(a, b) < 1e-4
    assert models.relative_error(want[2], got[2]) < 1e-4


def test_a_lookup_table_is_refused_with_the_input_pipeline_fix():
    with pytest.raises(ValueError, match=(
            r"(?s)LookupTableFindV2.*lookup table \(Keras' StringLookup, "
            r"IntegerLookup, TextVectorization\).*input pipeline")):
        trained("integer_lookup", {"data": 8})
    # The fix: the lookup in tf.data, the model on its integer ids.
    lookup = keras.layers.IntegerLookup(vocabulary=list(range(10)))
    data = _data()
    dataset = tf.data.Dataset.from_tensor_slices(
        (data["ids"], data["y"])).batch(16).map(
            lambda x, y: (lookup(x), y))

    def embedding_model():
        ids = keras.Input((4,), dtype="int64")
        h = keras.layers.Flatten()(keras.layers.Embedding(12, 4)(ids))
        return keras.Model(ids, keras.layers.Dense(3)(h))

    keras.utils.set_random_seed(0)
    weights = embedding_model().get_weights()
    found = []
    for axes in (None, {"data": 8}):
        model = models.built_on(embedding_model, axes)
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        found.append(model.fit(dataset, epochs=2, verbose=0).history["loss"])
    assert models.relative_error(np.array(found[0]),
                                 np.array(found[1])) < 1e-4


def test_the_stand_ins_example_runs():
    import doctest  # noqa: PLC0415 (one docstring)
    from tfpar import spmd_ops  # noqa: PLC0415

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(
            spmd_ops.digitize_by_comparison, globs=vars(spmd_ops)):
        runner.run(test)
    assert runner.summarize(verbose=False).attempted == 1
    assert runner.summarize(verbose=False).failed == 0
