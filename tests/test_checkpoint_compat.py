"""Checkpoints written by earlier code restore exactly (issue 40, item 6).

`tests/fixtures/checkpoint_3a663bc/` was written by
`tests/fixtures/make_checkpoint_fixture.py` with the code of commit 3a663bc
(before `tfpar/checkpoint.py` became the package `tfpar/checkpoint/`): a
tiny MLP on data=2 x model=4 with split kernels, after one Adam step. It is
restored (through `allow_older_format=True`: its format 2 has no manifest
checksum, so it is read only when asked for) onto the same mesh, onto model=8 (every block resharded) and into
a one-device model, and every weight and optimizer variable must equal the
saved value bit for bit (`expected.npz`, written beside it by the same
script). A change of the on-disk format, of the variable keys or of the
resharding math fails here.
"""

import contextlib
import json
import pathlib

import keras
import numpy as np
import pytest

import tfpar

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "checkpoint_3a663bc"
RULES = {r".*up/kernel": (None, "model"), r".*down/kernel": ("model", None)}
MESHES = {"data=2,model=4": {"data": 2, "model": 4},   # as saved
          "model=8": {"model": 8},                      # resharded
          "one device": None}


def build():
    """The fixture's model (as in make_checkpoint_fixture.py)."""
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="relu", name="up"),
        keras.layers.Dense(2, name="down"),
    ], name="compat")


def values(model):
    """{"params:<path>" / "optimizer:<name>": value} as expected.npz."""
    found = {f"params:{w.path}": np.asarray(w.numpy()) for w in model.weights}
    found.update({f"optimizer:{v.name}": np.asarray(v.numpy())
                  for v in model.optimizer.variables})
    return found


def test_fixture_is_the_old_format():
    manifest = json.loads((FIXTURE / "ckpt-1" / "manifest.json").read_text())
    assert manifest["format"] == "tfpar-checkpoint"
    assert manifest["format_version"] == 2
    assert manifest["mesh"] == {"data": 2, "model": 4}
    # Sharded variables were written as one block per model-axis device.
    blocks = {r["key"]: len(r["blocks"]) for r in manifest["variables"]}
    assert blocks["compat/up/kernel"] == blocks["compat/down/kernel"] == 4
    assert blocks["compat/up/kernel:momentum"] == 4


@pytest.mark.parametrize("mesh", list(MESHES))
def test_checkpoint_from_3a663bc_restores_exactly(mesh):
    expected = dict(np.load(FIXTURE / "expected.npz"))
    axes = MESHES[mesh]
    scope = (tfpar.ParallelStrategy(tfpar.Mesh(axes), rules=RULES).scope()
             if axes else contextlib.nullcontext())
    with scope:
        model = build()
        model.compile(optimizer="adam", loss="mse")
        model.optimizer.build(model.trainable_variables)
    before = values(model)
    assert before.keys() == expected.keys()
    # Not vacuous: fresh weights and zero slots differ from the saved ones.
    assert not np.array_equal(before["params:compat/up/kernel"],
                              expected["params:compat/up/kernel"])
    assert not np.array_equal(
        before["optimizer:compat_up_kernel_momentum"],
        expected["optimizer:compat_up_kernel_momentum"])

    assert tfpar.latest_checkpoint(FIXTURE) == str(FIXTURE / "ckpt-1")
    # Format 2 (no manifest checksum) is read only when asked for (issue
    # 38): refused by default, before any variable changes.
    with pytest.raises(ValueError, match="allow_older_format=True"):
        tfpar.restore_checkpoint(model, FIXTURE)
    assert tfpar.restore_checkpoint(model, FIXTURE,
                                    allow_older_format=True) == 1

    restored = values(model)
    assert restored.keys() == expected.keys()
    for key, value in expected.items():
        assert restored[key].dtype == value.dtype, key
        np.testing.assert_array_equal(restored[key], value, err_msg=key)
    assert int(model.optimizer.iterations.numpy()) == 1
    np.testing.assert_allclose(float(model.optimizer.learning_rate.numpy()),
                               0.01, rtol=1e-6)
