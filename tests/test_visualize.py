"""Layout pictures and the per-variable summary (tfpar.visualize)."""

import importlib.util
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar
from tfpar import placement
from tfpar import visualize

RULES = {
    r".*up/kernel": (None, "model"),
    r".*up/bias": ("model",),
    r".*down/kernel": ("model", None),
}


@pytest.fixture(scope="module")
def built():
    """A Megatron MLP on data=2 x model=4 with its Adam slots built."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=RULES)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, name="up"),
            keras.layers.Dense(8, name="down"),
        ], name="sequential")  # fixed names: paths do not depend on test order
        model.compile(optimizer=keras.optimizers.Adam(0.01, name="adam"),
                      loss="mse")
        model.optimizer.build(model.trainable_variables)
    return strategy, model


def weight(model, suffix):
    (variable,) = [v for v in model.weights if v.path.endswith(suffix)]
    return variable


def text_cells(text):
    """The device lists of each grid row of `visualize_layout` text."""
    rows = []
    for line in text.splitlines():
        if "|" in line:
            rows.append([c.strip() for c in line.split("|")[1:-1]])
    return rows


def expand(cell):
    """'CPU:0,4' -> {'CPU:0', 'CPU:4'}; 'CPU:0-7' -> CPU:0..CPU:7."""
    kind, indices = cell.split(":")
    out = set()
    for part in indices.split(","):
        lo, _, hi = part.partition("-")
        out.update(f"{kind}:{i}" for i in range(int(lo), int(hi or lo) + 1))
    return out


def test_column_parallel_kernel_has_four_column_blocks(built):
    _, model = built
    printed = []
    text = visualize.visualize_layout(weight(model, "up/kernel"),
                                      print_fn=printed.append)
    assert printed == [text]
    assert "sequential/up/kernel" in text and "(None, 'model')" in text
    rows = text_cells(text)
    assert len(rows) == 1 and len(rows[0]) == 4
    for c, cell in enumerate(rows[0]):
        # Devices fill the mesh row-major: model coordinate c is held by
        # device c (data row 0) and device c + 4 (data row 1).
        assert cell == f"CPU:{c},{c + 4}"
        assert expand(cell) == {f"CPU:{c}", f"CPU:{c + 4}"}
    assert "[0:4]" in text and "[12:16]" in text and "[0:8]" in text

    grid = visualize.layout_grid(weight(model, "up/kernel"))
    assert grid["spec"] == (None, "model")
    assert grid["block_shape"] == (8, 4)
    assert grid["cells"] == [[[f"CPU:{c}", f"CPU:{c + 4}"] for c in range(4)]]
    assert grid["col_ranges"] == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_row_parallel_kernel_and_sharded_bias(built):
    _, model = built
    rows = text_cells(visualize.visualize_layout(
        weight(model, "down/kernel"), print_fn=None))
    assert rows == [[f"CPU:{c},{c + 4}"] for c in range(4)]
    rows = text_cells(visualize.visualize_layout(
        weight(model, "up/bias"), print_fn=None))
    assert rows == [[f"CPU:{c},{c + 4}" for c in range(4)]]


def test_replicated_variable_is_one_block_on_all_devices(built):
    strategy, model = built
    text = visualize.visualize_layout(weight(model, "down/bias"),
                                      print_fn=None)
    rows = text_cells(text)
    assert len(rows) == 1 and len(rows[0]) == 1
    assert expand(rows[0][0]) == {f"CPU:{i}" for i in range(8)}
    # Scalars (the optimizer step counter) are one replicated cell too.
    rows = text_cells(visualize.visualize_layout(
        model.optimizer.iterations, print_fn=None))
    assert [[expand(c) for c in r] for r in rows] == [[set(strategy.mesh.devices)]]


def test_accepts_dvariables_and_dtensor_tensors(built):
    _, model = built
    kernel = weight(model, "up/kernel")
    expected = text_cells(visualize.visualize_layout(kernel, print_fn=None))
    for value in (kernel.value, kernel.value.read_value()):
        assert dtensor.is_dtensor(value)
        text = visualize.visualize_layout(value, print_fn=None)
        assert text_cells(text) == expected


def test_rank_above_two_is_drawn_over_its_sharded_dims(built):
    strategy, _ = built
    value = placement.put(np.zeros((3, 2, 8, 5), "float32"),
                          (None, "data", "model", None), strategy.mesh)
    text = visualize.visualize_layout(value, print_fn=None)
    assert "rank-4 value: grid over dims (1, 2)" in text
    assert text_cells(text) == [[f"CPU:{4 * r + c}" for c in range(4)]
                                for r in range(2)]
    replicated = placement.put(np.zeros((3, 2, 4), "float32"),
                               (None, None, None), strategy.mesh)
    text = visualize.visualize_layout(replicated, print_fn=None)
    assert "grid over dims (0, 1)" in text and "no dimension is sharded" in text
    assert [[expand(c) for c in r] for r in text_cells(text)] == [
        [set(strategy.mesh.devices)]]


@pytest.mark.parametrize("value, shown", [
    (np.zeros(3, "float32"), "numpy.ndarray"),
    (tf.Variable(1.0), "ResourceVariable"),
])
def test_non_dtensor_input_is_a_type_error(value, shown):
    with pytest.raises(TypeError) as error:
        visualize.visualize_layout(value)
    message = str(error.value)
    assert "Received: value=<" in message and shown in message
    assert "DTensor" in message and "ParallelStrategy.scope()" in message


def test_keras_variable_outside_the_scope_is_a_type_error():
    with pytest.raises(TypeError, match=r"Received: value=<keras.*'variable(_\d+)?'"):
        visualize.visualize_layout(keras.Variable(np.zeros(2, "float32")))


def test_mesh_argument_must_be_the_values_mesh(built):
    strategy, model = built
    kernel = weight(model, "up/kernel")
    visualize.visualize_layout(kernel, mesh=strategy.mesh, print_fn=None)
    with pytest.raises(ValueError, match="does not live on the given mesh"):
        visualize.visualize_layout(kernel, mesh=tfpar.Mesh({"data": 8}),
                                   print_fn=None)
    with pytest.raises(TypeError, match="Received: mesh="):
        visualize.visualize_layout(kernel, mesh="data", print_fn=None)


MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def test_png_is_saved(built, tmp_path):
    if not MATPLOTLIB:  # the test environment installs the `viz` extra
        pytest.fail("matplotlib is not installed: pip install matplotlib")
    _, model = built
    path = tmp_path / "kernel.png"
    visualize.visualize_layout(weight(model, "up/kernel"), path=str(path),
                               print_fn=None)
    data = path.read_bytes()
    assert len(data) > 100
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_says_how_to_install(built, tmp_path,
                                                    monkeypatch):
    _, model = built
    for name in ("matplotlib", "matplotlib.figure",
                 "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    path = tmp_path / "kernel.png"
    with pytest.raises(ImportError, match="pip install matplotlib"):
        visualize.visualize_layout(weight(model, "up/kernel"), path=str(path),
                                   print_fn=None)
    assert not path.exists()


def test_summary_rows_bytes_and_totals(built):
    strategy, model = built
    lines = []
    rows = visualize.summary(model, print_fn=lines.append)
    assert "\n".join(lines) == rows.text

    weights = [r for r in rows if r["section"] == "weights"]
    assert [r["path"] for r in weights] == [v.path for v in model.weights]
    by_path = {r["path"]: r for r in weights}
    assert by_path["sequential/up/kernel"]["spec"] == (None, "model")
    assert by_path["sequential/up/kernel"]["block_shape"] == (8, 4)
    assert by_path["sequential/down/bias"]["spec"] == (None,)

    optimizer_paths = [r["path"] for r in rows if r["section"] == "optimizer"]
    assert optimizer_paths == [v.path for v in model.optimizer.variables]
    assert "adam/sequential_up_kernel_momentum" in optimizer_paths
    assert [r["path"] for r in rows if r["section"] == "metrics"] == [
        v.path for v in model.metrics_variables]

    for row in rows:
        full = int(np.prod(row["shape"])) * np.dtype(row["dtype"]).itemsize
        assert row["bytes"] == full
        sharded = any(axis is not None for axis in row["spec"])
        assert row["bytes_per_device"] == (full // 4 if sharded else full), row
        assert sorted(row["devices"]) == sorted(strategy.mesh.devices)
        line = next(l for l in lines if l.startswith(row["path"] + " "))
        assert line.endswith(f"{row['bytes_per_device']:,}")

    expected = strategy.memory_per_device()
    assert set(rows.totals) == set(expected)
    for device, entry in rows.totals.items():
        assert entry["params"] == expected[device]["params"] == (
            4 * (8 * 16 + 16 + 16 * 8) // 4 + 4 * 8)
        assert entry["optimizer"] == expected[device]["optimizer"] == (
            2 * entry["params"])
        # The step counter, the learning rate and the loss tracker's total
        # and count: what memory_per_device counts too.
        assert entry["other"] == expected[device]["other"] == 8 + 4 + 4 + 4
        assert entry["total"] == sum(entry[k] for k in
                                     ("params", "optimizer", "other"))
    assert any(l.startswith("  each of 8 devices (CPU:0-7): params 304 B")
               for l in lines)


def test_summary_without_optimizer_and_errors(built):
    strategy, model = built
    rows = visualize.summary(model, strategy=strategy, print_fn=None,
                             include_optimizer=False)
    assert {r["section"] for r in rows} == {"weights", "metrics"}
    assert rows.totals["CPU:0"]["optimizer"] == 0
    with pytest.raises(TypeError, match=r"Received: model=<numpy.ndarray"):
        visualize.summary(np.zeros(3))
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="has no weights yet"):
        visualize.summary(unbuilt)


def mlp_in(strategy, optimizer):
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(16, name="up"),
                                  keras.layers.Dense(8, name="down")],
                                 name="sequential")
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def test_summary_before_the_first_fit_shows_the_slots_to_come():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=RULES)
    model = mlp_in(strategy, keras.optimizers.Adam(0.01, name="adam"))
    before = visualize.summary(model, print_fn=None)
    assert "optimizer slots the first step will create (not built yet)" in (
        before.text)
    model.fit(np.ones((8, 8), "float32"), np.ones((8, 8), "float32"),
              batch_size=8, verbose=0)
    after = visualize.summary(model, print_fn=None)

    def slots(rows, section):
        return [(r["path"], r["spec"], r["block_shape"], r["devices"])
                for r in rows if r["section"] == section
                and r["kind"] == "optimizer"]

    predicted = slots(before, "optimizer, once built")
    assert len(predicted) == 8  # Adam: 2 slots for each of 4 weights
    assert sorted(predicted) == sorted(slots(after, "optimizer"))
    for device, entry in after.totals.items():
        assert before.totals[device]["optimizer"] == entry["optimizer"]
        assert entry == {**strategy.memory_per_device()[device],
                         "total": entry["total"]}


class NeedsAnArgument(keras.optimizers.SGD):
    """An optimizer that cannot be rebuilt from its config."""

    def __init__(self, special, **kwargs):
        super().__init__(**kwargs)
        self.special = special


def test_summary_says_not_built_yet_when_the_slots_cannot_be_known():
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=RULES)
    with strategy.scope():
        optimizer = NeedsAnArgument(1, learning_rate=0.1)
    model = mlp_in(strategy, optimizer)
    rows = visualize.summary(model, print_fn=None)
    assert "(slots: not built yet)" in rows.text
    assert all(entry["optimizer"] == 0 for entry in rows.totals.values())
