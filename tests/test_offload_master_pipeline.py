"""`offload="optimizer+master"` with a `PipelineModel` (issue 15): each
stage's devices hold its weights only in the compute dtype, each part's
float32 masters and optimizer slots live on the host devices of its own
stage's devices (`tfpar.offload.master`).

pipe=2 x data=2 on CPU:0-3 (stage 0 on CPU:0,1, stage 1 on CPU:2,3), the
host CPU:4-7 (`offload_devices`; CPU:4,5 hold stage 0's state, CPU:6,7
stage 1's), as in tests/test_offload_pipeline.py.

Tolerance: none. As for plain models (tests/test_offload_master.py) the
forward and backward see the same compute-dtype values under "+master",
`offload="optimizer"` and no offload, the gradient of a cast is the cast
of the gradient, each part sums its micro-batches' gradients in float32
(`ModelPart.add_gradient`) and the update is the same float32 program:
measured bit-identical for 1F1B, GPipe, ZB-H1, interleaved stages and
weights tied across stages, Adam and SGD with momentum under
mixed_bfloat16 and a LossScaleOptimizer under mixed_float16. (Before the
float32 sums the 1F1B pipeline's weights differed from "optimizer" by 0.27
relative after 4 steps: bfloat16 sums of 4 micro-batches.)

The default run trains one 1F1B pipeline with and without "+master" (a
module fixture shared by the parity, placement, memory and checkpoint
tests); the other schedules, optimizers, loss scaling, interleaved and
tied pipelines are slow.
"""

import contextlib

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import models
import tfpar
from test_offload_pipeline import (DEVICES, HOST, deep_mlp, mlp_data,
                                   optimizer_values, short, state_devices)
from test_pipeline_tied import lm_data, tiny_lm

MASTER = "optimizer+master"
STAGE_DEVICES = [DEVICES[:2], DEVICES[2:]]
STAGE_HOSTS = [HOST[:2], HOST[2:]]


@contextlib.contextmanager
def policy(name):
    """Keras' global dtype policy `name` inside (float32 after)."""
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy("float32")


def two_dense():
    """One Dense layer per stage (compiles fastest)."""
    return keras.Sequential([
        keras.Input((16,)), keras.layers.Dense(32, activation="relu",
                                               name="d0"),
        keras.layers.Dense(8, name="d1")], name="two")


def adam():
    return keras.optimizers.Adam(0.01)


def sgd_momentum():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def pipeline(offload, weights, optimizer=adam, build=two_dense, loss="mse",
             **options):
    """A compiled `PipelineModel` of `build()` on pipe=2 x data=2 with
    `weights`, offloading (`offload`: None, "optimizer" or "+master") to
    CPU:4-7."""
    extra = {} if offload is None else {"offload": offload,
                                        "offload_devices": HOST}
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"pipe": 2, "data": 2}, devices=DEVICES), **extra)
    with strategy.scope():
        pipe = tfpar.PipelineModel(build(), **{"num_microbatches": 2,
                                               **options})
        pipe.set_weights(weights)
        pipe.compile(optimizer=optimizer(), loss=loss)
    return pipe


def fit(pipe, data, epochs=1):
    """(per-batch losses, final weights) of `fit` in order, batch 16."""
    losses = models.BatchLosses()
    pipe.fit(*data, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
             callbacks=[losses])
    return np.array(losses.losses), pipe.get_weights()


def assert_identical(want, got):
    """Losses and weights equal to the bit."""
    assert len(want[0]) == len(got[0]) > 0
    np.testing.assert_array_equal(want[0], got[0])
    assert len(want[1]) == len(got[1]) > 0
    for a, b in zip(want[1], got[1]):
        np.testing.assert_array_equal(a, b)


def blocks(variable):
    return dtensor.unpack(variable.read_value())


def stage_of(pipe, weight):
    """The stage whose devices hold `weight`'s device blocks."""
    devices = [short(b.device) for b in blocks(
        tfpar._compat.backing_variable(weight))]  # noqa: SLF001
    return STAGE_DEVICES.index(devices)


def check_placement(pipe, dtype, variables=None):
    """Each trainable weight (and each of `variables`): `dtype` blocks on
    its stage's devices, each its float32 master block (on the stage's
    host devices) cast; every part's slots and counters on its stage's
    hosts."""
    for weight in variables or pipe.trainable_weights:
        backing = tfpar._compat.backing_variable(weight)  # noqa: SLF001
        stage = stage_of(pipe, weight)
        mine, masters = blocks(backing), blocks(backing.master)
        assert [b.dtype.name for b in mine] == [dtype] * 2, weight.path
        assert [b.dtype.name for b in masters] == ["float32"] * 2
        assert [short(b.device) for b in masters] == STAGE_HOSTS[stage]
        for block, master in zip(mine, masters):
            np.testing.assert_array_equal(
                block.numpy(),
                master.numpy().astype(block.dtype.as_numpy_dtype))
    assert state_devices(pipe)[:2] == STAGE_HOSTS


@pytest.fixture(scope="module")
def weights():
    """The initial weights of `two_dense` under mixed_bfloat16."""
    with policy("mixed_bfloat16"):
        keras.utils.set_random_seed(0)
        return two_dense().get_weights()


def _trained(offload, weights):
    """(pipeline, (losses, weights)): `two_dense`, 1F1B, Adam,
    mixed_bfloat16, 2 steps of 2 micro-batches from `weights`."""
    with policy("mixed_bfloat16"):
        pipe = pipeline(offload, weights)
        return pipe, fit(pipe, mlp_data(32))


@pytest.fixture(scope="module")
def master(weights):
    return _trained(MASTER, weights)


@pytest.fixture(scope="module")
def plain(weights):
    return _trained(None, weights)


def test_master_pipeline_holds_compute_dtype_weights(master):
    """Each stage's devices hold bfloat16 blocks only, the float32 masters
    and slots on its hosts; get_weights gives the masters."""
    pipe, (_, trained) = master
    check_placement(pipe, "bfloat16")
    assert all(w.dtype == np.float32 for w in trained)
    for weight, value in zip(pipe.weights, trained):
        np.testing.assert_array_equal(weight.numpy(), value)


def test_master_pipeline_equals_the_pipeline_without_offload(plain, master):
    """1F1B: the same losses and weights to the bit."""
    assert_identical(plain[1], master[1])


def test_each_stage_device_drops_the_slots_and_half_the_weights(plain,
                                                                 master):
    """Per stage device: params halve (bfloat16 blocks of the same
    shapes), no optimizer state (Adam's m and v moved); its host device
    holds the float32 master blocks and the slots."""
    before = plain[0].distribute_strategy.memory_per_device()
    after = master[0].distribute_strategy.memory_per_device()
    assert sorted(after) == sorted(DEVICES + HOST)
    for devices, hosts in zip(STAGE_DEVICES, STAGE_HOSTS):
        for device, host in zip(devices, hosts):
            params = before[device]["params"]
            assert before[device]["optimizer"] == 2 * params > 0
            assert after[device]["params"] == params // 2
            assert after[device]["optimizer"] == 0
            assert after[host]["params"] == params
            assert after[host]["optimizer"] == 2 * params
    # The stages differ (16x32 against 32x8 kernels).
    assert before[DEVICES[0]]["params"] != before[DEVICES[2]]["params"]


def test_checkpoints_move_between_master_and_no_offload(master, tmp_path):
    """A sharded checkpoint of the "+master" pipeline (float32 masters)
    restored into a pipeline without offload, saved there and restored
    into a new "+master" pipeline: weights and every optimizer variable
    equal to the bit; the last one's devices hold its masters cast."""
    saving = master[0]
    tfpar.save_checkpoint(saving, str(tmp_path / "master"))
    with policy("mixed_bfloat16"):
        fresh = two_dense().get_weights()
        plain = pipeline(None, fresh)
        assert tfpar.restore_checkpoint(plain, str(tmp_path / "master")) == 2
        tfpar.save_checkpoint(plain, str(tmp_path / "plain"))
        back = pipeline(MASTER, fresh)
        assert tfpar.restore_checkpoint(back, str(tmp_path / "plain")) == 2
    expected = optimizer_values(saving)
    for restored in (plain, back):
        for a, b in zip(saving.get_weights(), restored.get_weights()):
            assert a.dtype == b.dtype == np.float32
            np.testing.assert_array_equal(a, b)
        got = optimizer_values(restored)
        assert len(got) == len(expected) == 2 * (2 + 2 * 2)
        for a, b in zip(expected, got):
            np.testing.assert_array_equal(a, b)
    check_placement(back, "bfloat16")


def three_ways(data, optimizer=adam, build=two_dense, loss="mse", epochs=2,
               **options):
    """{"plain", "optimizer", "master": (losses, weights)} of the same
    pipeline from the same weights, and the "+master" pipeline."""
    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    found = {}
    for name, offload in (("plain", None), ("optimizer", "optimizer"),
                          ("master", MASTER)):
        pipe = pipeline(offload, weights, optimizer, build, loss, **options)
        found[name] = fit(pipe, data, epochs)
    assert_identical(found["optimizer"], found["master"])
    assert_identical(found["plain"], found["master"])
    return pipe


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize("optimizer", [adam, sgd_momentum],
                         ids=["adam", "sgd_momentum"])
def test_every_schedule_and_optimizer(schedule, optimizer):
    """4 micro-batches, 8 steps: "+master" equals offload="optimizer" and
    no offload to the bit."""
    with policy("mixed_bfloat16"):
        pipe = three_ways(mlp_data(), optimizer, num_microbatches=4,
                          schedule=schedule)
    check_placement(pipe, "bfloat16")


@pytest.mark.slow
def test_interleaved_stages():
    """virtual_stages=2: four parts, parts 0 and 2 on stage 0 (their
    masters and slots on CPU:4,5), 1 and 3 on stage 1 (CPU:6,7)."""
    with policy("mixed_bfloat16"):
        pipe = three_ways(mlp_data(), build=deep_mlp, num_microbatches=4,
                          virtual_stages=2)
    assert len(pipe.stages) == 4
    assert state_devices(pipe) == STAGE_HOSTS * 2
    check_placement(pipe, "bfloat16")


@pytest.mark.slow
def test_tied_weights():
    """The embedding (stage 0) is also the head (stage 1): its persistent
    copy on stage 1 is held in bfloat16 too, its master and slots on
    stage 1's hosts; after training the copy's blocks (and its master's)
    equal the embedding's."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with policy("mixed_bfloat16"):
        pipe = three_ways(lm_data(), build=tiny_lm, loss=loss,
                          stage_boundaries=["top"])
    copies = [c.variable for c in pipe.ties.copies]
    assert copies
    check_placement(pipe, "bfloat16", pipe.trainable_weights + copies)
    for copy in pipe.ties.copies:
        home = tfpar._compat.backing_variable(copy.weight)  # noqa: SLF001
        mine = tfpar._compat.backing_variable(copy.variable)  # noqa: SLF001
        for a, b in zip(blocks(home) + blocks(home.master),
                        blocks(mine) + blocks(mine.master)):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.slow
def test_loss_scaling_under_mixed_float16():
    """A LossScaleOptimizer (SGD with momentum) from 2**20, which
    overflows the first step: every part skips it together
    (`tfpar.pipeline.loss_scale`) under "+master" as under "optimizer"
    and no offload; float16 blocks on the devices."""
    def scaled():
        return keras.optimizers.LossScaleOptimizer(sgd_momentum(),
                                                   initial_scale=2.0**20)

    with policy("mixed_float16"):
        pipe = three_ways(mlp_data(), scaled, num_microbatches=4)
    check_placement(pipe, "float16")
    # Steps skipped (two, measured) and the scale halved, alike per part.
    steps = [int(o.iterations.numpy()) for o in pipe.stage_optimizers]
    scales = [float(o.dynamic_scale.numpy()) for o in pipe.stage_optimizers]
    assert steps[0] == steps[1] <= 8 - 1, steps
    assert scales[0] == scales[1] <= 2.0**19, scales
