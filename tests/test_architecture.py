"""The layer contract (.importlinter, docs/architecture.md) holds: each layer
imports only the layers below it, and no package has an import cycle."""

import shutil
import subprocess
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed")
def test_import_contracts_are_kept():
    result = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_timeline_imports_nothing_drawn_from_it():
    graph = grimp.build_graph("unisched")
    drawn = ("unisched.memory", "unisched.metrics", "unisched.render", "unisched.simulate", "unisched.execute")
    imported = graph.find_modules_directly_imported_by("unisched.timeline")
    assert not [m for m in imported if m.startswith(drawn)]
