"""Sharded, reshardable, crash-safe checkpoints (issue 5, items 2-4).

Saved on one mesh, restored onto others (and into one device) with equal
weights, optimizer state and predictions; every block file holds one
device's block and its CRC-32 is in the manifest; resumed training repeats
the losses of uninterrupted training; a save killed halfway leaves the
previous checkpoint in charge; bad checkpoints (a single flipped bit
included) and mismatched models fail before any weight changes.
"""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import zlib

import keras
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
from tfpar import checkpoint
from tfpar.checkpoint import blocks as checkpoint_blocks
from tfpar.checkpoint import files as checkpoint_files
from tfpar.checkpoint import keys as checkpoint_keys
from tfpar import layout as layout_lib
from tfpar import placement
from tfpar import strategy as strategy_lib

import models

RULES = {r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
         r".*down/kernel": ("model", None)}
MESHES = {"model=8": ({"model": 8}, RULES),
          "data=2,model=4": ({"data": 2, "model": 4}, RULES),
          "data=4,model=2": ({"data": 4, "model": 2}, RULES),
          "data=8": ({"data": 8}, None)}
EXPECTED_SPECS = {"up/kernel": (None, "model"), "up/bias": ("model",),
                  "down/kernel": ("model", None), "down/bias": (None,),
                  "out/kernel": (None, None), "out/bias": (None,)}
_STRATEGIES = {}


def strategy(name):
    if name not in _STRATEGIES:
        axes, rules = MESHES[name]
        _STRATEGIES[name] = tfpar.ParallelStrategy(tfpar.Mesh(axes),
                                                   rules=rules)
    return _STRATEGIES[name]


def mlp(hidden=32, extra=False, out=True):
    layers = [keras.Input((16,)),
              keras.layers.Dense(hidden, activation="relu", name="up"),
              keras.layers.Dense(16, name="down")]
    if out:
        layers.append(keras.layers.Dense(3, name="out"))
    if extra:
        layers.append(keras.layers.Dense(3, name="extra"))
    return keras.Sequential(layers, name="mlp")


def build(mesh=None, seed=1, compile=True, **kwargs):  # noqa: A002
    """An MLP on `mesh` (None: one device) with weights from `seed`."""
    keras.utils.set_random_seed(seed)
    if mesh is None:
        model = mlp(**kwargs)
    else:
        single = mlp(**kwargs)
        with strategy(mesh).scope():
            model = mlp(**kwargs)
            model.set_weights(single.get_weights())
    if compile:
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def build_optimizer(model):
    """Builds the optimizer (slots) as training would, in the model's scope."""
    with model.distribute_strategy.scope():
        model.optimizer.build(model.trainable_variables)


def data(n=64, seed=0):
    return models.mlp_data(n, seed)


fit = models.fit_mlp


def state(model):
    """(weights, optimizer variables) as host arrays (test-side gather)."""
    opt = getattr(model, "optimizer", None)
    return ([np.asarray(w) for w in model.get_weights()],
            [np.asarray(v) for v in opt.variables] if opt else [])


def assert_same_state(a, b):
    for xs, ys in zip(a, b):
        assert len(xs) == len(ys)
        for x, y in zip(xs, ys):
            np.testing.assert_array_equal(x, y)


def specs(model):
    return {v.path.removeprefix("mlp/"):
            layout_lib.spec_of(dtensor.fetch_layout(v.value))
            for v in model.weights}


def manifest(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A model=8 model trained 4 Adam steps and checkpointed."""
    model = build("model=8")
    fit(model, 1)
    root = str(tmp_path_factory.mktemp("ckpt"))
    path = checkpoint.save_checkpoint(model, root)
    x, _ = data()
    return {"root": root, "path": path, "model": model, "state": state(model),
            "predictions": model.predict(x, verbose=0)}


def test_layout_of_the_files(saved):
    """One file per distinct block: 8 column blocks of up/kernel, 8 row
    blocks of down/kernel, one file for each replicated variable."""
    assert saved["path"] == os.path.join(saved["root"], "ckpt-4")
    assert checkpoint.latest_checkpoint(saved["root"]) == saved["path"]
    info = manifest(saved["path"])
    assert info["format"] == "tfpar-checkpoint" and info["step"] == 4
    assert info["mesh"] == {"model": 8}
    assert set(info["versions"]) == {"tfpar", "tensorflow", "keras", "numpy"}
    records = {(r["kind"], r["key"]): r for r in info["variables"]}
    assert set(records) == (
        {("params", f"mlp/{k}") for k in EXPECTED_SPECS}
        | {("optimizer", "iteration"), ("optimizer", "learning_rate")}
        | {("optimizer", f"mlp/{k}:{slot}") for k in EXPECTED_SPECS
           for slot in ("momentum", "velocity")})

    def block_shapes(kind, key):
        record = records[(kind, key)]
        return [np.load(os.path.join(saved["path"], b["file"]),
                        mmap_mode="r").shape for b in record["blocks"]]

    # Weights and their Adam slots (laid out like the weight) alike.
    for kind, suffix in (("params", ""), ("optimizer", ":momentum"),
                         ("optimizer", ":velocity")):
        up = block_shapes(kind, f"mlp/up/kernel{suffix}")
        assert up == [(16, 4)] * 8, (kind, suffix)   # (in, out/8) each
        assert block_shapes(kind, f"mlp/up/bias{suffix}") == [(4,)] * 8
        assert block_shapes(kind, f"mlp/down/kernel{suffix}") == [(4, 16)] * 8
        assert block_shapes(kind, f"mlp/down/bias{suffix}") == [(16,)]
        assert block_shapes(kind, f"mlp/out/kernel{suffix}") == [(16, 3)]
    assert block_shapes("optimizer", "iteration") == [()]
    up = records[("params", "mlp/up/kernel")]
    assert up["spec"] == [None, "model"] and up["shape"] == [16, 32]
    assert [b["index"] for b in up["blocks"]] == [
        [[0, 16], [4 * c, 4 * c + 4]] for c in range(8)]
    # No whole-variable file for any sharded variable.
    for record in info["variables"]:
        if any(record["spec"]):
            for b in record["blocks"]:
                shape = np.load(os.path.join(saved["path"], b["file"]),
                                mmap_mode="r").shape
                assert list(shape) != record["shape"]
    assert len(os.listdir(saved["path"])) == 1 + sum(
        len(r["blocks"]) for r in info["variables"])


@pytest.mark.parametrize("target", ["data=2,model=4", "data=8", None])
def test_restore_onto_another_mesh(saved, target):
    x, _ = data()
    model = build(target, seed=7)
    assert models.relative_error(saved["state"][0][0],
                                 model.get_weights()[0]) > 0.1
    step = checkpoint.restore_checkpoint(model, saved["root"])
    assert step == 4
    assert_same_state(saved["state"], state(model))
    assert models.relative_error(saved["predictions"],
                                 model.predict(x, verbose=0)) < 1e-5
    if target == "data=2,model=4":
        assert specs(model) == EXPECTED_SPECS
        # Slots are matched by weight, whatever the optimizer is called
        # ("adam" when saved, "adam_<n>" here); they keep their layout.
        moments = {v.name: layout_lib.spec_of(dtensor.fetch_layout(v.value))
                   for v in model.optimizer.variables}
        assert model.optimizer.name != "adam"
        assert moments["mlp_up_kernel_momentum"] == (None, "model")
        assert moments["mlp_down_kernel_velocity"] == ("model", None)
    # A weights-only restore into an uncompiled model.
    bare = build(target, seed=9, compile=False)
    checkpoint.restore_checkpoint(bare, saved["path"], optimizer=False)
    assert_same_state((saved["state"][0],), (state(bare)[0],))


def test_no_variable_is_gathered(tmp_path, monkeypatch):
    """Save and restore never assemble a sharded variable (on host or a
    device): the gathering paths of tfpar fail loudly while they run."""
    source = build("data=2,model=4")
    fit(source, 1)
    target = build("model=8", seed=7)
    expected = state(source)

    def forbidden(*args, **kwargs):
        raise AssertionError("a variable was gathered")

    monkeypatch.setattr(placement, "fetch", forbidden)
    monkeypatch.setattr(placement, "relayout", forbidden)
    monkeypatch.setattr(strategy_lib.ShardedVariable, "numpy", forbidden)
    monkeypatch.setattr(dtensor, "relayout", forbidden)
    checkpoint.save_checkpoint(source, tmp_path)
    checkpoint.restore_checkpoint(target, tmp_path)
    monkeypatch.undo()
    assert_same_state(expected, state(target))


@pytest.fixture(scope="module")
def uninterrupted():
    """Per-batch losses of 3 epochs (12 Adam steps) on data=2 x model=4."""
    model = build("data=2,model=4")
    losses = models.BatchLosses()
    fit(model, 3, callbacks=[losses])
    return {"losses": losses.losses, "state": state(model)}


@pytest.mark.parametrize("resume_on", ["data=2,model=4", "data=4,model=2"])
def test_resumed_training_repeats_the_losses(uninterrupted, tmp_path,
                                             resume_on):
    first = build("data=2,model=4")
    losses = models.BatchLosses()
    fit(first, 1, callbacks=[losses])
    assert models.relative_error(uninterrupted["losses"][:4],
                                 losses.losses) < 1e-4
    checkpoint.save_checkpoint(first, tmp_path)
    del first                                   # the job "stops" here
    resumed = build(resume_on, seed=7)          # other initial weights
    assert checkpoint.restore_checkpoint(resumed, tmp_path) == 4
    assert int(np.asarray(resumed.optimizer.iterations)) == 4
    losses = models.BatchLosses()
    fit(resumed, 2, callbacks=[losses])
    assert len(losses.losses) == 8
    assert models.relative_error(uninterrupted["losses"][4:],
                                 losses.losses) < 1e-4
    weights, opt = state(resumed)
    for a, b in zip(uninterrupted["state"][0] + uninterrupted["state"][1],
                    weights + opt):
        assert models.relative_error(a, b) < 1e-4


def test_a_save_killed_halfway_leaves_the_previous_checkpoint(tmp_path):
    root, out = tmp_path / "run", tmp_path / "child.npz"
    child = os.path.join(os.path.dirname(__file__), "checkpoint_crash_child.py")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, child, str(root), str(out)],
                            capture_output=True, text=True, env=env,
                            timeout=300, check=False)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    entries = sorted(os.listdir(root))
    assert entries[:2] == ["checkpoint", "ckpt-4"]
    assert len(entries) == 3 and entries[2].startswith("ckpt-8.tmp-")
    partial = os.listdir(root / entries[2])
    assert "manifest.json" not in partial
    assert 0 < len(partial) < len(os.listdir(root / "ckpt-4")) - 1
    assert checkpoint.latest_checkpoint(root) == str(root / "ckpt-4")
    # Even without the pointer file the tmp directory never counts.
    os.remove(root / "checkpoint")
    assert checkpoint.latest_checkpoint(root) == str(root / "ckpt-4")

    model = build("data=8", seed=7)
    assert checkpoint.restore_checkpoint(model, root) == 4
    saved = np.load(out)
    arrays = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    weights, opt = state(model)
    assert len(arrays) == len(weights) + len(opt)
    for a, b in zip(arrays, weights + opt):
        np.testing.assert_array_equal(a, b)


def test_latest_checkpoint_and_resave(tmp_path):
    assert checkpoint.latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
        checkpoint.restore_checkpoint(build(compile=False), tmp_path,
                                      optimizer=False)
    model = build()
    first = checkpoint.save_checkpoint(model, tmp_path, step=3)
    second = checkpoint.save_checkpoint(model, tmp_path)     # iterations = 0
    assert checkpoint.latest_checkpoint(tmp_path) == second
    assert os.path.basename(second) == "ckpt-0"
    (tmp_path / "checkpoint").write_text("garbage")
    assert checkpoint.latest_checkpoint(tmp_path) == first   # highest step
    checkpoint.save_checkpoint(model, tmp_path, step=3)      # same step again
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-0", "ckpt-3"]


@pytest.mark.parametrize("target", [None, "data=2,model=4"])
@pytest.mark.parametrize("variant,names", [
    ({"extra": True}, ["mlp/extra/kernel", "mlp/extra/bias",
                       "mlp/extra/kernel:momentum"]),
    ({"out": False}, ["mlp/out/kernel", "mlp/out/bias"]),
    ({"hidden": 64}, ["mlp/up/kernel", "mlp/up/bias", "mlp/down/kernel"]),
])
def test_mismatched_model_changes_nothing(saved, target, variant, names):
    model = build(target, seed=7, **variant)
    build_optimizer(model)
    before = state(model)
    with pytest.raises(ValueError) as error:
        checkpoint.restore_checkpoint(model, saved["root"])
    for name in names:
        assert repr(name) in str(error.value), (name, str(error.value))
    assert "No variable was changed" in str(error.value)
    assert_same_state(before, state(model))


def _corrupt(path, how):
    info = manifest(path)
    # The last variable's block: a restore that assigned as it went would
    # have changed every other variable before failing.
    file = os.path.join(path, info["variables"][-1]["blocks"][0]["file"])
    up = [r for r in info["variables"] if r["key"] == "mlp/up/kernel"][0]
    if how == "truncated":
        size = os.path.getsize(file)
        with open(file, "r+b") as f:
            f.truncate(size - 3)
    elif how == "missing":
        os.remove(file)
    elif how == "wrong shape":
        file = os.path.join(path, up["blocks"][5]["file"])
        np.save(file, np.zeros((16, 5), "float32"))
    elif how == "manifest":
        file = os.path.join(path, "manifest.json")
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)
    elif how in ("manifest fields", "manifest checksum"):
        file = os.path.join(path, "manifest.json")
        if how == "manifest fields":
            up["blocks"][1]["index"] = [[0, 16], [0, 4]]   # overlaps block 0
        else:
            del up["blocks"][3]["crc32"]
        with open(file, "w") as f:
            json.dump(info, f)
    return os.path.basename(file)


@pytest.mark.parametrize("how", ["truncated", "missing", "wrong shape",
                                 "manifest", "manifest fields",
                                 "manifest checksum"])
def test_damaged_checkpoint_changes_nothing(saved, tmp_path, how):
    path = str(tmp_path / "ckpt-4")
    shutil.copytree(saved["path"], path)
    file = _corrupt(path, how)
    model = build("data=2,model=4", seed=7)
    build_optimizer(model)
    before = state(model)
    with pytest.raises(ValueError, match=file.replace(".", r"\.")):
        checkpoint.restore_checkpoint(model, path)
    assert_same_state(before, state(model))


def test_block_files_carry_their_crc32(saved):
    """The manifest holds, per block, the CRC-32 of the file's bytes."""
    info = manifest(saved["path"])
    assert info["format_version"] == 3
    blocks = [b for r in info["variables"] for b in r["blocks"]]
    assert len(blocks) == len(os.listdir(saved["path"])) - 1
    for block in blocks:
        with open(os.path.join(saved["path"], block["file"]), "rb") as f:
            assert block["crc32"] == zlib.crc32(f.read()), block["file"]
    # Different bytes, different checksums (none is a constant).
    assert len({b["crc32"] for b in blocks}) > len(blocks) // 2


def test_a_flipped_byte_changes_nothing(saved, tmp_path):
    """One byte flipped in the middle of a block file (same size, header
    intact, still a valid .npy of the right shape) is caught by its CRC-32
    before any variable is assigned."""
    path = str(tmp_path / "ckpt-4")
    shutil.copytree(saved["path"], path)
    info = manifest(path)
    # A sharded block of the last sharded variable in restore order: a
    # restore that assigned as it went would have changed the others.
    record = [r for r in info["variables"] if len(r["blocks"]) == 8][-1]
    name = record["blocks"][5]["file"]
    file = os.path.join(path, name)
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    assert os.path.getsize(file) == size
    assert np.load(file).shape == tuple(b - a for a, b in
                                        record["blocks"][5]["index"])
    model = build("data=2,model=4", seed=7)
    build_optimizer(model)
    before = state(model)
    with pytest.raises(ValueError) as error:
        checkpoint.restore_checkpoint(model, path)
    message = str(error.value)
    assert file in message and repr(record["key"]) in message
    assert "CRC-32" in message and "No variable was changed" in message
    assert_same_state(before, state(model))


def test_format_1_without_checksums_still_restores(saved, tmp_path):
    """A version-1 manifest (no crc32) is read, without the check, when
    asked for (allow_older_format=True)."""
    path = str(tmp_path / "ckpt-4")
    shutil.copytree(saved["path"], path)
    info = manifest(path)
    info["format_version"] = 1
    del info["manifest_crc32"]     # format 1 had none (nor block checksums)
    for record in info["variables"]:
        for block in record["blocks"]:
            del block["crc32"]
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(info, f)
    model = build("model=8", seed=7)
    with pytest.raises(ValueError, match="allow_older_format=True"):
        checkpoint.restore_checkpoint(model, path)
    assert checkpoint.restore_checkpoint(model, path,
                                         allow_older_format=True) == 4
    assert_same_state(saved["state"], state(model))
    info["format_version"] = 4
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(info, f)
    with pytest.raises(ValueError, match="format_version 4 is not one of"):
        checkpoint.restore_checkpoint(model, path, allow_older_format=True)


def test_restore_keeps_few_files_open(saved, tmp_path):
    """Restoring maps one variable's block files at a time: it works with
    fewer free file descriptors than the checkpoint has files."""
    files = len(os.listdir(saved["path"])) - 1          # 83 block files
    model = build("data=2,model=4", seed=7)
    build_optimizer(model)
    checkpoint.restore_checkpoint(model, saved["path"])  # warm every path
    model = build("data=2,model=4", seed=7)
    build_optimizer(model)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + files // 2
    assert limit < soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        step = checkpoint.restore_checkpoint(model, saved["path"])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert step == 4
    assert_same_state(saved["state"], state(model))


def test_bfloat16_round_trip(tmp_path):
    """bfloat16 blocks (stored by .npy as raw 2-byte items) restore as
    bfloat16 onto another mesh and into one device."""
    def bf16_mlp():
        return keras.Sequential(
            [keras.Input((16,)),
             keras.layers.Dense(32, name="up", dtype="bfloat16"),
             keras.layers.Dense(16, name="down", dtype="bfloat16")],
            name="mlp")

    keras.utils.set_random_seed(3)
    with strategy("model=8").scope():
        source = bf16_mlp()
        source.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    checkpoint.save_checkpoint(source, tmp_path, step=1)
    expected = [np.asarray(w) for w in source.get_weights()]
    assert expected[0].dtype.name == "bfloat16"
    keras.utils.set_random_seed(4)
    single = bf16_mlp()
    with strategy("data=2,model=4").scope():
        other = bf16_mlp()
    for model in (single, other):
        assert not np.array_equal(model.get_weights()[0], expected[0])
        assert checkpoint.restore_checkpoint(model, tmp_path,
                                             optimizer=False) == 1
        for want, got in zip(expected, model.get_weights()):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(want.view(np.uint16),
                                          np.asarray(got).view(np.uint16))


def test_long_variable_paths(tmp_path):
    """Keys longer than a file name may be are cut in the file names only."""
    keras.utils.set_random_seed(5)
    layer = "a" * 150 + "_up"
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(8, name=layer)],
                             name="b" * 120)
    path = checkpoint.save_checkpoint(model, tmp_path, optimizer=False, step=0)
    assert max(len(name) for name in os.listdir(path)) <= 255
    assert {r["key"] for r in manifest(path)["variables"]} == {
        f"{'b' * 120}/{layer}/kernel", f"{'b' * 120}/{layer}/bias"}
    expected = model.get_weights()
    model.set_weights([np.zeros_like(w) for w in expected])
    checkpoint.restore_checkpoint(model, path, optimizer=False)
    assert_same_state((expected,), (model.get_weights(),))


def _values(model):
    """{(kind, key): host array} of all a checkpoint of `model` holds."""
    return {(kind, key): np.asarray(variable) for kind, key, variable
            in checkpoint_keys.entries(model, True)}


def test_restore_assigns_one_variable_at_a_time(saved, monkeypatch):
    """After the checks, each variable is read and assigned before the next
    is read: no second copy of the whole model is staged."""
    expected = _values(saved["model"])
    model = build("data=2,model=4", seed=7)
    build_optimizer(model)
    before = _values(model)
    entries = checkpoint_keys.entries(model, True)
    order = {id(variable): n for n, (_, _, variable) in enumerate(entries)}
    original = checkpoint_blocks.assemble
    calls = []

    def spy(variable, record, opened):
        n = order[id(variable)]
        calls.append(n)
        if n > 0:   # the previous variable already holds its saved value
            kind, key, previous = entries[n - 1]
            np.testing.assert_array_equal(np.asarray(previous),
                                          expected[kind, key])
        kind, key, _ = entries[n]    # this one still holds its own
        np.testing.assert_array_equal(np.asarray(variable), before[kind, key])
        return original(variable, record, opened)

    monkeypatch.setattr(checkpoint_blocks, "assemble", spy)
    assert checkpoint.restore_checkpoint(model, saved["path"]) == 4
    assert calls == list(range(len(entries)))
    monkeypatch.undo()
    assert_same_state(saved["state"], state(model))


def test_failure_after_the_checks_says_how_far_it_got(saved, monkeypatch):
    model = build("model=8", seed=7)
    build_optimizer(model)
    total = len(checkpoint_keys.entries(model, True))
    original = checkpoint_files.open_blocks
    calls = []

    def vanish_third(path, record):
        calls.append(record["key"])
        if len(calls) == 3:
            raise ValueError(f"block file of {record['key']!r} is missing")
        return original(path, record)

    monkeypatch.setattr(checkpoint_files, "open_blocks", vanish_third)
    with pytest.raises(RuntimeError) as error:
        checkpoint.restore_checkpoint(model, saved["path"])
    message = str(error.value)
    assert f"failed at {calls[2]!r} after 2 of {total} variables" in message
    assert "restore it again" in message and saved["path"] in message


class _WithEmpty(keras.layers.Layer):
    """A layer with a zero-size weight next to a shardable one."""

    def build(self, input_shape):
        self.empty = self.add_weight(shape=(0, 4), name="empty")
        self.up = self.add_weight(shape=(16,), name="up_scale",
                                  initializer="random_normal")

    def call(self, x):
        return x * self.up


def test_zero_size_variables_round_trip(tmp_path):
    """A zero-size weight saves as one empty block and restores anywhere."""
    rules = {r".*up_scale": ("model",)}

    def build_on(mesh, seed):
        keras.utils.set_random_seed(seed)
        layers = [keras.Input((16,)), _WithEmpty(name="odd")]
        if mesh is None:
            return keras.Sequential(layers, name="e")
        with tfpar.ParallelStrategy(tfpar.Mesh(mesh), rules=rules).scope():
            return keras.Sequential(layers, name="e")

    source = build_on({"model": 8}, 1)
    checkpoint.save_checkpoint(source, tmp_path, optimizer=False, step=2)
    record = {r["key"]: r for r in manifest(tmp_path / "ckpt-2")["variables"]}
    assert record["e/odd/empty"]["blocks"][0]["index"] == [[0, 0], [0, 4]]
    assert len(record["e/odd/up_scale"]["blocks"]) == 8
    expected = source.get_weights()
    for mesh in ({"data": 2, "model": 4}, None):
        target = build_on(mesh, 2)
        assert not np.array_equal(target.get_weights()[1], expected[1])
        assert checkpoint.restore_checkpoint(target, tmp_path,
                                             optimizer=False) == 2
        assert_same_state((expected,), (target.get_weights(),))
