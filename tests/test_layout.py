"""The package's layout, as docs/development.md describes it: imports go one way, and a long file says why it is one.

Import circles are found statically (every import in a module, including those inside functions), so one that only
a rarely used command would hit is caught here rather than at that command's first run.
"""

import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "trl_opd"
LONG_FILE = 400  # lines; a longer file is named in docs/development.md with the reason it holds one concern


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (imports for annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports when it runs, anywhere in its body."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:  # `from . import x` imports the module x, `from .x import y` the module x
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    return (found & modules) - {name}


def _import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(paths)) for name, path in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state, path = [], {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for dependency in sorted(graph[module]):
            if state.get(dependency) == "open":
                cycles.append(path[path.index(dependency):] + [dependency])
            elif dependency not in state:
                visit(dependency)
        state[module] = "done"
        path.pop()

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_the_circle_finder_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    graph = _import_graph()
    assert "trl_opd.tools.recipe" in graph["trl_opd.tools.preflight"]  # the graph sees imports (a check of the check)
    assert _cycles(graph) == []


def test_a_long_module_is_named_in_the_development_guide():
    guide = (ROOT / "docs" / "development.md").read_text()
    long = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    unexplained = {path: lines for path, lines in long.items() if lines > LONG_FILE and f"`{path}`" not in guide}
    assert unexplained == {}, f"over {LONG_FILE} lines with no note in docs/development.md: {unexplained}"


def test_the_trainer_steers_grpo_only_through_its_own_class():
    """OPDTrainer's bases are GRPO's trainer and one mixin; no module declares a method for another base to provide
    (`NotImplementedError`), assigns a GRPO method on an object, or sets attributes by name but `grpo_calls.py`."""
    from trl import GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration

    from trl_opd.trainer import OPDTrainer
    from trl_opd.trainer.hub import HubMixin

    assert OPDTrainer.__bases__ == (HubMixin, GRPOTrainer)
    # GRPO's methods on a trainer, and those of the generation object it holds (`trainer.vllm_generation`)
    methods = {holder: {name for name, _ in inspect.getmembers(cls, inspect.isfunction)}
               for holder, cls in (("self", GRPOTrainer), ("trainer", GRPOTrainer),
                                   ("vllm_generation", VLLMGeneration))}
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Name) and node.id == "NotImplementedError":
                found.append(f"{where} NotImplementedError")
            if isinstance(node, ast.Assign):
                found += [f"{where} assigns {target.attr}" for target in node.targets
                          if isinstance(target, ast.Attribute) and target.attr in methods.get(
                              getattr(target.value, "id", None) or getattr(target.value, "attr", None), ())]
                # the one change of class: TRL's colocated generation made its subclass that syncs by reload
                found += [f"{where} assigns __class__" for target in node.targets
                          if isinstance(target, ast.Attribute) and target.attr == "__class__"
                          and path.name != "colocate.py"]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and (
                    path.name != "grpo_calls.py"):
                found.append(f"{where} setattr")
    assert found == []
