"""The notebooks are executed, so they cannot rot."""

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.parametrize("name", ["unified_scheme.ipynb"])
def test_notebook_runs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("text/html" in o.get("data", {}) for o in outputs), "the diagrams render as HTML"
    figures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(figures) >= 2, "the matplotlib figures render inline, not as their text repr"
