"""`ParallelStrategy(offload="optimizer+master")` (issue 15, the second
level): under mixed precision the mesh devices hold each weight only in the
compute dtype; its float32 master and the optimizer's slots live on the
host devices, where the update runs (`tfpar.offload.master`).

As in tests/test_offload.py the "host" is other virtual CPUs of this
process (CPU:4-7 for the mesh CPU:0-3); the 8-device meshes of the issue
run in a 16-CPU subprocess (`python tests/test_offload_master.py <case>`).

Tolerance: none. "+master" is compared with `offload="optimizer"` and
with no offload on the same mesh EXACTLY (all mixed_bfloat16): the forward
and backward see the same compute-dtype values, the gradient of a cast is
the cast of the gradient, and the update is the same float32 program
(measured bit-identical on data=8, data=8 fsdp and data=2 x model=4, with
Adam, AdamW and SGD with momentum). Single-device Keras is not the oracle
here: under mixed_bfloat16 the mesh itself (no offload) differs from one
device by up to 4e-2 relative in a weight after 8 steps (bfloat16 sums
split differently; measured on data=8 fsdp, AdamW); tests/test_offload.py
holds offload="optimizer" to one device in float32.
"""

import json
import sys

import numpy as np
import pytest

import tfpar
import test_offload as base

DEVICES, HOST = base.DEVICES, base.HOST
MASTER = "optimizer+master"


@pytest.fixture
def mixed():
    """keras with the global policy `mixed_bfloat16` (float32 after)."""
    import keras  # noqa: PLC0415

    keras.config.set_dtype_policy("mixed_bfloat16")
    yield keras
    keras.config.set_dtype_policy("float32")


def _strategy(offload, axes=None, devices=DEVICES, host=HOST, rules=None,
              fsdp=False):
    options = {} if offload is None else {"offload": offload,
                                          "offload_devices": host}
    return tfpar.ParallelStrategy(tfpar.Mesh(axes or {"data": 4},
                                             devices=devices),
                                  rules=rules, fsdp=fsdp, **options)


def _fit(keras, strategy, weights, optimizer="adam", epochs=2, build=None):
    """(model, losses) of `fit` under `strategy` from `weights`."""
    with strategy.scope():
        model = (build or base._mlp)(keras)  # noqa: SLF001
        model.set_weights(weights)
        model.compile(optimizer=base.OPTIMIZERS[optimizer](keras),
                      loss="mse")
    x, y = base._data()  # noqa: SLF001
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False,
                        verbose=0)
    return model, history.history.get("loss", [])


def _master_blocks(weight):
    """The per-device components of `weight`'s float32 master."""
    from tensorflow.experimental import dtensor  # noqa: PLC0415

    master = tfpar._compat.backing_variable(weight).master  # noqa: SLF001
    return dtensor.unpack(master.read_value())


def _differences(runs, reference):
    """{loss_vs_R, weights_vs_R: max relative difference} of runs["master"]
    against runs[R] = (losses, weights)."""
    found = {}
    for name in reference:
        losses, weights = runs[name]
        found[f"loss_vs_{name}"] = base._relative(runs["master"][0], losses)
        found[f"weights_vs_{name}"] = max(
            base._relative(a, b) for a, b in zip(runs["master"][1], weights))
    return found


def _parity(keras, case):
    """One 8-device case "<mesh>/<optimizer>" under mixed_bfloat16:
    differences of "+master" from offload="optimizer" and no offload, and
    where its variables live."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    mesh, optimizer = case.split("/")
    axes, rules, fsdp = {"data8": ({"data": 8}, None, False),
                         "data2model4": ({"data": 2, "model": 4}, base.RULES,
                                         False),
                         "data8fsdp": ({"data": 8}, None, True)}[mesh]
    weights = base._mlp(keras).get_weights()  # noqa: SLF001
    runs = {}
    devices = [f"CPU:{i}" for i in range(8)]
    host = [f"CPU:{i}" for i in range(8, 16)]
    for name, offload in (("plain", None), ("optimizer", "optimizer"),
                          ("master", MASTER)):
        model, losses = _fit(keras, _strategy(offload, axes, devices, host,
                                              rules, fsdp), weights,
                             optimizer)
        runs[name] = (losses, model.get_weights())
    found = _differences(runs, ("optimizer", "plain"))
    found["device_dtypes"] = sorted({
        b.dtype.name for w in model.trainable_weights
        for b in base._blocks(w)})
    found["master_devices"] = sorted({
        base._short(b.device)  # noqa: SLF001
        for w in model.trainable_weights
        for b in _master_blocks(w)})
    found["slot_devices"] = sorted({
        base._short(b.device) for v in model.optimizer.variables  # noqa
        for b in base._blocks(v)})  # noqa: SLF001
    return found


def _check_parity(found):
    hosts = sorted(f"CPU:{i}" for i in range(8, 16))
    for case, figures in found.items():
        assert figures.pop("device_dtypes") == ["bfloat16"], case
        assert figures.pop("master_devices") == hosts, case
        assert figures.pop("slot_devices") == hosts, case
        assert figures == {"loss_vs_optimizer": 0.0,
                           "weights_vs_optimizer": 0.0,
                           "loss_vs_plain": 0.0, "weights_vs_plain": 0.0}, case


def _run_cases(cases):
    return base._run_cases(cases, __file__)  # noqa: SLF001


def test_master_matches_optimizer_offload_and_no_offload_on_8_devices():
    """data=8 fsdp with AdamW: "+master" equals offload="optimizer"
    exactly, and no offload / one device within 1e-4; the devices hold
    bfloat16 blocks only, the masters and slots are on CPU:8-15."""
    _check_parity(_run_cases(["data8fsdp/adamw"]))


@pytest.mark.slow
def test_master_matches_every_mesh_and_optimizer():
    """Adam, AdamW, SGD with momentum on data=8, data=8 fsdp, data=2 x
    model=4."""
    _check_parity(_run_cases([
        f"{m}/{o}" for m in ("data8", "data8fsdp", "data2model4")
        for o in base.OPTIMIZERS]))


@pytest.mark.parametrize("axes, rules, fsdp", [
    ({"data": 4}, None, False), ({"data": 4}, None, True),
    ({"data": 2, "model": 2}, base.RULES, False)],
    ids=["data=4", "fsdp", "data=2 x model=2"])
def test_devices_hold_half_the_weights_bytes_and_no_state(mixed, axes, rules,
                                                           fsdp):
    """Per mesh device: params halve (bfloat16 blocks of the same shape),
    optimizer 0 (Adam's slots moved, and its two scalars): the
    drop from no offload is the slots plus half the weights' bytes. Host
    device i holds device i's float32 master blocks and slots."""
    keras = mixed
    weights = base._mlp(keras).get_weights()  # noqa: SLF001
    plain = _strategy(None, axes, rules=rules, fsdp=fsdp)
    kept, _ = _fit(keras, plain, weights, epochs=1)
    master = _strategy(MASTER, axes, rules=rules, fsdp=fsdp)
    model, _ = _fit(keras, master, weights, epochs=1)
    before, after = plain.memory_per_device(), master.memory_per_device()
    for device, host in zip(DEVICES, HOST):
        params, state = before[device]["params"], before[device]["optimizer"]
        assert state == 2 * params > 0  # Adam's m and v
        # Iterations (int64) and learning rate (float32), counted as
        # "other", moved with the slots.
        assert after[device] == {"params": params // 2, "optimizer": 0,
                                 "other": before[device]["other"] - 12}
        assert after[host] == {"params": params, "optimizer": state,
                               "other": 12}
    for weight, before_weight in zip(model.trainable_weights,
                                     kept.trainable_weights):
        blocks = base._blocks(weight)
        expected = base._blocks(before_weight)
        assert [b.dtype.name for b in blocks] == ["bfloat16"] * 4
        assert [b.shape for b in blocks] == [b.shape for b in expected]
        assert [base._short(b.device) for b in blocks] == DEVICES  # noqa
        masters = _master_blocks(weight)
        assert [b.dtype.name for b in masters] == ["float32"] * 4
        assert [base._short(b.device) for b in masters] == HOST  # noqa
        # The devices' blocks are the masters' blocks cast.
        for block, master_block in zip(blocks, masters):
            np.testing.assert_array_equal(
                block.numpy(), master_block.numpy().astype(block.dtype
                                                           .as_numpy_dtype))
    assert all(w.dtype == np.float32 for w in model.get_weights())


def test_user_visible_weights_are_the_float32_masters(mixed):
    """get_weights, weight.numpy(), np.asarray and set_weights: float32
    values not representable in bfloat16 go in and come out whole."""
    keras = mixed
    model, _ = _fit(keras, _strategy(MASTER), base._mlp(keras).get_weights(),
                    epochs=1)
    rng = np.random.default_rng(1)
    values = [w + rng.standard_normal(w.shape).astype("float32") * 1e-4
              for w in model.get_weights()]
    model.set_weights(values)
    for weight, value in zip(model.weights, values):
        np.testing.assert_array_equal(weight.numpy(), value)
        np.testing.assert_array_equal(np.asarray(weight), value)
    kernel = model.trainable_weights[0]
    kernel.assign(kernel.numpy() * 3)
    np.testing.assert_array_equal(kernel.numpy(), values[0] * 3)
    # An expression of the weight computes in the devices' copy's dtype
    # (Keras uses the tf.Variable's): documented in tfpar.offload.master.
    assert (kernel * 0.5).dtype == "bfloat16"
    assert not np.array_equal(
        values[0] * 3, values[0].astype("bfloat16").astype("float32") * 3)


def _trained_from(keras, offload, weights, epochs, axes):
    return _fit(keras, _strategy(offload, axes, rules=base.RULES), weights,
                epochs=epochs)[0]


def test_memory_report_halves_the_weights_and_puts_the_masters_back(mixed):
    """tfpar.memory_report under "+master": a mesh device's params half of
    its host device's (bfloat16 against the float32 masters), no
    optimizer state on it; the float32 weights unchanged after (the
    report runs a step and puts every variable back)."""
    keras = mixed
    model, _ = _fit(keras, _strategy(MASTER), base._mlp(keras).get_weights(),
                    epochs=1)
    weights = model.get_weights()
    x, y = base._data()  # noqa: SLF001
    report = tfpar.memory_report(model, x[:16], y[:16])
    for device, host in zip(DEVICES, HOST):
        assert 2 * report[device]["params"] == report[host]["params"] > 0
        assert report[device]["optimizer"] == 0 < report[host]["optimizer"]
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)


def test_checkpoints_move_between_master_and_no_offload(mixed, tmp_path):
    """Saved with "+master" (float32 masters, same files as no offload),
    restored without offload and back: weights and slots equal, the next
    epoch equal to the saving model's."""
    keras = mixed
    axes = {"data": 2, "model": 2}
    weights = base._mlp(keras).get_weights()  # noqa: SLF001
    saving = _trained_from(keras, MASTER, weights, 2, axes)
    tfpar.save_checkpoint(saving, str(tmp_path / "master"))
    restored = {}
    for name, offload, source in (("plain", None, "master"),
                                  ("master", MASTER, "plain")):
        model = _trained_from(keras, offload, base._mlp(keras).get_weights(),
                              0, axes)
        tfpar.restore_checkpoint(model, str(tmp_path / source))
        if name == "plain":
            tfpar.save_checkpoint(model, str(tmp_path / "plain"))
        restored[name] = model
    saved = base.saved_variables(tmp_path / "master")
    assert saved == base.saved_variables(tmp_path / "plain")
    assert {e["dtype"] for e in saved} >= {"float32"}
    x, y = base._data()  # noqa: SLF001
    expected_slots = base._slot_values(saving)  # noqa: SLF001
    expected_weights = saving.get_weights()
    reference = saving.fit(x, y, batch_size=16, shuffle=False,
                           verbose=0).history["loss"]
    for name, model in restored.items():
        for a, b in zip(model.get_weights(), expected_weights):
            np.testing.assert_array_equal(a, b, err_msg=name)
        slots = base._slot_values(model)  # noqa: SLF001
        for key, value in expected_slots.items():
            np.testing.assert_array_equal(slots[key], value, err_msg=key)
        losses = model.fit(x, y, batch_size=16, shuffle=False,
                           verbose=0).history["loss"]
        assert base._relative(losses, reference) <= 1e-4, name
        for a, b in zip(model.get_weights(), saving.get_weights()):
            assert base._relative(a, b) <= 1e-4, name


def _written_runs(keras, steps):
    """{name: (losses, weights)} of fit, set_weights, fit with a callback
    halving a kernel after batch 1, for each (name, offload, train_step
    write) of `steps` (the write: None, or (kernel) -> its new value)."""
    class HalveAfterBatch1(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                kernel = self.model.layers[0].kernel
                kernel.assign(kernel.numpy() * 0.5)  # float32

    x, y = base._data()  # noqa: SLF001
    weights = base._mlp(keras).get_weights()  # noqa: SLF001
    runs = {}
    for name, offload, write in steps:
        class Writing(keras.Sequential):
            def train_step(self, data, write=write):
                if write is not None:
                    kernel = self.layers[1].kernel
                    kernel.assign(write(kernel))
                return super().train_step(data)

        def build(keras, cls=Writing):
            return cls([keras.Input((16,)),
                        keras.layers.Dense(32, activation="relu"),
                        keras.layers.Dense(8)])

        model, losses = _fit(keras, _strategy(offload), weights, epochs=1,
                             build=build)
        model.set_weights([w * 1.5 for w in model.get_weights()])
        losses += model.fit(x, y, batch_size=16, shuffle=False, verbose=0,
                            callbacks=[HalveAfterBatch1()]).history["loss"]
        runs[name] = (losses, model.get_weights())
    return runs


def test_weights_written_between_steps_reach_the_master(mixed):
    """set_weights between fits and `assign` of a float32 value in a
    callback write the float32 master whole: exactly as
    offload="optimizer". (An expression of the weight, `kernel * 0.5`, is
    in the compute dtype: shown by test_user_visible_weights_...)"""
    runs = _written_runs(mixed, [("optimizer", "optimizer", None),
                                 ("master", MASTER, None)])
    assert max(_differences(runs, ("optimizer",)).values()) == 0.0


def test_a_write_inside_the_step_is_in_the_compute_dtype(mixed):
    """A train_step assigning a weight (kernel * 0.9) sees only the
    devices' bfloat16 copy, so it writes a bfloat16 value, which reaches
    the master (`pull_weights`): exactly offload="optimizer" with the
    write made in bfloat16 (cast(kernel) * 0.9); offload="optimizer"'s
    float32 write itself differs (measured 4e-2 relative in the weights
    after two epochs): a documented difference of "+master"."""
    keras = mixed
    runs = _written_runs(keras, [
        ("optimizer", "optimizer",
         lambda k: keras.ops.cast(k, "bfloat16") * 0.9),
        ("float32_write", "optimizer", lambda k: k * 0.9),
        ("master", MASTER, lambda k: k * 0.9)])
    assert max(_differences(runs, ("optimizer",)).values()) == 0.0
    assert _differences(runs, ("float32_write",))[
        "weights_vs_float32_write"] > 1e-3


def test_loss_scaling_under_mixed_float16_matches_optimizer_offload():
    """mixed_float16, Keras' LossScaleOptimizer from 2**20 (overflows the
    first steps): "+master" keeps float16 weights on the devices and
    trains as offload="optimizer" (exactly: same skipped steps, scale)."""
    import keras  # noqa: PLC0415

    keras.config.set_dtype_policy("mixed_float16")
    try:
        weights = base._mlp(keras).get_weights()  # noqa: SLF001
        x, y = base._data()  # noqa: SLF001
        runs, models = {}, {}
        for name, offload in (("optimizer", "optimizer"), ("master", MASTER)):
            with _strategy(offload).scope():
                model = base._mlp(keras)  # noqa: SLF001
                model.set_weights(weights)
                model.compile(loss="mse", optimizer=(
                    keras.optimizers.LossScaleOptimizer(
                        keras.optimizers.SGD(0.05, momentum=0.9),
                        initial_scale=2.0**20)))
            runs[name] = (model.fit(x, y, batch_size=16, epochs=2,
                                    shuffle=False, verbose=0)
                          .history["loss"], model.get_weights())
            models[name] = model
    finally:
        keras.config.set_dtype_policy("float32")
    assert max(_differences(runs, ("optimizer",)).values()) == 0.0
    # The same steps skipped (at least the first two; a third now and then,
    # by the random initial weights) and the same scale.
    master, offload = (models[n].optimizer for n in ("master", "optimizer"))
    assert master.iterations.numpy() == offload.iterations.numpy() <= 8 - 2
    assert master.dynamic_scale.numpy() == offload.dynamic_scale.numpy()
    assert master.dynamic_scale.numpy() <= 2.0**18
    kernel = models["master"].trainable_weights[0]
    assert base._blocks(kernel)[0].dtype.name == "float16"


def test_master_under_a_float32_policy_is_refused_at_compile():
    """Nothing to gain (the device copy would be the float32 master):
    refused, naming the policy, rather than silently equal to
    offload="optimizer"."""
    import keras  # noqa: PLC0415

    with _strategy(MASTER).scope():
        model = base._mlp(keras)  # noqa: SLF001
        with pytest.raises(ValueError, match=(
                r"offload='optimizer\+master'\): under the dtype policy "
                r"'float32'.*Use offload='optimizer', or set a mixed policy"
                r".*Received: offload='optimizer\+master', policy "
                r"'float32'")):
            model.compile(optimizer="adam", loss="mse")


def test_a_float32_layer_keeps_float32_weights_on_the_devices(mixed):
    """A layer computing in float32 (dtype="float32" head) reads its
    weights in float32: they stay float32 on the devices (else its
    forward would see rounded weights); the others are bfloat16."""
    keras = mixed

    def build(keras):
        return keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="up"),
            keras.layers.Dense(8, name="down", dtype="float32")], name="mlp")

    weights = build(keras).get_weights()
    runs = {}
    for name, offload in (("optimizer", "optimizer"), ("master", MASTER)):
        model, losses = _fit(keras, _strategy(offload), weights, epochs=1,
                             build=build)
        runs[name] = (losses, model.get_weights())
    assert max(_differences(runs, ("optimizer",)).values()) == 0.0
    assert [base._blocks(w)[0].dtype.name
            for w in model.trainable_weights] == [
                "bfloat16", "bfloat16", "float32", "float32"]


def test_docstring_example_runs():
    """tfpar.offload.master's example: 544 bytes of bfloat16 weights on a
    mesh device, 1088 of float32 masters on its host device."""
    import doctest  # noqa: PLC0415

    from tfpar.offload import master as offload_master  # noqa: PLC0415

    result = doctest.testmod(offload_master, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


if __name__ == "__main__":  # the 16-CPU subprocess of the parity tests
    tfpar.use_virtual_cpus(16)
    import keras  # noqa: E402 (after the devices are configured)

    print(json.dumps({case: _parity(keras, case) for case in sys.argv[1:]}))
