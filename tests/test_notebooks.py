"""Notebooks run top to bottom with the public API, offline, on the addition task, with small settings; a cell that
raises fails the test. Each plot is a real figure, shown inline and saved next to the notebook's outputs."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"


def run_notebook(name: str, parameters: str, tmp_path) -> list[str]:
    """Execute notebook `name` with `parameters` appended to its parameters cell; return the text of each cell's
    outputs (failing on the first cell that raises)."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert notebook.cells[1].source.startswith("# Parameters")
    notebook.cells[1].source += "\n" + parameters
    resources = {"metadata": {"path": str(tmp_path)}}
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources=resources).execute()
    assert any("image/png" in output.get("data", {}) for cell in notebook.cells for output in cell.get("outputs", []))
    return ["".join(output.get("text", "") for output in cell.get("outputs", [])) for cell in notebook.cells]


def test_quickstart_notebook_trains_evaluates_and_plots(tiny_task, tmp_path):
    out = tmp_path / "out"
    outputs = run_notebook("quickstart.ipynb", f"TASK_DIR = {str(tiny_task)!r}\nSTEPS = 6\nEVAL_STEPS = 3\n"
                           f"OUTPUT_DIR = {str(out)!r}", tmp_path)
    text = "".join(outputs)
    assert "held-out accuracy: " in text and "at step 0 -> " in text and "at step 6" in text
    assert "held-out reverse KL: " in text
    assert (out / "quickstart.png").stat().st_size > 10_000
    assert (out / "model.safetensors").exists()


def test_comparison_notebook_runs_every_method_and_plots(tiny_task, tmp_path):
    out = tmp_path / "out"
    outputs = run_notebook("compare_trainers.ipynb", f"TASK_DIR = {str(tiny_task)!r}\nSTEPS = 2\nEVAL_EVERY = 1\n"
                           f"OUTPUT_DIR = {str(out)!r}", tmp_path)
    summary = outputs[-1]
    for method in ("opd", "opd-sampled", "trl-distillation", "grpo", "sft"):
        assert f"{method:>17}: accuracy " in summary
    assert (out / "compare.png").stat().st_size > 10_000 and (out / "runs.json").exists()
