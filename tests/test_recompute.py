"""Recomputation (activation checkpointing) through Keras' own API,
`keras.RematScope` / `keras.remat`, under ParallelStrategy.

A recomputed layer keeps only its inputs for the backward pass and runs
its forward again there. Under fsdp its weights are gathered again in the
backward pass too, so between the two passes a device holds only their
blocks (PyTorch FSDP's `reshard_after_forward`). Results equal one device
without recomputation.
"""

import collections
import contextlib
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context as tf_context

import tfpar
from tfpar import recompute
from tfpar import step_context

import fuzzing
import models

recompute.install()  # the opt-in: keras.RematScope on one device (no strategy)

RTOL = 1e-4
RULES = {r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
         r".*down/kernel": ("model", None)}
MESHES = pytest.mark.parametrize("axes,rules,fsdp", [
    ({"data": 2, "model": 4}, RULES, False),
    ({"data": 8}, None, True),
], ids=["data2xmodel4", "data8-fsdp"])


class Block(keras.layers.Layer):
    """x + down(relu(up(x))) * scale: an MLP block with a residual, whose
    gate `scale` arrives as a keyword tensor (it must get gradients)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(64, activation="relu", name="up")
        self.down = keras.layers.Dense(16, name="down")

    def call(self, x, scale=None):
        return x + self.down(self.up(x)) * scale


def build(remat):
    x = keras.Input((16,))
    scale = keras.layers.Dense(16, activation="sigmoid", name="gate")(x)
    with (keras.RematScope(mode="list_of_layers", layer_names=["block"])
          if remat else contextlib.nullcontext()):
        block = Block(name="block")
    return keras.Model(x, keras.layers.Dense(3, name="out")(
        block(x, scale=scale)))


def train(strategy, remat, weights):
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build(remat)
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    with tfpar.communication.capture() as programs:
        history = models.fit_mlp(model, epochs=2)
    return model, history.history["loss"], programs


@pytest.fixture(scope="module")
def reference():
    keras.utils.set_random_seed(0)
    weights = build(remat=False).get_weights()
    model, losses, _ = train(None, False, weights)
    return weights, model, losses


def test_tf_recompute_grad_refuses_keywords_in_a_function():
    """Why tfpar replaces Keras' TF `remat` (`tf.recompute_grad`): every
    Keras layer is called with `training=`, and on TF 2.21 this fails inside
    any `tf.function`, so `RematScope(mode="full")` breaks `fit` even on one
    device. If this test fails, TF fixed it and the patch can go."""
    layer = keras.layers.Dense(4)

    @tf.function
    def step(x):
        return tf.recompute_grad(layer)(x, training=True)

    with pytest.raises(ValueError, match="keywords arguments only when eager"):
        step(tf.ones((2, 3)))


def test_remat_scope_trains_on_one_device(reference):
    weights, single, losses = reference
    model, got, _ = train(None, True, weights)
    assert models.relative_error(losses, got) < RTOL
    for want, have in zip(single.weights, model.weights):
        assert models.relative_error(want.numpy(), have.numpy()) < RTOL


def _updates_racing_reads(graph):
    """(read, update) node pairs of one weight in a GraphDef that no path
    of data or control edges orders: the update may run before the read."""
    nodes = {node.name: node for node in graph.node}
    after = collections.defaultdict(set)
    for node in graph.node:
        for name in node.input:
            after[name.lstrip("^").split(":")[0]].add(node.name)

    def resource(node):
        name = node.input[0].split(":")[0]
        while name in nodes and nodes[name].op == "Identity":
            name = nodes[name].input[0].split(":")[0]
        return name

    def reaches(start, goal):
        seen, todo = {start}, [start]
        while todo:
            for name in after[todo.pop()] - seen:
                seen.add(name)
                todo.append(name)
        return goal in seen

    reads, updates = collections.defaultdict(list), []
    for node in graph.node:
        if node.op == "ReadVariableOp":
            reads[resource(node)].append(node.name)
        elif node.op.startswith("Assign") and node.op.endswith("VariableOp"):
            updates.append(node)
    return [(read, update.name) for update in updates
            for read in reads[resource(update)]
            if not reaches(read, update.name)
            and not reaches(update.name, read)]


def test_recomputation_reads_every_weight_before_its_update():
    """The step Grappler optimized reads each weight before Adam updates
    it. The recomputation's reads of the block's `down` kernel and bias
    reach only other weights' gradients; Grappler's dependency optimizer
    dropped the control edges ordering them before their updates, so now
    and then the recomputation read the updated weights: one-device
    training with RematScope differed from without it (1 to 2 fits in
    30, 1.6e-3 and 4.9e-3 after 2 epochs). Found by issue 17's hunt for
    intermittent failures."""
    keras.utils.set_random_seed(0)
    model = build(remat=True)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y = models.mlp_data(n=16)
    eager = tf_context.context()
    eager.enable_run_metadata()
    try:
        model.train_on_batch(x, y)
        step = max(eager.export_run_metadata().function_graphs,
                   key=lambda f: len(f.pre_optimization_graph.node))
    finally:
        eager.disable_run_metadata()
    assert any(node.name.startswith("down") for node  # recomputed reads
               in step.pre_optimization_graph.node)
    assert _updates_racing_reads(step.pre_optimization_graph) == []
    assert _updates_racing_reads(step.post_optimization_graph) == []


@MESHES
def test_recomputed_block_matches_one_device(reference, axes, rules, fsdp):
    weights, single, losses = reference
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules,
                                      fsdp=fsdp)
    model, got, _ = train(strategy, True, weights)
    assert models.relative_error(losses, got) < RTOL
    for want, have in zip(single.weights, model.weights):
        error = models.relative_error(want.numpy(), have.numpy())
        assert error < RTOL, (want.path, error)
    # The gate reaches the loss only through the keyword tensor `scale`.
    assert not np.allclose(model.get_layer("gate").kernel.numpy(),
                           weights[0])


@MESHES
def test_recomputation_keeps_only_the_block_input(reference, axes, rules,
                                                  fsdp):
    weights = reference[0]
    saved, gathered = {}, {}
    for remat in (False, True):
        strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules,
                                          fsdp=fsdp)
        _, _, programs = train(strategy, remat, weights)
        report = programs.train_report()
        saved[remat] = set(report.saved_activations)
        gathered[remat] = sorted(
            c.shape for c in report.collectives
            if c.phase == "backward" and c.kind == "all-gather")
    inside = {name for name in saved[False]
              if "block" in name and not name.endswith("add:0")}
    # Without recomputation the block's hidden ReLU output and down
    # projection are kept for the backward pass; with it, neither is.
    assert any("up_1/Relu" in name for name in inside)
    assert not any("block" in name and not name.endswith("add:0")
                   for name in saved[True])
    assert len(saved[True]) == len(saved[False]) - len(inside)
    assert gathered[False] == []
    if fsdp:  # the block's weights are gathered again in the backward pass
        n = axes["data"]
        assert gathered[True] == sorted([(64 // n,), (16 // n, 64),
                                         (64 // n, 16), (16 // n,)])
    else:
        assert gathered[True] == []


class Noisy(keras.layers.Layer):
    """Dropout and BatchNormalization called without `training=` (they take
    it from the Keras call context); counts its traced calls and those that
    recompute it in a backward pass."""

    calls = recomputed = 0

    def __init__(self, rate, seed, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(64, activation="relu", name="dense")
        self.norm = keras.layers.BatchNormalization(name="norm")
        self.drop = keras.layers.Dropout(rate, seed=seed, name="drop")

    def call(self, x):
        Noisy.calls += 1
        Noisy.recomputed += step_context.recompute_dependency() is not None
        return self.drop(self.norm(self.dense(x)))


def build_noisy(remat, policy=None):
    """Two Noisy layers in a Sequential; with `remat` everything is
    recomputed, the Sequential too (nested checkpoints)."""
    with (keras.RematScope(mode="full") if remat
          else contextlib.nullcontext()):
        inner = keras.Sequential([Noisy(0.5, 3, name="a", dtype=policy),
                                  Noisy(0.3, 5, name="b", dtype=policy)],
                                 name="inner")
    x = keras.Input((16,))
    return keras.Model(x, keras.layers.Dense(3, name="out")(inner(x)))


@pytest.mark.parametrize("axes,policy", [
    (None, None), ({"data": 8}, None), ({"data": 8}, "mixed_bfloat16"),
    ({"pipe": 2, "data": 4}, None)],
    ids=["one-device", "data8-fsdp", "mixed-bfloat16", "pipe2xdata4-fsdp"])
def test_recomputation_reproduces_the_forward_pass(axes, policy):
    """Recomputing changes nothing, and each layer runs twice per traced
    step, not three times (nested checkpoints recompute once): Dropout
    applies the same mask (seeds replayed; `tf.recompute_grad` would draw
    new ones and advance the seed twice), Dropout and BatchNormalization
    read `training` from the forward pass's Keras context, the moving
    statistics are updated once, mixed precision computes in its dtype.
    Compared on the same mesh with and without recomputation (one-device
    parity of Dropout's masks: tests/test_dropout_parity.py)."""
    keras.utils.set_random_seed(0)
    weights = build_noisy(False, policy).get_weights()
    results, calls = [], []
    for remat in (False, True):
        strategy = axes and tfpar.ParallelStrategy(tfpar.Mesh(axes),
                                                   fsdp=True)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = build_noisy(remat, policy)
            model.set_weights(weights)
            if axes and "pipe" in axes:
                model = tfpar.PipelineModel(model, num_microbatches=2)
            model.compile(optimizer="sgd", loss="mse")
        Noisy.calls = Noisy.recomputed = 0
        losses = models.fit_mlp(model, epochs=2).history["loss"]
        calls.append((Noisy.calls, Noisy.recomputed))
        seeds = [v.numpy() for v in model.variables if "seed" in v.path]
        results.append((losses, model.get_weights(), seeds))
    (want_losses, want, want_seeds), (losses, got, seeds) = results
    # Each Noisy layer recomputed once per traced forward pass.
    forward = 2 if axes is None or "pipe" not in axes else 2 * 2  # m = 2
    assert calls[0][1] == 0 and calls[1] == (calls[0][0] + forward, forward)
    tolerance = RTOL if policy is None else 1e-6  # same ops, same dtype
    assert models.relative_error(want_losses, losses) < max(tolerance, RTOL)
    for a, b in zip(want, got):  # also BatchNormalization's moving stats
        assert models.relative_error(a, b) < max(tolerance, RTOL)
    assert len(seeds) == 2
    np.testing.assert_array_equal(want_seeds, seeds)


class AddsLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.mean(x ** 2))
        return x


def test_a_recomputed_layer_that_adds_a_loss_is_refused():
    """Its forward pass records no gradients: the loss would get none."""
    with keras.RematScope(mode="full"):
        layer = AddsLoss(name="adds_loss")
    x = keras.Input((16,))
    model = keras.Model(x, keras.layers.Dense(3)(layer(x)))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="'adds_loss' adds a loss"):
        models.fit_mlp(model)


class Noise(keras.layers.Layer):
    """Dense(relu), BatchNormalization, then GaussianNoise (keras.random.normal)
    and `draw(shape, seed)` added (None: nothing more)."""

    def __init__(self, draw=None, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(64, activation="relu", name="dense")
        self.norm = keras.layers.BatchNormalization(name="norm")
        self.noise = keras.layers.GaussianNoise(0.3, seed=3, name="noise")
        self.draw = draw
        self.seed_generator = keras.random.SeedGenerator(5)

    def call(self, x, training=False):
        h = self.noise(self.norm(self.dense(x)))
        if self.draw is None or not training:
            return h
        return h + 0.1 * self.draw(keras.ops.shape(h), self.seed_generator)


def build_noise(remat, draw=None):
    with (keras.RematScope(mode="full") if remat
          else contextlib.nullcontext()):
        noisy = Noise(draw, name="noisy")
    x = keras.Input((16,))
    return keras.Model(x, keras.layers.Dense(3, name="out")(noisy(x)))


def shuffled_ramp(shape, seed):
    """keras.random.shuffle of 0, 1/n, ..., (n-1)/n along the features."""
    ramp = keras.ops.arange(shape[-1], dtype="float32") / shape[-1]
    return keras.random.shuffle(keras.ops.ones(shape) * ramp, axis=1,
                                seed=seed)


@pytest.mark.parametrize("build_model", [
    build_noisy, build_noise,
    functools.partial(build_noise, draw=shuffled_ramp)],
    ids=["dropout", "gaussian-noise", "shuffle"])
def test_random_layers_recomputed_under_tensor_parallelism_match_one_device(
        build_model):
    """On data=2×model=4 DTensor may lay a recomputed tensor out otherwise
    (BatchNormalization's output did); Dropout's and GaussianNoise's
    numbers are drawn whole on every device (one device's whatever the
    layout, tests/test_random_layers.py), so recomputing them replays the
    forward pass's: the losses, weights and moving statistics are one
    device's without recomputation (GaussianNoise was refused before, and
    so was keras.random.shuffle until its numbers were drawn whole)."""
    keras.utils.set_random_seed(0)
    single = build_model(False)
    weights = single.get_weights()
    single.compile(optimizer="sgd", loss="mse")
    want = models.fit_mlp(single, epochs=2).history["loss"]
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 4}),
        rules={r".*dense/kernel": (None, "model"),
               r".*dense/bias": ("model",)})
    with strategy.scope():
        model = build_model(True)
        model.set_weights(weights)
        model.compile(optimizer="sgd", loss="mse")
    got = models.fit_mlp(model, epochs=2).history["loss"]
    assert models.relative_error(want, got) < RTOL, (want, got)
    for a, b in zip(single.get_weights(), model.get_weights()):
        assert models.relative_error(a, b) < RTOL


def tf_uniform(shape, seed):
    """A TF op on the generator's seed (not Keras' random ops)."""
    return tf.random.stateless_uniform(
        shape, seed=tf.cast(seed.next() % 65536, "int32"))


def test_other_random_ops_are_not_recomputed_under_tensor_parallelism():
    """A TF random op on `SeedGenerator.next()` still draws its numbers per
    device block: recomputing it on data=2×model=4 could draw other
    numbers, refused before the first step (data-only meshes are fine,
    above)."""
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"data": 2, "model": 4}),
        rules={r".*dense/kernel": (None, "model"),
               r".*dense/bias": ("model",)})
    with strategy.scope():
        model = build_noise(remat=True, draw=tf_uniform)
        model.compile(optimizer="sgd", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=(
            "draws random numbers.*seed_generator.*'model': 4")):
        models.fit_mlp(model)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


class RematMLP(keras.layers.Layer):
    """Calls `keras.remat` itself on part of its computation."""

    def __init__(self, remat, **kwargs):
        super().__init__(**kwargs)
        self.remat = remat
        self.up = keras.layers.Dense(64, activation="relu", name="up")
        self.down = keras.layers.Dense(16, name="down")

    def mlp(self, x):
        return self.down(self.up(x))

    def call(self, x):
        mlp = keras.remat(self.mlp) if self.remat else self.mlp
        return x + mlp(x)


@pytest.mark.parametrize("axes", [None, {"data": 8}], ids=["one-device",
                                                           "data8-fsdp"])
def test_keras_remat_function_matches_one_device(axes):
    def build(remat):
        x = keras.Input((16,))
        h = RematMLP(remat, name="block")(x)
        return keras.Model(x, keras.layers.Dense(3, name="out")(h))

    keras.utils.set_random_seed(0)
    reference = build(False)
    weights = reference.get_weights()
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    want = models.fit_mlp(reference, epochs=2).history["loss"]
    strategy = axes and tfpar.ParallelStrategy(tfpar.Mesh(axes), fsdp=True)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build(True)
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    with tfpar.communication.capture() as programs:
        got = models.fit_mlp(model, epochs=2).history["loss"]
    # Adam turns float32's rounding into whole steps where a gradient is
    # tiny: one device's own block/down/kernel is 5.5e-5 from float64's
    # and data=8's 9e-5 on the other side: 1.5e-4 apart, every run on an
    # AMD EPYC (AVX2) host), so float32's own noise bounds it (`fuzzing`).
    x, y = models.mlp_data()
    exact = fuzzing.train_in_float64(  # 2 epochs in order: the data twice
        lambda: build(False), np.concatenate([x, x]), np.concatenate([y, y]),
        weights, keras.optimizers.Adam(0.01))[1]
    fuzzing.assert_parity(want, got, reference.get_weights(),
                          model.get_weights(), exact=(want, exact))
    if strategy:  # recomputed: the hidden activation is not kept
        saved = programs.train_report().saved_activations
        assert not any("up_1/Relu" in name for name in saved), saved
