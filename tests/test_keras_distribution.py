"""Keras' own distribution API (`keras.distribution`) on TensorFlow through
tfpar, in parity with one device; DTensor compile errors naming the layers.

Each parallel run uses unchanged Keras code: a `DataParallel` or
`ModelParallel` set with `set_distribution` or entered with `scope()`, the
model built and compiled there, `fit` called (inside or outside). The
oracle is the same model on one device from the same weights and data.
"""

import contextlib

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfpar
from tfpar import keras_distribution

import hub_models
import models

RTOL = 1e-4


@pytest.fixture(autouse=True)
def no_distribution_left():
    """Every test starts and ends with no distribution (nor strategy) set."""
    assert keras.distribution.distribution() is None
    yield
    keras.distribution.set_distribution(None)
    assert not tf.distribute.has_strategy()


def device_mesh(shape=(2, 4), names=("batch", "model")):
    return keras.distribution.DeviceMesh(
        shape, names, devices=keras.distribution.list_devices())


def mlp():
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu", name="up"),
        keras.layers.Dense(16, activation="relu", name="mid"),
        keras.layers.Dense(3, name="out")], name="mlp")


def train(build, x, y, weights, distribution=None, optimizer="sgd",
          loss="mse", epochs=2):
    """(per-batch losses, final weights, model) of `build()` trained from
    `weights`; built and compiled in `distribution.scope()`, fit outside."""
    with distribution.scope() if distribution else contextlib.nullcontext():
        model = build()
        model.set_weights(weights)
        model.compile(optimizer=optimizer, loss=loss)
    losses = models.BatchLosses()
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[losses])
    return losses.losses, model.get_weights(), model


def assert_parity(reference, parallel):
    (want_losses, want_weights), (got_losses, got_weights) = reference, parallel
    assert len(got_losses) == len(want_losses)
    assert models.relative_error(want_losses, got_losses) < RTOL
    for want, got in zip(want_weights, got_weights):
        assert models.relative_error(want, got) < RTOL


def blocks(variable):
    """The per-device blocks of a model weight, as DTensor holds them."""
    return dtensor.unpack(tf.convert_to_tensor(variable.value))


def test_data_parallel_trains_in_parity_with_replicated_weights():
    x, y = models.mlp_data()
    keras.utils.set_random_seed(0)
    weights = mlp().get_weights()
    reference = train(mlp, x, y, weights)[:2]
    distribution = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices())
    keras.distribution.set_distribution(distribution)
    try:
        *parallel, model = train(mlp, x, y, weights)
    finally:
        keras.distribution.set_distribution(None)
    assert_parity(reference, parallel)
    strategy = keras_distribution.strategy_for(distribution)
    assert model.distribute_strategy is strategy
    assert strategy.mesh.shape == {"batch": 8}
    assert strategy.data_axis == "batch"
    kernel = model.get_layer("up").kernel
    layout = dtensor.fetch_layout(kernel.value)
    assert layout.mesh.dim_names == ["batch"] and layout.is_fully_replicated()
    assert [b.shape for b in blocks(kernel)] == [(16, 32)] * 8


def test_model_parallel_layout_map_trains_in_parity_with_sharded_blocks():
    """Column then row parallel by a LayoutMap; a "/output" key relayouts a
    layer's output through distribute_tensor; default Adam."""
    mesh = device_mesh()
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*mid/kernel"] = ("model", None)
    layout_map["mlp/out/output"] = ("batch", None)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")
    x, y = models.mlp_data()
    keras.utils.set_random_seed(0)
    weights = mlp().get_weights()
    reference = train(mlp, x, y, weights, optimizer="adam")[:2]
    *parallel, model = train(mlp, x, y, weights, distribution,
                             optimizer="adam")
    assert_parity(reference, parallel)
    assert not tf.distribute.has_strategy()  # scope() exited
    up, mid = model.get_layer("up"), model.get_layer("mid")
    layout = dtensor.fetch_layout(up.kernel.value)
    assert layout.sharding_specs == [dtensor.UNSHARDED, "model"]
    assert layout.mesh.dim_names == ["batch", "model"]
    # Devices fill the (batch, model) grid row-major: device d holds column
    # block d % 4 of the up kernel and row block d % 4 of the mid kernel.
    whole_up, whole_mid = up.kernel.numpy(), mid.kernel.numpy()
    for d, (b_up, b_mid) in enumerate(zip(blocks(up.kernel),
                                          blocks(mid.kernel))):
        k = d % 4
        np.testing.assert_array_equal(b_up, whole_up[:, 8 * k:8 * (k + 1)])
        np.testing.assert_array_equal(b_mid, whole_mid[8 * k:8 * (k + 1)])
    assert [b.shape for b in blocks(model.get_layer("out").kernel)] == [
        (16, 3)] * 8


def _hub_layout_run(name, backbone, mesh_shape, optimizer, steps=2):
    x, y = hub_models.data(name, batch=8 * steps)
    keras.utils.set_random_seed(0)
    weights = hub_models.BUILDERS[name]().get_weights()
    # Built from arguments, not called eagerly: keras-hub backbones are
    # functional, so their weights exist once constructed.
    build = hub_models.BUILDERS[name]
    loss = hub_models.loss(name)
    reference = train(build, x, y, weights, optimizer=optimizer(),
                      loss=loss, epochs=1)[:2]
    mesh = device_mesh(mesh_shape)
    distribution = keras.distribution.ModelParallel(
        layout_map=backbone.get_layout_map(mesh), batch_dim_name="batch")
    *parallel, model = train(build, x, y, weights, distribution,
                             optimizer=optimizer(), loss=loss, epochs=1)
    assert_parity(reference, parallel)
    return model, keras_distribution.strategy_for(distribution)


def test_keras_hub_llama_layout_map_trains_in_parity_2d():
    """keras-hub's own Llama layout map splits weights over "batch" and
    "model" (2-D); they are stored so, gathered over "batch" in a step."""
    model, strategy = _hub_layout_run(
        "llama", keras_hub.models.LlamaBackbone, (2, 4), keras.optimizers.SGD)
    specs = {p: (s, b) for p, s, b in strategy.placements("params")}
    assert specs["transformer_layer_0/feedforward_gate_dense/kernel"] == (
        ("batch", "model"), (32, 32))
    assert specs["transformer_layer_0/self_attention/query/kernel"] == (
        ("model", "batch", None), (16, 4, 8))
    kernel = model.backbone.get_layer(
        "transformer_layer_0")._feedforward_gate_dense.kernel
    whole = kernel.numpy()
    for d, block in enumerate(blocks(kernel)):
        row, col = divmod(d, 4)  # (batch, model) coordinates of device d
        np.testing.assert_array_equal(
            block, whole[32 * row:32 * (row + 1), 32 * col:32 * (col + 1)])


@pytest.mark.slow
@pytest.mark.parametrize("name,backbone", [
    ("gemma", keras_hub.models.GemmaBackbone),
    ("llama_gqa", keras_hub.models.LlamaBackbone),
])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)])
@pytest.mark.parametrize("optimizer", [keras.optimizers.SGD,
                                       keras.optimizers.Adam])
def test_keras_hub_layout_maps_train_in_parity(name, backbone, mesh_shape,
                                                optimizer):
    _, strategy = _hub_layout_run(name, backbone, mesh_shape, optimizer)
    split = [p for p, s, _ in strategy.placements("params")
             if "model" in s and strategy.mesh.axis_size("model") > 1]
    assert len(split) >= 10


def test_a_variable_layout_wins_over_the_layout_map():
    """keras.Variable(layout=...) as Keras' get_variable_layout honours it."""
    mesh = device_mesh()
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        up = keras.layers.Dense(8, name="up")
        up.build((None, 4))
        own = keras.Variable(np.ones((4, 8), "float32"), name="own",
                             layout=keras.distribution.TensorLayout(
                                 ("model", None), mesh))
        with pytest.raises(ValueError, match="layout=.*rank 2"):
            keras.Variable(np.ones((4, 8), "float32"),
                           layout=keras.distribution.TensorLayout(
                               ("model",), mesh))
    specs = [dtensor.fetch_layout(v.value).sharding_specs
             for v in (up.kernel, own)]
    assert specs == [[dtensor.UNSHARDED, "model"], ["model", dtensor.UNSHARDED]]


def test_distribute_tensor_puts_host_values_and_relayouts_in_steps():
    mesh = device_mesh()
    # (Keras 3.15's DataParallel on a 2-D mesh fails in its own warning:
    # warnings.warn(..., ndim) passes the int as the category.)
    distribution = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh))
    layout = keras.distribution.TensorLayout((None, "model"), mesh)
    with pytest.raises(ValueError, match="needs a distribution set"):
        keras.distribution.distribute_tensor(np.ones((4, 8)), layout)
    with distribution.scope():
        value = keras.distribution.distribute_tensor(
            tf.reshape(tf.range(32.0), (4, 8)), layout)
        assert dtensor.fetch_layout(value).sharding_specs == [
            dtensor.UNSHARDED, "model"]
        assert [b.shape for b in dtensor.unpack(value)] == [(4, 2)] * 8
        with pytest.raises(ValueError, match="rank 1"):
            keras.distribution.distribute_tensor(tf.ones(4), layout)
        other = keras.distribution.TensorLayout(
            ("x", None), device_mesh((8,), ("x",)))
        with pytest.raises(ValueError, match="current distribution's mesh"):
            keras.distribution.distribute_tensor(tf.ones((8, 8)), other)


def test_mesh_and_rules_from_keras():
    mesh = device_mesh()
    assert tfpar.Mesh.from_keras(mesh) == tfpar.Mesh({"batch": 2, "model": 4})
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    layout_map["dense/output"] = ("batch", None)
    rules = tfpar.LayoutRules.from_keras(layout_map)
    assert rules.items() == [(".*dense.*kernel", (None, "model"))]
    with pytest.raises(TypeError, match="needs a keras.distribution.DeviceMesh"):
        tfpar.Mesh.from_keras((2, 4))
    with pytest.raises(TypeError, match="needs a keras.distribution.LayoutMap"):
        tfpar.LayoutRules.from_keras([".*"])


def test_unsupported_parts_raise_clear_errors():
    mesh = device_mesh()

    class MyDistribution(keras.distribution.DataParallel):
        pass

    with pytest.raises(TypeError, match=r"DataParallel and ModelParallel.*"
                       r"Received: a distribution of type MyDistribution"):
        keras.distribution.set_distribution(
            MyDistribution(devices=keras.distribution.list_devices()))
    assert keras.distribution.distribution() is None  # not set
    layout_map = keras.distribution.LayoutMap(mesh)
    with pytest.raises(ValueError, match=r"batch_dim_name 'data' is not an "
                       r"axis of its device mesh \['batch', 'model'\]"):
        keras.distribution.set_distribution(keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="data"))
    with pytest.raises(NotImplementedError, match="tfpar.connect_hosts"):
        keras.distribution.initialize("10.0.0.1:1234", 2, 0)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    with strategy.scope(), pytest.raises(
            RuntimeError, match="inside `with strategy.scope\\(\\):`"):
        with keras.distribution.DataParallel(
                devices=keras.distribution.list_devices()).scope():
            pass
    # A weight key that matches no variable: stricter than Keras.
    layout_map["nothing/kernel"] = (None, "model")
    with pytest.raises(ValueError, match=r"'nothing/kernel'.*matched no"):
        train(mlp, *models.mlp_data(), mlp().get_weights(),
              keras.distribution.ModelParallel(layout_map=layout_map))


def conv_model():
    return keras.Sequential([
        keras.Input((8, 8, 4)), keras.layers.Conv2D(8, 3, name="conv"),
        keras.layers.BatchNormalization(name="bn"), keras.layers.Flatten(),
        keras.layers.Dense(4, name="out")], name="convnet")


@pytest.mark.parametrize("rules,needles", [
    ({r".*conv/kernel": (None, None, "model", None)},
     ["its tf.Conv2D op failed: Filter for convolution must have fully "
      "replicated layout",
      "layer 'convnet/conv' (Conv2D): weight 'convnet/conv/kernel' shape "
      "(3, 3, 4, 8), layout (None, None, 'model', None), per-device block "
      "(3, 3, 1, 8)",
      "What to change: DTensor's convolutions take only replicated filters"]),
    ({r".*bn/gamma": ("model",), r".*bn/beta": ("model",)},
     ["tf.Conv2DBackpropFilter op failed",
      "layer 'convnet/bn' (BatchNormalization): weight 'convnet/bn/gamma'",
      "weight 'convnet/bn/beta' shape (8,), layout ('model',)",
      "What to change: this op runs only on tensors split over the batch"]),
])
def test_dtensor_compile_errors_name_the_layers(rules, needles):
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"data": 2, "model": 4}),
                                      rules=rules)
    with strategy.scope():
        model = conv_model()
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError) as error:
        model.fit(np.ones((8, 8, 8, 4), "float32"),
                  np.ones((8, 4), "float32"), batch_size=8, verbose=0)
    message = str(error.value)
    assert message.startswith(
        "DTensor could not compile the train step of model 'convnet' on "
        "Mesh({'data': 2, 'model': 4}")
    for needle in needles:
        assert needle in message, message


def test_compile_error_names_the_weights_of_a_contracting_clash():
    """DTensor's message for keras-hub's 2-D Llama layout before tfpar
    gathered weights over the data axis (as it was raised in fit, location
    lines trimmed), explained against a Llama laid out by that layout map:
    the operand block (16, 32) is the token embedding's."""
    message = (
        "error: Contracting dimension for matmul has sharding dimension batch "
        "for the left input and model for the right input which are not "
        "equal. This case is currently not supported.\n"
        "tensorflow/dtensor/mlir/expansions/matmul_spmd_expander.cc:84 ::\n"
        "While computing SPMD expansion\n"
        'note: see current operation: %607 = "tf.BatchMatMulV2"(%606, %591) '
        "<{adj_x = false}> {_global_shape = [#tf_type.shape<8x8x64>]} : "
        "(tensor<8x8x32xf32>, tensor<16x32xf32>) -> tensor<8x8x64xf32>")
    mesh = device_mesh()
    distribution = keras.distribution.ModelParallel(
        layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh))
    with distribution.scope():
        model = hub_models.BUILDERS["llama"]()
    from tfpar import compile_errors  # noqa: PLC0415

    text = compile_errors.explain(
        message, model, keras_distribution.strategy_for(distribution).extended)
    assert "its tf.BatchMatMulV2 op failed: Contracting dimension" in text
    assert ("layer 'token_embedding' (ReversibleEmbedding): weight "
            "'token_embedding/embeddings' shape (64, 64), layout "
            "('model', 'batch'), computed as ('model', None), per-device "
            "block (16, 32)") in text
    assert "split that dimension over the same axis on both sides" in text


def test_set_distribution_sets_the_strategy_and_clear_session_clears_both():
    distribution = keras.distribution.DataParallel()
    keras.distribution.set_distribution(distribution)
    assert tf.distribute.get_strategy() is keras_distribution.strategy_for(
        distribution)
    keras.backend.clear_session()  # Keras' state and TF's default graph
    assert keras.distribution.distribution() is None
    assert not tf.distribute.has_strategy()
    with distribution.scope():  # the same strategy again
        assert tf.distribute.get_strategy() is keras_distribution.strategy_for(
            distribution)
