"""The notebooks are executed, so they cannot rot."""

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.parametrize("name, figures", [("unified_scheme.ipynb", 2), ("cluster_layouts.ipynb", 1)])
def test_notebook_runs(name, figures):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("text/html" in o.get("data", {}) for o in outputs), "the diagrams render as HTML"
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= figures, "the matplotlib figures render inline, not as their text repr"
