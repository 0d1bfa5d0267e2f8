"""The checker `tests/conftest.py` runs around every test file
(`process_state`): each kind of process-wide state a file could leave
changed for the files after it in its pytest-xdist worker is seen, and
named; what tfpar does by design (installing its hooks once) is not."""

import os

import keras
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

import process_state
import tfpar
from tfpar import _compat, recompute, step_context


def _leak_dtype_policy():
    keras.config.set_dtype_policy("mixed_bfloat16")
    return lambda: keras.config.set_dtype_policy("float32")


def _leak_remat_scope():
    scope = keras.RematScope(mode="full")
    scope.__enter__()
    return lambda: scope.__exit__(None, None, None)


def _leak_op_determinism():
    tf.config.experimental.enable_op_determinism()
    return tf_config.disable_op_determinism


def _leak_environment():
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"
    return lambda: os.environ.pop("TF_ENABLE_ONEDNN_OPTS")


def _leak_a_replaced_hook():
    from keras.src.backend.tensorflow import core  # noqa: PLC0415

    ours = core.remat
    core.remat = lambda f: f
    return lambda: setattr(core, "remat", ours)


def _leak_a_recomputation_stack():
    pushed = step_context.layout_free_draw()
    pushed.__enter__()
    return lambda: pushed.__exit__(None, None, None)


@pytest.mark.parametrize("leak,named", [
    (_leak_dtype_policy, "keras dtype_policy"),
    (_leak_remat_scope, "keras remat_scope_stack"),
    (_leak_op_determinism, "tf op determinism"),
    (_leak_environment, "env TF_ENABLE_ONEDNN_OPTS"),
    (_leak_a_replaced_hook, "tfpar patch keras.src.backend.tensorflow.core.remat"),
    (_leak_a_recomputation_stack, "tfpar recompute stacks"),
], ids=lambda v: v.__name__[len("_leak_"):] if callable(v) else "")
def test_a_leak_is_named_and_its_undoing_clears_it(leak, named):
    recompute.install()  # the hook a replaced-hook leak replaces
    before = process_state.snapshot()
    undo = leak()
    try:
        changed = process_state.changes(before, process_state.snapshot())
    finally:
        undo()
    assert [c.split(":")[0] for c in changed] == [named], changed
    assert process_state.changes(before, process_state.snapshot()) == []


def test_a_strategy_installing_its_hooks_is_no_leak():
    """tfpar installs its Keras/TF hooks once, with the first strategy (by
    design, for the rest of the process): a file making the first one
    leaves nothing the checker names."""
    before = process_state.snapshot()
    tfpar.ParallelStrategy(tfpar.Mesh({"data": 8}))
    assert "strategy" in _compat._installed  # noqa: SLF001
    assert process_state.changes(before, process_state.snapshot()) == []
