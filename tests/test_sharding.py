"""Sharding is real: layouts, per-device blocks, optimizer slots, memory."""

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar import placement

import models


@pytest.fixture(scope="module")
def trained():
    """A functional model trained one epoch with Adam on data=2 x model=4."""
    mesh = tfpar.Mesh({"data": 2, "model": 4})
    strategy = tfpar.ParallelStrategy(mesh, rules=models.tp_rules())
    with strategy.scope():
        model = models.functional()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y = models.data("functional", n=32)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return strategy, model


EXPECTED = {
    "up/kernel": (None, "model"),
    "up/bias": ("model",),
    "down/kernel": ("model", None),
    "embed/embeddings": (None, "model"),
}


def test_each_sharded_variable_has_its_layout_and_only_its_block(trained):
    strategy, model = trained
    by_path = {v.path: v for v in model.weights}
    for path, spec in EXPECTED.items():
        variable = by_path[path].value
        layout = dtensor.fetch_layout(variable)
        assert tuple(None if s == dtensor.UNSHARDED else s
                     for s in layout.sharding_specs) == spec, path
        full = placement.fetch(variable.read_value())
        blocks = dtensor.unpack(variable.read_value())
        locations = strategy.mesh.dtensor_mesh.local_device_locations()
        dim = spec.index("model")
        expected_shape = list(variable.shape)
        expected_shape[dim] //= 4
        for device, block, location in zip(strategy.mesh.devices, blocks,
                                           locations):
            assert list(block.shape) == expected_shape, (path, device)
            assert block.device.endswith(device), (path, device)
            index = placement.block_index(full.shape, spec, {"model": 4},
                                          location)
            np.testing.assert_array_equal(block.numpy(), full[index])


def test_unruled_variables_are_replicated(trained):
    _, model = trained
    for variable in model.weights:
        if variable.path in EXPECTED:
            continue
        layout = dtensor.fetch_layout(variable.value)
        assert layout.is_fully_replicated(), variable.path


def test_adam_slots_are_sharded_like_their_weights(trained):
    _, model = trained
    weights = {v.path: v for v in model.trainable_weights}
    slots = 0
    for variable in model.optimizer.variables:
        for path, weight in weights.items():
            if variable.name.startswith(path.replace("/", "_") + "_"):
                assert variable.shape == weight.shape
                assert (dtensor.fetch_layout(variable.value)
                        == dtensor.fetch_layout(weight.value)), variable.path
                slots += 1
    assert slots == 2 * len(weights)  # momentum and velocity per weight


def test_memory_report_follows_the_formula(trained):
    strategy, model = trained

    def per_device(variable, spec):
        n = int(np.prod(variable.shape)) * 4
        return n // 4 if spec and "model" in spec else n

    params = sum(per_device(v, EXPECTED.get(v.path))
                 for v in model.trainable_weights)
    report = strategy.memory_per_device()
    assert set(report) == set(strategy.mesh.devices)
    for device, usage in report.items():
        assert usage["params"] == params, device
        assert usage["optimizer"] == 2 * params, device  # Adam: m and v
    # The sharded part really is split: the whole model is larger.
    whole = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
    sharded = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights
                  if v.path in EXPECTED)
    assert params == whole - sharded + sharded // 4


def test_assign_takes_values_from_any_layout_or_mesh(trained):
    """A weight accepts host arrays, DTensors of another layout and values
    living on another mesh, and keeps its own layout."""
    strategy, model = trained
    kernel = [v for v in model.weights if v.path == "up/kernel"][0]
    layout = dtensor.fetch_layout(kernel.value)
    target = np.arange(np.prod(kernel.shape), dtype="float32").reshape(kernel.shape)
    other = tfpar.ParallelStrategy(tfpar.Mesh({"model": 8}))
    replicated = placement.put(target, (None, None), strategy.mesh)
    elsewhere = placement.put(target, ("model", None), other.mesh)
    for value in (target, replicated, elsewhere):
        kernel.assign(np.zeros_like(target))
        kernel.assign(value)
        np.testing.assert_array_equal(kernel.numpy(), target)
        assert dtensor.fetch_layout(kernel.value) == layout
