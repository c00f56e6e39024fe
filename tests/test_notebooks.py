"""The notebooks are executed, so they cannot rot; the two whose results do not
depend on timing must also show, as committed, what the code prints today.  To
refresh one after a change:

    jupyter execute --inplace notebooks/NAME.ipynb
"""

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
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert _texts(notebook) == _texts(committed), (
        f"{name} as committed shows other results than the code gives now: refresh it with "
        f"jupyter execute --inplace notebooks/{name}")


def _texts(notebook) -> list[tuple[str, list[str]]]:
    """What each code cell printed (however the kernel split it into pieces) and the text
    of what it returned, figures' pixels left out."""
    texts = []
    for cell in notebook.cells:
        if cell.cell_type == "code":
            outputs = cell.get("outputs", [])
            printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
            returned = [o["data"].get("text/plain", "") for o in outputs
                        if o.output_type == "execute_result" and "image/png" not in o["data"]]
            texts.append((printed, returned))
    return texts


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_committed_run_so_they_read_with_their_figures(path):
    """A reader on a code host sees the outputs: every code cell was run, in order, without error."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    assert not [o for cell in code for o in cell.get("outputs", []) if o.output_type == "error"]
