"""Shared machinery of the property-based tests (tests/test_fuzz_*.py).

Each property is written once, as a function of one drawn case, and
`fast_and_long(check, cases, fast_examples)` turns it into two tests:

- `test_<name>`: in the default suite, a few examples, `derandomize=True`
  (the same cases on every run, so CI is reproducible);
- `test_<name>_long`: marked `slow`, run by `python3 dev.py fuzz`:
  `TFPAR_FUZZ_EXAMPLES` (default 25) random examples per property. `--hypothesis-show-statistics` then prints how many
  cases each property tried and what they did (`hypothesis.event`: trained,
  or refused with which error).

The property every case must satisfy: it trains in parity with one device,
or it raises a clear Python error (ValueError/TypeError/RuntimeError whose
message shows what was received) before the first step; never a TF/DTensor
internal error, a NaN, or a changed weight after a refusal.
"""

import contextlib
import functools
import os

import hypothesis
import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck

import models

RTOL = 1e-4
NOISE = 10  # assert_parity: how far past float32's own rounding noise
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large,
          HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture]
CLEAR_ERRORS = (ValueError, TypeError, RuntimeError)


def _settings(examples, long):
    return hypothesis.settings(
        max_examples=examples, deadline=None, database=None,
        derandomize=not long, suppress_health_check=_QUIET,
        print_blob=long, phases=[hypothesis.Phase.explicit,
                                 hypothesis.Phase.generate,
                                 hypothesis.Phase.shrink][:3 if long else 2])


def long_examples():
    return int(os.environ.get("TFPAR_FUZZ_EXAMPLES", "25"))


def fast_and_long(check, cases, fast_examples):
    """(fast test, slow-marked long test) of the property `check(..., case)`;
    `check`'s other arguments are pytest fixtures."""

    def twin(examples, long):
        @functools.wraps(check)
        def test(*args, **kwargs):
            return check(*args, **kwargs)

        return _settings(examples, long)(hypothesis.given(case=cases)(test))

    return (twin(fast_examples, long=False),
            pytest.mark.slow(twin(long_examples(), long=True)))


def is_clear_error(error):
    """A Python error for the user, not an internal TF/DTensor one: one of
    CLEAR_ERRORS, not a `tf.errors.OpError`, and its message shows what was
    received (tfpar's house style: "... Received: ...") or names a path."""
    if isinstance(error, tf.errors.OpError) or not isinstance(
            error, CLEAR_ERRORS):
        return False
    return "Received" in str(error) or "'" in str(error)


def refused(error, before, after):
    """Asserts `error` is a clear error and that nothing changed (`before`
    and `after` are lists of host arrays: weights before and after)."""
    assert is_clear_error(error), (
        f"not a clear error: {type(error).__name__}: {str(error)[:2000]}")
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    hypothesis.event(f"refused: {type(error).__name__}")
    if os.environ.get("TFPAR_FUZZ_VERBOSE"):
        print("refused:", str(error)[:300])


def relative_error(a, b):
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.max(np.abs(a - b), initial=0.0)
                 / max(np.max(np.abs(a), initial=0.0), 1e-12))


def assert_parity(want_losses, got_losses, want_weights, got_weights,
                  rtol=RTOL, exact=None):
    """Losses and weights within `rtol` relative, and finite.

    `exact`: (losses, weights) of the same one-device run in float64
    (`train_in_float64`). A value whose float32 one-device result is itself
    farther than `rtol` from float64's is rounding noise, not a result: a
    weight whose true gradient is zero (a bias a LayerNorm's mean removes,
    attention key biases) holds only noise, and two float32 runs that sum
    in another order (over a data axis, or recomputing) hold other noise.
    There the bound is NOISE times float32's own distance from float64:
        error(got, want) < max(rtol, NOISE * error(want, exact)).
    """
    exact_losses, exact_weights = exact or (want_losses, want_weights)

    def bound(want, exact_value):
        return max(rtol, NOISE * relative_error(exact_value, want))

    assert np.all(np.isfinite(got_losses)), got_losses
    assert relative_error(want_losses, got_losses) < bound(
        want_losses, exact_losses), (want_losses, got_losses)
    for i, (want, got, exact_value) in enumerate(
            zip(want_weights, got_weights, exact_weights)):
        assert np.all(np.isfinite(got)), i
        error = relative_error(want, got)
        assert error < bound(want, exact_value), (
            i, np.shape(want), error, bound(want, exact_value))


def train(model, x, y, weights, losses, optimizer=None, batch_size=16):
    """One epoch in order from `weights` (plain SGD(0.1) unless
    `optimizer`), batch losses recorded by `losses`: (losses, weights)."""
    model.set_weights(weights)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1),
                  loss="mse")
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
              verbose=0, callbacks=[losses])
    return np.array(losses.losses), [np.asarray(w) for w in model.get_weights()]


@contextlib.contextmanager
def float64_policy():
    """Keras' floatx and dtype policy float64 inside, as before after."""
    previous = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_floatx(previous[0])
        keras.config.set_dtype_policy(previous[1])


def train_in_float64(build, x, y, weights, optimizer=None, batch_size=16):
    """`train` of a model `build()` makes with Keras' floatx float64, from
    `weights` and on `x`, `y` cast to float64 (Keras' dtype policy too):
    the rounding-free reference
    `assert_parity(exact=...)` measures float32's noise by."""
    def cast(value):
        value = np.asarray(value)
        return value.astype("float64") if value.dtype == "float32" else value

    with float64_policy():
        model = build()
        inputs = [cast(a) for a in x] if isinstance(x, list) else cast(x)
        losses, weights = train(model, inputs, cast(y),
                                [cast(w) for w in weights],
                                models.BatchLosses(), optimizer, batch_size)
    assert all(w.dtype == "float64" for w in weights), "not float64"
    return losses, weights


class Dropout(keras.layers.Dropout):
    """Keras' Dropout, whose mask under a float64 policy is the one float32
    draws (TF's uniform numbers depend on their dtype), so that
    `train_in_float64` drops what the float32 runs drop: keep where
    dropout(ones) in float32 is not 0, scale by 1 / (1 - rate)."""

    def call(self, inputs, training=False):
        if not training or self.rate == 0 or inputs.dtype != "float64":
            return super().call(inputs, training=training)
        kept = keras.random.dropout(
            keras.ops.ones_like(inputs, "float32"), self.rate,
            noise_shape=self.noise_shape, seed=self.seed_generator)
        return inputs * keras.ops.cast(kept != 0, inputs.dtype) / (
            1 - self.rate)


class GaussianNoise(keras.layers.GaussianNoise):
    """Keras' GaussianNoise, whose noise under a float64 policy is the one
    float32 draws (cast), as `Dropout` keeps float32's masks."""

    def call(self, inputs, training=False):
        if not training or self.stddev == 0 or inputs.dtype != "float64":
            return super().call(inputs, training=training)
        noise = keras.random.normal(keras.ops.shape(inputs), stddev=self.stddev,
                                    dtype="float32", seed=self.seed_generator)
        return inputs + keras.ops.cast(noise, inputs.dtype)


def parity_or_refused(build_and_train, weights, want_losses, want_weights,
                      exact=None):
    """The property: `build_and_train(losses, built)` (which passes the
    parallel model to `built` once made, then trains it with `losses` as a
    callback and returns (losses, weights)) trains in parity with one
    device's `want_*`, or raises a clear error before any batch ended with
    no weight changed (`exact`: as in `assert_parity`). Returns the
    trained model, or None if refused."""
    losses = models.BatchLosses()
    losses.losses = []
    made = []
    try:
        got_losses, got_weights = build_and_train(losses, made.append)
    except Exception as error:  # noqa: BLE001 (classified by `refused`)
        assert not losses.losses, f"failed after a step: {error!r}"
        refused(error, weights, made[0].get_weights() if made else weights)
        return None
    assert_parity(want_losses, got_losses, want_weights, got_weights,
                  exact=exact)
    return made[0]
