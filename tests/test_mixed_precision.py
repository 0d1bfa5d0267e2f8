"""Keras mixed precision under ParallelStrategy: tensor parallelism and
fsdp train like one device, in bfloat16 and in float16 with loss scaling.

bfloat16 keeps 8 bits of mantissa (relative spacing 2**-8 = 0.4%), float16
11 (2**-11), and the sharded step sums in another order than one device,
so results agree to that precision, not to the 1e-4 of the fp32 parity
tests.
"""

import contextlib
import functools

import keras
import numpy as np
import pytest

import tfpar

import models

# The oracle: sharding may change the result by about as much as the low
# precision itself does. One device in mixed precision differs from one
# device in float32 by some amount per weight; the sharded mixed-precision
# run must stay within SLACK times that amount of the one-device
# mixed-precision run. Both round to the low precision, but on the mesh
# DTensor sums the per-device partial gradients in the compute dtype (a
# float16/bfloat16 all-reduce, as DDP's fp16 all-reduce does: up to
# log2(8) = 3 more roundings than one device's single sum), so the
# largest observed ratio is about 2.4 (float16, data=8, a bias).
# SGD with momentum: Adam's step is about lr * sign(gradient) wherever a
# gradient is tiny, which would turn a rounding difference into a whole step.
SLACK = 3.0
# float16's loss scale: 2**15 never overflows on this model and data; from
# 2**20 the first three steps overflow (inf gradients): they are skipped and
# the scale halves each time (2**20 -> 2**17), as Keras' LossScaleOptimizer
# does on one device.
SAFE_SCALE, OVERFLOWING_SCALE = 2**15, 2**20
STEPS = 8  # 2 epochs of 64 samples, batch 16

MESHES = pytest.mark.parametrize("axes,rules,fsdp", [
    ({"data": 2, "model": 4}, {r".*up/kernel": (None, "model"),
                               r".*up/bias": ("model",),
                               r".*down/kernel": ("model", None)}, False),
    ({"data": 8}, None, True),
], ids=["tensor-parallel", "fsdp"])


def build(policy):
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="up", dtype=policy),
        keras.layers.Dense(32, name="down", dtype=policy),
        keras.layers.Dense(3, name="out")], name="mp")


def optimizer(policy, scale):
    """SGD with momentum; wrapped in dynamic loss scaling when the test is
    about float16 (also its float32 oracle run, where scaling by a power of
    two is exact)."""
    sgd = keras.optimizers.SGD(0.05, momentum=0.9)
    if scale is None:
        return sgd
    return keras.optimizers.LossScaleOptimizer(sgd, initial_scale=scale)


def train(strategy, weights, policy, scale=None):
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build(policy)
        model.set_weights(weights)
        model.compile(optimizer=optimizer(policy, scale), loss="mse")
    history = models.fit_mlp(model, epochs=2)
    return model, history.history["loss"]


@functools.cache
def reference(policy):
    """Initial weights and the one-device run in `policy`, with its
    difference from float32 (per weight and for the losses)."""
    keras.utils.set_random_seed(0)
    weights = build(policy).get_weights()
    scale = SAFE_SCALE if policy == "mixed_float16" else None
    model, losses = train(None, weights, policy, scale)
    fp32_model, fp32_losses = train(None, weights, "float32", scale)
    error = {
        "losses": np.abs(np.subtract(losses, fp32_losses)).max(),
        **{a.path: np.abs(a.numpy() - b.numpy()).max()
           for a, b in zip(model.weights, fp32_model.weights)}}
    return weights, model, losses, error


def check_within_oracle(single, single_losses, model, losses, error):
    assert np.abs(np.subtract(losses, single_losses)).max() <= \
        SLACK * error["losses"]
    for want, got in zip(single.weights, model.weights):
        assert got.dtype == "float32"  # weights stay float32
        difference = np.abs(want.numpy() - got.numpy()).max()
        assert 0 < error[want.path]
        assert difference <= SLACK * error[want.path], (want.path, difference)
    assert all(v.dtype == "float32" for v in model.optimizer.variables
               if v.shape.rank)


@MESHES
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_trains_like_one_device(axes, rules, fsdp, policy):
    weights, single, single_losses, error = reference(policy)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules,
                                      fsdp=fsdp)
    scale = SAFE_SCALE if policy == "mixed_float16" else None
    model, losses = train(strategy, weights, policy, scale)
    check_within_oracle(single, single_losses, model, losses, error)
    if scale is not None:
        assert model.optimizer.iterations.numpy() == STEPS  # none skipped
    x, _ = models.mlp_data(n=16)
    hidden = keras.Model(model.inputs, model.get_layer("up").output)
    assert hidden.predict(x, batch_size=16, verbose=0).dtype == np.dtype(
        keras.backend.standardize_dtype(policy.split("_")[1]))


@MESHES
def test_float16_overflow_skips_the_same_steps(axes, rules, fsdp):
    """Inf gradients, wherever a shard of them lives, skip the step on every
    device and halve the loss scale, exactly as on one device."""
    weights, _, _, error = reference("mixed_float16")
    single, single_losses = train(None, weights, "mixed_float16",
                                  OVERFLOWING_SCALE)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=rules,
                                      fsdp=fsdp)
    model, losses = train(strategy, weights, "mixed_float16",
                          OVERFLOWING_SCALE)
    skipped = STEPS - single.optimizer.iterations.numpy()
    assert skipped == 3
    assert model.optimizer.iterations.numpy() == STEPS - skipped
    assert model.optimizer.dynamic_scale.numpy() == \
        single.optimizer.dynamic_scale.numpy() == OVERFLOWING_SCALE / 2**3
    check_within_oracle(single, single_losses, model, losses, error)
