"""Checkpoint hardening (issue 38, item 4 and the `step` half of item 5).

One test per promise, each on a small data=2 x model=4 MLP whose weights
are set to a recognisable "version" before every save, and each ending by
restoring the previous good checkpoint bit for bit:

* a re-save of an existing step crashing between any two of its renames
  (simulated: an exception raised at that point) leaves a complete
  checkpoint, the new one, and the next save finishes the interrupted one;
* two views of the directory (host 0 sees step 8, a host with a stale copy
  only step 4): that host restores host 0's step or fails clearly;
* a FIFO or a device in place of a block, the manifest or the pointer is
  refused, not waited on;
* every malformed manifest is a ValueError; an edited one is caught by its
  own checksum, also when the edit says format_version 1;
* `max_to_keep`, stale `ckpt-N.tmp-<pid>` of dead processes cleaned at the
  next save (a live process's kept);
* hosts' block records checked before merging;
* `step` not an int >= 0: a ValueError naming it.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import zlib

import keras
import numpy as np
import pytest

import tfpar
from tfpar import checkpoint
from tfpar import launch
from tfpar.checkpoint import api as checkpoint_api
from tfpar.checkpoint import directory as checkpoint_directory
from tfpar.checkpoint import manifest as checkpoint_manifest

RULES = {r".*up/kernel": (None, "model"), r".*down/kernel": ("model", None)}
_STRATEGY = []


def build():
    if not _STRATEGY:
        _STRATEGY.append(tfpar.ParallelStrategy(
            tfpar.Mesh({"data": 2, "model": 4}), rules=RULES))
    with _STRATEGY[0].scope():
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(8, name="up"),
                                  keras.layers.Dense(4, name="down")],
                                 name="hard")
    return model


def versioned(version):
    """Weights that say which save they are: arange + 1000 * version."""
    return [np.arange(w.size, dtype="float32").reshape(w.shape)
            + 1000.0 * version for w in build_shapes()]


def build_shapes():
    return [np.zeros((4, 8)), np.zeros((8,)), np.zeros((8, 4)), np.zeros(4)]


@pytest.fixture(scope="module")
def model():
    return build()


def save(model, root, version, step, **kwargs):
    model.set_weights(versioned(version))
    return checkpoint.save_checkpoint(model, root, optimizer=False,
                                      step=step, **kwargs)


def restored_version(model, path, **kwargs):
    """Restores `path` into `model` and returns the saved version."""
    model.set_weights(versioned(-1))
    step = checkpoint.restore_checkpoint(model, path, optimizer=False,
                                         **kwargs)
    weights = model.get_weights()
    version = int(round(float(weights[0].flat[0]) / 1000.0))
    for got, want in zip(weights, versioned(version)):
        np.testing.assert_array_equal(got, want)
    return step, version


def assert_unchanged(model):
    for got, want in zip(model.get_weights(), versioned(-1)):
        np.testing.assert_array_equal(got, want)


class Crash(BaseException):
    """A process dying at this point (nothing after it runs)."""


# -- re-saving a step: a crash between any two renames ---------------------

@pytest.mark.parametrize("crash_after", [
    "commit pointer", "old moved away", "new renamed", "final pointer"])
def test_resave_crashing_between_renames_keeps_a_checkpoint(
        model, tmp_path, monkeypatch, crash_after):
    root = str(tmp_path)
    save(model, root, version=1, step=4)
    save(model, root, version=2, step=8)
    real_rename, real_point = os.rename, checkpoint_directory._point_at
    events = []

    def rename(src, dst):
        real_rename(src, dst)
        events.append("old moved away" if dst.endswith(
            f".old-{os.getpid()}") else "new renamed")
        if events[-1] == crash_after:
            raise Crash

    def point_at(directory, name, step):
        real_point(directory, name, step)
        events.append("commit pointer" if ".tmp-" in name
                      else "final pointer")
        if events[-1] == crash_after:
            raise Crash

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(checkpoint_directory, "_point_at", point_at)
    with pytest.raises(Crash):
        save(model, root, version=3, step=8)        # re-save of step 8
    monkeypatch.undo()
    # Whatever the crash point: the latest checkpoint is complete, and it
    # is the new step 8 (committed by the pointer before the old went).
    latest = checkpoint.latest_checkpoint(root)
    assert restored_version(model, latest) == (8, 3), (crash_after, latest)
    assert restored_version(model, root) == (8, 3)
    assert restored_version(model, os.path.join(root, "ckpt-4")) == (4, 1)
    # The next save (another process: this one is now "gone") finishes the
    # interrupted publish and removes its leftovers.
    monkeypatch.setattr(checkpoint_directory, "_pid_is_gone",
                        lambda pid: True)
    save(model, root, version=4, step=12)
    assert sorted(os.listdir(root)) == ["checkpoint", "ckpt-12", "ckpt-4",
                                        "ckpt-8"]
    assert restored_version(model, root, step=8) == (8, 3)
    assert restored_version(model, root) == (12, 4)


def test_resave_keeps_the_name_and_replaces_the_contents(model, tmp_path):
    first = save(model, tmp_path, version=1, step=3)
    assert save(model, tmp_path, version=2, step=3) == first
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-3"]
    assert restored_version(model, tmp_path) == (3, 2)


# -- two views of the directory ------------------------------------------

class _Host1:
    """dtensor as host 1 of 2 sees it (for `checkpoint.api` only)."""

    @staticmethod
    def num_clients():
        return 2

    @staticmethod
    def client_id():
        return 1


class _Placement:
    """The collectives of a 2-host job, host 0's values given."""

    def __init__(self, host0_choice):
        self.host0_choice = host0_choice

    def same_on_every_host(self, value):
        return np.asarray(self.host0_choice, np.int64)

    @staticmethod
    def sum_over_hosts(value):
        return np.asarray(value)


def test_every_host_restores_the_step_host0_chose(model, tmp_path,
                                                  monkeypatch):
    """Host 0 sees steps 4 and 8 (latest 8); host 1's view is stale (its
    pointer names step 4). Host 1 restores step 8, not its own latest; a
    host that cannot see host 0's checkpoint, or sees another one under the
    same name, fails clearly and changes nothing."""
    host0, host1 = tmp_path / "host0", tmp_path / "host1"
    save(model, host0, version=1, step=4)
    save(model, host1, version=1, step=4)
    chosen = save(model, host0, version=2, step=8)
    choice = [8, checkpoint_directory.manifest_crc32(chosen)]
    # Host 1's copy of ckpt-8 arrived, its pointer was not updated.
    shutil.copytree(chosen, host1 / "ckpt-8")
    assert checkpoint.latest_checkpoint(host1).endswith("ckpt-4")
    monkeypatch.setattr(checkpoint_api, "dtensor", _Host1)
    monkeypatch.setattr(checkpoint_api, "placement", _Placement(choice))
    assert restored_version(model, host1) == (8, 2)
    # A view without step 8: a clear error, nothing changed.
    shutil.rmtree(host1 / "ckpt-8")
    model.set_weights(versioned(-1))
    with pytest.raises(FileNotFoundError,
                       match=r"No complete checkpoint of step 8 as host 0 "
                             r"chose it .* the latest here is .*ckpt-4"):
        checkpoint.restore_checkpoint(model, host1, optimizer=False)
    assert_unchanged(model)
    # Another ckpt-8 (different bytes) under the same name: refused too.
    monkeypatch.undo()
    save(model, host1, version=5, step=8)
    monkeypatch.setattr(checkpoint_api, "dtensor", _Host1)
    monkeypatch.setattr(checkpoint_api, "placement", _Placement(choice))
    model.set_weights(versioned(-1))
    with pytest.raises(FileNotFoundError, match="has a different manifest"):
        checkpoint.restore_checkpoint(model, host1, optimizer=False)
    assert_unchanged(model)
    monkeypatch.undo()
    assert restored_version(model, host0, step=4) == (4, 1)


@pytest.mark.slow
def test_two_hosts_with_different_views_restore_host0s_choice(tmp_path):
    """A real two-host job (two processes, `tfpar.connect_hosts`): host 1's
    copy of the directory is stale (pointer at step 4); both restore step
    8, host 0's choice. Without ckpt-8 in host 1's copy, both raise (host 1
    naming the step, host 0 pointing at host 1) and nothing changes."""
    child = os.path.join(os.path.dirname(__file__), "checkpoint_crash_child.py")
    addresses = ",".join(f"localhost:{p}" for p in launch.free_ports(2))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTENSOR_")}
    env.update(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(
                   [os.path.dirname(__file__)] + sys.path))
    processes = [subprocess.Popen(
        [sys.executable, child, "hosts", str(i), addresses, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for i in range(2)]
    try:
        outputs = [p.communicate(timeout=400)[0] for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    first, second = (json.loads((tmp_path / f"host{i}.json").read_text())
                     for i in range(2))
    assert first["own_latest"].endswith("shared/ckpt-8")
    assert second["own_latest"].endswith("view1/ckpt-4")
    for host in (first, second):
        assert host["step"] == 8 and host["weights_are_v2"]
        assert host["unchanged"]
    assert second["failed"].startswith(
        "FileNotFoundError: No complete checkpoint of step 8 as host 0 chose")
    assert first["failed"].startswith(
        "RuntimeError: restore_checkpoint failed on another host while "
        "reading the checkpoint")


def test_hosts_records_must_describe_the_same_variables(tmp_path):
    """Host 0 checks every host's block records before merging."""
    record = {"kind": "params", "key": "m/w", "path": "m/w", "shape": [4, 2],
              "dtype": "float32", "spec": ["model", None]}

    def write(host, records):
        (tmp_path / f"host{host}.json").write_text(json.dumps(records))

    def half(start, device):
        return dict(record, blocks=[{"file": f"v0000_m_w.b{device}.npy",
                                     "index": [[start, start + 2], [0, 2]],
                                     "crc32": 1}])

    write(0, [half(0, 0)])
    write(1, [half(2, 4)])
    merged = checkpoint_api._merge_host_records(str(tmp_path), 2)
    assert [b["index"] for b in merged[0]["blocks"]] == [[[0, 2], [0, 2]],
                                                         [[2, 4], [0, 2]]]
    for other, message in (
            ([], "host 1 saved 0 variables and host 0 1"),
            ([dict(half(2, 4), shape=[4, 3])], r"differ at \['m/w'\]"),
            ([dict(half(2, 4), key="m/v")], r"differ at \['m/w'\]")):
        write(0, [half(0, 0)])
        write(1, other)
        with pytest.raises(ValueError, match=message):
            checkpoint_api._merge_host_records(str(tmp_path), 2)
    write(0, [half(0, 0)])
    write(1, [half(0, 4)])          # both hosts claim rows 0-2
    with pytest.raises(ValueError, match="overlap"):
        checkpoint_api._merge_host_records(str(tmp_path), 2)


# -- only regular files ----------------------------------------------------

@pytest.fixture
def alarm():
    """Fails a test that hangs (a FIFO read) instead of hanging the run."""
    def timeout(*_):
        raise AssertionError("restore hung on a non-regular file")
    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("what", ["block FIFO", "block device", "manifest FIFO",
                                  "pointer FIFO"])
def test_a_fifo_or_device_is_refused_not_waited_on(model, tmp_path, alarm,
                                                   what):
    good = save(model, tmp_path, version=1, step=4)
    path = save(model, tmp_path, version=2, step=8)
    info = json.loads(open(os.path.join(path, "manifest.json")).read())
    block = os.path.join(path, info["variables"][-1]["blocks"][0]["file"])
    target = {"block FIFO": block, "block device": block,
              "manifest FIFO": os.path.join(path, "manifest.json"),
              "pointer FIFO": os.path.join(tmp_path, "checkpoint")}[what]
    os.remove(target)
    if what == "block device":
        os.symlink("/dev/zero", target)
    else:
        os.mkfifo(target)
    model.set_weights(versioned(-1))
    if what == "pointer FIFO":   # the pointer is a hint: the scan decides
        assert checkpoint.latest_checkpoint(tmp_path) == path
        assert restored_version(model, tmp_path) == (8, 2)
        return
    for where in (path, tmp_path):   # the checkpoint, or the root's latest
        with pytest.raises(ValueError, match="is not a regular file"):
            checkpoint.restore_checkpoint(model, where, optimizer=False)
        assert_unchanged(model)
    assert restored_version(model, good) == (4, 1)


# -- malformed and edited manifests ----------------------------------------

def _reseal(info):
    """The bytes tfpar would write for `info` (a valid manifest checksum),
    so that the structure checks behind the checksum are reached."""
    return checkpoint_manifest.encode(info)


MALFORMED = {
    "step Infinity": lambda text, info: text.replace('"step": 8',
                                                     '"step": Infinity'),
    "step NaN": lambda text, info: text.replace('"step": 8', '"step": NaN'),
    "step 1e400": lambda text, info: text.replace('"step": 8',
                                                  '"step": 1e400'),
    "deep nesting": lambda text, info: text.replace(
        '"step": 8', '"step": ' + "[" * 100000 + "]" * 100000),
    "not JSON": lambda text, info: text[: len(text) // 2],
    "binary": lambda text, info: "\xff\xfe\x00garbage",
    "a list": lambda text, info: "[1, 2, 3]",
    "step -1": lambda text, info: _reseal(dict(info, step=-1)),
    "step '8'": lambda text, info: _reseal(dict(info, step="8")),
    "step true": lambda text, info: _reseal(dict(info, step=True)),
    "step 8.0": lambda text, info: _reseal(dict(info, step=8.0)),
    "variables null": lambda text, info: _reseal(dict(info, variables=None)),
    "shape float": lambda text, info: _reseal(_edit_record(
        info, shape=[4.0, 8])),
    "shape huge": lambda text, info: _reseal(_edit_record(
        info, shape=[10**400, 8])),
    "index strings": lambda text, info: _reseal(_edit_block(
        info, index=[["0", "4"], [0, 8]])),
    "index 3 numbers": lambda text, info: _reseal(_edit_block(
        info, index=[[0, 4, 5], [0, 8]])),
    "blocks a dict": lambda text, info: _reseal(_edit_record(
        info, blocks={"a": 1})),
    "file '..'": lambda text, info: _reseal(_edit_block(info, file="..")),
    "record a list": lambda text, info: _reseal(dict(
        info, variables=[[1, 2]])),
    "crc32 float": lambda text, info: _reseal(_edit_block(info, crc32=1.5)),
}


def _edit_record(info, **fields):
    info = json.loads(json.dumps(info))
    info["variables"][0].update(fields)
    return info


def _edit_block(info, **fields):
    info = json.loads(json.dumps(info))
    info["variables"][0]["blocks"][0].update(fields)
    return info


@pytest.fixture(scope="module")
def saved_pair(model, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pair"))
    good = save(model, root, version=1, step=4)
    path = save(model, root, version=2, step=8)
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        data = f.read()
    return good, path, data


@pytest.mark.parametrize("how", list(MALFORMED))
def test_every_malformed_manifest_is_a_value_error(model, saved_pair, how):
    good, path, data = saved_pair
    info = json.loads(data)
    damaged = MALFORMED[how](data.decode(), info)
    file = os.path.join(path, "manifest.json")
    try:
        with open(file, "wb") as f:
            f.write(damaged if isinstance(damaged, bytes)
                    else damaged.encode("utf-8", "surrogateescape"))
        model.set_weights(versioned(-1))
        with pytest.raises(ValueError, match="manifest.json"):
            checkpoint.restore_checkpoint(model, path, optimizer=False)
        assert_unchanged(model)
        assert restored_version(model, good) == (4, 1)
    finally:
        with open(file, "wb") as f:
            f.write(data)


def test_random_edits_of_a_manifest_are_value_errors(saved_pair):
    """200 random edits, each resealed with a valid checksum: the manifest
    is either still well-formed or a ValueError, never another error."""
    _, path, data = saved_pair
    rng = random.Random(0)
    values = [None, True, -1, 0, 2**40, 1.5, 1e300, "", "x", "..", [], {},
              [0], [[0, 1]], {"a": 1}]
    outcomes = set()
    for _ in range(200):
        info = json.loads(data)
        node, key = _random_node(info, rng)
        node[key] = rng.choice(values)
        try:
            checkpoint_manifest.decode(_reseal(info), "manifest.json")
            outcomes.add("accepted")
        except ValueError:
            outcomes.add("refused")
    assert "refused" in outcomes


def _random_node(info, rng):
    """(container, key) of a random field anywhere in the manifest."""
    node = info
    while True:
        keys = list(node.keys()) if isinstance(node, dict) else list(
            range(len(node)))
        key = rng.choice(keys)
        child = node[key]
        if isinstance(child, (dict, list)) and child and rng.random() < 0.7:
            node = child
            continue
        return node, key


def test_an_edited_manifest_is_caught_by_its_checksum(model, saved_pair):
    good, path, data = saved_pair
    file = os.path.join(path, "manifest.json")
    info = json.loads(data)
    assert info["format_version"] == 3
    assert info["manifest_crc32"] == zlib.crc32(json.dumps(
        {k: v for k, v in info.items() if k != "manifest_crc32"},
        sort_keys=True, separators=(",", ":")).encode())
    edits = {
        # Turning the block checksums off: caught, with or without the
        # explicit route for older formats (the checksum is still there).
        "format_version 1": data.replace(b'"format_version": 3',
                                         b'"format_version": 1'),
        "a crc32": data.replace(b'"crc32": ', b'"crc32": 1', 1),
        "the step": data.replace(b'"step": 8', b'"step": 9'),
    }
    try:
        for name, edited in edits.items():
            assert edited != data, name
            with open(file, "wb") as f:
                f.write(edited)
            for older in (False, True):
                model.set_weights(versioned(-1))
                with pytest.raises(ValueError, match="manifest_crc32"):
                    checkpoint.restore_checkpoint(
                        model, path, optimizer=False, allow_older_format=older)
                assert_unchanged(model)
        # Without its checksum a format-3 manifest is refused as well.
        del info["manifest_crc32"]
        with open(file, "w") as f:
            json.dump(info, f)
        with pytest.raises(ValueError, match="manifest_crc32"):
            checkpoint.restore_checkpoint(model, path, optimizer=False)
    finally:
        with open(file, "wb") as f:
            f.write(data)
    assert restored_version(model, path) == (8, 2)


# -- max_to_keep and stale temporaries -------------------------------------

def test_max_to_keep(model, tmp_path):
    for step in range(1, 6):
        save(model, tmp_path, version=step, step=step, max_to_keep=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-4", "ckpt-5"]
    assert restored_version(model, tmp_path) == (5, 5)
    assert restored_version(model, tmp_path, step=4) == (4, 4)
    # Re-saving an older step keeps it (the one just saved) and the newest.
    save(model, tmp_path, version=9, step=2, max_to_keep=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-2", "ckpt-5"]
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_to_keep"):
            save(model, tmp_path, version=1, step=7, max_to_keep=bad)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-2", "ckpt-5"]


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_are_removed_at_the_next_save(model, tmp_path):
    save(model, tmp_path, version=1, step=4)
    dead, alive = _dead_pid(), os.getppid()
    for name in (f"ckpt-8.tmp-{dead}", f"ckpt-4.old-{dead}",
                 f"ckpt-9.tmp-{alive}"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "v0000_x.b0.npy").write_bytes(b"partial")
    assert checkpoint.latest_checkpoint(tmp_path).endswith("ckpt-4")
    save(model, tmp_path, version=2, step=5)
    # The dead process's leftovers are gone, the live one's (in use) kept.
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint", "ckpt-4", "ckpt-5", f"ckpt-9.tmp-{alive}"]
    assert restored_version(model, tmp_path, step=4) == (4, 1)
    assert restored_version(model, tmp_path) == (5, 2)


# -- step ------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, 2.0])
def test_step_must_be_a_nonnegative_integer(model, tmp_path, bad):
    with pytest.raises(ValueError, match=r"save_checkpoint\(step\) must be an "
                                         r"integer >= 0. Received: step="):
        save(model, tmp_path, version=1, step=bad)
    assert not os.path.exists(tmp_path / "checkpoint")
    save(model, tmp_path, version=1, step=np.int64(3))   # numpy ints are ints
    with pytest.raises(ValueError, match=r"restore_checkpoint\(step\) must"):
        checkpoint.restore_checkpoint(model, tmp_path, optimizer=False,
                                      step=bad)
    with pytest.raises(FileNotFoundError, match=r"step 2 .* Saved steps: "
                                                r"\[3\]"):
        checkpoint.restore_checkpoint(model, tmp_path, optimizer=False,
                                      step=2)
    assert restored_version(model, tmp_path, step=3) == (3, 1)
