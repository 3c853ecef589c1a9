"""Every recipe parses through the real CLI parser, and starts with its launch command."""

from pathlib import Path

import pytest
import yaml

from trl_opd.tools.recipe import load_reward_funcs, make_parser

ROOT = Path(__file__).parents[1]
RECIPES = sorted(ROOT.glob("recipes/*.yaml"))
ACCELERATE_CONFIGS = sorted(ROOT.glob("recipes/accelerate/*.yaml"))


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {
        "smoke_cpu.yaml", "smoke_cpu_served.yaml", "opd.yaml", "qwen3_deepmath_served_teacher.yaml"
    }
    assert {p.name for p in ACCELERATE_CONFIGS} >= {"cpu.yaml", "single_gpu.yaml", "zero3.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_documents_its_launch(recipe):
    lines = recipe.read_text().splitlines()
    header = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    assert header and any("accelerate launch" in line for line in header)
    # GPU recipes set bf16, which TrainingArguments rejects on a machine without a GPU unless told it is a CPU run
    argv = ["--config", str(recipe), "--use_cpu", "true"]
    script_args, training_args, model_args = make_parser().parse_args_and_config(argv)
    raw = yaml.safe_load(recipe.read_text())
    assert model_args.model_name_or_path == raw["model_name_or_path"]
    assert training_args.teacher_model_name_or_path == raw.get("teacher_model_name_or_path")
    served = raw.get("teacher_server_url")
    assert training_args.teacher_server_url == ([served] if isinstance(served, str) else served)
    sources = (training_args.teacher_model_name_or_path, training_args.teacher_server_url,
               training_args.student_as_teacher)
    assert sum(source is not None for source in sources) == 1  # one teacher source
    assert script_args.dataset_name == raw["dataset_name"]
    # unset estimator fields stay unset until the trainer knows the teacher source (see OPDConfig.resolved)
    assert (training_args.opd_estimator, training_args.opd_coef) == (raw.get("opd_estimator"), raw.get("opd_coef"))
    if "teacher_model_init_kwargs" in raw:
        assert training_args.teacher_model_init_kwargs == raw["teacher_model_init_kwargs"]
    # every reward and accuracy function the recipe names resolves to a callable
    named = [*(script_args.reward_funcs or []), *([script_args.accuracy_func] if script_args.accuracy_func else [])]
    assert all(callable(func) for func in load_reward_funcs(named))


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_document_their_launch(config):
    assert "accelerate launch" in config.read_text().splitlines()[1]
    assert yaml.safe_load(config.read_text())["num_processes"] >= 1


def test_the_flagship_recipe_fails_fast_and_clearly_without_a_gpu_or_the_hub():
    # `trl-opd check` as a user would run it here: no GPU for bf16, and then (on CPU) no hub for the dataset
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    check = [sys.executable, "-m", "trl_opd", "check", "--config", str(ROOT / "recipes" / "opd.yaml")]
    for extra, message in (([], "this machine has no GPU with bfloat16 (Ampere or later). Set `bf16: false`"),
                           (["--use_cpu", "true"], "Couldn't reach 'zwhe99/DeepMath-103K' on the Hub")):
        result = subprocess.run([*check, *extra], capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


def test_unknown_recipe_key_is_an_error(tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("model_name_or_path: a\nopd_coeff: 2.0\nbf16: false\n")
    with pytest.raises(ValueError, match="opd_coeff"):
        make_parser().parse_args_and_config(["--config", str(recipe)])


def test_command_line_overrides_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: a\nopd_coef: 2.0\nbf16: false\n")
    _, training_args, _ = make_parser().parse_args_and_config(["--config", str(recipe), "--opd_coef", "0.5"])
    assert training_args.opd_coef == 0.5
    with pytest.raises(ValueError):
        make_parser().parse_args_and_config(["--config", str(recipe), "--no_such_flag", "1"])
