"""Parity with single-device Keras: same weights and data in, same out.

For every mesh data x model in {8x1, 4x2, 2x4, 1x8} and every model kind
(Sequential, functional, subclassed), two epochs of Adam training give the
same per-batch losses, final metrics and final weights as single-device
Keras within 1e-4 relative (fp32). SGD with momentum and AdamW run on the
2x4 mesh. The single-device results are computed once per (kind,
optimizer) and shared by the meshes.
"""

import functools

import pytest

import tfpar

import models

RTOL = 1e-4
MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
BATCH, EPOCHS = 16, 2


def train(kind, optimizer_name, strategy=None):
    """Trains `kind` from the shared initial weights; returns its results."""
    weights = models.initial_weights(kind)
    x, y = models.data(kind)
    if strategy is None:
        model = models.BUILDERS[kind]()
        model.set_weights(weights)
        model.compile(optimizer=models.optimizer(optimizer_name), loss="mse",
                      metrics=["mae"])
    else:
        with strategy.scope():
            model = models.BUILDERS[kind]()
            model.set_weights(weights)
            model.compile(optimizer=models.optimizer(optimizer_name),
                          loss="mse", metrics=["mae"])
    losses = models.BatchLosses()
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                        verbose=0, callbacks=[losses])
    return {
        "batch_losses": losses.losses,
        "history": history.history,
        "weights": {v.path: v.numpy() for v in model.weights},
        "predictions": model.predict(x, batch_size=BATCH, verbose=0),
    }


@functools.lru_cache(maxsize=None)
def single_device(kind, optimizer_name):
    return train(kind, optimizer_name)


def assert_same(reference, result):
    assert len(result["batch_losses"]) == len(reference["batch_losses"])
    assert models.relative_error(reference["batch_losses"],
                                 result["batch_losses"]) < RTOL
    for key, values in reference["history"].items():
        assert models.relative_error(values, result["history"][key]) < RTOL, key
    assert reference["weights"].keys() == result["weights"].keys()
    for path, value in reference["weights"].items():
        error = models.relative_error(value, result["weights"][path])
        assert error < RTOL, (path, error)
    assert models.relative_error(reference["predictions"],
                                 result["predictions"]) < RTOL


# Every mesh and every kind of model at least once in the default run (the
# whole matrix with `python3 dev.py test-all`).
_DEFAULT_ADAM_CASES = {("sequential", 8, 1), ("subclassed", 2, 4),
                       ("functional", 1, 8)}


@pytest.mark.parametrize("kind,data,model", [
    pytest.param(kind, d, m, id=f"{d}x{m}-{kind}",
                 marks=() if (kind, d, m) in _DEFAULT_ADAM_CASES
                 else pytest.mark.slow)
    for kind in ["sequential", "functional", "subclassed"] for d, m in MESHES])
def test_adam_parity(kind, data, model):
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": data, "model": model}),
        rules=models.tp_rules(kind) if model > 1 else None)
    assert_same(single_device(kind, "adam"), train(kind, "adam", strategy))


@pytest.mark.parametrize("optimizer_name", [
    "sgd", pytest.param("adamw", marks=pytest.mark.slow)])
def test_other_optimizers_parity(optimizer_name):
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 4}), rules=models.tp_rules())
    assert_same(single_device("functional", optimizer_name),
                train("functional", optimizer_name, strategy))


@pytest.mark.parametrize("fsdp", [
    pytest.param(False, id="plain"),
    pytest.param(True, id="fsdp", marks=pytest.mark.slow)])
def test_gradient_accumulation_parity(fsdp):
    """Keras' `gradient_accumulation_steps`: the accumulators are laid out
    like their weights' optimizer slots (split by the rules, and over the
    data axis under fsdp)."""
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 4}), rules=models.tp_rules(),
        fsdp=fsdp)
    reference = single_device("functional", "adam-accumulate")
    assert models.relative_error(  # accumulating changes the training
        single_device("functional", "adam")["batch_losses"],
        reference["batch_losses"]) > 1e-2
    assert_same(reference, train("functional", "adam-accumulate", strategy))
    specs = {path: spec for path, spec, _ in strategy.placements("optimizer")}
    accumulators = [p for p in specs if p.endswith("_gradient_accumulator")]
    assert len(accumulators) == len(strategy.placements("params"))
    for path in accumulators:
        assert specs[path] == specs[path.replace("_gradient_accumulator",
                                                 "_momentum")], path
    assert any("model" in specs[p] for p in accumulators)
    assert any("data" in specs[p] for p in accumulators) == fsdp
