"""The documentation site (mkdocs.yml, docs/) builds with warnings as
errors, as `python3 dev.py docs` builds it, and holds the API reference.

The build runs without `--quiet`: strict mode counts only the warnings that
reach it, and `--quiet` hid all 75 of a fresh install's (2026-12-04).
`test_strict_build_fails_on_a_warning` shows the same command fails on one.
"""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _build_strict(project, site_dir):
    """`mkdocs build --strict` of `project` (as dev.py runs it) into `site_dir`."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--site-dir", str(site_dir)],
        cwd=project, capture_output=True, text=True, timeout=300)


def test_docs_site_builds_strict(tmp_path):
    result = _build_strict(ROOT, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("ParallelStrategy", "memory_per_device", "LayoutRules",
                 "PipelineModel", "save_checkpoint"):
        assert name in api, name
    for guide in ("data", "tensor", "pipeline", "fsdp", "checkpoints",
                  "hosts"):
        assert (tmp_path / "guides" / guide / "index.html").exists(), guide
    assert (tmp_path / "benchmarks" / "index.html").exists()


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
