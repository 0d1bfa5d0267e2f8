"""Property: a checkpoint damaged anywhere is refused or restores exactly.

A checkpoint written on model=8 has one of its files (a block .npy or the
manifest) truncated at a random length or a random byte changed to another
value. `restore_checkpoint` onto data=2 x model=4 must then either raise a
ValueError naming the damaged file with no variable changed, or restore
exactly the saved weights, optimizer state and step (a byte whose change
means nothing, e.g. JSON whitespace turned into another blank).
"""

import os
import shutil
import tempfile

import hypothesis
import keras
import numpy as np
import pytest
from hypothesis import strategies as st

import tfpar

import fuzzing
import models

RULES = {r".*up/kernel": (None, "model"), r".*up/bias": ("model",),
         r".*down/kernel": ("model", None)}


def mlp():
    return keras.Sequential([
        keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="up"),
        keras.layers.Dense(16, name="down"), keras.layers.Dense(3, name="out")],
        name="mlp")


def state(model):
    return ([np.asarray(w) for w in model.get_weights()]
            + [np.asarray(v) for v in model.optimizer.variables])


def on(axes, seed):
    keras.utils.set_random_seed(seed)
    start = mlp().get_weights()
    with tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=RULES).scope():
        model = mlp()
        model.set_weights(start)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        model.optimizer.build(model.trainable_variables)
    return model


class Saved(tuple):
    """(path, saved state, target model); a short repr for hypothesis."""

    def __new__(cls, *items):
        return super().__new__(cls, items)

    def __repr__(self):
        return f"Saved({self[0]!r})"


@pytest.fixture(scope="module")
def saved():
    root = tempfile.mkdtemp(prefix="tfpar-fuzz-ckpt-")
    model = on({"model": 8}, seed=1)
    models.fit_mlp(model)
    path = tfpar.save_checkpoint(model, root)
    target = on({"data": 2, "model": 4}, seed=7)
    yield Saved(path, state(model), target)
    shutil.rmtree(root, ignore_errors=True)


damage = st.tuples(st.one_of(st.just("manifest.json"),  # which file
                             st.integers(0, 10**6)),
                   st.sampled_from(["truncate", "change"]),
                   st.floats(0, 1, exclude_max=True),  # where
                   st.integers(1, 255))              # xor with


def check_damaged_checkpoint(saved, case):
    path, want, target = saved
    pick, how, where, xor = case
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, os.path.basename(path))
        shutil.copytree(path, copy)
        names = sorted(os.listdir(copy))
        name = pick if isinstance(pick, str) else names[pick % len(names)]
        file = os.path.join(copy, name)
        size = os.path.getsize(file)
        at = int(where * size)
        with open(file, "r+b") as f:
            if how == "truncate":
                f.truncate(at)
            else:
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ xor]))
        before = state(target)
        try:
            step = tfpar.restore_checkpoint(target, copy)
        except ValueError as error:
            # A changed manifest may name another file (e.g. a block name
            # it now misspells); a damaged block must be named itself.
            named = name if name != "manifest.json" else copy
            assert named in str(error), str(error)
            fuzzing.refused(error, before, state(target))
            return
        # Accepted: then it must be exactly the saved checkpoint.
        hypothesis.event(f"accepted: {how} {name.split('.')[-1]}")
        assert step == int(os.path.basename(path).split("-")[1])
        for a, b in zip(want, state(target)):
            np.testing.assert_array_equal(a, b)


(test_damaged_checkpoint_is_refused_or_exact,
 test_damaged_checkpoint_is_refused_or_exact_long) = fuzzing.fast_and_long(
    check_damaged_checkpoint, damage, fast_examples=8)


def test_a_damaged_npy_header_is_a_clear_error(saved, tmp_path):
    """Found by the fuzzing: a '{' written into the blank padding of a .npy
    header made numpy's header parser raise tokenize.TokenError, which
    escaped restore_checkpoint instead of its ValueError."""
    path, _, target = saved
    copy = tmp_path / os.path.basename(path)
    shutil.copytree(path, copy)
    file = copy / sorted(p for p in os.listdir(copy) if "out_bias" in p)[0]
    data = bytearray(file.read_bytes())
    data[data.index(b"}") + 2] = ord("{")   # inside the padding blanks
    file.write_bytes(bytes(data))
    before = state(target)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        tfpar.restore_checkpoint(target, str(copy))
    for a, b in zip(before, state(target)):
        np.testing.assert_array_equal(a, b)
