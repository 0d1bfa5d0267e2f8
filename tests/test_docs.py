"""The documentation site (mkdocs.yml, docs/) builds with warnings as
errors, as `python3 dev.py docs` builds it, and holds the API reference."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_site_builds_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("ParallelStrategy", "memory_per_device", "LayoutRules",
                 "PipelineModel", "save_checkpoint"):
        assert name in api, name
    for guide in ("data", "tensor", "pipeline", "fsdp", "checkpoints",
                  "hosts"):
        assert (tmp_path / "guides" / guide / "index.html").exists(), guide
    assert (tmp_path / "benchmarks" / "index.html").exists()
