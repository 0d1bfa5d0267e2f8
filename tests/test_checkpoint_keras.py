"""Keras' own save/load APIs under ParallelStrategy (issue 5, item 1).

Every file written under a mesh must load into another mesh, into a
single-device model, and into a fresh process that never imports tfpar, with
the single-device results; Keras' checkpoint callbacks must work during `fit`.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar import layout as layout_lib

import models

RTOL = 1e-4
RULES = {r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
         r".*down/kernel": ("model", None)}
# The layouts RULES give the Sequential "mlp" below (the rest is replicated).
EXPECTED_SPECS = {"up/kernel": (None, "model"), "up/bias": ("model",),
                  "down/kernel": ("model", None), "down/bias": (None,),
                  "out/kernel": (None, None), "out/bias": (None,)}
MESHES = {"model=8": ({"model": 8}, RULES),
          "data=2,model=4": ({"data": 2, "model": 4}, RULES),
          "data=8": ({"data": 8}, None)}
_STRATEGIES = {}


def strategy(name):
    """One strategy per mesh for the whole module (rules checked per model)."""
    if name not in _STRATEGIES:
        axes, rules = MESHES[name]
        _STRATEGIES[name] = tfpar.ParallelStrategy(tfpar.Mesh(axes),
                                                   rules=rules)
    return _STRATEGIES[name]


def mlp():
    return keras.Sequential(
        [keras.Input((16,)),
         keras.layers.Dense(32, activation="relu", name="up"),
         keras.layers.Dense(16, name="down"), keras.layers.Dense(3, name="out")],
        name="mlp")


def build(mesh=None, seed=1, compile=True):  # noqa: A002
    """An MLP on `mesh` (None: single device), initialised from `seed`."""
    keras.utils.set_random_seed(seed)
    single = mlp()
    if mesh is None:
        model = single
    else:
        with strategy(mesh).scope():
            model = mlp()
            model.set_weights(single.get_weights())
    if compile:
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def data(n=64, seed=0):
    return models.mlp_data(n, seed)


fit = models.fit_mlp


def specs(model):
    # A Sequential's paths start with its name, except after load_model.
    return {v.path.removeprefix("mlp/"):
            layout_lib.spec_of(dtensor.fetch_layout(v.value))
            for v in model.weights}


def assert_close(a, b, rtol=RTOL):
    assert len(a) == len(b)
    for wa, wb in zip(a, b):
        assert np.shape(wa) == np.shape(wb)
        assert models.relative_error(wa, wb) < rtol


def assert_equal(a, b):
    assert len(a) == len(b)
    for wa, wb in zip(a, b):
        np.testing.assert_array_equal(np.asarray(wa), np.asarray(wb))


def optimizer_state(model):
    return [np.asarray(v) for v in model.optimizer.variables]


@pytest.mark.parametrize("source,target", [
    ("model=8", None), ("model=8", "data=2,model=4"),
    ("data=8", "data=2,model=4")])
def test_save_weights_loads_across_meshes(tmp_path, source, target):
    """Trained on one mesh, loaded into another (or one device): same model."""
    x, _ = data()
    reference = build()          # single device, same initial weights
    trained = build(source)
    fit(reference, 2)
    fit(trained, 2)
    assert_close(reference.get_weights(), trained.get_weights())
    path = str(tmp_path / "w.weights.h5")
    trained.save_weights(path)

    loaded = build(target, seed=7)       # different initial weights
    # The file holds the Adam state too; Keras loads it into a built optimizer.
    if target is None:
        loaded.optimizer.build(loaded.trainable_variables)
    else:
        with strategy(target).scope():  # as any tf.distribute strategy needs
            loaded.optimizer.build(loaded.trainable_variables)
    loaded.load_weights(path)
    assert_equal(trained.get_weights(), loaded.get_weights())
    assert_equal(optimizer_state(trained), optimizer_state(loaded))
    if target is not None:
        assert specs(loaded) == EXPECTED_SPECS
    # Predictions equal a single-device model holding the same file.
    on_one_device = build(seed=7, compile=False)
    on_one_device.load_weights(path)
    expected = on_one_device.predict(x, verbose=0)
    assert models.relative_error(expected, loaded.predict(x, verbose=0)) < RTOL
    assert models.relative_error(expected, trained.predict(x, verbose=0)) < RTOL


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A .keras file of an Adam-trained model on data=2 x model=4, with the
    model's predictions and optimizer state when it was saved."""
    model = build("data=2,model=4")
    fit(model, 2)
    path = str(tmp_path_factory.mktemp("saved") / "model.keras")
    model.save(path)
    x, _ = data()
    return {"path": path, "model": model,
            "predictions": model.predict(x, verbose=0),
            "weights": model.get_weights(),
            "optimizer": optimizer_state(model)}


_CHILD = r"""
import json, sys
import keras, numpy as np
path, out = sys.argv[1], sys.argv[2]
model = keras.models.load_model(path)
rng = np.random.RandomState(0)
x = rng.normal(size=(64, 16)).astype("float32")
np.savez(out, predictions=model.predict(x, verbose=0),
         *[np.asarray(v) for v in model.optimizer.variables])
print(json.dumps({"tfpar_imported": "tfpar" in sys.modules,
                  "optimizer": type(model.optimizer).__name__,
                  "iterations": int(model.optimizer.iterations.numpy())}))
"""


def test_keras_file_loads_in_a_process_without_tfpar(saved_model, tmp_path):
    out = str(tmp_path / "child.npz")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, saved_model["path"], out],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"tfpar_imported": False, "optimizer": "Adam",
                      "iterations": 8}  # 2 epochs x 4 batches
    child = np.load(out)
    np.testing.assert_allclose(child["predictions"],
                               saved_model["predictions"], rtol=0, atol=1e-6)
    # The optimizer state (iterations, learning rate, Adam moments) too.
    state = [child[f"arr_{i}"] for i in range(len(child.files) - 1)]
    assert_equal(saved_model["optimizer"], state)


def test_load_model_under_strategy_scope(saved_model):
    """load_model in scope: rules' layouts, same predictions and optimizer
    state, and training continues exactly as the saved model would."""
    x, _ = data()
    with strategy("data=2,model=4").scope():
        loaded = keras.models.load_model(saved_model["path"])
    assert specs(loaded) == EXPECTED_SPECS
    assert_equal(saved_model["weights"], loaded.get_weights())
    np.testing.assert_array_equal(saved_model["predictions"],
                                  loaded.predict(x, verbose=0))
    assert getattr(loaded, "optimizer", None) is not None, (
        "load_model did not compile the model")
    assert int(loaded.optimizer.iterations.numpy()) == 8
    assert_equal(saved_model["optimizer"], optimizer_state(loaded))
    # Adam moments follow their weight's layout.
    moments = {v.path.split("/")[-1]:
               layout_lib.spec_of(dtensor.fetch_layout(v.value))
               for v in loaded.optimizer.variables
               if v.path.endswith("kernel_momentum")}
    assert moments == {"up_kernel_momentum": (None, "model"),
                       "down_kernel_momentum": ("model", None),
                       "out_kernel_momentum": (None, None)}

    # Continue training: equal to continuing on one device from the file.
    on_one_device = keras.models.load_model(saved_model["path"])
    assert getattr(on_one_device, "optimizer", None) is not None, (
        "load_model did not compile the model (in a process importing tfpar)")
    assert_equal(saved_model["optimizer"], optimizer_state(on_one_device))
    fit(loaded, 1)
    fit(on_one_device, 1)
    assert int(loaded.optimizer.iterations.numpy()) == 12
    assert_close(on_one_device.get_weights(), loaded.get_weights())
    assert_close(optimizer_state(on_one_device), optimizer_state(loaded))


@pytest.mark.parametrize("weights_only", [True, False])
def test_model_checkpoint_callback(tmp_path, weights_only):
    suffix = "weights.h5" if weights_only else "keras"
    pattern = str(tmp_path / f"ckpt-{{epoch}}.{suffix}")
    reference = build()
    parallel = build("data=2,model=4")
    for model in (reference, parallel):
        fit(model, 2)
    parallel_before = parallel.get_weights()
    fit(parallel, 2, callbacks=[keras.callbacks.ModelCheckpoint(
        pattern, save_weights_only=weights_only)])
    fit(reference, 2)
    assert sorted(os.listdir(tmp_path)) == [f"ckpt-{e}.{suffix}" for e in (1, 2)]
    last = pattern.format(epoch=2)
    if weights_only:
        restored = build(seed=7, compile=False)
        restored.load_weights(last)
    else:
        restored = keras.models.load_model(last)
        assert getattr(restored, "optimizer", None) is not None, (
            "load_model did not compile the model")
        assert int(restored.optimizer.iterations.numpy()) == 16
        assert_equal(optimizer_state(parallel), optimizer_state(restored))
    assert_equal(parallel.get_weights(), restored.get_weights())
    assert_close(reference.get_weights(), restored.get_weights())
    # The epoch-1 file holds an intermediate state, not the start or the end.
    first = build(seed=7, compile=False)
    first.load_weights(pattern.format(epoch=1))
    for other in (parallel_before, parallel.get_weights()):
        assert any(not np.array_equal(u, v)
                   for u, v in zip(first.get_weights(), other))


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_an_interrupted_fit(tmp_path):
    epochs = 4
    reference = build()
    fit(reference, epochs)
    uninterrupted = build("data=2,model=4")
    fit(uninterrupted, epochs)
    assert_close(reference.get_weights(), uninterrupted.get_weights())

    backup = str(tmp_path / "backup")
    model = build("data=2,model=4")
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(model, epochs, callbacks=[
            keras.callbacks.BackupAndRestore(backup), _Interrupt()])
    assert os.path.exists(os.path.join(backup, "latest.weights.h5"))
    # A restarted job: a new model with other initial weights resumes at
    # epoch 2 from the backup.
    resumed = build("data=2,model=4", seed=7)
    epochs_run = []
    history = fit(resumed, epochs, callbacks=[
        keras.callbacks.BackupAndRestore(backup),
        keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: epochs_run.append(epoch))])
    assert epochs_run == [2, 3]
    assert len(history.history["loss"]) == 2
    assert int(resumed.optimizer.iterations.numpy()) == epochs * 4
    assert_close(uninterrupted.get_weights(), resumed.get_weights(), 1e-5)
    assert_close(optimizer_state(uninterrupted), optimizer_state(resumed),
                 1e-5)
    assert_close(reference.get_weights(), resumed.get_weights())
    assert not os.path.exists(backup)  # deleted after a completed fit
