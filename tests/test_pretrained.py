"""Pretrained models loaded straight into shards (issue 37).

Rules from a builder (`tfpar.auto_rules(lambda: ...from_preset(path,
load_weights=False))`) make a strategy that creates every split weight
already split while keras-hub's `from_preset` runs in its scope: placement
is instrumented during the load (every host-to-device move, `dtensor.pack`
and `dtensor.copy_to_mesh`, is recorded) and no device tensor of a split
weight may have the weight's full shape. Hugging Face checkpoints go both
ways through keras-hub's name maps (`tfpar.pretrained`); bad checkpoints
are refused, naming the tensor, before any weight changes. Host memory of
a load is measured in a fresh process (tests/pretrained_child.py).

Default profile: a small Llama3 preset on model=8 (no full-shape device
tensor of a split weight, each device its block, weights equal, one
training step equal to one device's), the same preset and its HF
checkpoint loaded inside `tfpar.pretrained.deferred_init()` (every split
tensor read one device's block at a time) and a checkpoint missing a
tensor; the rest is slow (host memory in a fresh process, two hosts each
reading only their own devices' blocks).
"""

import json
import os
import shutil
import subprocess
import sys

import h5py
import keras
import keras_hub
import numpy as np
import pytest
from tensorflow.experimental import dtensor

import tfpar
from fuzzing import RTOL, relative_error
from h5_files import same_datasets
from models import assert_one_block_per_device
from test_hosts import run_two_hosts

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA = dict(vocabulary_size=96, num_layers=2, num_query_heads=8,
             num_key_value_heads=8, hidden_dim=64, intermediate_dim=128)


def llama3(**overrides):
    keras.utils.set_random_seed(0)
    return keras_hub.models.Llama3Backbone(**{**LLAMA, **overrides})


class DevicePlacements:
    """Every block shape a host value was put on devices with during the
    block: `dtensor.pack`'s components (one per device) and the value of
    `dtensor.copy_to_mesh` (whole on every device)."""

    def __init__(self, monkeypatch):
        self.shapes = []
        pack, copy = dtensor.pack, dtensor.copy_to_mesh

        def recording_pack(components, layout):
            self.shapes.extend(tuple(c.shape) for c in components)
            return pack(components, layout)

        def recording_copy(tensor, layout, *args, **kwargs):
            self.shapes.append(tuple(tensor.shape))
            return copy(tensor, layout, *args, **kwargs)

        monkeypatch.setattr(dtensor, "pack", recording_pack)
        monkeypatch.setattr(dtensor, "copy_to_mesh", recording_copy)

    def whole_split_weights(self, strategy):
        """Paths of split weights some device received whole (shapes that
        a replicated weight also has cannot be told apart: left out)."""
        split = {path: spec for path, spec, _ in strategy.placements()
                 if any(spec)}
        assert split, "the rules split no weight"
        shapes = {path: tuple(v.shape) for path, v in strategy.variables()}
        replicated = {shapes[p] for p, spec, _ in strategy.placements()
                      if not any(spec)}
        checked = {p for p in split if shapes[p] not in replicated}
        assert len(checked) >= len(split) - 2, (split, replicated)
        return sorted(p for p in checked if shapes[p] in set(self.shapes))


def token_batch(hidden, batch=8, seq=8):
    rng = np.random.default_rng(1)
    x = {"token_ids": rng.integers(0, LLAMA["vocabulary_size"],
                                   (batch, seq)).astype("int32"),
         "padding_mask": np.ones((batch, seq), "int32")}
    return x, rng.normal(size=(batch, seq, hidden)).astype("float32")


def one_step(backbone, x, y):
    """(loss, weights) after one SGD step on (x, y)."""
    backbone.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    loss = backbone.fit(x, y, batch_size=len(y), epochs=1, verbose=0,
                        shuffle=False).history["loss"][0]
    return loss, [np.asarray(w) for w in backbone.weights]


def test_llama3_preset_loads_split_with_rules_from_a_builder(
        tmp_path, monkeypatch):
    """model=8: rules planned from a weightless build of the preset; the
    load in the strategy's scope puts no split weight whole on a device
    (the naive route, rules applied after the load, does: the detector
    works), each device holds its block, weights equal the preset's, and
    one training step equals one device's."""
    original = llama3()
    preset = str(tmp_path / "preset")
    original.save_to_preset(preset)
    mesh = tfpar.Mesh({"model": 8})

    def build():
        return keras_hub.models.Llama3Backbone.from_preset(
            preset, load_weights=False)

    rules = tfpar.auto_rules(build, mesh=mesh)
    with monkeypatch.context() as patch:
        placed = DevicePlacements(patch)
        strategy = tfpar.ParallelStrategy(mesh, rules=rules)
        with strategy.scope():
            loaded = keras_hub.models.Llama3Backbone.from_preset(preset)
        assert placed.whole_split_weights(strategy) == []
    with monkeypatch.context() as patch:
        naive_placed = DevicePlacements(patch)
        naive = tfpar.ParallelStrategy(mesh)
        with naive.scope():
            model = keras_hub.models.Llama3Backbone.from_preset(preset)
            naive.apply_rules(model, tfpar.auto_rules(model, mesh=mesh))
        assert len(naive_placed.whole_split_weights(naive)) > 10
    weights = {w.path: w for w in loaded.weights}
    for path, spec, _ in strategy.placements():
        if any(spec):
            assert_one_block_per_device(weights[path], spec)
    for want, got in zip(original.weights, loaded.weights):
        assert want.path == got.path
        np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
    x, y = token_batch(LLAMA["hidden_dim"])
    want_loss, want_weights = one_step(original, x, y)
    with strategy.scope():
        got_loss, got_weights = one_step(loaded, x, y)
    assert relative_error(want_loss, got_loss) < RTOL
    for want, got in zip(want_weights, got_weights):
        assert relative_error(want, got) < RTOL


def test_missing_tensor_is_named_before_any_weight_changes(tmp_path):
    """A Hugging Face checkpoint lacking one tensor: ValueError naming it,
    and every weight of the model as it was (the check reads headers)."""
    source = llama3()
    path = str(tmp_path / "hf")
    tfpar.pretrained.export_to_transformers(source, path)
    drop_tensor(path, "model.layers.1.mlp.up_proj.weight")
    target = llama3()
    target.set_weights([np.zeros_like(w) for w in target.get_weights()])
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj"
                       r"\.weight' is missing"):
        tfpar.pretrained.load_weights(target, path)
    assert all(not np.any(w) for w in target.get_weights())
    restored = llama3()
    tfpar.pretrained.export_to_transformers(source, path)
    tfpar.pretrained.load_weights(restored, path)
    for want, got in zip(source.weights, restored.weights):
        np.testing.assert_array_equal(np.asarray(want), np.asarray(got))


def rewrite_checkpoint(path, change):
    """Rewrites the single-file checkpoint at `path` with `change(name,
    array)` -> array (or None: dropped) applied to every tensor."""
    ckpt = tfpar.safetensors_io.SafetensorsCheckpoint(path)
    arrays = {name: ckpt.get_tensor(name) for name in ckpt.keys()}
    os.remove(os.path.join(path, "model.safetensors"))
    entries = []
    for name, array in arrays.items():
        array = change(name, array)
        if array is not None:
            entries.append((name, array.shape, array.dtype,
                            lambda a=array: a))
    tfpar.safetensors_io.write_checkpoint(path, entries)


def drop_tensor(path, dropped):
    rewrite_checkpoint(path, lambda name, a: None if name == dropped else a)


# -- slow: more cases ----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    (lambda name, a: a[:-8] if name.endswith("gate_proj.weight") else a,
     r"'model\.layers\.0\.mlp\.gate_proj\.weight'.*\(120, 64\)"),
    (lambda name, a: a.astype("int32") if name == "model.norm.weight" else a,
     r"'model\.norm\.weight'.*int32, not a float"),
])
def test_shape_or_dtype_mismatch_is_named(tmp_path, change, message):
    path = str(tmp_path / "hf")
    tfpar.pretrained.export_to_transformers(llama3(), path)
    rewrite_checkpoint(path, change)
    target = llama3()
    before = target.get_weights()
    with pytest.raises(ValueError, match=message):
        tfpar.pretrained.load_weights(target, path)
    for want, got in zip(before, target.get_weights()):
        np.testing.assert_array_equal(want, got)


@pytest.mark.slow
def test_config_not_matching_the_builder_is_named(tmp_path):
    """A checkpoint of hidden_dim 64 into a model of intermediate 256; a
    keras preset of another width: the config entry / tensors named."""
    path = str(tmp_path / "hf")
    tfpar.pretrained.export_to_transformers(llama3(), path)
    with pytest.raises(ValueError, match=r"intermediate_dim=128 but model"):
        tfpar.pretrained.load_weights(llama3(intermediate_dim=256), path)
    preset = str(tmp_path / "preset")
    llama3().save_to_preset(preset)
    with pytest.raises(ValueError, match=r"intermediate_dim=128 but model"):
        tfpar.pretrained.check_checkpoint(llama3(intermediate_dim=256), preset)
    weights = os.path.join(preset, "model.weights.h5")
    with pytest.raises(ValueError, match=r"ffn|feedforward.*has shape "
                       r"\(64, 128\) but weight"):
        tfpar.pretrained.check_checkpoint(llama3(intermediate_dim=256),
                                          weights)


@pytest.mark.slow
def test_unnamed_functional_model_builds_again_with_the_same_paths():
    """Layers named by Keras' counters (dense, dense_1, ...): the rules of
    the weightless build match the build in the scope (its names given
    back), and every split weight is created split."""
    def build():
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        hidden = keras.layers.Dense(16)(hidden)
        return keras.Model(inputs, keras.layers.Dense(4)(hidden))

    mesh = tfpar.Mesh({"data": 2, "model": 4})
    rules = tfpar.auto_rules(build, mesh=mesh)
    assert len(rules) == 2
    strategy = tfpar.ParallelStrategy(mesh, rules=rules)
    with strategy.scope():
        model = build()
        model.compile(optimizer="sgd", loss="mse")  # checks every rule matched
    specs = {path: spec for path, spec, _ in strategy.placements()}
    kernels = [w.path for w in model.weights if w.path.endswith("kernel")]
    assert [specs[p] for p in kernels] == [(None, "model"), ("model", None),
                                           (None, None)]


@pytest.mark.slow
def test_plan_of_a_builder_gives_a_strategy_with_its_rules(tmp_path):
    """tfpar.plan(builder) then plan.strategy(): the strategy carries the
    plan's rules, and the builder run in its scope creates the weights
    laid out by them; plan.apply changes nothing more."""
    preset = str(tmp_path / "preset")
    llama3().save_to_preset(preset)

    def build():
        return keras_hub.models.Llama3Backbone.from_preset(
            preset, load_weights=False)

    plan = tfpar.plan(build, global_batch_size=8, memory_per_device=4e5,
                      check=False, sequence_length=8)
    strategy = plan.strategy()
    assert dict(strategy.rules.items()).keys() == dict(plan.rules.items()).keys()
    assert plan.axes.get("model", 1) > 1, plan.axes
    with strategy.scope():
        model = keras_hub.models.Llama3Backbone.from_preset(preset)
        before = [(p, spec) for p, spec, _ in strategy.placements()]
        plan.apply(model)
    assert [(p, spec) for p, spec, _ in strategy.placements()] == before
    # split over the model axis by a rule (fsdp splits every weight over
    # data as well)
    split = [p for p, spec in before if "model" in spec]
    assert len(split) == len(plan.rules) + 1, split  # + reverse embeddings


HF_FAMILIES = {
    "llama3": lambda: keras_hub.models.Llama3CausalLM(
        llama3(), preprocessor=None),
    "llama3_backbone": llama3,
    "gemma": lambda: _hub("gemma"),
    "mistral": lambda: _hub("mistral"),
    "gpt2": lambda: _hub("gpt2"),
}


def _hub(name):
    import hub_models  # noqa: PLC0415 (tests' helper)

    keras.utils.set_random_seed(0)
    return hub_models.build(name)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(HF_FAMILIES))
def test_transformers_round_trip_on_model_8(tmp_path, family):
    """One device's model exported to a Hugging Face checkpoint (sharded
    files + index), loaded on model=8 with rules from a builder (no split
    weight whole on a device), weights and logits equal one device's;
    exported again from the sharded model: the same tensors."""
    source = HF_FAMILIES[family]()
    backbone = getattr(source, "backbone", source)
    first = str(tmp_path / "first")
    files = tfpar.pretrained.export_to_transformers(
        source, first, max_shard_bytes=backbone.count_params())
    assert len(files) > 1
    mesh = tfpar.Mesh({"model": 8})

    def build():
        return tfpar.pretrained.transformers_backbone(first)

    strategy = tfpar.ParallelStrategy(
        mesh, rules=tfpar.auto_rules(build, mesh=mesh))
    with strategy.scope():
        loaded = build()
        tfpar.pretrained.load_weights(loaded, first)
    for want, got in zip(backbone.weights, loaded.weights):
        np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
    x = {"token_ids": np.arange(16, dtype="int32").reshape(2, 8) % 60,
         "padding_mask": np.ones((2, 8), "int32")}
    want = np.asarray(backbone(x))
    with strategy.scope():
        got = np.asarray(loaded(x))
    assert relative_error(want, got) < RTOL
    again = str(tmp_path / "again")
    tfpar.pretrained.export_to_transformers(
        loaded if source is backbone else type(source)(loaded,
                                                       preprocessor=None),
        again)
    a = tfpar.safetensors_io.SafetensorsCheckpoint(first)
    b = tfpar.safetensors_io.SafetensorsCheckpoint(again)
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        np.testing.assert_array_equal(a.get_tensor(name), b.get_tensor(name))


def test_deferred_init_writes_each_device_block_from_the_file(
        tmp_path, monkeypatch):
    """model=8, inside `tfpar.pretrained.deferred_init()`: a preset
    (.weights.h5) and an HF checkpoint (safetensors) load with every split
    tensor read block by block (each read 1/8 of it, h5py selections and
    safetensors boxes), no split weight whole on a device, weights equal
    the original's; a model built in the block and never loaded gets its
    initializers' values (equal to a build outside the block)."""
    original = llama3()
    preset, hf = str(tmp_path / "preset"), str(tmp_path / "hf")
    original.save_to_preset(preset)
    tfpar.pretrained.export_to_transformers(original, hf)
    mesh = tfpar.Mesh({"model": 8})
    reads = []
    get_block = tfpar.safetensors_io.SafetensorsCheckpoint.get_block
    h5_read = h5py.Dataset.__getitem__
    monkeypatch.setattr(
        tfpar.safetensors_io.SafetensorsCheckpoint, "get_block",
        lambda self, name, box: reads.append((self.shape(name), box))
        or get_block(self, name, box))
    monkeypatch.setattr(
        h5py.Dataset, "__getitem__", lambda self, index: reads.append(
            (self.shape, [s.indices(n)[:2] if isinstance(s, slice) else
                          (0, n) for s, n in zip(index, self.shape)]))
        or h5_read(self, index))
    for path, build in (
            (preset, lambda: keras_hub.models.Llama3Backbone.from_preset(
                preset, load_weights=False)),
            (hf, lambda: tfpar.pretrained.transformers_backbone(hf))):
        strategy = tfpar.ParallelStrategy(
            mesh, rules=tfpar.auto_rules(build, mesh=mesh))
        del reads[:]
        with monkeypatch.context() as patch:
            placed = DevicePlacements(patch)
            with strategy.scope(), tfpar.pretrained.deferred_init():
                loaded = build()
                tfpar.pretrained.load_weights(loaded, path)
            assert placed.whole_split_weights(strategy) == [], path
        for want, got in zip(original.weights, loaded.weights):
            np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
        split = [(shape, box) for shape, box in reads if len(shape) > 1]
        assert len(split) >= 8 * 10, (path, len(split))
        for shape, box in split:  # each read one device's block
            assert np.prod([b - a for a, b in box]) * 8 == np.prod(shape), \
                (path, shape, box)
    with strategy.scope(), tfpar.pretrained.deferred_init():
        unloaded = llama3()  # nothing assigns: initializers' values
    for want, got in zip(original.weights, unloaded.weights):
        np.testing.assert_array_equal(np.asarray(want), np.asarray(got))


def run_child(*args):
    result = subprocess.run(
        [sys.executable, os.path.join(HERE, "pretrained_child.py"), *args],
        capture_output=True, text=True, timeout=1800,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(HERE), HERE])})
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("size", ["150m"])  # smaller: TF's own ~0.1 GB dominates
def test_load_memory_in_a_fresh_process(tmp_path, size):
    """A Llama3 preset and its HF checkpoint loaded on model=8 with rules
    from a builder inside `tfpar.pretrained.deferred_init()`, in a fresh
    process: each device ~1/8 of the weights (<= 0.25x the checkpoint),
    weights equal, a step runs, the preset exports equal, and the peak
    resident growth is at most the issue's 1.6x of the checkpoint
    (2026-12-05, 148M parameters: 1.23x preset, 1.24x HF); the control,
    the same rules without `deferred_init` (random initial values drawn
    on the host first), grows more: 1.56x (1.70x when whole tensors were
    also read, before block reads)."""
    run_child("make", size, str(tmp_path))
    growth = {}
    for fmt, route in (("preset", "rules"), ("hf", "rules"),
                       ("preset", "rules_random")):
        out = str(tmp_path / f"{fmt}_{route}.json")
        run_child("load", size, str(tmp_path), fmt, route, "model=8", out)
        with open(out) as f:
            r = json.load(f)
        assert r["weights_equal"] and np.isfinite(r["step_loss"]), r
        assert r["per_device_bytes"] <= 0.25 * r["checkpoint_bytes"], r
        assert r.get("export_equal", True), r
        growth[f"{fmt} {route}"] = round(r["growth"] / r["checkpoint_bytes"], 3)
    assert max(growth["preset rules"], growth["hf rules"]) <= 1.6, \
        f"peak growth over the checkpoint's bytes: {growth}"
    assert growth["preset rules_random"] > growth["preset rules"], growth


@pytest.mark.slow
def test_keras_hub_converter_bugs_still_reproduce():
    """The four keras-hub 0.32 bugs tfpar works around still happen
    (tests/keras_hub_hf_converters_repro.py): once one prints "ok", its
    workaround in tfpar/pretrained.py can go."""
    result = subprocess.run(
        [sys.executable, os.path.join(HERE, "keras_hub_hf_converters_repro.py")],
        capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stdout.splitlines()
             if line.startswith(("BUG", "ok"))]
    assert len(lines) == 4 and all(line.startswith("BUG") for line in lines), \
        result.stdout + result.stderr[-2000:]


def _elements(box):
    return int(np.prod([b - a for a, b in box]))


def _overlap(a, b):
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


@pytest.mark.slow  # two TF processes
def test_two_hosts_each_read_only_their_own_devices_blocks(tmp_path):
    """A Llama3 preset (.weights.h5) and HF checkpoint (safetensors) loaded
    on model=8 over two hosts of 4 devices (tests/pretrained_hosts_child.py):
    every device's block equals one device's weights; every 2-D+ tensor
    (all split by the rules) is read in blocks, the two hosts' blocks
    never overlap and each host's cover half the tensor (its 4 devices'
    blocks), so no host reads a block of a device it does not own; whole
    reads are of the replicated 1-D norm scales only."""
    run_child("make", "small", str(tmp_path))
    run_two_hosts(os.path.join(HERE, "pretrained_hosts_child.py"), tmp_path)
    want = {w.path: w.numpy() for w in keras_hub.models.Llama3Backbone
            .from_preset(str(tmp_path / "preset")).weights}
    for fmt in ("preset", "hf"):
        hosts = []
        for i in range(2):
            with open(tmp_path / f"host{i}_{fmt}.json") as f:
                hosts.append(json.load(f))
        for host in hosts:
            assert host["weights"].keys() == want.keys()
            for path, entry in host["weights"].items():
                for location, block in entry["blocks"]:
                    index = tfpar.placement.block_index(
                        want[path].shape, entry["spec"], {"model": 8},
                        location)
                    np.testing.assert_array_equal(
                        np.asarray(block, want[path].dtype),
                        want[path][index], err_msg=f"{fmt} {path}")
        shapes = {}  # each tensor's shape: the ends of the boxes read
        for host in hosts:
            for name, box in host["reads"]:
                shapes[name] = [max(b, end) for b, (_, end) in zip(
                    shapes.get(name, [0] * len(box)), box)]
        for name, shape in shapes.items():
            per_host = [[box for n, box in host["reads"] if n == name]
                        for host in hosts]
            whole = [[0, n] for n in shape]
            if len(shape) == 1:  # a replicated norm scale: read whole
                assert all(boxes == [whole] for boxes in per_host), name
                continue
            for boxes in per_host:
                assert whole not in boxes, (fmt, name, "read whole")
                assert sum(map(_elements, boxes)) == _elements(whole) // 2, \
                    (fmt, name, boxes)
            assert not any(_overlap(a, b) for a in per_host[0]
                           for b in per_host[1]), (fmt, name, per_host)


def assert_same_transformers_checkpoint(first, second):
    a = tfpar.safetensors_io.SafetensorsCheckpoint(first)
    b = tfpar.safetensors_io.SafetensorsCheckpoint(second)
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        np.testing.assert_array_equal(a.get_tensor(name), b.get_tensor(name),
                                      err_msg=name)


@pytest.mark.parametrize("axes", [
    {"data": 8},
    pytest.param({"data": 2, "model": 4}, marks=pytest.mark.slow),
], ids=["data=8", "data=2,model=4"])
def test_fsdp_loads_each_device_block_and_exports_back(
        tmp_path, monkeypatch, axes):
    """fsdp=True (every trainable weight also split over the data axis),
    rules from a builder, in `deferred_init()`: a preset and an HF
    checkpoint load with no split weight whole on a device, each device
    holding only its fsdp block, weights equal the saved ones; the sharded
    model exports back to a preset / checkpoint equal to the original, and
    one training step (of the HF load's model) equals one device's."""
    original = llama3()
    preset, hf = str(tmp_path / "preset"), str(tmp_path / "hf")
    original.save_to_preset(preset)
    tfpar.pretrained.export_to_transformers(original, hf)
    mesh = tfpar.Mesh(axes)
    x, y = token_batch(LLAMA["hidden_dim"])
    want_loss, want_weights = one_step(llama3(), x, y)
    for path, build in (
            (preset, lambda: keras_hub.models.Llama3Backbone.from_preset(
                preset, load_weights=False)),
            (hf, lambda: tfpar.pretrained.transformers_backbone(hf))):
        strategy = tfpar.ParallelStrategy(
            mesh, rules=tfpar.auto_rules(build, mesh=mesh), fsdp=True)
        with monkeypatch.context() as patch:
            placed = DevicePlacements(patch)
            with strategy.scope(), tfpar.pretrained.deferred_init():
                loaded = build()
                tfpar.pretrained.load_weights(loaded, path)
            assert placed.whole_split_weights(strategy) == [], path
        specs = {p: spec for p, spec, _ in strategy.placements()}
        assert all("data" in spec for spec in specs.values()), specs
        assert len(placed.shapes) >= 8 * len(specs), path  # the load seen
        for want, got in zip(original.weights, loaded.weights):
            assert want.path == got.path
            np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
            assert_one_block_per_device(got, specs[got.path])
        again = str(tmp_path / "again")
        if path == preset:
            loaded.save_to_preset(again)
            assert same_datasets(os.path.join(preset, "model.weights.h5"),
                                 os.path.join(again, "model.weights.h5"))
        else:
            tfpar.pretrained.export_to_transformers(loaded, again)
            assert_same_transformers_checkpoint(hf, again)
        shutil.rmtree(again)
    with strategy.scope():  # the HF load's model (the preset's: weights equal)
        got_loss, got_weights = one_step(loaded, x, y)
    assert relative_error(want_loss, got_loss) < RTOL
    for want, got in zip(want_weights, got_weights):
        assert relative_error(want, got) < RTOL
