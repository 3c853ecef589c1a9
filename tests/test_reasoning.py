"""The reasoning-gym task: prompts from its datasets, answers read between <answer> tags and graded by the dataset's
own `score_answer`, full marks only."""

import json
from pathlib import Path

import pytest

from trl_opd.envs.reasoning import extract_answer, make_reasoning_task, reasoning_gym_reward, reasoning_rows, score

DATASETS = ("leg_counting", "basic_arithmetic", "chain_sum", "gsm_symbolic", "countdown", "family_relationships")
COMPLETIONS = Path(__file__).parent / "data" / "reasoning_completions.json"


def _gold(row: dict) -> str:
    return json.loads(row["solution"])["answer"]


@pytest.mark.parametrize("dataset", DATASETS)
def test_gold_answers_score_one_and_wrong_ones_zero(dataset):
    rows = reasoning_rows(dataset, size=20, seed=5)
    gold = [f"Let me see.\n<answer>{_gold(row)}</answer>" for row in rows]
    assert reasoning_gym_reward(gold, [row["solution"] for row in rows]) == [1.0] * len(rows)
    # another row's answer where it differs, and a number no entry has: wrong, including where the dataset's own
    # scorer gives partial credit (gsm_symbolic 0.01 for a number, countdown 0.05 for an expression)
    wrong = [f"<answer>{_gold(rows[(i + 1) % len(rows)])}</answer>" for i in range(len(rows))]
    differs = [i for i in range(len(rows)) if _gold(rows[(i + 1) % len(rows)]) != _gold(rows[i])]
    assert len(differs) >= 10
    assert reasoning_gym_reward([wrong[i] for i in differs], [rows[i]["solution"] for i in differs]) == [0.0] * len(
        differs)
    assert reasoning_gym_reward(["<answer>-987654</answer>"], [rows[0]["solution"]]) == [0.0]


def test_partial_credit_counts_as_wrong():
    row = reasoning_rows("gsm_symbolic", size=1, seed=1)[0]
    assert 0.0 < score("<answer>-987654</answer>", row["solution"]) < 1.0  # the dataset's own credit for a number
    assert reasoning_gym_reward(["<answer>-987654</answer>"], [row["solution"]]) == [0.0]


def test_the_answer_is_the_last_tagged_one_and_none_without_tags():
    assert extract_answer("<answer>3</answer> no, <answer> 292 </answer>") == "292"
    assert extract_answer("<answer>\n12\n</answer>") == "12"
    assert extract_answer("The answer is 292.") is None
    assert extract_answer("<answer>292") is None  # cut off before its closing tag
    row = reasoning_rows("leg_counting", size=1, seed=1)[0]
    # the right number without the format every prompt asks for has no answer: 0, as reasoning-gym grades it
    assert reasoning_gym_reward([_gold(row), f"<answer>{_gold(row)}</answer>"], [row["solution"]] * 2) == [0.0, 1.0]
    # chat completions, as GRPO passes them
    assert reasoning_gym_reward([[{"role": "assistant", "content": f"<answer>{_gold(row)}</answer>"}]],
                                [row["solution"]]) == [1.0]


def test_prompts_ask_for_tagged_answers_in_a_system_turn():
    row = reasoning_rows("leg_counting", size=1, seed=1)[0]
    system, user = row["prompt"]
    assert system["role"] == "system" and "<answer>" in system["content"]
    assert user == {"role": "user", "content": json.loads(row["solution"])["question"]}
    with pytest.raises(ValueError, match="Unknown system prompt 'nope'"):
        reasoning_rows("leg_counting", size=1, seed=1, system_prompt="nope")


def test_the_task_holds_no_heldout_question_among_its_training_prompts(tmp_path):
    directory = make_reasoning_task(tmp_path / "task", dataset="basic_arithmetic", train=400, heldout=100,
                                    min_terms=2, max_terms=2, min_digits=1, max_digits=1)  # few questions: repeats
    train = [json.loads(line) for line in open(directory / "train.jsonl")]
    heldout = [json.loads(line) for line in open(directory / "heldout.jsonl")]
    held = {row["prompt"][-1]["content"] for row in heldout}
    assert len(heldout) == 100 and 0 < len(train) < 400  # some training draws were held-out questions, and dropped
    assert not held & {row["prompt"][-1]["content"] for row in train}
    assert reasoning_gym_reward([f"<answer>{_gold(row)}</answer>" for row in heldout],
                                [row["solution"] for row in heldout]) == [1.0] * 100


def test_the_command_writes_the_task_and_refuses_one_seed_for_both(tmp_path, capsys):
    from trl_opd.envs.reasoning import main

    main([str(tmp_path / "task"), "--dataset", "leg_counting", "--train", "30", "--heldout", "10",
          "--config", "min_animals=2", "max_animals=3"])
    assert "10 held-out prompts of reasoning-gym's leg_counting" in capsys.readouterr().out
    heldout = [json.loads(line) for line in open(tmp_path / "task" / "heldout.jsonl")]
    assert all(2 <= json.loads(row["solution"])["metadata"]["num_animals"] <= 3 for row in heldout)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "other"), "--seed", "3", "--heldout-seed", "3"])
    assert "must differ" in capsys.readouterr().err


def test_an_unknown_dataset_or_setting_is_named_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="no dataset 'leg_countin'; did you mean 'leg_counting'"):
        make_reasoning_task(tmp_path / "a", dataset="leg_countin")
    with pytest.raises(ValueError, match=r"refused the settings \{'max_animals': 1\} .* max_animals must be >= min"):
        make_reasoning_task(tmp_path / "b", dataset="leg_counting", max_animals=1)
    with pytest.raises(ValueError, match="unexpected keyword argument 'nope'"):
        make_reasoning_task(tmp_path / "c", dataset="leg_counting", nope=1)
    assert not any(tmp_path.iterdir())


def test_the_default_task_is_the_measured_one(tmp_path, capsys):
    from trl_opd.envs.reasoning import main

    main([str(tmp_path / "task"), "--train", "20", "--heldout", "20"])
    assert "held-out prompts of reasoning-gym's chain_sum" in capsys.readouterr().out
    for row in map(json.loads, open(tmp_path / "task" / "heldout.jsonl")):
        entry = json.loads(row["solution"])
        numbers = entry["metadata"]["expression"].replace("+", " ").replace("-", " ").split()
        assert len(numbers) in (2, 3) and all(0 <= int(n) < 100 for n in numbers), entry  # as the recipe says


def test_the_recipe_trains_a_step_and_logs_reasoning_gyms_accuracy(tiny, tmp_path):
    # recipes/reasoning_cpu.yaml as it runs, on the tiny pair instead of the real one: the prompts' system turn, the
    # accuracy function the recipe names, its evaluation on the held-out file
    from trl_opd.tools import cli, recipe

    task = make_reasoning_task(tmp_path / "task", dataset="chain_sum", train=16, heldout=4, max_terms=3, max_digits=2)
    trainer = cli.train(*recipe.make_parser().parse_args_and_config([
        "--config", str(Path(__file__).parents[1] / "recipes" / "reasoning_cpu.yaml"),
        "--model_name_or_path", str(tiny / "student"), "--teacher_model_name_or_path", str(tiny / "teacher"),
        "--dataset_name", str(task / "train.jsonl"), "--eval_dataset_name", str(task / "heldout.jsonl"),
        "--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--logging_steps", "1", "--eval_steps", "1",
        "--per_device_eval_batch_size", "4", "--save_final_model", "false",
    ]))
    evaluations = [entry for entry in trainer.state.log_history if "eval_accuracy" in entry]
    assert trainer.state.global_step == 1 and len(evaluations) == 2  # before the first step and after it
    assert all(entry["eval_accuracy"] in (0.0, 0.25, 0.5, 0.75, 1.0) for entry in evaluations)  # of 4 prompts
    assert all(entry["eval_opd/reverse_kl"] > 0 for entry in evaluations)  # two different models
    train = next(entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry)
    assert 0.0 <= train["accuracy"] <= 1.0 and train["opd/reverse_kl"] > 0


def test_real_completions_of_both_models_are_read_and_graded_as_written_by_hand():
    # completions of the real pair on the recipe's task (benchmarks/reasoning_task_gap.py), their answers read by
    # hand: a right number without tags, a dropped sign, a completion cut off before its answer, right and wrong ones
    cases = json.loads(COMPLETIONS.read_text())["completions"]
    assert {(case["model"], case["mode"]) for case in cases} == {
        (model, mode) for model in ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct")
        for mode in ("greedy", "sampled")}
    for case in cases:
        assert extract_answer(case["completion"]) == case["answer"], case
    assert reasoning_gym_reward([case["completion"] for case in cases], [case["solution"] for case in cases]) == [
        float(case["correct"]) for case in cases]
    assert {case["correct"] for case in cases} == {True, False}
