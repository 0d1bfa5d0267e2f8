"""Every notebook in colab/ runs top to bottom on 8 virtual CPU devices.

Each notebook is executed with nbclient in a fresh Jupyter kernel running
this interpreter (a kernelspec written to a temporary JUPYTER_PATH, so the
result does not depend on which `python3` kernel is installed where), with
TFPAR_NOTEBOOK_SMALL=1 so the notebooks pick tiny sizes. A cell error fails
the test; then a key output of each notebook is checked.
"""

import json
import re
import sys
import time
from pathlib import Path

import ipykernel  # noqa: F401  (the kernel the notebooks run in)
import nbclient
import nbformat
import pytest

COLAB = Path(__file__).resolve().parents[1] / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
KERNEL = "tfpar-notebook-test"
CELL_TIMEOUT = 300  # seconds; each notebook takes well under a minute

# Text each notebook must print (in any stream or display output), and
# whether it must display at least one PNG.
EXPECTED = {
    "checkpoints": (["resume across meshes matches uninterrupted training: OK",
                     "export to plain Keras: OK", "CPU:7"], False),
    "quickstart": (["parity with one device: OK", "8 CPU device(s)",
                    "up0/kernel"], True),
    "gpt": (["parity with one device: OK", "ColumnParallel", "RowParallel",
             "3-D parity with one device: OK"],
            True),
    "keras_hub_llama": (["auto_rules parity with one device: OK",
                         "keras.distribution parity with one device: OK",
                         "('batch', 'model')"], True),
    "plan": (["planned training matches one device: OK",
              "On paper (not run): GPT-3 (", "Binding constraint: "], False),
    "pipeline_schedules": (
        ["simulated bubbles match (p-1)/(m+p-1): OK",
         "pipeline parity with one device: OK",
         "gpipe schedule, 4 stages x 8 micro-batches",
         "1f1b schedule, 4 stages x 8 micro-batches"], True),
}


def test_every_notebook_has_expectations():
    assert NOTEBOOKS, f"no notebooks in {COLAB}"
    assert {p.stem for p in NOTEBOOKS} == set(EXPECTED)


@pytest.fixture(scope="module")
def kernel_path(tmp_path_factory):
    """A JUPYTER_PATH whose only kernelspec runs this interpreter."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher",
                 "-f", "{connection_file}"],
        "display_name": "tfpar notebook test",
        "language": "python",
        "env": {
            "TFPAR_NOTEBOOK_SMALL": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "KERAS_BACKEND": "tensorflow",
            # No stray matplotlib GUI backend in the kernel.
            "MPLBACKEND": "Agg",
        },
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return root


def _outputs(nb):
    text, pngs = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                text.append(out.text)
            elif out.output_type in ("execute_result", "display_data"):
                text.append(out.data.get("text/plain", ""))
                pngs += "image/png" in out.data
    return "\n".join(text), pngs


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}: outputs not cleared")
    assert "OWNER" not in path.read_text(), f"{path.name}: a placeholder link"
    install, hardware = [c.source for c in nb.cells if c.cell_type == "code"][:2]
    assert install == _install_cell(NOTEBOOKS[0]), (
        f"{path.name}: its first code cell differs from {NOTEBOOKS[0].name}'s "
        "install cell; copy that cell")
    for needle in ("tfpar.connect_tpu()", "use_virtual_cpus(8)"):
        assert needle in hardware, (path.name, needle)


def _install_cell(path):
    nb = nbformat.read(path, as_version=4)
    return next(c for c in nb.cells if c.cell_type == "code").source


def _run_cell_without(module, source, monkeypatch):
    """Runs `source` in an IPython shell where `module` is not importable
    and `%pip` only records its (variable-expanded) line and makes `module`
    importable. Returns (the cell's result, the pip lines)."""
    from IPython.core.interactiveshell import InteractiveShell  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, module, None)  # importing it fails
    pip_lines = []

    def pip(line):
        pip_lines.append(line)
        sys.modules[module] = type(sys)(module)  # "installed"

    shell = InteractiveShell.instance()
    try:
        shell.register_magic_function(pip, "line", "pip")
        return shell.run_cell(source, silent=True), pip_lines
    finally:
        InteractiveShell.clear_instance()


def _run_install_cell(source, monkeypatch, tfpar_source=None):
    """The install cell run where tfpar is not installed (`TFPAR_SOURCE`
    set to `tfpar_source` when given)."""
    if tfpar_source is not None:
        source = source.replace('TFPAR_SOURCE = ""',
                                f"TFPAR_SOURCE = {tfpar_source!r}", 1)
    return _run_cell_without("tfpar", source, monkeypatch)


def test_install_cell_is_well_formed(monkeypatch):
    source = _install_cell(NOTEBOOKS[0])
    # One clearly marked setting, empty as shipped.
    assert source.startswith("# ==== SETTING: where tfpar comes from")
    assert source.count("\nTFPAR_SOURCE = ") == 1 and 'TFPAR_SOURCE = ""' in source
    # Not set and tfpar missing: the cell says exactly what to do.
    result, pip_lines = _run_install_cell(source, monkeypatch)
    assert pip_lines == []
    assert isinstance(result.error_in_exec, RuntimeError)
    message = str(result.error_in_exec)
    assert "tfpar is not installed" in message
    assert "Set TFPAR_SOURCE" in message and "git+https://github.com/" in message
    # Set: pip installs exactly that requirement, then tfpar imports.
    result, pip_lines = _run_install_cell(
        source, monkeypatch, "git+https://github.com/someone/tfpar")
    assert result.success, result.error_in_exec
    assert pip_lines == ["install -q git+https://github.com/someone/tfpar"]


def _keras_hub_pin():
    pyproject = (COLAB.parent / "pyproject.toml").read_text()
    return re.search(r'"(keras-hub==[^"]+)"', pyproject).group(1)


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS
                                  if "import keras_hub" in p.read_text()],
                         ids=lambda p: p.stem)
def test_keras_hub_notebook_installs_it_when_missing(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    first = next(i for i, c in enumerate(code) if "import keras_hub" in c)
    assert first >= 2, f"{path.name}: keras-hub installed before the setup"
    result, pip_lines = _run_cell_without("keras_hub", code[first], monkeypatch)
    assert result.success, result.error_in_exec
    # The version the tests run: the pin in pyproject.toml's test extra.
    assert pip_lines == [f"install -q {_keras_hub_pin()}"]


# The default profile runs the notebooks whose flow no default example
# test runs too; the others (each mirrors an example the default profile
# runs: examples/gpt.py, pipeline.py, checkpoints.py, plan.py) run with
# `dev.py test-all`.
MIRRORED_BY_AN_EXAMPLE = {"gpt", "pipeline_schedules", "checkpoints", "plan"}


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.slow) if p.stem in MIRRORED_BY_AN_EXAMPLE
    else p for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_path, tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_path))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(tmp_path)}},  # PNGs land here
    )
    start = time.monotonic()
    client.execute()  # raises CellExecutionError on the first failing cell
    elapsed = time.monotonic() - start
    print(f"{path.name}: {elapsed:.1f} s")

    text, pngs = _outputs(nb)
    needles, wants_png = EXPECTED[path.stem]
    for needle in needles:
        assert needle in text, f"{path.name}: {needle!r} not in outputs:\n{text}"
    if wants_png:
        assert pngs >= 1, f"{path.name}: no PNG displayed"
    # The install line is skipped when tfpar is importable.
    assert "Successfully installed" not in text
