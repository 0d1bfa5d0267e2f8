"""Property: every Keras optimizer, in its default configuration or with
common options, trains in parity with one device on data, data x model and
model meshes, with fsdp on or off, or is refused with a clear error.

One device's optimizer is built before `fit` (`one_device`), as tfpar
builds it: Keras builds an unbuilt optimizer inside the first traced train
step, where ScheduleFreeAdamW's "momentum = weights" initialisation is lost
(`test_keras_loses_schedule_free_init_when_built_in_the_step`).

Options drawn: momentum and nesterov (where the optimizer has them),
weight decay, clipnorm, clipvalue, global_clipnorm, EMA, gradient
accumulation, loss scaling (Keras' LossScaleOptimizer). The model reads an
Embedding (sparse gradients) split hidden-wise on model meshes, and a
column-parallel Dense.
"""

import inspect

import hypothesis
import keras
import numpy as np
import pytest
from hypothesis import strategies as st

import tfpar

import fuzzing
import models

OPTIMIZERS = ["SGD", "RMSprop", "Adam", "AdamW", "Adadelta", "Adagrad",
              "Adamax", "Adafactor", "Nadam", "Ftrl", "Lion", "Lamb", "Muon",
              "ScheduleFreeAdamW"]
MESHES = [({"data": 8}, False), ({"data": 8}, True),
          ({"data": 2, "model": 4}, False), ({"data": 2, "model": 4}, True),
          ({"model": 8}, False), ({"model": 2, "data": 4}, True)]
RULES = {r".*embed/embeddings": (None, "model"),
         r".*up/kernel": (None, "model"), r".*up/bias": ("model",)}
N, BATCH, VOCAB = 32, 16, 16

OPTIONS = st.fixed_dictionaries({}, optional={
    "momentum": st.sampled_from([0.5, 0.9]),
    "nesterov": st.just(True),
    "weight_decay": st.sampled_from([0.01, 0.1]),
    "clipnorm": st.sampled_from([0.1, 1.0]),
    "clipvalue": st.just(0.05),
    "global_clipnorm": st.just(0.5),
    "use_ema": st.just(True),
    "gradient_accumulation_steps": st.just(2),
    # Kept on the instance, not in the config: lost where tfpar copied the
    # optimizer until 2026-12-07 (`tests/test_optimizer_settings.py`).
    "exclude_from_weight_decay": st.sampled_from([["bias"], ["embed"]]),
    # The optimizer for `up`'s weights only, SGD(0.1) for the others.
    "multi_optimizer": st.just(True),
})
CASES = st.tuples(st.sampled_from(OPTIMIZERS), OPTIONS, st.booleans(),
                  st.sampled_from(MESHES))


def build():
    tokens = keras.Input((4,), dtype="int32")
    features = keras.Input((8,))
    e = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 8, name="embed")(
        tokens))
    h = keras.layers.Concatenate()([e, features])
    h = keras.layers.Dense(8, activation="relu", name="up")(h)
    return keras.Model([tokens, features], keras.layers.Dense(3, name="out")(h))


def make_optimizer(name, options, loss_scaling):
    """The optimizer, or None when Keras itself refuses the options (then
    one device would refuse them too: not a tfpar case)."""
    cls = getattr(keras.optimizers, name)
    accepted = inspect.signature(cls.__init__).parameters
    excluded = options.get("exclude_from_weight_decay")
    multi = options.get("multi_optimizer")
    options = {k: v for k, v in options.items() if k in accepted}
    if "nesterov" in options and "momentum" not in options:
        options.pop("nesterov")
    if sum(k in options for k in ("clipnorm", "clipvalue",
                                  "global_clipnorm")) > 1:
        options.pop("clipvalue", None)
        options.pop("global_clipnorm", None)
    try:
        optimizer = cls(**options)
    except (ValueError, TypeError):
        return None
    if excluded:
        optimizer.exclude_from_weight_decay(var_names=excluded)
    if multi:
        optimizers = keras.optimizers.OptimizerMap(
            default_optimizer=keras.optimizers.SGD(0.1))
        optimizers["up/.*"] = optimizer
        optimizer = keras.optimizers.MultiOptimizer(optimizers)
    if loss_scaling:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def one_device(model, optimizer):
    """`optimizer` built on `model`'s weights eagerly, before `fit`, as
    tfpar builds it. Keras' own `fit` builds an unbuilt optimizer in the
    first traced train step, as a tf.function's first trace, which creates
    the variables and is then replaced by a second trace: an assignment in
    `build` is lost there, and ScheduleFreeAdamW's momentum starts at zero
    instead of the weights (so its first step sets the weights to about
    -lr * sign(gradient)). Building first gives one device the algorithm
    Keras writes (z_0 = x_0, Defazio et al., 2024)."""
    if optimizer is not None:
        optimizer.build(model.trainable_variables)
    return optimizer


def data():
    rng = np.random.RandomState(0)
    x = [rng.randint(0, VOCAB, size=(N, 4)).astype("int32"),
         rng.normal(size=(N, 8)).astype("float32")]
    return x, rng.normal(size=(N, 3)).astype("float32")


def check_optimizer(case):
    name, options, loss_scaling, (axes, fsdp) = case
    hypothesis.note(f"{name}({options}), loss scaling {loss_scaling}")
    x, y = data()
    keras.utils.set_random_seed(0)
    single = build()
    weights = single.get_weights()
    optimizer = one_device(single, make_optimizer(name, options,
                                                  loss_scaling))
    hypothesis.assume(optimizer is not None)
    try:
        want_losses, want_weights = fuzzing.train(
            single, x, y, weights, models.BatchLosses(), optimizer)
    except (ValueError, TypeError, NotImplementedError):
        hypothesis.assume(False)  # Keras refuses it on one device too
    rules = RULES if "model" in axes else None

    def build_and_train(losses, built):
        strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules,
                                          fsdp=fsdp)
        with strategy.scope():
            model = build()
        built(model)
        return fuzzing.train(model, x, y, weights, losses,
                             make_optimizer(name, options, loss_scaling))

    if fuzzing.parity_or_refused(build_and_train, weights, want_losses,
                                 want_weights) is None:
        return
    hypothesis.event(f"trained in parity: {name}")


test_optimizer_trains_in_parity_or_is_refused, \
    test_optimizer_trains_in_parity_or_is_refused_long = \
    fuzzing.fast_and_long(check_optimizer, CASES, fast_examples=2)


def _parity(name, options, axes, fsdp):
    """check_optimizer on one case, outside hypothesis."""
    x, y = data()
    keras.utils.set_random_seed(0)
    single = build()
    weights = single.get_weights()
    want = fuzzing.train(single, x, y, weights, models.BatchLosses(),
                         one_device(single, make_optimizer(name, options,
                                                           False)))
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh(axes), rules=RULES if "model" in axes else None, fsdp=fsdp)
    with strategy.scope():
        model = build()
    got = fuzzing.train(model, x, y, weights, models.BatchLosses(),
                        make_optimizer(name, options, False))
    fuzzing.assert_parity(want[0], got[0], want[1], got[1])


@pytest.mark.parametrize("axes", [
    {"data": 8},
    {"data": 2, "model": 4},
    pytest.param({"model": 8}, marks=pytest.mark.slow),
], ids=["data8", "data2xmodel4", "model8"])
def test_schedule_free_adamw_matches_one_device(axes):
    """Found by the fuzzing: it ended far from one device on data=8, which
    was one device's fault (`one_device`); in its default configuration it
    trains in parity with the weights replicated or split over `model`."""
    _parity("ScheduleFreeAdamW", {}, axes, False)


def test_keras_loses_schedule_free_init_when_built_in_the_step():
    """Why the oracle builds one device's optimizer first (a Keras 3.15
    bug, one device only): with learning rate 0, one step must leave the
    weights alone (y = z = x_0 at step 1), and does when the optimizer was
    built before `fit`; built by `fit` inside the step, the momentum z
    starts at 0 and the step sets the weights to 0. If Keras fixes it,
    this fails and `one_device` can go."""
    x, y = data()

    def step(build_first):
        keras.utils.set_random_seed(0)
        model = build()
        optimizer = keras.optimizers.ScheduleFreeAdamW(learning_rate=0.0)
        if build_first:
            one_device(model, optimizer)
        before = model.get_weights()
        model.compile(optimizer=optimizer, loss="mse")
        model.fit([a[:BATCH] for a in x], y[:BATCH], batch_size=BATCH,
                  verbose=0)
        return before, model.get_weights()

    before, after = step(build_first=True)
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    before, after = step(build_first=False)
    kernel = 1  # up/kernel: random, not zero, before the step
    assert np.abs(before[kernel]).max() > 0.1
    np.testing.assert_array_equal(after[kernel], 0.0)


@pytest.mark.slow
def test_schedule_free_adamw_pipeline_matches_one_device():
    """pipe=2 × data=4, 2 micro-batches: every stage's optimizer starts its
    momentum at the weights, as one device built first with gradient
    accumulation over 2 does."""
    def mlp():
        x = keras.Input((16,))
        h = keras.layers.Dense(32, activation="tanh", name="up")(x)
        h = keras.layers.Dense(16, activation="tanh", name="down")(h)
        return keras.Model(x, keras.layers.Dense(3, name="out")(h))

    keras.utils.set_random_seed(0)
    single = mlp()
    weights = single.get_weights()
    x, y = models.mlp_data()
    want = fuzzing.train(single, x, y, weights, models.BatchLosses(),
                         one_device(single, keras.optimizers.ScheduleFreeAdamW(
                             gradient_accumulation_steps=2)), batch_size=8)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh({"pipe": 2, "data": 4}))
    with strategy.scope():
        model = tfpar.PipelineModel(mlp(), num_microbatches=2)
    got = fuzzing.train(model, x, y, weights, models.BatchLosses(),
                        keras.optimizers.ScheduleFreeAdamW())
    # Keras logs the running mean at every accumulated step: compare those.
    fuzzing.assert_parity(want[0][1::2], got[0], want[1], got[1])
