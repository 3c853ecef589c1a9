"""Execute the notebooks in place at their defaults, from their own folder as Jupyter runs them, so that the committed
copies show the outputs (and plots) of a real run; the tests execute them at small settings instead.

    .venv/bin/python benchmarks/execute_notebooks.py                 # both
    .venv/bin/python benchmarks/execute_notebooks.py quickstart      # one
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(path: Path) -> float:
    notebook = nbformat.read(path, as_version=4)
    begin = time.perf_counter()
    # coalesce_streams folds each cell's progress bars to their last state, as a browser shows them
    NotebookClient(notebook, timeout=3600, kernel_name="python3", coalesce_streams=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(notebook, path)
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook names without .ipynb (default: all)")
    names = parser.parse_args().names or sorted(path.stem for path in NOTEBOOKS.glob("*.ipynb"))
    for name in names:
        print(f"{name}.ipynb: {execute(NOTEBOOKS / f'{name}.ipynb'):.0f} s", flush=True)


if __name__ == "__main__":
    main()
