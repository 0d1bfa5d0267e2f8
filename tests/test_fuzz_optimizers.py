"""Property: every Keras optimizer, in its default configuration or with
common options, trains in parity with one device on data, data x model and
model meshes, with fsdp on or off, or is refused with a clear error.

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

# ScheduleFreeAdamW is left out: found by this fuzzing, it trains
# differently from one device even on data=8 with replicated weights
# (test_schedule_free_adamw_matches_one_device below, a known failure).
OPTIMIZERS = ["SGD", "RMSprop", "Adam", "AdamW", "Adadelta", "Adagrad",
              "Adamax", "Adafactor", "Nadam", "Ftrl", "Lion", "Lamb", "Muon"]
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
    if loss_scaling:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
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
    optimizer = make_optimizer(name, options, loss_scaling)
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
                         make_optimizer(name, options, False))
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh(axes), rules=RULES if "model" in axes else None, fsdp=fsdp)
    with strategy.scope():
        model = build()
    got = fuzzing.train(model, x, y, weights, models.BatchLosses(),
                        make_optimizer(name, options, False))
    fuzzing.assert_parity(want[0], got[0], want[1], got[1])


@pytest.mark.slow  # a known failure, documented; kept out of the fast run
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "Found by the fuzzing, not fixed: ScheduleFreeAdamW (momentum slots "
    "initialised from the weights in build, reads the old momentum before "
    "updating it) ends far from one device's weights on data=8; on model=8 "
    "it fails compiling the step with a DTensor internal error."))
def test_schedule_free_adamw_matches_one_device():
    _parity("ScheduleFreeAdamW", {}, {"data": 8}, False)

