"""Hub ids read from a local mirror (`OPD_MODELS_DIR`), and the real-model recipes and benchmarks naming the Hub ids
that the mirror resolves. Nothing here loads a model."""

import ast
import importlib.util
from pathlib import Path

import pytest
import yaml

from trl_opd.models_dir import resolve_model
from trl_opd.tools.recipe import make_parser

ROOT = Path(__file__).parents[1]
QWEN_05B, QWEN_15B = "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
REAL_RECIPES = {"real_cpu.yaml": (QWEN_05B, QWEN_15B), "real_cross_cpu.yaml": (SMOLLM2, QWEN_05B),
                "reasoning_cpu.yaml": (QWEN_05B, QWEN_15B)}


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A mirror holding the 0.5B as `make real-models` lays it out, its name in lower case."""
    (tmp_path / "qwen2.5-coder-0.5b-instruct").mkdir()
    (tmp_path / "qwen2.5-coder-0.5b-instruct" / "config.json").write_text("{}")
    monkeypatch.setenv("OPD_MODELS_DIR", str(tmp_path))
    return tmp_path


def test_without_a_mirror_a_hub_id_stays_a_hub_id(monkeypatch):
    monkeypatch.delenv("OPD_MODELS_DIR", raising=False)
    assert resolve_model(QWEN_05B) == QWEN_05B


def test_a_mirrored_hub_id_names_its_directory_and_anything_else_stays_as_it_is(mirror):
    assert resolve_model(QWEN_05B) == str(mirror / "qwen2.5-coder-0.5b-instruct")
    assert resolve_model(QWEN_15B) == QWEN_15B  # not in the mirror: for the Hub to answer
    assert resolve_model(None) is None


def test_an_existing_local_path_wins_over_the_mirror(mirror, tmp_path_factory, monkeypatch):
    # a relative path spelt like a Hub id, which the mirror also holds: what is there is what the user meant
    monkeypatch.chdir(tmp_path_factory.mktemp("work"))
    Path(QWEN_05B).mkdir(parents=True)
    assert resolve_model(QWEN_05B) == QWEN_05B
    assert resolve_model(str(Path(QWEN_05B).absolute())) == str(Path(QWEN_05B).absolute())


def test_a_mirror_may_also_keep_the_hub_layout(tmp_path, monkeypatch):
    (tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct").mkdir(parents=True)
    monkeypatch.setenv("OPD_MODELS_DIR", str(tmp_path))
    assert resolve_model(SMOLLM2) == str(tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct")


@pytest.mark.parametrize("recipe", sorted(REAL_RECIPES))
def test_the_real_recipes_name_hub_ids_and_say_how_to_read_them_offline(recipe):
    path = ROOT / "recipes" / recipe
    raw = yaml.safe_load(path.read_text())
    assert (raw["model_name_or_path"], raw["teacher_model_name_or_path"]) == REAL_RECIPES[recipe]
    assert "OPD_MODELS_DIR=~/.cache/real-models" in path.read_text()
    _, training_args, model_args = make_parser().parse_args_and_config(["--config", str(path)])
    assert (model_args.model_name_or_path, training_args.teacher_model_name_or_path) == REAL_RECIPES[recipe]


def _argument_defaults(script: Path) -> dict[str, object]:
    """`{option: default}` of the script's `add_argument` calls with a constant default, read without running it."""
    defaults = {}
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args:
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if isinstance(default, ast.Constant):
                defaults[node.args[0].value] = default.value
    return defaults


@pytest.mark.parametrize("script", ["real_pair.py", "served_real_teacher.py", "real_task_gap.py"])
def test_the_real_pair_benchmarks_default_to_the_hub_ids(script):
    defaults = _argument_defaults(ROOT / "benchmarks" / script)
    assert (defaults["--student"], defaults["--teacher"]) == (QWEN_05B, QWEN_15B)


def test_the_cross_tokenizer_benchmark_names_its_real_pair_by_hub_id():
    spec = importlib.util.spec_from_file_location("cross_tokenizer", ROOT / "benchmarks" / "cross_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the module's top level only: its pairs, no model
    real = module.PAIRS["real"]
    assert real["student"] == SMOLLM2
    assert {teacher for teacher, _, _ in real["arms"].values()} == {QWEN_05B}
