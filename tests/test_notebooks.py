"""Notebooks run top to bottom with the public API, offline, on the addition task, with small settings; a cell that
raises fails the test. Each plot is a real figure, shown inline and saved next to the notebook's outputs. The
committed copies hold the outputs of a run at their defaults (`benchmarks/execute_notebooks.py`), and what they
printed is what the docs cite."""

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
    outputs = run_notebook("compare_trainers.ipynb", f"RESULTS = None\nTASK_DIR = {str(tiny_task)!r}\nSTEPS = 2\n"
                           f"EVAL_EVERY = 1\nOUTPUT_DIR = {str(out)!r}", tmp_path)
    rates, summary = outputs[-2], outputs[-1]
    for method in ("opd", "opd-sampled", "trl-distillation", "grpo", "sft"):
        assert f"{method:>17}: learning rate 0.001 of 0.001; seeds [0]" in rates
        assert f"{method:>17}: accuracy " in summary
    assert (out / "compare.png").stat().st_size > 10_000 and (out / "runs.json").exists()


def _committed_outputs(name: str) -> tuple[list[str], int]:
    """The text each code cell of the committed notebook printed, and how many PNG plots it holds."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in cells), f"{name} is committed without a run"
    outputs = [output for cell in cells for output in cell.outputs]
    return ([output.get("text", "") for output in outputs if output.get("name") == "stdout"],
            sum("image/png" in output.get("data", {}) for output in outputs))


def test_the_committed_comparison_notebook_shows_the_readme_s_numbers():
    import re

    printed, plots = _committed_outputs("compare_trainers.ipynb")
    assert plots == 1
    text = "".join(printed)
    assert re.search(r"executed \d{4}-\d{2}-\d{2} on a ", text)
    final = {method: int(after) for method, after in re.findall(r"^ *([\w-]+): accuracy \d+% -> (\d+)%", text, re.M)}
    readme = (NOTEBOOKS.parent / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| addition, 300 steps x 32, each at its best"))
    opd, forward_kl = map(int, re.search(r"-> (\d+)% held-out \(default\), (\d+)% \(forward KL\)", row).groups())
    others = dict(re.findall(r"(TRL|GRPO|SFT) (\d+)%", row))
    assert (final["opd"], final["opd-forward-kl"]) == (opd, forward_kl)
    assert [final["trl-distillation"], final["grpo"], final["sft"]] == [int(others[k]) for k in ("TRL", "GRPO", "SFT")]
    assert "learning rate 0.001 of 0.0003, 0.001, 0.003; seeds [0, 1]" in text  # the rate chosen is said


def test_the_committed_quickstart_notebook_shows_the_run_docs_benchmarks_cites():
    import re

    printed, plots = _committed_outputs("quickstart.ipynb")
    assert plots == 1
    text = "".join(printed)
    date = re.search(r"executed (\d{4}-\d{2}-\d{2}) on a ", text).group(1)
    before, after = re.search(r"held-out accuracy: (\d+)% at step 0 -> (\d+)% at step 600", text).groups()
    docs = " ".join((NOTEBOOKS.parent / "docs" / "benchmarks.md").read_text().split())
    assert f"from {before}% to {after}% held-out accuracy in 600 steps" in docs and date in docs
