"""The CLI end to end, in process: the smoke recipe trains and saves a LoRA adapter that reloads exactly."""

import json
from pathlib import Path

import pytest
import torch

from trl_opd.tools import cli, recipe

SMOKE = str(Path(__file__).parents[1] / "recipes" / "smoke_cpu.yaml")


def test_smoke_recipe_trains_and_saves_a_reloadable_adapter(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    output_dir = tmp_path / "smoke"
    trainer = cli.train(*recipe.make_parser().parse_args_and_config([
        "--config", SMOKE,
        "--model_name_or_path", str(tiny / "student"),
        "--teacher_model_name_or_path", str(tiny / "teacher"),
        "--dataset_name", str(tiny / "train.jsonl"),
        "--output_dir", str(output_dir),
        "--max_steps", "3", "--logging_steps", "1",
    ]))

    assert json.loads((output_dir / "adapter_config.json").read_text())["r"] == 32
    assert (output_dir / "adapter_model.safetensors").exists()
    assert not list(output_dir.glob("model*.safetensors"))  # the adapter, not merged weights, and no teacher
    assert all("opd/reverse_kl" in entry for entry in trainer.state.log_history[:3])

    base = AutoModelForCausalLM.from_pretrained(tiny / "student")
    ids = torch.tensor([[1, 263, 264, 201, 272, 260, 291]])
    with torch.no_grad():
        base_logits = base(ids).logits
        reloaded_logits = PeftModel.from_pretrained(base, output_dir)(ids).logits
        trained_logits = trainer.model.eval()(ids).logits
    torch.testing.assert_close(reloaded_logits, trained_logits)
    assert not torch.allclose(reloaded_logits, base_logits)  # the adapter learned something


@pytest.mark.parametrize("path, builder", [
    ("artifacts/nowhere/student", "trl-opd make-tiny artifacts/tiny`"),
    ("artifacts/tiny_task/nowhere", "trl-opd make-tiny-task artifacts/tiny_task`"),
])
def test_missing_local_model_says_how_to_build_it(tmp_path, path, builder):
    argv = ["--config", SMOKE, "--model_name_or_path", path, "--output_dir", str(tmp_path)]
    with pytest.raises(FileNotFoundError, match=builder):
        cli.main(argv)


def test_a_run_read_from_its_logs_alone_writes_no_weights(tiny, tmp_path):
    # save_final_model: false (the prepared GPU check's runs): trained, logged, and nothing written to output_dir
    argv = ["--config", SMOKE, "--model_name_or_path", str(tiny / "student"), "--teacher_model_name_or_path",
            str(tiny / "teacher"), "--dataset_name", str(tiny / "train.jsonl"), "--output_dir", str(tmp_path / "out"),
            "--max_steps", "2", "--logging_steps", "1", "--save_final_model", "false"]
    trainer = cli.train(*recipe.make_parser().parse_args_and_config(argv))
    assert trainer.state.global_step == 2 and "opd/reverse_kl" in trainer.state.log_history[0]
    written = [p.name for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert not [name for name in written if name.endswith((".safetensors", ".bin", ".pt", ".md"))], written
    with pytest.raises(ValueError, match="save_final_model: false saves no final model"):
        cli.train(*recipe.make_parser().parse_args_and_config([*argv, "--push_to_hub", "true"]))


def test_prompt_column_is_mapped_and_wrapped_as_a_chat_message(tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text(json.dumps({"question": "What is 2 plus 2?", "prompt": "stale"}) + "\n")
    script_args = recipe.OPDScriptArguments(
        dataset_name=str(data), prompt_column="question", prompt_as_user_message=True, system_prompt="Be brief."
    )
    dataset = recipe.load_prompts(script_args, "train")
    assert dataset[0]["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 2?"},
    ]


def test_check_preflight_prints_zero_reference_kl_on_the_smoke_recipe(tiny, tmp_path, capsys):
    argv = [
        "check", "--config", SMOKE,
        "--model_name_or_path", str(tiny / "student"),
        "--teacher_model_name_or_path", str(tiny / "teacher"),
        # as recipes/opd.yaml sets it: the reference pass, which loads no teacher, must drop it
        "--teacher_model_init_kwargs", '{"dtype": "float32"}',
        "--dataset_name", str(tiny / "train.jsonl"),
        "--output_dir", str(tmp_path / "unused"),
    ]
    with pytest.raises(SystemExit) as exit_code:
        cli.main(argv)
    out = capsys.readouterr().out
    assert exit_code.value.code == 0
    assert "reference as teacher: opd/reverse_kl = 0.000000 (OK, 0 as expected)" in out
    assert "tokenizers: the student and the teacher agree" in out
    shown = out.split("the run's plan")[1].splitlines()[1:]
    plan = dict(line.split(None, 1) for line in shown[:shown.index(next(x for x in shown if not x.startswith("  ")))])
    # what the smoke recipe decides: a local teacher, the default estimator for one, no rewards
    assert (plan["teacher_source"], plan["estimator"], plan["rewards"]) == ("local", "full", "False")
    assert "first prompt, student's chat template: '<|im_start|>user\\nWhat is" in out
    reverse_kl = float(out.split("recipe's teacher:")[1].split("opd/reverse_kl = ")[1].split(",")[0])
    assert reverse_kl > 1.0  # the real teacher is far from the tiny student


def test_reward_functions_load_by_name_or_import_path():
    from trl.rewards import accuracy_reward

    from trl_opd.tiny import arithmetic_answer_reward

    assert recipe.load_reward_funcs(["accuracy_reward", "trl_opd.tiny.arithmetic_answer_reward"]) == [
        accuracy_reward, arithmetic_answer_reward
    ]
    with pytest.raises(ValueError, match="Unknown reward function 'nope'"):
        recipe.load_reward_funcs(["nope"])
    with pytest.raises(ValueError, match="Cannot import reward function 'no_such_module.f'"):
        recipe.load_reward_funcs(["no_such_module.f"])
    completions = [[{"role": "assistant", "content": "3 plus 4 is 7. The answer is 7."}], "It is 8."]
    assert arithmetic_answer_reward(completions, answer=["... The answer is 7.", "The answer is 7."]) == [1.0, 0.0]


def test_the_eval_summary_shows_a_metric_logged_as_none_as_not_applicable():
    # GRPO logs None for a metric with no valid value (a checker that returned None for every held-out completion)
    from types import SimpleNamespace

    printed = []
    history = [{"step": 0, "eval_loss": 0.0, "eval_accuracy": None, "eval_opd/reverse_kl": 0.5},
               {"step": 4, "eval_loss": 0.0, "eval_accuracy": 0.25, "eval_opd/reverse_kl": 0.125}]
    trainer = SimpleNamespace(state=SimpleNamespace(log_history=history, global_step=4),
                              accelerator=SimpleNamespace(print=printed.append))
    cli.print_eval_summary(trainer)
    assert printed[0].splitlines()[1:] == [
        f"  {'accuracy':<38}      n/a ->   0.2500",
        f"  {'reverse KL (sampled tokens)':<38}   0.5000 ->   0.1250",
    ]
