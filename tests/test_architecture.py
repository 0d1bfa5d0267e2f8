"""The house rules of tfpar's structure, checked on its source.

* no function body over 60 lines and no class body over 300 (docstrings
  excluded: a runnable example is documentation, not logic);
* `import tfpar` alone leaves Keras and TF as they were: tfpar's hooks are
  installed when a strategy is first made, and can be taken out again;
* `_compat.py` holds shims and the patch registry, not features: no
  function there over 15 lines, no patch made there, no tfpar import;
* the dependency rules of docs/architecture.md (read from its tables):
  every module on one floor and in the module map, imports only down,
  none inside a function, the named packages never importing the named
  ones, patches installed only by the named modules.
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


def _features_in_compat(path):
    """What `path` (`_compat.py`) holds beyond shims and the patch
    registry: 'name: n lines' of each top-level function longer than
    MAX_COMPAT_FUNCTION_LINES, and each patch made there ('Patch(...)
    at line n': patches live with the features that own them)."""
    tree = ast.parse(path.read_text())
    long = [f"{node.name}: {_body_lines(node)} lines"
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _body_lines(node) > MAX_COMPAT_FUNCTION_LINES]
    patches = [f"Patch(...) at line {node.lineno}"
               for node in ast.walk(tree)
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
               and node.func.id == "Patch"]
    return long + patches


def test_compat_holds_only_shims_and_the_patch_registry():
    assert _features_in_compat(PACKAGE / "_compat.py") == []


def test_compat_check_sees_a_feature_and_a_patch(tmp_path):
    long_body = '    """doc"""\n' + "    x = 1\n" * 16
    source = tmp_path / "_compat.py"
    source.write_text(
        f"def feature():\n{long_body}"
        "def short():\n    return 1\n"
        "PATCHES = (Patch('f', owner, 'f', short),)\n")
    assert _features_in_compat(source) == [
        "feature: 16 lines", "Patch(...) at line 21"]


def test_compat_imports_no_tfpar_module():
    assert [target for module, target, _, _ in _imports()
            if module == "_compat"] == []


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


# -- The dependency rules: read from docs/architecture.md, enforced here ------
#
# docs/architecture.md's "Dependency rules" section holds the rules as tables
# (the floors, what a package never imports, which modules install patches);
# the checks below read those tables, so the page and the test cannot drift.

ARCHITECTURE_PAGE = PACKAGE.parent / "docs" / "architecture.md"


def _module_name(path, package=None):
    """'pipeline.runner' for tfpar/pipeline/runner.py, 'pipeline' for its
    __init__.py, '__init__' for tfpar/__init__.py."""
    package = package or PACKAGE
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _modules(package=None):
    package = package or PACKAGE
    return {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def _imported(module, node, modules):
    """tfpar modules (names as `_module_name` gives them) that the import
    statement `node` in `module` loads."""
    if isinstance(node, ast.Import):
        bases = [a.name for a in node.names]
        names = [[] for _ in bases]
    else:
        base = node.module or ""
        if node.level:
            here = module.split(".") if module != "__init__" else []
            is_package = modules[module].name == "__init__.py"
            here = here if is_package else here[:-1]
            here = here[:len(here) - (node.level - 1)]
            base = ".".join(["tfpar", *here, *([base] if base else [])])
        bases = [base]
        names = [[a.name for a in node.names]]
    found = []
    for base, members in zip(bases, names):
        if base != "tfpar" and not base.startswith("tfpar."):
            continue
        inner = base[len("tfpar."):] if base != "tfpar" else "__init__"
        submodules = [f"{inner}.{m}" if inner != "__init__" else m
                      for m in members]
        hits = [m for m in submodules if m in modules]
        found += hits
        if len(hits) < len(members) or not members:
            found.append(inner if inner in modules else inner + ".__init__")
    return [m for m in found if m in modules and m != module]


def _imports(package=None):
    """[(module, imported module, line, inside a function)] of every tfpar
    import in `package`, those done inside functions included."""
    modules = _modules(package)
    edges = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        late = {id(n) for f in ast.walk(tree)
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges += [(module, target, node.lineno, id(node) in late)
                          for target in _imported(module, node, modules)]
    return edges


def _section_tables(page, heading):
    """The rows (lists of cells) of each Markdown table under `heading`."""
    text = page.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ")[0]
    tables, rows = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if rows is None:
                rows = []
                tables.append(rows)
            elif not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        else:
            rows = None
    return tables


def _names(cell):
    """The `backticked` names of a table cell: "`a`, `b.c`" -> ['a', 'b.c']."""
    return cell.split("`")[1::2]


def dependency_rules(page=None):
    """(floor of each module, {package: modules it never imports},
    modules allowed to install patches), from the architecture page's
    "Dependency rules" tables. A module on two floors is an error."""
    floors_table, never_table, patch_table = _section_tables(
        page or ARCHITECTURE_PAGE, "Dependency rules")
    floors = {}
    for row in floors_table:
        for module in _names(row[1]):
            assert module not in floors, f"{module} is on two floors"
            floors[module] = int(row[0])
    never = {_names(row[0])[0]: _names(row[1]) for row in never_table}
    installers = set(_names(patch_table[0][1]))
    return floors, never, installers


def mapped_modules(page=None):
    """The modules the architecture page's module map names."""
    (table,) = _section_tables(page or ARCHITECTURE_PAGE, "The module map")
    return {name for row in table for name in _names(row[0])}


def _inside(module, package):
    return module == package or module.startswith(package + ".")


def rule_breaks(package=None, page=None):
    floors, never, _ = dependency_rules(page)
    breaks = []
    for module, target, line, late in _imports(package):
        where = f"{module}:{line} imports {target}"
        if late and module != "__init__":
            breaks.append(f"{where} inside a function")
        if module not in floors or target not in floors:
            continue  # test_every_module_has_a_floor reports it
        if floors[target] >= floors[module]:
            breaks.append(f"{where}: floor {floors[target]} is not below "
                          f"{floors[module]}")
        for owner, banned in never.items():
            if _inside(module, owner) and any(_inside(target, b) for b in banned):
                breaks.append(f"{where}: {owner} never imports {banned}")
    return breaks


def test_every_module_has_one_floor_on_the_architecture_page():
    floors, _, _ = dependency_rules()
    assert sorted(set(_modules()) - set(floors)) == []
    assert sorted(set(floors) - set(_modules())) == []


def test_every_module_is_in_the_module_map():
    assert sorted(set(_modules()) - mapped_modules()) == []
    assert sorted(mapped_modules() - set(_modules())) == []


def test_imports_point_down_and_none_is_inside_a_function():
    assert rule_breaks() == []


def test_rule_check_sees_an_import_up_and_a_late_one(tmp_path):
    package = tmp_path / "tfpar"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text(
        "def f():\n    from tfpar import high\n")
    (package / "high.py").write_text("from tfpar import low\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "part.py").write_text("from tfpar import high\n")
    page = tmp_path / "architecture.md"
    page.write_text(
        "# x\n\n## Dependency rules\n\n"
        "| floor | modules |\n|---|---|\n"
        "| 0 | `low` |\n| 1 | `high`, `sub.part` |\n| 2 | `__init__`, `sub` |\n\n"
        "| package | never imports |\n|---|---|\n| `sub` | `high` |\n\n"
        "| rule | modules |\n|---|---|\n| install patches | `high` |\n")
    breaks = rule_breaks(package, page)
    assert breaks == [
        "low:2 imports high inside a function",
        "low:2 imports high: floor 1 is not below 0",
        "sub.part:1 imports high: floor 1 is not below 1",
        "sub.part:1 imports high: sub never imports ['high']"], breaks


def _installs_patches(path):
    """Whether `path` calls the patch registry's `install_group`."""
    return any(isinstance(n, ast.Call) and (
        getattr(n.func, "attr", None) == "install_group"
        or getattr(n.func, "id", None) == "install_group")
        for n in ast.walk(ast.parse(path.read_text())))


def test_only_the_named_modules_install_patches():
    _, _, installers = dependency_rules()
    found = {m for m, p in _modules().items()
             if m != "_compat" and _installs_patches(p)}
    assert found == installers
