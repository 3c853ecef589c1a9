"""The command line a pip user meets: subcommands listed at once, typos answered with usage, recipes shipped in the
wheel and found by name."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trl_opd
from trl_opd.tools import cli, packaged

ROOT = Path(__file__).parents[1]
HEAVY = ("torch", "transformers", "trl", "datasets", "accelerate", "peft")


def _trl_opd(*args, cwd=None, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "trl_opd", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def test_help_lists_every_command_without_importing_torch_or_trl():
    probe = ("import sys\nfrom trl_opd.tools import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit as e:\n"
             f"    print('EXIT', e.code)\nprint('HEAVY', sorted(set({HEAVY!r}) & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert "EXIT 0" in result.stdout and "HEAVY []" in result.stdout, result.stdout + result.stderr
    for name, (_, line) in cli.COMMANDS.items():
        assert f"  {name}" in result.stdout and line in result.stdout


def test_no_command_prints_the_list_and_exits_2():
    result = _trl_opd()
    assert result.returncode == 2
    assert result.stdout.startswith("usage: trl-opd <command>") and "make-tiny-task" in result.stdout


@pytest.mark.parametrize("typed, hint", [
    ("nosuchcmd", None),
    ("chek", "Did you mean `trl-opd check`?"),
    ("make-tiny-tsk", "Did you mean `trl-opd make-tiny-task`?"),
    ("recipes/smoke_cpu.yaml", "Did you mean `trl-opd --config recipes/smoke_cpu.yaml`?"),
])
def test_an_unknown_command_exits_2_with_usage_and_the_nearest_command(typed, hint):
    result = _trl_opd(typed, cwd=ROOT)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("usage: trl-opd <command>")
    assert f"trl-opd: {typed!r} is not a command" in result.stderr
    assert "Traceback" not in result.stderr
    assert (hint in result.stderr) if hint else "Did you mean" not in result.stderr


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_each_command_s_help_names_it_as_trl_opd_command(name, capsys):
    with pytest.raises(SystemExit) as exit_code:
        cli.main([name, "--help"])
    assert exit_code.value.code == 0
    usage = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("usage:"))
    assert usage.startswith(f"usage: trl-opd {name} ")


def test_a_recipe_is_found_by_name_or_by_path_and_a_typo_by_its_nearest_name(tmp_path):
    shipped = packaged.recipe_path("smoke_cpu")
    assert shipped == packaged.RECIPES / "smoke_cpu.yaml" and shipped.exists()
    assert packaged.recipe_path("smoke_cpu.yaml") == shipped
    assert packaged.recipe_path("recipes/smoke_cpu.yaml") == Path("recipes/smoke_cpu.yaml")  # a path, as given
    own = tmp_path / "smoke_cpu.yaml"
    own.write_text("model_name_or_path: m\n")
    assert packaged.recipe_path(str(own)) == own
    with pytest.raises(SystemExit, match=r"'smoke' is neither a file nor a recipe .* Did you mean 'smoke_cpu'\?"):
        packaged.recipe_path("smoke")
    assert packaged.accelerate_config_path("zero3") == packaged.ACCELERATE / "zero3.yaml"
    with pytest.raises(SystemExit, match="Did you mean 'cpu'"):
        packaged.accelerate_config_path("cpux")


def test_recipes_lists_each_shipped_recipe_with_the_first_sentence_of_its_header(capsys):
    cli.main(["recipes"])
    listing = capsys.readouterr().out.splitlines()
    names = sorted(path.stem for path in packaged.RECIPES.glob("*.yaml"))
    assert [line.split()[0] for line in listing[1:-1]] == names
    assert "  smoke_cpu " in "\n".join(listing)
    assert any(line.split(None, 1)[1] == "The main demo: OPD on CPU, no network." for line in listing[1:-1]
               if line.split()[0] == "addition_cpu")
    assert all(len(line) <= 120 for line in listing[1:-1])
    assert (ROOT / "recipes").resolve() == packaged.RECIPES  # the repository's recipes/ is the packaged folder


def test_compare_demo_names_a_folder_without_a_held_out_curve(tmp_path):
    with pytest.raises(SystemExit, match=r"nowhere/heldout_curve.json does not exist: give the output_dir of a "
                                         r"finished demo run"):
        cli.main(["compare-demo", str(tmp_path / "nowhere")])


def test_the_package_lists_its_public_names_before_they_load():
    assert {"OPDConfig", "OPDTrainer", "TeacherScorer", "TeacherScores"} <= set(dir(trl_opd))
    assert not [name for name in dir(trl_opd) if not name.startswith("_") and name not in trl_opd.__all__]


@pytest.mark.slow
def test_the_wheel_ships_the_recipes_and_trains_one_by_name_from_an_empty_folder(tmp_path):
    from trl_opd.tools.testing import install_wheel

    site = install_wheel(ROOT, tmp_path / "install")
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    empty = tmp_path / "empty"
    empty.mkdir()
    where = _trl_opd("config-path", "cpu", cwd=empty, env=env)
    assert where.returncode == 0 and Path(where.stdout.strip()) == site / "trl_opd/recipes/accelerate/cpu.yaml"
    assert _trl_opd("make-tiny", "artifacts/tiny", cwd=empty, env=env, timeout=300).returncode == 0
    run = _trl_opd("--config", "smoke_cpu", "--max_steps", "1", cwd=empty, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Saved the trained adapter to outputs/smoke" in run.stdout
    # a clean log: no warning the user would have to act on (Python's, or a library's logged [WARNING] line)
    assert "Warning: " not in run.stderr and "WARNING" not in run.stdout + run.stderr, run.stdout + run.stderr
    assert (empty / "outputs/smoke/adapter_model.safetensors").exists()
    # the demo's last step, on a curve whose final values sit in the shipped sweep's range and above it
    sweep = json.loads((site / "trl_opd/recipes/addition_cpu.seeds.json").read_text())["runs"]
    accuracy = sorted(run["accuracy"] for run in sweep)[len(sweep) // 2]
    reverse_kl = max(run["reverse_kl_sampled"] for run in sweep) * 2
    (empty / "demo").mkdir()
    final = {"accuracy": accuracy, "reverse_kl_sampled": reverse_kl}
    (empty / "demo/heldout_curve.json").write_text(json.dumps([final]))
    compared = _trl_opd("compare-demo", "demo", cwd=empty, env=env)
    assert compared.returncode == 0, compared.stderr
    assert compared.stdout.startswith(f"held-out accuracy {accuracy:.4f}: inside the range measured for `make demo` "
                                      f"over {len(sweep)} seeds")
    assert f"held-out reverse KL {reverse_kl:.4f}: above the range" in compared.stdout


def _readme_python_block(after: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index(after):].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_readme_s_cpu_python_example_runs_as_printed(tmp_path):
    code = _readme_python_block("The same on a CPU, with the tiny local pair")
    assert 'make_tiny("artifacts/tiny")' in code  # the block this test is about
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = map(float, result.stdout.split("sampled tokens: ")[1].split(" -> "))
    assert after < before  # 20 steps lower the student's KL to the teacher
    assert (tmp_path / "outputs/tiny-opd/adapter_model.safetensors").exists()


# ------------------------------------------------------------------ bad input, named before anything heavy runs

@pytest.fixture
def nothing_loads(monkeypatch):
    """Fails a test whose command gets as far as building a trainer: the error must come before any weights load."""
    from trl_opd.trainer.opd_trainer import OPDTrainer

    def refuse(*args, **kwargs):
        raise AssertionError("the trainer was built: the bad input was not caught first")

    monkeypatch.setattr(OPDTrainer, "__init__", refuse)


def test_a_misspelt_option_in_a_recipe_or_on_the_command_line_gets_the_nearest_name(tmp_path, capsys,
                                                                                      nothing_loads):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("model_name_or_path: artifacts/tiny/student\nlerning_rate: 1.0e-3\n")  # bf16 unset: not read
    with pytest.raises(SystemExit) as exit_code:
        cli.main(["--config", str(recipe), "--max_stesp", "3"])
    assert exit_code.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "the command line: unknown option 'max_stesp'. Did you mean 'max_steps'?",
        f"recipe {recipe}: unknown option 'lerning_rate'. Did you mean 'learning_rate'?",
        "`trl-opd train --help` lists the options.",
    ]


def test_a_missing_model_path_is_named_with_the_nearest_one_that_exists(tiny, tmp_path, monkeypatch, nothing_loads):
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "tiny").symlink_to(tiny)
    monkeypatch.chdir(tmp_path)
    argv = ["--config", "smoke_cpu", "--model_name_or_path", "artifacts/tiny/studnet", "--output_dir", "out"]
    with pytest.raises(FileNotFoundError, match=r"model_name_or_path 'artifacts/tiny/studnet' does not exist .* "
                                                r"Did you mean 'artifacts/tiny/student'\?"):
        cli.main(argv)
    # a plausible Hub id that is not a path here, with the Hub offline: both named, no Hub traceback
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    argv[3] = "tiny/student"
    with pytest.raises(FileNotFoundError, match=r"'tiny/student' is neither a path here \(relative paths are from "
                                                r".*\) nor, with HF_HUB_OFFLINE set, a Hub model in the local cache"):
        cli.main(argv)
    assert not (tmp_path / "out").exists()


def test_the_python_api_names_a_missing_model_path_before_loading_anything(tiny, tmp_path, monkeypatch):
    from trl_opd import OPDConfig, OPDTrainer

    class NoLoading:
        def from_pretrained(*args, **kwargs):
            raise AssertionError("a tokenizer was loaded: the bad path was not caught first")

    monkeypatch.setattr("trl_opd.trainer.opd_trainer.AutoTokenizer", NoLoading)
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "tiny").symlink_to(tiny)
    monkeypatch.chdir(tmp_path)
    args = OPDConfig(output_dir="out", bf16=False, report_to="none", per_device_train_batch_size=2, num_generations=1)
    with pytest.raises(FileNotFoundError, match=r"^model 'artifacts/tiny/studnet' does not exist .* "
                                                r"Did you mean 'artifacts/tiny/student'\?"):
        OPDTrainer(model="artifacts/tiny/studnet", teacher_model="artifacts/tiny/teacher", args=args)
    with pytest.raises(FileNotFoundError, match=r"^teacher_model 'artifacts/tiny/teachr' does not exist .* "
                                                r"Did you mean 'artifacts/tiny/teacher'\?"):
        OPDTrainer(model="artifacts/tiny/student", teacher_model="artifacts/tiny/teachr", args=args)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match=r"^model 'tiny/student' is neither a path here"):
        OPDTrainer(model="tiny/student", teacher_model="artifacts/tiny/teacher", args=args)


@pytest.mark.parametrize("options, message", [
    ({}, r"bf16 is on \(as set, or GRPOConfig's default when unset\), and this machine has no GPU with bfloat16 "
         r".* Set `bf16: false` in the recipe"),
    ({"bf16": False, "fp16": True}, r"fp16 mixed precision needs a GPU, and this machine has none\. Set `fp16: false`"),
    ({"bf16": False, "use_liger_kernel": True}, r"use_liger_kernel is not supported: .* Remove it\."),
])
def test_options_this_machine_or_package_cannot_run_are_refused_with_the_fix(tmp_path, options, message):
    import torch

    from trl_opd import OPDConfig

    if torch.accelerator.is_available() and "use_liger_kernel" not in options:
        pytest.skip("bf16 and fp16 are refused only on a machine without a GPU")
    with pytest.raises(ValueError, match=message):
        OPDConfig(output_dir=str(tmp_path), report_to="none", **options)


def test_resuming_a_finished_run_says_so_and_trains_and_saves_nothing(tiny, tmp_path, capsys):
    argv = ["--config", "smoke_cpu", "--model_name_or_path", str(tiny / "student"), "--teacher_model_name_or_path",
            str(tiny / "teacher"), "--dataset_name", str(tiny / "train.jsonl"), "--output_dir", str(tmp_path / "run"),
            "--max_steps", "1", "--save_strategy", "steps", "--save_steps", "1", "--per_device_train_batch_size", "4"]
    cli.main(argv)
    adapter = tmp_path / "run" / "adapter_model.safetensors"
    saved = adapter.stat().st_mtime_ns, adapter.read_bytes()
    capsys.readouterr()
    cli.main([*argv, "--resume_from_checkpoint", "true"])
    out = capsys.readouterr().out
    assert f"Nothing to train: {tmp_path / 'run' / 'checkpoint-1'} is at step 1, and max_steps is 1. Raise " \
           "max_steps to train on from it (e.g. --max_steps 2)" in out
    assert "Saved the trained" not in out and (adapter.stat().st_mtime_ns, adapter.read_bytes()) == saved


def test_ctrl_c_names_the_intact_checkpoint_and_the_command_that_resumes(tiny, tmp_path):
    import signal
    import time

    output_dir = tmp_path / "run"
    options = ["--config", "smoke_cpu", "--model_name_or_path", str(tiny / "student"), "--teacher_model_name_or_path",
               str(tiny / "teacher"), "--dataset_name", str(tiny / "train.jsonl"), "--output_dir", str(output_dir),
               "--max_steps", "500", "--save_strategy", "steps", "--save_steps", "1",
               "--per_device_train_batch_size", "4"]
    # the output goes to files: a pipe nobody reads fills up and stalls the run before any checkpoint
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        # Ctrl-C as a terminal sends it: a suite started in the background (`.ci/run &`) passes SIGINT on ignored,
        # and a Python started with SIGINT ignored installs no KeyboardInterrupt for it
        process = subprocess.Popen([sys.executable, "-m", "trl_opd", *options], stdout=stdout, stderr=stderr,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 300
        while not (output_dir / "checkpoint-2" / "trainer_state.json").exists():
            assert process.poll() is None and time.monotonic() < deadline, \
                "the run ended or stalled before checkpoint 2: " + (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    err = (tmp_path / "stderr").read_text()
    assert process.returncode == 130, err[-3000:]
    last = next(line for line in err.splitlines() if line.startswith("Interrupted."))  # tqdm closes its bar after
    assert last.startswith(f"Interrupted. {output_dir}/checkpoint-") and "is the last complete checkpoint; resume " \
        f"with: trl-opd train --config smoke_cpu --model_name_or_path {tiny / 'student'}" in last
    assert last.endswith("--per_device_train_batch_size 4 --resume_from_checkpoint true")
    assert "Traceback" not in err
