"""The house rules of tfpar's structure, checked on its source.

* no function body over 60 lines and no class body over 300 (docstrings
  excluded: a runnable example is documentation, not logic);
* `import tfpar` alone leaves Keras and TF as they were: tfpar's hooks are
  installed when a strategy is first made, and can be taken out again;
* `_compat.py` holds shims and the patch registry, not features: no
  function there over 15 lines but the patch factories (the functions a
  `Patch(...)` of the registry names).
"""

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tfpar"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300


def _body_lines(node):
    """Lines from the first statement after the docstring to the last one."""
    body = node.body
    if (body and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def _oversized():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            elif isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            else:
                continue
            lines = _body_lines(node)
            if lines > limit:
                where = path.relative_to(PACKAGE.parent)
                found.append(f"{where}:{node.lineno} {node.name}: "
                             f"{lines} lines (limit {limit})")
    return found


def test_no_oversized_function_or_class():
    assert _oversized() == []


def test_size_check_sees_a_long_function(tmp_path, monkeypatch):
    long_function = "def f():\n    '''doc'''\n" + "    x = 1\n" * 61
    (tmp_path / "tfpar").mkdir()
    (tmp_path / "tfpar" / "long.py").write_text(long_function)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "tfpar")
    assert len(_oversized()) == 1


MAX_COMPAT_FUNCTION_LINES = 15


def _patch_factories(tree):
    """Names of the functions a `Patch(...)` call of the module names (the
    factories of the registry's replacements)."""
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "Patch"):
            names.update(n.id for arg in node.args for n in ast.walk(arg)
                         if isinstance(n, ast.Name))
    return names


def _features_in_compat(path):
    """'name: n lines' of each top-level function of `path` longer than
    MAX_COMPAT_FUNCTION_LINES that is no patch factory."""
    tree = ast.parse(path.read_text())
    factories = _patch_factories(tree)
    return [f"{node.name}: {_body_lines(node)} lines"
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name not in factories
            and _body_lines(node) > MAX_COMPAT_FUNCTION_LINES]


def test_compat_holds_only_shims_and_the_patch_registry():
    assert _features_in_compat(PACKAGE / "_compat.py") == []


def test_compat_check_sees_a_feature_but_not_a_patch_factory(tmp_path):
    long_body = '    """doc"""\n' + "    x = 1\n" * 16
    source = tmp_path / "_compat.py"
    source.write_text(
        f"def factory(original, hooks):\n{long_body}"
        f"def feature():\n{long_body}"
        "PATCHES = (Patch('f', owner, 'f', factory),)\n")
    assert _features_in_compat(source) == ["feature: 16 lines"]


_KERAS_ENTRY_POINTS = """
import keras, tensorflow as tf
import keras_hub
from keras.src.trainers import trainer
from keras.src.trainers.data_adapters import array_data_adapter
from keras.src.backend.common import global_state
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.backend.tensorflow import core, numpy as knp, random
from keras.src.backend.tensorflow import distribution_lib
from keras.src.layers.layer import Layer
from keras.src.optimizers import base_optimizer
from keras.src.ops import operation
from keras.src.random import seed_generator
from tensorflow.python.eager.polymorphic_function import polymorphic_function
MISSING = object()
def snapshot():
    return {
        "compile": trainer.Trainer.compile,
        "make_train_function": tf_trainer.TensorFlowTrainer.make_train_function,
        "make_test_function": tf_trainer.TensorFlowTrainer.make_test_function,
        "make_predict_function":
            tf_trainer.TensorFlowTrainer.make_predict_function,
        "make_generate_function":
            keras_hub.models.CausalLM.make_generate_function,
        "symbolic_build": trainer.Trainer._symbolic_build,
        "maybe_symbolic_build":
            tf_trainer.TensorFlowTrainer._maybe_symbolic_build,
        "model_call": keras.Model.__call__,
        "operation_call": operation.Operation.__call__,
        "function_call": polymorphic_function.Function.__call__,
        "add_weight": Layer.add_weight,
        "variable_initialize": core.Variable._initialize,
        "remat": core.remat,
        "seed_next": seed_generator.SeedGenerator.next,
        "slice_update": core.slice_update,
        "categorical": random.categorical,
        "divide": knp.divide,
        "tensor_getitem": tf.Tensor.__getitem__,
        "get_tf_dataset": array_data_adapter.ArrayDataAdapter.get_tf_dataset,
        "set_global_attribute": global_state.set_global_attribute,
        "distribute_tensor":
            getattr(distribution_lib, "distribute_tensor", MISSING),
        "initialize": getattr(distribution_lib, "initialize", MISSING),
        "get_device_count":
            getattr(distribution_lib, "get_device_count", MISSING),
        "optimizer_apply": base_optimizer.BaseOptimizer.apply,
    }
"""


def _run(code):
    result = subprocess.run(
        [sys.executable, "-c", _KERAS_ENTRY_POINTS + code],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "KERAS_BACKEND": "tensorflow"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_import_alone_leaves_keras_unpatched():
    changed = _run(
        "before = snapshot()\n"
        "import tfpar\n"
        "after = snapshot()\n"
        "print(sorted(k for k in before if before[k] is not after[k]))\n")
    assert changed == "[]"


def test_hooks_install_with_a_strategy_and_uninstall():
    out = _run(
        "before = snapshot()\n"
        "import tfpar\n"
        "tfpar.use_virtual_cpus(8)\n"
        "tfpar.ParallelStrategy(tfpar.Mesh({'data': 8}))\n"
        "import tfpar.keras_distribution\n"  # its opt-in hook
        "from tfpar import _compat, patches\n"
        "patches.count_array_batches()\n"  # a per-host-input strategy's
        "during = snapshot()\n"
        "_compat.uninstall()\n"
        "after = snapshot()\n"
        "print(all(before[k] is not during[k] for k in"
        " ('compile', 'set_global_attribute', 'get_tf_dataset')),"
        " sorted(k for k in before if before[k] is not after[k]))\n")
    assert out == "True []"


def test_a_model_built_before_the_first_strategy_is_laid_out_by_its_styles():
    """Before the first strategy no hook runs (so none notes which layer
    adds a weight); adoption finds each weight's layer by walking the
    model, and styles lay it out as if it had been built in the scope."""
    placements = _run(
        "import tfpar\n"
        "tfpar.use_virtual_cpus(8)\n"
        "model = keras.Sequential([keras.Input((16,)),\n"
        "    keras.layers.Dense(32, name='up'),\n"
        "    keras.layers.Dense(16, name='down')], name='m')\n"
        "strategy = tfpar.ParallelStrategy(\n"
        "    tfpar.Mesh({'data': 2, 'model': 4}), rules={\n"
        "        r'.*up': tfpar.ColumnParallel(),\n"
        "        r'.*down': tfpar.RowParallel()})\n"
        "with strategy.scope():\n"
        "    model.compile(optimizer='sgd', loss='mse')\n"
        "print(sorted((p, s) for p, s, _ in strategy.placements('params')))\n")
    assert placements == str([
        ("m/down/bias", (None,)), ("m/down/kernel", ("model", None)),
        ("m/up/bias", ("model",)), ("m/up/kernel", (None, "model"))])


def test_tests_import_their_helpers_as_top_level_modules():
    """`tests/` is not a package: pytest and a test file run as a script
    (the 16-CPU offload subprocesses) put `tests/` itself on sys.path, so
    helpers are `import models`. `from tests import models` worked only with
    the repository root on PYTHONPATH — a clean clone's `python3 dev.py
    test` failed on it (tests/test_offload_master.py, found before a stop)."""
    tests = pathlib.Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names]
                     if isinstance(node, ast.Import) else [])
            found += [f"{path.name}:{node.lineno}" for name in names
                      if name == "tests" or name.startswith("tests.")]
    assert not found, found
