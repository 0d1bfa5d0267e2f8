"""Keras' `TensorBoard` callback under a ParallelStrategy: scalars every
step, and at each epoch's end a histogram and an image of every weight —
the same summaries one device writes (values within 1e-4 relative).

Found on 2026-12-07: with `histogram_freq` the callback stopped `fit` at
the first epoch's end ("Reshape got a regular tensor ... but was expecting
a DTensor": TensorBoard buckets a DTensor weight with regular tensors),
and with `write_images` on a weight split over the mesh ("Trying to copy
a non-single-device and non-replicated DTensor"). tfpar's patches
(`patches._weights_logged_from_host`, `patches._image_from_host`) log a
tfpar model's weights from host copies.
"""
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import models


def build():
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(12, 8, name="embed")(tokens)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    h = keras.layers.Dense(16, activation="tanh", name="mid")(h)
    return keras.Model(tokens, keras.layers.Dense(3, name="out")(h))


def summaries(directory):
    """{(run, tag, step): value} of every tensor summary written under
    `directory` (run: "train" or "validation")."""
    found = {}
    for path in pathlib.Path(directory).rglob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.HasField("tensor"):
                    found[path.parent.name, value.tag, event.step] = (
                        tf.make_ndarray(value.tensor))
    return found


def logged(directory, axes=None, pipeline=False):
    rng = np.random.RandomState(0)
    x = rng.randint(0, 12, size=(32, 6)).astype("int32")
    y = rng.normal(size=(32, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    model = models.built_on(
        build, axes, "mid" if pipeline else None,
        rules={r".*embed/embeddings": (None, "model"),
               r".*mid/kernel": (None, "model")} if axes and "model" in axes
        else None)
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              validation_data=(x, y), callbacks=[keras.callbacks.TensorBoard(
                  directory, histogram_freq=1, write_images=True,
                  update_freq="batch")])
    return summaries(directory)


@pytest.mark.parametrize("mesh", [
    "data2xmodel4", pytest.param("pipe2xdata4", marks=pytest.mark.slow)])
def test_tensorboard_writes_what_one_device_writes(mesh, tmp_path):
    want = logged(tmp_path / "one")
    got = logged(tmp_path / mesh, *{
        "data2xmodel4": ({"data": 2, "model": 4}, False),
        "pipe2xdata4": ({"pipe": 2, "data": 4}, True)}[mesh])
    if mesh == "pipe2xdata4":
        # Keras writes the model's config ("keras") for functional and
        # Sequential models only: a PipelineModel is a Model subclass.
        del want["train", "keras", 0]
    assert sorted(got) == sorted(want)
    tags = {tag for _, tag, _ in want}
    assert {"embed/embeddings/histogram", "mid/kernel/histogram",
            "mid/kernel/image", "epoch_loss", "batch_loss"} <= tags
    compared = 0
    for key, value in want.items():
        # Text (the model's config, naming its own layers) and images (PNG
        # bytes) are bytes: present alike; numbers within 1e-4.
        if value.dtype.kind in "fi":
            assert models.relative_error(value, got[key]) < 1e-4, key
            compared += 1
        else:
            assert got[key].shape == value.shape, key
    assert compared >= 2 * 8  # two epochs' histograms, losses and more
