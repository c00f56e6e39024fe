"""The layer contract (.importlinter, docs/architecture.md) holds: each layer
imports only the layers below it, and no package has an import cycle."""

import shutil
import subprocess
import sys
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


def test_every_public_name_is_in_dir_and_the_lazy_ones_load_only_when_used():
    code = ("import sys, unisched; names = dir(unisched); "
            "assert {'Trainer', 'split_model', 'epl', 'policies', 'load_plan', 'SplitError'} <= set(names), names; "
            "assert 'torch' not in sys.modules and 'ortools' not in sys.modules; "
            "assert unisched.SplitError is unisched.epl.SplitError")
    subprocess.run([sys.executable, "-c", code], check=True)
