"""The planning notebook runs from top to bottom."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "planning.ipynb"


def test_planning_notebook_executes():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # run from the repository root so the kernel imports this checkout
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
    assert "memory limit 2: latency 51, optimal True" in outputs
    assert "worker of (batch, stage)" in outputs
