"""Fully sharded data parallelism: `ParallelStrategy(..., fsdp=True)`.

Every trainable weight is also split over the data axis, and so are its
optimizer slots; steps gather weights where layers read them and
reduce-scatter their gradients; rows looked up in a weight keep a sparse
gradient. Parity with single-device Keras on
the same meshes and models as `test_parity`, layouts and per-device blocks,
the memory report, the compiled collectives, checkpoints across fsdp and
plain strategies, eager calls and the errors.
"""

import contextlib
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar
from tfpar import placement

import models
import test_parity as parity

KINDS = ["sequential", "functional", "subclassed"]
MESHES = [(8, 1), (2, 4)]


def fsdp_strategy(data, model, kind="functional"):
    return tfpar.ParallelStrategy(
        tfpar.Mesh({"data": data, "model": model}),
        rules=models.tp_rules(kind) if model > 1 else None, fsdp=True)


# Default profile: each model kind and each mesh at least once; all six
# with `dev.py test-all`.
_DEFAULT_ADAM_CASES = {("sequential", 8, 1), ("subclassed", 2, 4)}


@pytest.mark.parametrize("kind,data,model", [
    pytest.param(kind, d, m, id=f"{d}x{m}-{kind}",
                 marks=() if (kind, d, m) in _DEFAULT_ADAM_CASES
                 else pytest.mark.slow)
    for kind in KINDS for d, m in MESHES])
def test_adam_parity(kind, data, model):
    parity.assert_same(parity.single_device(kind, "adam"),
                       parity.train(kind, "adam", fsdp_strategy(data, model,
                                                                kind)))


@pytest.mark.parametrize("optimizer_name", ["sgd", pytest.param("adamw", marks=pytest.mark.slow)])
def test_other_optimizers_parity(optimizer_name):
    parity.assert_same(
        parity.single_device("functional", optimizer_name),
        parity.train("functional", optimizer_name, fsdp_strategy(4, 2)))


def _mlp():
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="up"),
        keras.layers.Dense(32, activation="relu", name="mid"),
        keras.layers.Dense(3, name="out")], name="mlp")


def _fit_mlp(strategy, steps_per_execution=1):
    keras.utils.set_random_seed(1)
    weights = _mlp().get_weights()
    if strategy is None:
        model = _mlp()
    else:
        with strategy.scope():
            model = _mlp()
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                  steps_per_execution=steps_per_execution)
    losses = models.BatchLosses()
    models.fit_mlp(model, epochs=2, callbacks=[losses])
    return model, losses.losses


@pytest.fixture(scope="module")
def mlp_on_data8():
    """The MLP trained with fsdp on data=8 (4 steps per call), next to one
    device."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), fsdp=True)
    model, losses = _fit_mlp(strategy, steps_per_execution=4)
    reference, reference_losses = _fit_mlp(None)
    return strategy, model, losses, reference, reference_losses


def test_steps_per_execution_parity(mlp_on_data8):
    _, model, losses, reference, reference_losses = mlp_on_data8
    # Keras logs the last of every 4 steps (2 epochs x 4 batches of 16).
    assert len(losses) == 2
    assert models.relative_error(reference_losses[3::4], losses) < parity.RTOL
    for ours, theirs in zip(model.weights, reference.weights):
        assert models.relative_error(theirs.numpy(), ours.numpy()) < parity.RTOL


def test_weights_and_slots_hold_one_block_per_device(mlp_on_data8):
    strategy, model, _, _, _ = mlp_on_data8
    expected = {"up/kernel": ("data", None), "up/bias": ("data",),
                "mid/kernel": ("data", None), "mid/bias": ("data",),
                "out/kernel": ("data", None),
                "out/bias": (None,)}  # 3 rows: data=8 cannot split them
    slots = {v.path: v for v in model.optimizer.variables}
    locations = strategy.mesh.dtensor_mesh.local_device_locations()
    for weight in model.weights:
        spec = expected[weight.path.removeprefix("mlp/")]
        prefix = weight.path.replace("/", "_")
        own = [v for p, v in slots.items()
               if p.split("/")[-1].startswith(prefix)]
        assert len(own) == 2, weight.path  # Adam's momentum and velocity
        for variable in [weight] + own:
            layout = dtensor.fetch_layout(variable.value)
            assert placement.layout_lib.spec_of(layout) == spec, variable.path
            full = variable.numpy()
            blocks = dtensor.unpack(variable.value.read_value())
            for block, location in zip(blocks, locations):
                index = placement.block_index(full.shape, spec, {"data": 8},
                                              location)
                np.testing.assert_array_equal(block.numpy(), full[index])
                if spec[0] == "data":
                    assert block.shape[0] == full.shape[0] // 8


def test_memory_report_is_one_eighth(mlp_on_data8):
    strategy, model, _, _, _ = mlp_on_data8

    def block_bytes(variable):
        n = int(np.prod(variable.shape))
        return 4 * (n if variable.path == "mlp/out/bias" else n // 8)

    params = sum(block_bytes(v) for v in model.trainable_weights)
    whole = sum(4 * int(np.prod(v.shape)) for v in model.trainable_weights)
    assert params < whole / 7
    for usage in strategy.memory_per_device().values():
        assert usage["params"] == params
        assert usage["optimizer"] == 2 * params  # Adam: m and v


def test_specs_add_the_data_axis_to_the_first_free_dimension():
    strategy = fsdp_strategy(2, 4, "subclassed")
    with strategy.scope():
        models.subclassed()  # Keras defers this model's weights
    specs = {path: spec for path, spec, _ in strategy.placements("params")}
    assert specs["sub/embed/embeddings"] == ("data", "model")
    assert specs["sub/up/kernel"] == ("data", "model")
    assert specs["sub/down/kernel"] == ("model", "data")  # (32, 16)
    assert specs["sub/conv/kernel"] == (None, None, "data", None)


def test_step_gathers_each_split_weight_once_and_reduce_scatters_its_gradient(
        mlp_on_data8):
    """On data=8 the compiled step all-gathers each split weight once (real
    CollectiveGatherV2 ops; the optimizer update reads the blocks) and
    reduce-scatters its gradient (on CPU DTensor runs that as an all-reduce
    followed by a slice: `purpose` is what DTensor asked for)."""
    strategy, model, _, _, _ = mlp_on_data8
    x, y = models.mlp_data(n=16)
    report = tfpar.communication_report(model, x, y)
    gathers = report.select(kind="all-gather")
    assert all(c.op == "CollectiveGatherV2" for c in gathers)
    assert all(c.phase == "forward" for c in gathers)
    split = [v for v in model.trainable_weights if v.path != "mlp/out/bias"]
    sizes = sorted(4 * int(np.prod(v.shape)) for v in split)
    assert sorted(c.bytes for c in gathers) == sizes
    scatters = report.select(purpose="reduce-scatter")
    assert all(c.phase == "backward" for c in scatters)
    assert sorted(c.bytes for c in scatters) == sizes
    assert os.environ.get("LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2") is None


def test_checkpoints_move_between_fsdp_and_plain(mlp_on_data8, tmp_path):
    strategy, model, _, _, _ = mlp_on_data8
    x, _ = models.mlp_data()
    expected = model.predict(x, batch_size=16, verbose=0)
    tfpar.save_checkpoint(model, str(tmp_path / "ckpt"))
    for target in (tfpar.ParallelStrategy(tfpar.Mesh({"data": 2,
                                                      "model": 4})),
                   tfpar.ParallelStrategy(tfpar.Mesh({"data": 4,
                                                      "model": 2}),
                                          fsdp=True),
                   None):
        with target.scope() if target else contextlib.nullcontext():
            restored = _mlp()
            restored.compile(optimizer=keras.optimizers.Adam(0.01),
                             loss="mse")
        tfpar.restore_checkpoint(restored, str(tmp_path / "ckpt"))
        for ours, theirs in zip(restored.weights, model.weights):
            np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
        np.testing.assert_allclose(
            restored.predict(x, batch_size=16, verbose=0), expected,
            rtol=1e-5, atol=1e-6)


def test_keras_saving_round_trips(mlp_on_data8, tmp_path):
    """model.save / load_model without tfpar, and save_weights /
    load_weights into an fsdp model (which keeps its split layout)."""
    strategy, model, _, _, _ = mlp_on_data8
    x, _ = models.mlp_data(n=16)
    expected = model.predict(x, batch_size=16, verbose=0)
    model.save(tmp_path / "mlp.keras")
    plain = keras.models.load_model(tmp_path / "mlp.keras")
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected,
                               rtol=1e-5, atol=1e-6)
    model.save_weights(tmp_path / "mlp.weights.h5")
    with strategy.scope():
        again = _mlp()
    again.load_weights(tmp_path / "mlp.weights.h5")
    for ours, theirs in zip(again.weights, model.weights):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
        assert dtensor.fetch_layout(ours.value) == dtensor.fetch_layout(
            theirs.value)


def test_eager_call_matches_predict(mlp_on_data8):
    _, model, _, _, _ = mlp_on_data8
    x, _ = models.mlp_data(n=16)
    np.testing.assert_allclose(
        np.asarray(model(x)), model.predict(x, batch_size=16, verbose=0),
        rtol=1e-5, atol=1e-6)


def test_row_lookups_outside_a_step():
    """tf.gather of a table split by rows also works in an eager call."""
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), fsdp=True)
    with strategy.scope():
        model = _lookup_model("tf.gather")
    ids = np.arange(48, dtype="int32").reshape(16, 3) % 16
    table = model.get_layer("lookup").table.numpy()
    kernel, bias = model.get_layer("out").get_weights()
    expected = table[ids].reshape(16, 12) @ kernel + bias
    np.testing.assert_allclose(np.asarray(model(ids)), expected, rtol=1e-5,
                               atol=1e-6)


class Lookup(keras.layers.Layer):
    """Looks rows of its own table up: `tf.gather` of the variable (its
    sparse_read) or `keras.ops.take` (a read of the whole table, then a
    gather of that tensor, as Keras' Embedding does)."""

    def __init__(self, how, **kwargs):
        super().__init__(**kwargs)
        self.how = how

    def build(self, input_shape):
        self.table = self.add_weight(shape=(16, 4), name="table")

    def call(self, ids):
        if self.how == "tf.gather":
            return tf.gather(self.table.value, ids)
        return keras.ops.take(self.table, ids, axis=0)


def _lookup_model(how):
    return keras.Sequential([keras.Input((3,), dtype="int32"),
                             Lookup(how, name="lookup"),
                             keras.layers.Flatten(),
                             keras.layers.Dense(2, name="out")], name="lk")


@pytest.mark.parametrize("how,fsdp", [("tf.gather", True),
                                      ("keras.ops.take", True),
                                      ("tf.gather", False)])
def test_row_lookups_keep_sparse_gradients(how, fsdp):
    """Rows looked up in a split weight keep a sparse gradient, so Adam
    (which treats sparse gradients differently) matches one device even
    with repeated rows. Without fsdp the table is split by a rule."""
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 16, size=(64, 3)).astype("int32")
    ids[:, 1] = ids[:, 0]  # repeated rows within every sample
    y = rng.normal(size=(64, 2)).astype("float32")
    keras.utils.set_random_seed(2)
    weights = _lookup_model(how).get_weights()
    results = []
    rules = None if fsdp else {r".*lookup/table": ("data", None)}
    for strategy in (None, tfpar.ParallelStrategy(
            tfpar.Mesh({"data": 8}), rules=rules, fsdp=fsdp)):
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = _lookup_model(how)
            model.set_weights(weights)
            model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        model.fit(ids, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        results.append(model.get_weights())
    specs = dict((p, s) for p, s, _ in strategy.placements("params"))
    assert specs["lk/lookup/table"] == ("data", None)
    for want, got in zip(*results):
        assert models.relative_error(want, got) < parity.RTOL


def test_bad_fsdp_arguments():
    with pytest.raises(TypeError, match=r"fsdp.*Received: fsdp='yes'"):
        tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}), fsdp="yes")
    with pytest.raises(ValueError, match=r"fsdp=True.*data axis 'data'"):
        tfpar.ParallelStrategy(tfpar.Mesh({"model": 8}), fsdp=True)


def test_pipeline_stages_shard_their_weights_over_data():
    import test_pipeline as pipeline_tests  # noqa: PLC0415

    axes = {"pipe": 2, "data": 2, "model": 2}
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes),
                                      rules=pipeline_tests.TP_RULES, fsdp=True)
    with strategy.scope():
        pipe = tfpar.PipelineModel(pipeline_tests.build(), num_microbatches=4)
    pipeline_tests.assert_parity(pipeline_tests.train(pipe))
    kernel = pipe.get_layer("d0").kernel  # (16, 32), rule (None, "model")
    blocks = dtensor.unpack(kernel.value.read_value())
    assert [tuple(b.shape) for b in blocks] == [(8, 16)] * 4  # one stage

