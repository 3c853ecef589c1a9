"""The comparison harness measures every method alike: generated tokens counted where generated (never the
evaluation's own samples), and the same held-out evaluation at the same steps."""

import pytest

from trl_opd.tools.comparison import METHODS, at_best_rate, best_learning_rates, run_method, summarize, task_inputs


@pytest.fixture(scope="module")
def runs(tiny_task):
    inputs = task_inputs(tiny_task)
    return {method: run_method(method, **inputs, steps=2, eval_every=1, eval_prompts=8, batch_size=8,
                               grpo_generations=4) for method in METHODS}


def test_every_method_is_evaluated_alike(runs):
    before = {method: run["history"][0] for method, run in runs.items()}
    for run in runs.values():
        assert [entry["step"] for entry in run["history"]] == [0, 1, 2]
        # the same untrained student, the same held-out samples: identical numbers before training
        assert run["history"][0]["reverse_kl_exact"] == pytest.approx(before["opd"]["reverse_kl_exact"], rel=1e-6)
        assert run["history"][0]["accuracy"] == before["opd"]["accuracy"]
        assert run["history"][0]["generated_tokens"] == 0  # the evaluation's own samples are not counted
        tokens = [entry["generated_tokens"] for entry in run["history"]]
        assert 0 < tokens[1] < tokens[2] <= 2 * 8 * 40  # at most steps x completions x max_completion_length
        assert run["seconds_per_step"] > 0


def test_generated_tokens_match_the_trainers_own_count(runs):
    """OPD logs the completion tokens it trained on; the harness counted them at `generate`: the same number."""
    logged = [entry for entry in runs["opd"]["log_history"] if "data/completion_tokens_total" in entry]
    assert logged[-1]["step"] == 2
    assert runs["opd"]["history"][-1]["generated_tokens"] == logged[-1]["data/completion_tokens_total"]


def test_summary_finds_when_a_run_first_reaches_the_target():
    history = [{"step": s, "generated_tokens": 100 * s, "train_seconds": s / 10, "accuracy": a, "reverse_kl_exact": k}
               for s, a, k in [(0, 0.1, 2.0), (1, 0.5, 1.0), (2, 0.95, 0.1), (3, 0.9, 0.2)]]
    runs = [{"method": "a", "seed": 0, "history": history, "seconds_per_step": 0.1},
            {"method": "a", "seed": 1, "history": history[:2], "seconds_per_step": 0.3}]
    row = summarize(runs[:1], target=0.9)["a"]
    assert (row["tokens_to_target"], row["steps_to_target"], row["seconds_to_target"]) == (200, 2, 0.2)
    assert (row["accuracy_before"], row["accuracy"], row["reverse_kl"]) == (0.1, 0.9, 0.2)
    both = summarize(runs, target=0.9)["a"]  # one seed never reaches it: no mean over the ones that did
    assert (both["reached"], both["tokens_to_target"], both["seconds_per_step"]) == (1, None, pytest.approx(0.2))


def test_each_method_is_reported_at_the_rate_with_its_best_mean_final_accuracy_then_its_lower_kl():
    def run(method, rate, seed, accuracy, reverse_kl):
        history = [{"step": 0, "generated_tokens": 0, "train_seconds": 0.0, "accuracy": 0.0, "reverse_kl_exact": 2.0},
                   {"step": 1, "generated_tokens": 9, "train_seconds": 1.0, "accuracy": accuracy,
                    "reverse_kl_exact": reverse_kl}]
        return {"method": method, "learning_rate": rate, "seed": seed, "history": history, "seconds_per_step": 1.0}

    runs = [run("a", 1e-3, 0, 0.9, 0.1), run("a", 1e-3, 1, 0.1, 0.1),  # mean 0.5, though one seed is the best run
            run("a", 3e-3, 0, 0.6, 0.3), run("a", 3e-3, 1, 0.6, 0.3),  # mean 0.6: the best rate
            run("b", 1e-3, 0, 0.5, 0.2), run("b", 3e-3, 0, 0.5, 0.1)]  # a tie on accuracy: the lower KL
    assert best_learning_rates(runs) == {"a": 3e-3, "b": 3e-3}
    assert at_best_rate(runs) == [runs[2], runs[3], runs[5]]
    assert summarize(at_best_rate(runs), target=1.0)["a"]["accuracy"] == pytest.approx(0.6)


def test_a_sweep_measures_the_untrained_student_once_and_that_is_each_run_s_first_point(tiny_task):
    # a sweep's baselines measure the untrained student once (benchmarks/reasoning_benchmark.py); each run then starts
    # its curve from them. Valid because a LoRA student before its first step is that student: the same answers,
    # the same numbers, as measured in the run itself
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.rewards import accuracy_reward

    from trl_opd.evaluation import heldout_reverse_kl

    inputs = task_inputs(tiny_task)
    heldout = inputs["heldout"][:8]
    tokenizer = AutoTokenizer.from_pretrained(inputs["student"])
    fresh = AutoModelForCausalLM.from_pretrained(inputs["student"], dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(inputs["teacher"], dtype=torch.float32).eval()
    baseline = heldout_reverse_kl(fresh, teacher, tokenizer, [row["prompt"] for row in heldout], max_new_tokens=40,
                                  seed=1234, solutions=[row["solution"] for row in heldout],
                                  accuracy_func=accuracy_reward, greedy_accuracy=True)
    options = dict(steps=1, eval_every=1, eval_prompts=8, batch_size=8, lora_r=4, greedy_accuracy=True)
    measured = run_method("opd", **inputs, **options)["history"][0]
    for key in ("accuracy", "accuracy_greedy"):
        assert measured[key] == baseline[key]
    assert measured["reverse_kl_exact"] == pytest.approx(baseline["reverse_kl_exact"], rel=1e-5)
    given = run_method("opd", **inputs, **options, initial={**baseline, "accuracy": 0.125})["history"]
    assert given[0] == {"step": 0, **baseline, "accuracy": 0.125, "train_seconds": 0.0, "generated_tokens": 0}
    assert [entry["step"] for entry in given] == [0, 1] and given[1]["generated_tokens"] > 0


def _reasoning_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "reasoning_benchmark.py"
    spec = importlib.util.spec_from_file_location("reasoning_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its functions only: nothing runs at import
    return module


def test_the_reasoning_table_takes_seconds_from_the_timing_pass_and_errors_over_every_answer():
    bench = _reasoning_benchmark()

    def run(method, rate, seed, curve, seconds_per_step):
        history = [{"step": 10 * i, "accuracy": a, "accuracy_greedy": a, "reverse_kl_exact": 1.0 - a,
                    "train_seconds": 10 * i * seconds_per_step} for i, a in enumerate(curve)]
        return {"method": method, "learning_rate": rate, "seed": seed, "history": history, "peak_rss_mib": 1.0,
                "seconds_per_step": seconds_per_step, "teacher_generation_seconds": 0.0}

    results = {"settings": {"eval_prompts": 100, "steps": 20, "batch_size": 8},
               "baselines": {"student": {"accuracy": 0.2}, "teacher": {"accuracy": 0.6}},  # half the gap: 0.4
               "runs": [run("opd", 1e-4, 0, [0.2, 0.3, 0.5], 40.0), run("opd", 1e-4, 1, [0.2, 0.5, 0.5], 60.0),
                        run("opd", 3e-4, 0, [0.2, 0.2, 0.2], 40.0), run("sft", 1e-4, 0, [0.2, 0.3, 0.3], 9.0)],
               # SFT timed at its chosen rate, OPD at a rate not chosen: OPD keeps its runs' own seconds
               "timing": {"sft": {"learning_rate": 1e-4, "seconds_per_step": 3.0, "teacher_seconds_per_answer": 0.5},
                          "opd": {"learning_rate": 3e-4, "seconds_per_step": 1.0, "teacher_seconds_per_answer": 0.0}}}
    rows = bench.summary(results)
    opd, sft = rows["opd"], rows["sft"]
    assert opd["learning_rate"] == 1e-4 and opd["seeds"] == [0, 1]
    assert opd["accuracy"] == pytest.approx(0.5) and opd["accuracy_range"] == (0.5, 0.5)
    assert opd["accuracy_stderr"] == pytest.approx((0.5 * 0.5 / 200) ** 0.5)  # 100 prompts x 2 seeds
    assert opd["steps_to_half_gap"] == 10  # the mean curve: 0.2, 0.4, 0.5
    assert opd["seconds_per_step"] == pytest.approx(50.0)
    assert sft["steps_to_half_gap"] is None
    assert (sft["seconds_per_step"], sft["teacher_generation_seconds"]) == (3.0, 0.5 * 20 * 8)
