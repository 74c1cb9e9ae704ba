"""Every notebook in notebooks/ runs top to bottom on a fresh kernel, and is committed clean.

The model notebooks read NOTEBOOK_TINY: set to 1 here, they run the lessons' --tiny model (two
layers, random weights) instead of SmolLM2, so the whole file takes about a minute on 2 CPU cores.
Everything they count and compare holds for it as well.
"""

from pathlib import Path

import nbclient
import nbformat
import pytest

pytestmark = [pytest.mark.notebook]

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{path.name} holds outputs: clear them before committing "
                f"(jupyter nbconvert --clear-output --inplace {path.name})"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    monkeypatch.setenv("NOTEBOOK_TINY", "1")  # the kernel inherits it
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError, with the failing cell and its traceback
