"""`offload="optimizer"` with a `PipelineModel` beyond the plain case
(issue 15): interleaved stages, weights tied across stages, loss scaling
under mixed_float16, and sharded checkpoints across offload and none.

pipe=2 x data=2 on CPU:0-3 (stage 0 on CPU:0,1, stage 1 on CPU:2,3), the
host CPU:4-7 (`offload_devices`): each part's optimizer keeps its state on
the host devices of its own stage's devices. Parity: losses and weights
within 1e-4 (relative, fp32) of the same pipeline without offload, and of
one device where the float32 step is the same.
"""

import keras
import numpy as np
from tensorflow.experimental import dtensor

import models
import tfpar
# The tiny LM whose embedding is also its head (tied across stages).
from test_pipeline_tied import lm_data, tiny_lm

DEVICES = [f"CPU:{i}" for i in range(4)]
HOST = [f"CPU:{i}" for i in range(4, 8)]
RTOL = 1e-4


def deep_mlp(dtype=None):
    """Four Dense layers (one per part with virtual_stages=2); `dtype` for
    the first two (e.g. "mixed_float16")."""
    return keras.Sequential([keras.Input((16,))] + [
        keras.layers.Dense(width, activation="relu" if i < 3 else None,
                           name=f"d{i}", dtype=dtype if i < 2 else None)
        for i, width in enumerate((32, 32, 32, 8))], name="deep")


def mlp_data(n=64):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n, 16)).astype("float32"),
            rng.standard_normal((n, 8)).astype("float32"))


def pipeline(build, host, weights, optimizer, loss="mse", **options):
    """A compiled `PipelineModel` of `build()` on pipe=2 x data=2 (offload
    to `host` when given) with `weights`."""
    offload = {} if host is None else {"offload": "optimizer",
                                       "offload_devices": host}
    strategy = tfpar.ParallelStrategy(
        tfpar.Mesh({"pipe": 2, "data": 2}, devices=DEVICES), **offload)
    with strategy.scope():
        pipe = tfpar.PipelineModel(build(), **{"num_microbatches": 4,
                                               **options})
        pipe.set_weights(weights)
        pipe.compile(optimizer=optimizer(), loss=loss)
    return pipe


def fit(model, data, epochs=2):
    """(per-batch losses, final weights) of `fit` in order, batch 16."""
    losses = models.BatchLosses()
    model.fit(*data, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[losses])
    return np.array(losses.losses), model.get_weights()


def assert_same(want, got):
    assert len(want[0]) == len(got[0]) > 0
    assert models.relative_error(want[0], got[0]) < RTOL, (want[0], got[0])
    assert len(want[1]) == len(got[1])
    for a, b in zip(want[1], got[1]):
        assert models.relative_error(a, b) < RTOL


def short(device):
    return device.rsplit("device:", 1)[-1]


def state_devices(pipe):
    """Per part's optimizer, the devices of its variables' blocks."""
    return [sorted({short(b.device) for v in optimizer.variables
                    for b in dtensor.unpack(v.value.read_value())})
            for optimizer in pipe.stage_optimizers]


def three_ways(build, data, optimizer, loss="mse", **options):
    """{"single", "plain", "offload": (losses, weights)} and the offloaded
    pipeline."""
    keras.utils.set_random_seed(0)
    weights = build().get_weights()
    single = build()
    single.set_weights(weights)
    single.compile(optimizer=optimizer(), loss=loss)
    found = {"single": fit(single, data)}
    for name, host in (("plain", None), ("offload", HOST)):
        pipe = pipeline(build, host, weights, optimizer, loss, **options)
        found[name] = fit(pipe, data)
    return found, pipe


def test_interleaved_stages_offload_matches_no_offload():
    """virtual_stages=2: four parts (one Dense each), parts 0 and 2 on
    stage 0, 1 and 3 on stage 1; each part's optimizer on its stage's
    hosts."""
    found, pipe = three_ways(deep_mlp, mlp_data(),
                             lambda: keras.optimizers.Adam(0.01),
                             virtual_stages=2)
    assert len(pipe.stages) == 4
    assert state_devices(pipe) == [HOST[:2], HOST[2:]] * 2
    assert_same(found["plain"], found["offload"])
    assert_same(found["single"], found["offload"])


def test_tied_weights_offload_matches_no_offload():
    """The embedding (stage 0) is also the head (stage 1): its persistent
    copy on stage 1 has its own optimizer slots there, on stage 1's hosts
    under offload; after training the copy equals the weight block by
    block, and the pipeline equals the one without offload and one
    device."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    found, pipe = three_ways(tiny_lm, lm_data(),
                             lambda: keras.optimizers.Adam(0.01), loss,
                             num_microbatches=2, stage_boundaries=["top"])
    assert pipe.ties.copies
    for copy in pipe.ties.copies:
        home = dtensor.unpack(copy.weight.value.read_value())
        mine = dtensor.unpack(copy.variable.value.read_value())
        assert [short(b.device) for b in mine] == DEVICES[2:]
        for a, b in zip(home, mine):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert state_devices(pipe) == [HOST[:2], HOST[2:]]
    assert_same(found["plain"], found["offload"])
    assert_same(found["single"], found["offload"])


def test_loss_scaling_under_mixed_float16_matches_no_offload():
    """mixed_float16 (the first two Dense layers) with a
    LossScaleOptimizer (SGD with momentum) from a scale of 2**20, which
    overflows the first step: every part's scale and counter live on its
    stage's hosts with its update; all parts skip that step and halve the
    scale, as without offload. Losses and weights within 1e-4 of the same
    pipeline without offload (the same float16 steps; not of one device:
    the pipeline scales each micro-batch's loss by 1/m, so float16
    rounds differently)."""
    keras.utils.set_random_seed(0)
    weights = deep_mlp("mixed_float16").get_weights()
    found, pipes = {}, {}
    for name, host in (("plain", None), ("offload", HOST)):
        pipes[name] = pipeline(
            lambda: deep_mlp("mixed_float16"), host, weights,
            lambda: keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.05, momentum=0.9),
                initial_scale=2.0**20))
        found[name] = fit(pipes[name], mlp_data())
    assert_same(found["plain"], found["offload"])
    for name, pipe in pipes.items():
        scales = [float(o.dynamic_scale.numpy())
                  for o in pipe.stage_optimizers]
        steps = [int(o.iterations.numpy()) for o in pipe.stage_optimizers]
        # One overflow decision for all parts (`tfpar.pipeline.loss_scale`):
        # the same skipped step (one, measured, as on one device) and the
        # same scale everywhere (before it, the float32 last part applied
        # every step while part 0 skipped four: [4, 8] steps).
        assert steps == [7, 7] and scales == [2.0**19] * 2, (name, steps,
                                                              scales)
    for optimizer in pipes["offload"].stage_optimizers:
        for variable in (optimizer.dynamic_scale, optimizer.step_counter,
                         *optimizer.inner_optimizer.variables):
            devices = [short(b.device) for b in
                       dtensor.unpack(variable.value.read_value())]
            assert set(devices) <= set(HOST), variable.path


def optimizer_values(pipe):
    """Every part optimizer's variables (slots, counters, rate) as host
    arrays, in order."""
    return [v.numpy() for optimizer in pipe.stage_optimizers
            for v in optimizer.variables]


def test_checkpoints_move_between_offloaded_and_plain_pipelines(tmp_path):
    """A sharded checkpoint of an offloaded pipeline restored into the same
    pipeline without offload (weights and every optimizer variable equal)
    and, saved from there, back into an offloaded one: the next epoch of
    each within 1e-4 of the original offloaded pipeline's."""
    keras.utils.set_random_seed(0)
    weights = deep_mlp().get_weights()
    data = mlp_data()

    def adam():
        return keras.optimizers.Adam(0.01)

    offloaded = pipeline(deep_mlp, HOST, weights, adam)
    fit(offloaded, data)
    tfpar.save_checkpoint(offloaded, str(tmp_path / "offload"))
    plain = pipeline(deep_mlp, None, deep_mlp().get_weights(), adam)
    assert tfpar.restore_checkpoint(plain, str(tmp_path / "offload")) == 8
    tfpar.save_checkpoint(plain, str(tmp_path / "plain"))
    back = pipeline(deep_mlp, HOST, deep_mlp().get_weights(), adam)
    assert tfpar.restore_checkpoint(back, str(tmp_path / "plain")) == 8
    expected = optimizer_values(offloaded)
    for restored in (plain, back):
        for a, b in zip(offloaded.get_weights(), restored.get_weights()):
            np.testing.assert_array_equal(a, b)
        got = optimizer_values(restored)
        assert len(got) == len(expected) == 2 * (2 + 2 * 4)
        for a, b in zip(expected, got):
            np.testing.assert_array_equal(a, b)
    reference = fit(offloaded, data, epochs=1)
    for restored in (plain, back):
        assert_same(reference, fit(restored, data, epochs=1))
    assert state_devices(back) == [HOST[:2], HOST[2:]]
