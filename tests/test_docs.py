"""The documentation: the site (mkdocs.yml, docs/) builds with warnings as
errors, as `python3 dev.py docs` builds it, also from a fresh install of the
pinned docs dependencies; the API reference covers every public name; the
README stays short and leads with what decides adoption.

The build runs without `--quiet`: strict mode counts only the warnings that
reach it, and `--quiet` hid all 75 of a fresh install's (2026-12-04).
`test_strict_build_fails_on_a_warning` shows the same command fails on one.
"""

import ast
import os
import re
import shutil
import subprocess
import textwrap
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_WORDS = 1200
TABLE_CELL_MAX_WORDS = 40
HARDWARE_STATUS = "nothing has been run on a GPU or TPU yet"
SMOKE_CHECK = "python -m tfpar.env --smoke"
COMMANDS = ("python3 dev.py demo", "python3 dev.py test")


def _build_strict(project, site_dir, python=sys.executable):
    """`mkdocs build --strict` of `project` (as dev.py runs it) into `site_dir`."""
    return subprocess.run(
        [str(python), "-m", "mkdocs", "build", "--strict",
         "--site-dir", str(site_dir)],
        cwd=project, capture_output=True, text=True, timeout=300)


def _public_names():
    """`tfpar.__all__`, read from tfpar/__init__.py without importing
    TensorFlow."""
    tree = ast.parse((ROOT / "tfpar" / "__init__.py").read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__all__"
                        for t in node.targets)):
            return ast.literal_eval(node.value)
    raise AssertionError("tfpar/__init__.py defines no __all__")


def _docs_requirements():
    """The `docs` extra of pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the list is one literal
        block = re.search(r"^docs = \[(.*?)\]", text, re.S | re.M).group(1)
        return re.findall(r'"([^"]+)"', block)
    return tomllib.loads(text)["project"]["optional-dependencies"]["docs"]


def _documented_names():
    """Names rendered by a `::: tfpar.<name>` directive of docs/api.md."""
    api = (ROOT / "docs" / "api.md").read_text()
    return set(re.findall(r"^::: tfpar\.(\w+)\s*$", api, re.M))


def test_docs_site_builds_strict(tmp_path):
    result = _build_strict(ROOT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("memory_per_device", "explain", "save_checkpoint"):
        assert name in api, name
    rendered = set(re.findall(r'id="tfpar\.(\w+)"', api))
    assert set(_public_names()) <= rendered, (
        set(_public_names()) - rendered)
    for guide in ("data", "tensor", "pipeline", "fsdp", "checkpoints",
                  "hosts"):
        assert (tmp_path / "guides" / guide / "index.html").exists(), guide
    for page in ("benchmarks", "status", "history"):
        assert (tmp_path / page / "index.html").exists(), page


def test_strict_build_fails_on_a_warning(tmp_path):
    """The build above would see a warning: the same command and config on
    a copy of docs/ with one page linking to a page that does not exist."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs", project / "docs")
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    (project / "tfpar").symlink_to(ROOT / "tfpar")
    with open(project / "docs" / "index.md", "a") as page:
        page.write("\n[a broken link](no_such_page.md)\n")
    result = _build_strict(project, tmp_path / "site")
    assert result.returncode != 0
    assert "no_such_page.md" in result.stdout + result.stderr


def test_api_reference_covers_every_public_name():
    missing = sorted(set(_public_names()) - _documented_names())
    assert not missing, (
        f"docs/api.md has no `::: tfpar.<name>` section for {missing}: "
        "add one for every name in tfpar.__all__")


def test_docs_dependencies_are_pinned():
    """A new release of mkdocstrings-python or griffelib changes what strict
    mode warns about: every docs dependency is an exact version."""
    requirements = _docs_requirements()
    assert requirements
    for requirement in requirements:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*",
                            requirement), requirement


@pytest.mark.slow
def test_docs_build_in_a_fresh_environment(tmp_path):
    """`python3 dev.py docs` on a fresh machine: a new virtual environment
    with only the pinned docs dependencies (from PyPI; no TensorFlow: the
    API reference is read from the sources) builds the site strictly."""
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=True)
    python = environment / ("Scripts/python.exe" if sys.platform == "win32"
                            else "bin/python")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q",
         "--disable-pip-version-check", *_docs_requirements()],
        capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stdout + install.stderr
    frozen = subprocess.run([str(python), "-m", "pip", "freeze"],
                            capture_output=True, text=True).stdout.lower()
    for requirement in _docs_requirements():
        assert requirement.lower() in frozen, requirement
    result = _build_strict(ROOT, tmp_path / "site", python=python)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr
    assert (tmp_path / "site" / "api" / "index.html").exists()


def _readme_tables_cells(text):
    """Every cell of every Markdown table row (`| a | b |`) in `text`."""
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line):
            yield from (cell.strip() for cell in line.strip().strip("|")
                        .split("|"))


def test_readme_is_short():
    words = len(README.read_text().split())  # what `wc -w` counts
    assert words <= README_MAX_WORDS, (
        f"README.md has {words} words, more than {README_MAX_WORDS}: move "
        "detail to docs/ (status.md, benchmarks.md, history.md)")


def test_readme_table_cells_are_short():
    long_cells = [cell for cell in _readme_tables_cells(README.read_text())
                  if len(cell.split()) > TABLE_CELL_MAX_WORDS]
    assert not long_cells, long_cells


def test_readme_leads_with_hardware_status_and_commands():
    """What decides adoption (where tfpar has run) and the two commands
    come in the first screen."""
    top = " ".join("\n".join(README.read_text().splitlines()[:40]).split())
    assert HARDWARE_STATUS in top
    assert SMOKE_CHECK in top
    for command in COMMANDS:
        assert command in top, command


def test_readme_links_point_to_files():
    """The README is read on GitHub, outside the site's strict build."""
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert targets and not missing, missing


def _run_as_a_reader(tmp_path, code, timeout):
    """Runs README code as a script in an empty folder (tfpar from this
    checkout); asserts it succeeds and returns its standard output."""
    script = tmp_path / "readme_code.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True,
        text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_readme_quickstart_runs(tmp_path):
    """The README's quickstart, as a reader copies it, trains (keras-hub
    GPT-2 with auto_rules on data=2 x model=4 of 8 virtual CPUs)."""
    quickstart = re.findall(r"```python\n(.*?)```", README.read_text(),
                            re.S)[0]
    assert "tfpar.auto_rules" in quickstart and "keras_hub" in quickstart
    out = _run_as_a_reader(tmp_path, quickstart + "\nprint('QUICKSTART DONE', "
                           "model.history.history['loss'])\n", timeout=900)
    assert "QUICKSTART DONE" in out


@pytest.mark.slow  # its path runs in the default profile: examples/does_not_fit.py
def test_readme_does_not_fit_plan_runs(tmp_path):
    """The README's "does not fit" step 3 (tfpar.plan under a memory limit,
    then fit), run after the quickstart's definitions as a reader would."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    planned = textwrap.dedent(next(b for b in blocks if "tfpar.plan(" in b))
    out = _run_as_a_reader(tmp_path, blocks[0] + planned + "\nprint('PLAN DONE', "
                           "plan, model.history.history['loss'])\n", timeout=1200)
    assert "PLAN DONE" in out and "Self-check: passed" in out
