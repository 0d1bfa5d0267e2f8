"""The process-wide settings a test file could leave changed for the files
after it in its pytest-xdist worker (`--dist loadfile` runs files one after
another in one process, grouped differently from run to run).

`snapshot()` reads them (cheap: no op runs); `changes(before, after)` names
what differs. `tests/conftest.py` compares them around every test module
and fails the module's last test, naming the file, when it leaves one
changed: the class of failure that passes alone and fails in the suite
(issue 17, item 3).

>>> before = snapshot()
>>> keras.config.set_floatx("float64")
>>> changes(before, snapshot())
['keras floatx: float32 -> float64']
>>> keras.config.set_floatx("float32")
"""

import os

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state
from tensorflow.python.eager import context
from tensorflow.python.framework import config as tf_config

from tfpar import _compat

# Keras' per-thread call state: None (or empty) between tests unless a
# scope (RematScope, StatelessScope, autocast, a layer call) was left open.
_KERAS_SCOPES = ("remat_scope_stack", "stateless_scope", "symbolic_scope",
                 "autocast_scope", "current_call_ctx", "name_scope_stack",
                 "custom_objects_scope_dict", "distribution")


def _keras():
    return {
        "keras floatx": keras.config.floatx(),
        "keras epsilon": keras.config.epsilon(),
        "keras image_data_format": keras.config.image_data_format(),
        "keras dtype_policy": keras.config.dtype_policy().name,
        "keras max_epochs": keras.config.max_epochs(),
        "keras max_steps_per_epoch": keras.config.max_steps_per_epoch(),
        "keras flash_attention": keras.config.is_flash_attention_enabled(),
        # Made on first use: an empty one is as good as none.
        **{f"keras {name}": repr(global_state.get_global_attribute(name)
                                 or None)
           for name in _KERAS_SCOPES},
    }


def _tensorflow():
    eager = context.context()
    return {
        "tf op determinism": tf_config.is_op_determinism_enabled(),
        "tf jit": tf.config.optimizer.get_jit(),
        "tf grappler options": repr(
            sorted(tf.config.optimizer.get_experimental_options().items())),
        "tf functions_run_eagerly": tf.config.functions_run_eagerly(),
        "tf executing_eagerly": tf.executing_eagerly(),
        "tf device scope": eager.device_name,
        "tf name scope": eager.scope_name,
        "tf distribute strategy": repr(tf.distribute.get_strategy()
                                       if tf.distribute.has_strategy()
                                       else None),
        "tf tensor_float_32": (
            tf.config.experimental.tensor_float_32_execution_enabled()),
        "tf soft device placement": tf.config.get_soft_device_placement(),
        "tf logical devices": len(tf.config.list_logical_devices()),
    }


def _tfpar():
    from tfpar import step_context  # noqa: PLC0415 (what a RematScope runs)

    open_stacks = {name: len(stack) for name, stack
                   in vars(step_context._RECOMPUTING).items() if stack}  # noqa: SLF001
    # tfpar's patches stay installed once made (by design): a patch made
    # since may appear (`changes` allows it), one in place may not change.
    patches = {f"tfpar patch {getattr(owner, '__name__', owner)}.{name}":
               id(vars(owner).get(name))
               for owner, name, _ in _compat._originals.values()}  # noqa: SLF001
    return {"tfpar recompute stacks": repr(open_stacks), **patches}


def snapshot():
    """{setting: value} for every process-wide setting watched here."""
    return {**_keras(), **_tensorflow(), **_tfpar(),
            "numpy errstate": repr(sorted(np.geterr().items())),
            "working directory": os.getcwd(),
            **{f"env {k}": v for k, v in os.environ.items()
               if k != "PYTEST_CURRENT_TEST"}}


def changes(before, after):
    """'name: old -> new' for each setting that differs."""
    return [f"{name}: {before.get(name)} -> {after.get(name)}"
            for name in sorted(set(before) | set(after))
            if before.get(name) != after.get(name)
            and not (name.startswith("tfpar patch ") and name not in before)]
