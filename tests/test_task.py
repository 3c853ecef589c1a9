"""The offline addition task: right worked answers, a held-out split no training set touches, a real teacher/student
gap, and the demo recipe's held-out evaluation during training."""

import json
import re
from pathlib import Path

import pytest
from trl.rewards import accuracy_reward

from trl_opd.envs.addition import TASK_SETTINGS, addition_rows, is_heldout
from trl_opd.tools import cli, recipe

ROOT = Path(__file__).parents[1]
RECIPE = str(ROOT / "recipes" / "addition_cpu.yaml")


def _pair(row) -> tuple[int, int]:
    return tuple(int(n) for n in re.findall(r"\d+", row["prompt"][0]["content"]))


def test_worked_answers_add_up_and_the_checker_scores_them():
    rows = addition_rows(300, seed=5) + addition_rows(100, seed=5, heldout=True)
    for row in rows:
        a, b = _pair(row)
        numbers = [int(n) for n in re.findall(r"\d+", row["completion"][0]["content"])]
        # units: a0 + b0 = u; tens: a1 + b1 + carry = t; then the answer
        assert numbers[2] == a % 10 + b % 10 and numbers[6] == a // 10 + b // 10 + numbers[2] // 10
        assert numbers[-1] == a + b == int(row["solution"])
    right = [row["completion"] for row in rows[:20]]
    wrong = [[{"role": "assistant", "content": f"The answer is \\boxed{{{int(row['solution']) + 1}}}."}]
             for row in rows[:20]]
    solutions = [row["solution"] for row in rows[:20]]
    assert accuracy_reward(right, solutions) == [1.0] * 20
    assert accuracy_reward(wrong, solutions) == [0.0] * 20


def test_heldout_pairs_are_in_no_training_set(tiny_task):
    heldout = [json.loads(line) for line in open(tiny_task / "heldout.jsonl")]
    train = [json.loads(line) for line in open(tiny_task / "train.jsonl")]
    assert heldout and all(is_heldout(*_pair(row)) for row in heldout)
    assert not any(is_heldout(*_pair(row)) for row in train + addition_rows(4096, seed=10))  # + the models' SFT data
    assert len({_pair(row) for row in heldout}) > 150  # distinct problems, not a few repeated


def test_a_teacher_that_stays_under_the_bar_starts_over_and_the_better_one_is_kept(tmp_path, monkeypatch):
    """With a bar no teacher can reach, the builder trains a second teacher from another initialisation and keeps
    the one with the higher sampled accuracy, as accuracy.json records."""
    from trl_opd import tiny
    from trl_opd.envs import addition

    seeds, measured = [], []
    build_model, task_accuracy = tiny.build_model, addition.task_accuracy

    def recording_build(tokenizer, *, hidden_size, seed):
        seeds.append(seed)
        return build_model(tokenizer, hidden_size=hidden_size, seed=seed)

    def recording_accuracy(model, tokenizer, rows, **kwargs):
        value = task_accuracy(model, tokenizer, rows[:20], **kwargs)
        measured.append((kwargs.get("do_sample", False), value))
        return value

    monkeypatch.setattr(tiny, "build_model", recording_build)
    monkeypatch.setattr(addition, "task_accuracy", recording_accuracy)
    addition.make_tiny_task(tmp_path, student_steps=2, teacher_steps=4, teacher_min_sampled=1.01,
                            teacher_max_rounds=0, teacher_max_inits=2)
    assert seeds == [0, 1, 1001]  # the student, then two teachers
    sampled = [value for do_sample, value in measured if do_sample]  # student, first teacher, second teacher
    built = json.loads((tmp_path / "accuracy.json").read_text())["teacher"]
    assert built["sampled"] == max(sampled[1:]) and built["init"] == sampled[1:].index(max(sampled[1:]))


def test_teacher_is_far_better_than_the_student_on_heldout_prompts(tiny_task):
    """The builder's own numbers, and the same measured independently: sampled answers scored by the checker."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_opd.envs.addition import task_accuracy
    from trl_opd.evaluation import heldout_reverse_kl

    built = json.loads((tiny_task / "accuracy.json").read_text())
    assert built["teacher"]["greedy"] >= 0.8 and built["student"]["greedy"] <= 0.4
    assert json.loads((tiny_task / "DONE").read_text()) == TASK_SETTINGS

    tokenizer = AutoTokenizer.from_pretrained(tiny_task / "teacher")
    teacher = AutoModelForCausalLM.from_pretrained(tiny_task / "teacher")
    student = AutoModelForCausalLM.from_pretrained(tiny_task / "student")
    rows = [json.loads(line) for line in open(tiny_task / "heldout.jsonl")][:100]
    kwargs = dict(prompts=[r["prompt"] for r in rows], solutions=[r["solution"] for r in rows],
                  accuracy_func=accuracy_reward, max_new_tokens=40)
    as_student = heldout_reverse_kl(student, teacher, tokenizer, **kwargs, greedy_accuracy=True)
    # greedy answers, one per prompt, scored as the task builder's own greedy decoding scores them
    assert as_student["accuracy_greedy"] == task_accuracy(student, tokenizer, rows)
    calls = []

    def recording_accuracy(completions, solution, prompts, **rest):
        calls.append((len(completions), len(solution), len(prompts)))
        return accuracy_reward(completions, solution)

    # two samples per prompt: the accuracy function gets one prompt and one solution per sample
    as_teacher = heldout_reverse_kl(teacher, teacher, tokenizer, **{**kwargs, "accuracy_func": recording_accuracy},
                                    samples_per_prompt=2)
    assert calls == [(200, 200, 200)]
    assert as_teacher["accuracy"] >= 0.8 and as_student["accuracy"] <= 0.4
    assert as_teacher["reverse_kl_exact"] == pytest.approx(0.0, abs=1e-6)
    assert as_teacher["forward_kl_exact"] == pytest.approx(0.0, abs=1e-6)
    # at the student's states the teacher is peaked and the student spread: the forward KL is the smaller (0.47 vs 2.0)
    assert as_student["reverse_kl_exact"] > 0.5 and as_student["forward_kl_exact"] > 0.1


@pytest.mark.parametrize("estimator", ["full", "sampled"])
def test_demo_recipe_evaluates_heldout_accuracy_and_kl_during_training(tiny_task, tmp_path, capsys, estimator):
    trainer = cli.train(*recipe.make_parser().parse_args_and_config([
        "--config", RECIPE,
        "--model_name_or_path", str(tiny_task / "student"),
        "--teacher_model_name_or_path", str(tiny_task / "teacher"),
        "--dataset_name", str(tiny_task / "train.jsonl"),
        "--eval_dataset_name", str(tiny_task / "heldout.jsonl"),
        "--output_dir", str(tmp_path / "out"),
        "--opd_estimator", estimator,
        *(["--opd_divergence_beta", "1.0"] if estimator == "sampled" else []),  # the recipe's forward KL is dense-only
        "--max_steps", "40", "--eval_steps", "20", "--logging_steps", "20",
    ]))
    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert [entry["step"] for entry in evals] == [0, 20, 40]  # before training, then every eval_steps
    for entry in evals:
        assert 0.0 <= entry["eval_accuracy"] <= 1.0 and entry["eval_opd/reverse_kl"] > 0
    if estimator == "full":  # the recipe's exact held-out forward KL falls within 40 steps (sampled first rises):
        # by 8% (0.525 -> 0.483) to more than 10%, depending on the CPU that built the task, so only the fall is held
        assert evals[-1]["eval_opd/forward_kl_dense"] < evals[0]["eval_opd/forward_kl_dense"]
    # the evaluation batch (100) is larger than the training one (32): every held-out prompt is scored
    assert trainer.eval_dataset.num_rows == 200 and evals[0]["eval_runtime"] > 0
    printed = capsys.readouterr().out
    first, last = evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]
    assert re.search(rf"accuracy +{first:.4f} -> +{last:.4f}", printed)
    assert "Held-out evaluation, step 0 -> step 40" in printed
    # the curve saved next to the model is the trainer's own evaluations, and its plot is drawn
    curve = json.loads((tmp_path / "out" / "heldout_curve.json").read_text())
    assert [(row["step"], row["accuracy"], row["reverse_kl_sampled"]) for row in curve] == [
        (entry["step"], entry["eval_accuracy"], entry["eval_opd/reverse_kl"]) for entry in evals]
    if estimator == "full":
        assert [row["forward_kl_exact"] for row in curve] == [entry["eval_opd/forward_kl_dense"] for entry in evals]
    assert (tmp_path / "out" / "heldout_curve.png").stat().st_size > 5_000
    assert f"Held-out curve: {tmp_path / 'out' / 'heldout_curve.json'}, " in printed


def test_the_curve_keeps_whichever_divergence_the_run_logged(tmp_path):
    """Every estimator's and divergence's held-out metric reaches the saved curve (here a top-k JSD run's bound),
    not only the full-vocabulary ones."""
    from trl_opd.evaluation import heldout_curve, write_heldout_curve

    log_history = [{"loss": 1.0, "step": 5},  # a training entry: not an evaluation
                   *({"eval_loss": 0.0, "step": step, "eval_accuracy": accuracy, "eval_opd/jsd_topk": jsd,
                      "eval_opd/reverse_kl": kl}
                     for step, accuracy, jsd, kl in [(0, 0.1, 0.4, 2.0), (10, 0.6, 0.1, 0.5)])]
    curve = heldout_curve(log_history)
    assert curve == [{"step": 0, "accuracy": 0.1, "jsd_topk": 0.4, "reverse_kl_sampled": 2.0},
                     {"step": 10, "accuracy": 0.6, "jsd_topk": 0.1, "reverse_kl_sampled": 0.5}]
    written = write_heldout_curve(curve, tmp_path)
    assert json.loads(written[0].read_text()) == curve and written[1].stat().st_size > 5_000


def test_demo_says_where_its_result_falls_in_the_measured_range(tmp_path):
    """`make demo` ends with its held-out numbers against the seed sweep's range; the README states that range."""
    from trl_opd.tools import demo
    sweep = {"machine": "2-core CPU", "date": "2026-12-01",
             "runs": [{"accuracy": a, "reverse_kl_sampled": k} for a, k in [(0.8, 0.02), (0.9, 0.01), (0.85, 0.03)]]}
    lines = {}
    for accuracy, reverse_kl in [(0.85, 0.04), (0.95, 0.02), (0.7, 0.005)]:
        (tmp_path / "heldout_curve.json").write_text(json.dumps(
            [{"step": 0, "accuracy": 0.0, "reverse_kl_sampled": 2.0},
             {"step": 600, "accuracy": accuracy, "reverse_kl_sampled": reverse_kl}]))
        lines[accuracy] = demo.compare(tmp_path, sweep).splitlines()
    assert lines[0.85][0].startswith("held-out accuracy 0.8500: inside the range measured for `make demo` over 3 "
                                     "seeds (0.8000-0.9000, mean 0.8500;")
    assert lines[0.85][1].startswith("held-out reverse KL 0.0400: above")
    assert " 0.9500: above" in lines[0.95][0] and " 0.0200: inside" in lines[0.95][1]
    assert " 0.7000: below" in lines[0.7][0] and " 0.0050: below" in lines[0.7][1]

    # the committed sweep is what the README's quick start quotes
    measured = json.loads(demo.SWEEP.read_text())["runs"]
    low, high = (f"{f(run['accuracy'] for run in measured):.3f}" for f in (min, max))
    assert f"held-out accuracy between {low} and {high}" in (ROOT / "README.md").read_text()
