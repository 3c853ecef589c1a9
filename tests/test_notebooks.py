"""Notebooks run top to bottom with the public API, offline, on the tiny pair."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"


def test_quickstart_notebook_trains_and_plots(tiny, tmp_path):
    notebook = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    # point the parameters at the session's tiny pair and a scratch output directory
    notebook.cells[1].source += (
        f"\nSTUDENT, TEACHER = {str(tiny / 'student')!r}, {str(tiny / 'teacher')!r}"
        f"\nfrom datasets import load_dataset\nPROMPTS = load_dataset('json', data_files={str(tiny / 'train.jsonl')!r},"
        f" split='train')\nSTEPS = 12\nOUTPUT_DIR = {str(tmp_path / 'out')!r}"
    )
    resources = {"metadata": {"path": str(tmp_path)}}
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", resources=resources)
    client.execute()
    outputs = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert "reverse KL:" in outputs and "model.safetensors" in outputs
    assert any("image/png" in o.get("data", {}) for cell in notebook.cells for o in cell.get("outputs", []))
