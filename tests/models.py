"""Models, data and comparisons shared by the parity tests.

Every model holds the layer kinds the foundation must cover: Dense (a
column-parallel "up" and a row-parallel "down" pair), Conv2D (replicated
filters), Embedding, LayerNormalization, BatchNormalization, Dropout (forced
into inference mode so results are deterministic) and a custom layer with
its own `add_weight`.
"""

import contextlib
import re

import keras
import numpy as np

import tfpar

IMAGE_SHAPE = (6, 6, 2)
SEQ_LEN, VOCAB = 5, 32
HIDDEN, OUT = 32, 4

# Megatron MLP pair: up is column-parallel, down is row-parallel; the
# embedding table is split along its hidden dimension.
TP_RULES = {
    r".*up/kernel": (None, "model"),
    r".*up/bias": ("model",),
    r".*down/kernel": ("model", None),
    r".*embed/embeddings": (None, "model"),
}


def tp_rules(kind="functional"):
    rules = dict(TP_RULES)
    if kind == "sequential":
        del rules[r".*embed/embeddings"]
    return tfpar.LayoutRules(rules)


class Scale(keras.layers.Layer):
    """A custom layer with its own weight: y = x * gamma."""

    def build(self, input_shape):
        self.gamma = self.add_weight(
            shape=(input_shape[-1],), initializer="ones", name="gamma"
        )

    def call(self, x):
        return x * self.gamma


class InferenceDropout(keras.layers.Dropout):
    """Dropout that always runs in inference mode (deterministic parity)."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=False)


def _trunk(image):
    h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv")(image)
    h = keras.layers.BatchNormalization(name="bn")(h)
    return keras.layers.Flatten(name="flat")(h)


def _head(h):
    h = keras.layers.Dense(HIDDEN, activation="relu", name="up")(h)
    h = InferenceDropout(0.3, name="drop")(h)
    h = keras.layers.Dense(16, name="down")(h)
    h = keras.layers.LayerNormalization(name="ln")(h)
    h = Scale(name="scale")(h)
    return keras.layers.Dense(OUT, name="out")(h)


def sequential():
    """Image-only Sequential model (no Embedding: Sequential has one input)."""
    return keras.Sequential(
        [
            keras.Input(IMAGE_SHAPE),
            keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Flatten(name="flat"),
            keras.layers.Dense(HIDDEN, activation="relu", name="up"),
            InferenceDropout(0.3, name="drop"),
            keras.layers.Dense(16, name="down"),
            keras.layers.LayerNormalization(name="ln"),
            Scale(name="scale"),
            keras.layers.Dense(OUT, name="out"),
        ],
        name="seq",
    )


def functional():
    image = keras.Input(IMAGE_SHAPE, name="image")
    tokens = keras.Input((SEQ_LEN,), dtype="int32", name="tokens")
    e = keras.layers.Embedding(VOCAB, 8, name="embed")(tokens)
    e = keras.layers.GlobalAveragePooling1D(name="pool")(e)
    h = keras.layers.Concatenate(name="cat")([_trunk(image), e])
    return keras.Model([image, tokens], _head(h), name="func")


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="sub")
        self.conv = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv")
        self.bn = keras.layers.BatchNormalization(name="bn")
        self.embed = keras.layers.Embedding(VOCAB, 8, name="embed")
        self.up = keras.layers.Dense(HIDDEN, activation="relu", name="up")
        self.drop = InferenceDropout(0.3, name="drop")
        self.down = keras.layers.Dense(16, name="down")
        self.ln = keras.layers.LayerNormalization(name="ln")
        self.scale = Scale(name="scale")
        self.out = keras.layers.Dense(OUT, name="out")

    def call(self, inputs, training=None):
        image, tokens = inputs
        h = keras.ops.reshape(self.bn(self.conv(image), training=training),
                              (-1, int(np.prod(IMAGE_SHAPE[:2])) * 4))
        e = keras.ops.mean(self.embed(tokens), axis=1)
        h = keras.ops.concatenate([h, e], axis=-1)
        h = self.ln(self.down(self.drop(self.up(h))))
        return self.out(self.scale(h))


def subclassed():
    model = Subclassed()
    model([keras.Input(IMAGE_SHAPE), keras.Input((SEQ_LEN,), dtype="int32")])
    return model


BUILDERS = {"sequential": sequential, "functional": functional,
            "subclassed": subclassed}


def data(kind, n=64, seed=0):
    """(x, y): inputs for model `kind` and a learnable regression target."""
    rng = np.random.RandomState(seed)
    image = rng.normal(size=(n, *IMAGE_SHAPE)).astype("float32")
    tokens = rng.randint(0, VOCAB, size=(n, SEQ_LEN)).astype("int32")
    mix = rng.normal(size=(int(np.prod(IMAGE_SHAPE)), OUT)).astype("float32")
    y = (image.reshape(n, -1) @ mix / 8.0 + tokens[:, :OUT] / VOCAB).astype(
        "float32")
    x = image if kind == "sequential" else [image, tokens]
    return x, y


def mlp_data(n=64, seed=0):
    """(x, y) for the 16 -> 3 MLPs of the API and checkpoint tests."""
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    y = np.stack([x[:, :4].sum(1), x[:, 4:8].prod(1), np.sin(x[:, 8])], 1)
    return x, y.astype("float32")


def fit_mlp(model, epochs=1, **kwargs):
    """Fits a 16 -> 3 MLP on `mlp_data()` in order, batch 16."""
    x, y = mlp_data()
    return model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False,
                     verbose=0, **kwargs)


def optimizer(name):
    return {
        "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "sgd-default": keras.optimizers.SGD,  # plain SGD, Keras' defaults
        "adam": lambda: keras.optimizers.Adam(0.01),
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
        # Keras' own gradient accumulation: update every 2nd batch.
        "adam-accumulate": lambda: keras.optimizers.Adam(
            0.01, gradient_accumulation_steps=2),
    }[name]()


def initial_weights(kind, seed=0):
    keras.utils.set_random_seed(seed)
    return BUILDERS[kind]().get_weights()


def relative_error(a, b):
    """max |a - b| / max(|a|, tiny): the test's notion of 'relative'."""
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-12))


def assert_one_block_per_device(variable, spec, devices=None):
    """Each device holding Keras `variable` (a tfpar strategy's) holds
    exactly its block of the whole value as laid out by `spec` (rows
    [c * n/k, (c+1) * n/k) of a dimension split k ways), on `devices`
    (short names, "CPU:4") when given."""
    from tensorflow.experimental import dtensor  # noqa: PLC0415

    from tfpar import placement  # noqa: PLC0415

    value = getattr(variable, "value", variable).read_value()
    mesh = dtensor.fetch_layout(value).mesh
    sizes = {axis: mesh.dim_size(axis) for axis in mesh.dim_names}
    full = np.asarray(variable)
    blocks = dtensor.unpack(value)
    if devices is not None:
        assert [b.device.rsplit("device:", 1)[-1] for b in blocks] == \
            list(devices), variable.path
    for block, location in zip(blocks, placement.local_locations(mesh)):
        np.testing.assert_array_equal(block.numpy(), full[
            placement.block_index(full.shape, spec, sizes, location)])


class BatchLosses(keras.callbacks.Callback):
    """Records the logged loss after every training batch."""

    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def train_built(strategy, build, x, y, batch_size, epochs=1):
    """(model, per-batch losses): `build()` (in `strategy.scope()` unless
    `strategy` is None), then fit on (x, y) in order."""
    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    losses = BatchLosses()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
              verbose=0, callbacks=[losses])
    return model, losses.losses



def assert_layer_trains_like_one_device(layer, mesh, width):
    """A Dense(width) then `layer()` (a fresh layer each build), SGD(0.1)
    and MSE on 16 seeded samples of `width` features, trained at batch 8
    on one device and on `mesh` ({axis: size}) from the same weights:
    losses and weights within 1e-4 relative."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, width)).astype("float32")
    y = rng.normal(size=(16, width)).astype("float32")
    keras.utils.set_random_seed(0)
    weights = keras.Sequential([keras.Input((width,)), keras.layers.Dense(
        width)]).get_weights()

    def build():
        model = keras.Sequential([keras.Input((width,)),
                                  keras.layers.Dense(width), layer()])
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    reference, want = train_built(None, build, x, y, 8)
    model, got = train_built(tfpar.ParallelStrategy(tfpar.Mesh(mesh)),
                             build, x, y, 8)
    assert relative_error(want, got) < 1e-4, (want, got)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        assert relative_error(a, b) < 1e-4


def train_sgd_in_order(strategy, build, weights, x, y):
    """(per-batch losses as an array, model): `build()` with `weights`,
    compiled with SGD(0.1) and MSE (in `strategy.scope()` unless `strategy`
    is None), then two epochs of fit on (x, y) at batch 16, in order."""
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build()
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    losses = BatchLosses()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[losses])
    return np.array(losses.losses), model

def assert_trains_in_order_like_one_device(build, x, y, mesh, rules=None):
    """`build()` from one set of initial weights, trained as
    `train_sgd_in_order` does on one device and on `mesh` ({axis: size},
    with `rules`): losses and weights within 1e-4 relative."""
    weights = build().get_weights()
    want, reference = train_sgd_in_order(None, build, weights, x, y)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(mesh), rules=rules)
    got, model = train_sgd_in_order(strategy, build, weights, x, y)
    assert relative_error(want, got) < 1e-4, (want, got)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        assert relative_error(a, b) < 1e-4

def assert_layer_trains_as_one_device(shape, layer, mesh=None):
    """`layer()` on inputs of `shape` (without the batch), flattened into
    a Dense of 3, trained as `assert_trains_in_order_like_one_device` on
    random float32 data: on `mesh` ({"data": 8} by default) as on one
    device. A layer whose symbolic call returns its input is refused: the
    functional model would not hold it, and the test would train the
    Dense alone (Keras 3.15's `Equalization` does this)."""
    def build():
        x = keras.Input(shape)
        h = layer()(x)
        assert h is not x, (
            f"{layer}: its symbolic call returned its input, so the model "
            "would skip it; call it inside a layer of one's own")
        return keras.Model(x, keras.layers.Dense(3)(
            keras.layers.Flatten()(h)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16,) + tuple(shape)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    assert_trains_in_order_like_one_device(build, x, y, mesh or {"data": 8})


# The MLP the two-host tests train (tests/test_hosts.py, hosts_child.py).
HOST_RULES = {r".*up0/kernel": (None, "model"), r".*up0/bias": ("model",),
              r".*down0/kernel": ("model", None)}


def host_mlp():
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu", name="up0"),
        keras.layers.Dense(16, activation="relu", name="down0"),
        keras.layers.Dense(3, name="head")], name="mlp")


# The optimizers the two-host offload tests train with, by name.
HOST_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgdm": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd": keras.optimizers.SGD}  # Keras' defaults


def train_host_mlp(model, x, y, weights, optimizer="adam"):
    """Two epochs of batch 32 in order from `weights` with
    `HOST_OPTIMIZERS[optimizer]`; (per-batch losses, final weights,
    evaluate, predict)."""
    model.set_weights(weights)
    model.compile(optimizer=HOST_OPTIMIZERS[optimizer](), loss="mse",
                  metrics=["mae"])
    losses = BatchLosses()
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
              callbacks=[losses])
    return (np.array(losses.losses), model.get_weights(),
            np.array(model.evaluate(x, y, verbose=0)),
            model.predict(x, verbose=0))


def host_mixed_mlp():
    """Four Dense layers, the first two (a pipeline's stage 0) in
    mixed_float16, the others float32: under a large loss scale only stage
    0's gradients overflow (tests/test_offload_hosts.py)."""
    return keras.Sequential([keras.Input((16,))] + [
        keras.layers.Dense(width, activation="relu" if i < 3 else None,
                           name=f"d{i}",
                           dtype="mixed_float16" if i < 2 else None)
        for i, width in enumerate((32, 32, 32, 8))], name="mixed")


def assert_trained_like(reference, got, rtol=1e-4):
    """`got` (a mapping: "losses", "evaluate", "predict", "w<i>") within
    `rtol` (relative) of `reference` = (per-batch losses, weights,
    evaluate, predict), e.g. of `train_host_mlp` on one device."""
    losses, weights, evaluated, predicted = reference
    assert relative_error(losses, got["losses"]) < rtol
    assert relative_error(evaluated, got["evaluate"]) < rtol
    assert relative_error(predicted, got["predict"]) < rtol
    for i, want in enumerate(weights):
        assert relative_error(want, got[f"w{i}"]) < rtol, f"w{i}"


def train_loss_scaled(pipe, given):
    """`host_mixed_mlp`'s pipeline `pipe` from `given`'s weights "m<i>",
    compiled with a LossScaleOptimizer (SGD with momentum) from 2**20,
    two epochs of batch 16 in order on "mx", "my": (per-batch losses,
    weights, each part's step count, each part's scale)."""
    with pipe.distribute_strategy.scope():
        pipe.set_weights([given[f"m{i}"] for i in range(8)])
        pipe.compile(optimizer=keras.optimizers.LossScaleOptimizer(
            HOST_OPTIMIZERS["sgdm"](), initial_scale=2.0**20), loss="mse")
    losses = BatchLosses()
    pipe.fit(given["mx"], given["my"], batch_size=16, epochs=2,
             shuffle=False, verbose=0, callbacks=[losses])
    return (np.array(losses.losses), pipe.get_weights(),
            [int(o.iterations.numpy()) for o in pipe.stage_optimizers],
            [float(o.dynamic_scale.numpy()) for o in pipe.stage_optimizers])


def host_token_mlp():
    """tokens -> Embedding -> mean -> up (L2-regularized) -> Dropout ->
    [cut: "mid"] -> mid -> out: an embedding lookup (a sparse gradient), a
    loss added before the last stage and a random layer on the first stage
    of a pipeline across hosts (tests/test_hosts_pipeline.py)."""
    x = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(16, 8, name="embed")(x)
    h = keras.layers.GlobalAveragePooling1D(name="mean")(h)
    h = keras.layers.Dense(16, activation="tanh", name="up",
                           kernel_regularizer=keras.regularizers.L2(0.01))(h)
    h = keras.layers.Dropout(0.3, name="drop")(h)
    h = keras.layers.Dense(16, activation="tanh", name="mid")(h)
    return keras.Model(x, keras.layers.Dense(3, activation="sigmoid",
                                             name="out")(h))


def masked_attention():
    """tokens (0: padding) -> Embedding(mask_zero) -> Dense -> [cut:
    "attend"] -> MultiHeadAttention (the mask read from its inputs) ->
    masked mean: a Keras mask crossing a pipeline's cut
    (tests/test_pipeline_microbatch_layers.py, test_hosts_pipeline.py)."""
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(12, 8, mask_zero=True, name="embed")(tokens)
    h = keras.layers.Dense(8, activation="tanh", name="up")(h)
    h = keras.layers.MultiHeadAttention(2, 4, name="attend")(h, h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(tokens, keras.layers.Dense(3, name="out")(h))


def padded_tokens():
    """(tokens padded with 0 at the end, float targets) for
    `masked_attention`."""
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 12, size=(32, 6)).astype("int32")
    tokens[:, 4:] = 0
    tokens[::3, 2:] = 0
    return tokens, rng.normal(size=(32, 3)).astype("float32")


def host_tied_mlp():
    """x -> shared -> mid -> shared again -> head: layer "shared" is called
    on both stages of a 2-stage pipeline (a tied weight, held as a copy on
    stage 1; tests/test_offload_hosts.py)."""
    shared = keras.layers.Dense(16, activation="tanh", name="shared")
    x = keras.Input((16,))
    h = keras.layers.Dense(16, activation="tanh", name="mid")(shared(x))
    return keras.Model(x, keras.layers.Dense(3, name="head")(shared(h)),
                       name="tied_mlp")


def fit_tokens(model, given, accumulation=1):
    """`host_token_mlp` (or its pipeline) from `given`'s weights w<i>,
    SGD(0.1) and mse, two epochs of batch 16 in order on its x, y — in
    batches of 16 // `accumulation` whose gradients Keras accumulates over
    `accumulation` steps: (final weights, evaluate's loss, each epoch's
    loss). Seed Keras before building the model (its Dropout's seeds)."""
    model.set_weights([given[f"w{i}"] for i in range(len(given) - 2)])
    model.compile(optimizer=keras.optimizers.SGD(
        0.1, gradient_accumulation_steps=accumulation if accumulation > 1
        else None), loss="mse")
    history = model.fit(given["x"], given["y"],
                        batch_size=16 // accumulation, epochs=2,
                        shuffle=False, verbose=0)
    return model.get_weights(), model.evaluate(
        given["x"], given["y"], batch_size=16, verbose=0), \
        history.history["loss"]


def host_deep_mlp():
    """A 5-layer MLP for pipelines of 4 stages across hosts
    (tests/test_hosts_pipeline.py)."""
    return keras.Sequential([keras.Input((16,))] + [
        keras.layers.Dense(width, activation="relu", name=name)
        for width, name in ((32, "up0"), (16, "down0"), (32, "up1"),
                            (16, "down1"))] + [
        keras.layers.Dense(3, name="head")], name="deep_mlp")


def train_plan_beside_one_device(plan, build, vocab=64, seq_len=16):
    """Fits `build()` on one device and `plan.apply(build())` (in the plan's
    scope, from the same initial weights) one epoch of 32 random token
    sequences, batch 16, with SGD. Returns (the planned model, the one-device
    model, the planned losses, the one-device losses)."""
    keras.utils.set_random_seed(0)
    reference = build()
    weights = reference.get_weights()
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (32, seq_len)).astype("int32")
    y = rng.integers(0, vocab, (32, seq_len)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference.compile(optimizer="sgd", loss=loss)
    expected = reference.fit(x, y, batch_size=16, shuffle=False,
                             verbose=0).history["loss"]
    with plan.strategy().scope():
        model = build()
        model.set_weights(weights)
        model = plan.apply(model)
        model.compile(optimizer="sgd", loss=loss)
    got = model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history["loss"]
    return model, reference, got, expected


def built_on(build, axes=None, pipeline_cut=None, devices=None, **options):
    """`build()` on one device (`axes` None) or under a ParallelStrategy
    on `tfpar.Mesh(axes, devices)` with `options`; given `pipeline_cut`
    (a layer name), a PipelineModel of 2 micro-batches whose second stage
    starts there."""
    if axes is None:
        return build()
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes, devices=devices),
                                      **options)
    with strategy.scope():
        model = build()
        if pipeline_cut is not None:
            model = tfpar.PipelineModel(model, num_microbatches=2,
                                        stage_boundaries=[pipeline_cut])
    return model


def mesh_shape(case):
    """The mesh axes a two-host case names ("pipe2-data2-model2:..." ->
    {"pipe": 2, "data": 2, "model": 2}, in order)."""
    return {name: int(size) for name, size in
            re.findall(r"([a-z]+)(\d+)", case.split(":")[0])}
