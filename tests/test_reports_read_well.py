"""Reports that read well (issue 34): `memory_report`'s layers named by the
paths their weights have and its batch taken from the model's inputs when
none is given, `summary`'s compact table, `Plan.explain()` without `nan`
and with the calibration's spread, and the warning for a strategy with
rules whose scope was never entered.
"""

import math
import warnings
import weakref

import keras
import numpy as np
import pytest

import tfpar
from tfpar import strategy as strategy_lib
from tfpar.planner import calibrate
from tfpar.reports import buffers
from tfpar.reports import memory
from tfpar.reports import visualize

MESH = {"data": 2, "model": 4}
UP_RULES = {r".*up/kernel": (None, "model"), r".*down/kernel": ("model", None)}


class Block(keras.layers.Layer):
    """up -> down: two Dense layers nested in one layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(32, activation="relu", name="up")
        self.down = keras.layers.Dense(16, name="down")

    def call(self, x):
        return self.down(self.up(x))


def blocks_model(num_blocks=2):
    x = keras.Input((16,), name="x")
    h = x
    for i in range(num_blocks):
        h = Block(name=f"block_{i}")(h)
    return keras.Model(x, keras.layers.Dense(4, name="head")(h), name="net")


def compiled(strategy, build=blocks_model):
    with strategy.scope():
        model = build()
        model.compile(optimizer="adam", loss="mse")
    return model


@pytest.fixture(scope="module")
def strategy():
    return tfpar.ParallelStrategy(tfpar.Mesh(MESH), rules=UP_RULES)


# -- memory_report -------------------------------------------------------------


def test_memory_report_names_layers_by_their_weights_paths(strategy):
    model = compiled(strategy)
    x = np.ones((8, 16), "float32")
    report = tfpar.memory_report(model, x, np.ones((8, 4), "float32"))
    # The layers' paths: the weights' paths without the weight's own name.
    weight_layers = {w.path.rsplit("/", 1)[0] for w in model.weights}
    assert weight_layers == {"block_0/up", "block_0/down", "block_1/up",
                             "block_1/down", "head"}
    layers = set(report.by_layer)
    assert {"block_0/up", "block_1/up", "block_0/down",
            "block_1/down"} <= layers, layers
    # No name scope of the traced step ("net_1/block_0_1/up_1") is left.
    assert all(name in weight_layers or name.startswith("compile_loss/")
               or name in {"block_0", "block_1"} for name in layers), layers
    # Every row of the printed table names its layer in full.
    text = str(report)
    for name in layers:
        assert any(line.startswith(name + " ") for line in text.splitlines())
    # Renaming loses no byte.
    device = strategy.mesh.devices[0]
    assert sum(v["activations"] for v in report.by_layer.values()) == (
        report[device]["activations"])


def test_memory_report_keeps_auto_named_layers_apart():
    """Keras names them dense, dense_1, ...; the traced step's scope of
    layer "dense" is "dense_1" (TF's suffix), which is not layer dense_1.
    The names are spelled out as Keras' counter gives them in a fresh
    process, so the test does not depend on which tests ran before it."""
    def four_dense():
        return keras.Sequential(
            [keras.Input((8,))]
            + [keras.layers.Dense(16, activation="relu", name=name)
               for name in ("dense", "dense_1", "dense_2", "dense_3")])

    strategy = tfpar.ParallelStrategy(tfpar.Mesh(MESH))
    model = compiled(strategy, four_dense)
    report = tfpar.memory_report(model, np.ones((16, 8), "float32"),
                                 np.ones((16, 16), "float32"))
    layers = {name for name in report.by_layer
              if not name.startswith("compile_loss/")}
    assert layers == {layer.path for layer in model.layers}, layers
    device = strategy.mesh.devices[0]
    assert sum(v["activations"] for v in report.by_layer.values()) == (
        report[device]["activations"])


def test_layer_paths_of_a_keras_hub_step_are_the_weights_paths():
    import hub_models  # noqa: PLC0415

    model = hub_models.build("gpt2")
    paths = buffers.LayerPaths(model)
    # An op of the traced step as DTensor names it: every scope made
    # unique with "_1" (the model itself traced before).
    op = (f"{model.name}_1/{model.backbone.name}_1/transformer_layer_0_1/"
          "self_attention_1/query_1/einsum/Einsum:0")
    assert paths(op) == "transformer_layer_0/self_attention/query"
    assert any(w.path.startswith(paths(op) + "/") for w in model.weights)
    assert paths(f"{model.name}_1/{model.backbone.name}_1/"
                 "transformer_layer_1_1/feedforward_layer_norm_1/add:0") == (
        "transformer_layer_1/feedforward_layer_norm")
    assert paths("compile_loss/sparse_categorical_crossentropy/"
                 "SparseSoftmaxCrossEntropyWithLogits/x:0") == (
        "compile_loss/sparse_categorical_crossentropy")


def test_memory_report_without_a_batch_reads_the_models_inputs(strategy):
    model = compiled(strategy)
    given = tfpar.memory_report(model, np.ones((16, 16), "float32"),
                                np.ones((16, 4), "float32"))
    made = tfpar.memory_report(model, batch_size=16)
    assert dict(made) == dict(given)
    assert made.by_layer == given.by_layer
    # The default: the smallest batch the step accepts (the data axis').
    x, y = memory.batch_from_inputs(model)
    assert (x.shape, x.dtype, y.shape) == ((2, 16), np.float32, (2, 4))
    with pytest.raises(ValueError, match=r"batch_size\) must be a positive "
                       r"multiple of 2.*batch_size=3"):
        tfpar.memory_report(model, batch_size=3)


def test_memory_report_without_a_batch_says_what_to_pass(strategy):
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__(name="sub")
            self.dense = keras.layers.Dense(4)

        def call(self, x):
            return self.dense(x)

    def unknown_length():
        tokens = keras.Input((None,), dtype="int32", name="token_ids")
        h = keras.layers.Embedding(8, 4, name="embed")(tokens)
        return keras.Model(tokens, keras.layers.Dense(4, name="out")(h))

    def subclassed():
        model = Subclassed()
        model(np.ones((2, 8), "float32"))
        return model

    with pytest.raises(ValueError, match=r"inputs of 'sub' are not known.*"
                       r"x=None.*memory_report\(model, x, y\)"):
        tfpar.memory_report(compiled(strategy, subclassed))
    with pytest.raises(ValueError, match=r"'token_ids'.*\(None, None\).*"
                       r"x=None.*memory_report\(model, x, y\)"):
        tfpar.memory_report(compiled(strategy, unknown_length))


# -- summary -------------------------------------------------------------------


def test_summary_is_compact_above_forty_variables(strategy):
    model = compiled(strategy, lambda: blocks_model(6))
    rows = tfpar.summary(model, print_fn=None)
    # 6 blocks x 4 weights + head 2, Adam's 2 slots each, 2 counters, loss.
    assert len(rows) == 26 + 52 + 2 + 2 > visualize.COMPACT_ABOVE
    text = rows.text.splitlines()
    assert text[1].startswith(f"(compact: {len(rows)} variables in ")
    assert "compact=False" in text[1]
    folded = [line for line in text if "block_{0..5}/up/kernel (x6)" in line]
    assert len(folded) == 1 and "(None, 'model')" in folded[0]
    # The row's bytes are the six kernels' per device: 6 x 16 x 8 x 4.
    assert folded[0].split()[-1] == f"{6 * 16 * 8 * 4:,}"
    assert any("*_momentum (x26)" in line for line in text)
    full = tfpar.summary(model, print_fn=None, compact=False)
    assert len(full.text.splitlines()) - len(text) >= len(rows) - 30
    assert all(row["path"] in full.text for row in full)
    assert [r["path"] for r in full] == [r["path"] for r in rows]


def test_compact_summary_labels_slot_groups_and_keeps_devices_apart():
    def slot(path, shape, devices):
        return {"section": "optimizer", "kind": "optimizer", "path": path,
                "shape": shape, "spec": (None,) * len(shape),
                "block_shape": shape, "bytes_per_device": 4 * math.prod(shape),
                "devices": devices}

    stage_0, stage_1 = ["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]
    rows = [slot(f"sgd/{name}{i}_{weight}_momentum", shape, stage_0)
            for i in range(2)
            for name, weight, shape in (("up", "kernel", (8, 8)),
                                        ("up", "bias", (8,)),
                                        ("down", "kernel", (8, 8)))]
    rows += [slot("sgd/head_kernel_momentum", (8, 4), stage_1),
             slot("sgd/head_bias_momentum", (4,), stage_1)]
    folded = visualize._folded_rows(rows)
    # One row per stage, labelled by the slot kind, not by its first row.
    assert [(r["path"], r["devices"], r["bytes_per_device"]) for r in folded
            ] == [("sgd/*_momentum (x6)", stage_0, 4 * 2 * (64 + 8 + 64)),
                  ("sgd/*_momentum (x2)", stage_1, 4 * (32 + 4))]


def test_summary_of_a_small_model_lists_every_variable(strategy):
    model = compiled(strategy, lambda: blocks_model(1))
    rows = tfpar.summary(model, print_fn=None)
    assert "(compact:" not in rows.text
    assert all(row["path"] in rows.text for row in rows)
    forced = tfpar.summary(model, print_fn=None, compact=True)
    assert "(compact:" in forced.text


# -- Plan.explain ----------------------------------------------------------------


def mlp():
    x = keras.Input((64,), name="x")
    h = keras.layers.Dense(128, activation="relu", name="up0")(x)
    return keras.Model(x, keras.layers.Dense(8, name="head")(h), name="mlp")


def test_explain_shows_no_nan_and_the_calibrations_spread(monkeypatch,
                                                          tmp_path):
    # Repeats of three micro-benchmarks: half-ranges 50%, 0%, 20%.
    monkeypatch.setattr(calibrate, "_TIMINGS",
                        [[1.0, 3.0], [2.0, 2.0, 2.0], [1.0, 1.5]])
    shared = tfpar.Cluster(num_hosts=1, devices_per_host=8,
                           device_memory=1e9, device_flops=1e10,
                           intra_host_bandwidth=1e9,
                           inter_host_bandwidth=1e9, shared_host=True)
    plan = tfpar.plan(mlp, 64, cluster=shared)
    assert any(c.estimate is None for c in plan.candidates)  # rejected
    text = plan.explain(top=40)
    assert "nan" not in text
    assert 'measured: "-", not timed' in text
    assert "Calibration spread ±20% over 7 timings" in text
    plan.save(tmp_path / "plan.json")
    assert "±20% over 7 timings" in tfpar.Plan.load(
        tmp_path / "plan.json").explain()
    described = tfpar.Cluster(num_hosts=1, devices_per_host=8,
                              device_memory=1e9, device_flops=1e10,
                              intra_host_bandwidth=1e9,
                              inter_host_bandwidth=1e9)
    assert "Calibration spread" not in tfpar.plan(
        mlp, 64, cluster=described).explain()


# -- a strategy with rules never entered -------------------------------------------


def _fit_plain_model():
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, name="up")])
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.fit(np.ones((8, 8)), np.ones((8, 16)), verbose=0)
            model.train_function = None  # made again by the next fit
    return [w for w in caught if "scope never entered" in str(w.message)]


def test_a_model_trained_outside_a_strategy_with_rules_warns_once(
        monkeypatch):
    monkeypatch.setattr(strategy_lib, "_NEVER_ENTERED", weakref.WeakSet())
    forgotten = tfpar.ParallelStrategy(tfpar.Mesh(MESH),  # noqa: F841
                                       rules={r".*up/kernel": (None, "model")})
    caught = _fit_plain_model()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    # It points at the user's line (here, `fit` in this file), not Keras'.
    assert caught[0].filename == __file__, caught[0].filename
    assert "Model 'sequential" in messages[0]
    assert ("{'data': 2, 'model': 4} whose layout rules match its weights "
            "(e.g. '.*up/kernel')") in messages[0]
    assert "with strategy.scope():" in messages[0]


def test_no_warning_when_the_scope_was_entered_or_there_are_no_rules(
        monkeypatch):
    monkeypatch.setattr(strategy_lib, "_NEVER_ENTERED", weakref.WeakSet())
    used = tfpar.ParallelStrategy(tfpar.Mesh(MESH),
                                  rules={r".*up/kernel": (None, "model")})
    with used.scope():
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(16, name="up")])
        model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(np.ones((8, 8)), np.ones((8, 16)), verbose=0)
    assert not [w for w in caught if "scope never entered" in str(w.message)]
    no_rules = tfpar.ParallelStrategy(tfpar.Mesh(MESH))  # noqa: F841
    other_model = tfpar.ParallelStrategy(  # noqa: F841
        tfpar.Mesh(MESH), rules={r".*attention/kernel": (None, "model")})
    # Never entered, but no rule is for this model's weights.
    assert _fit_plain_model() == []
