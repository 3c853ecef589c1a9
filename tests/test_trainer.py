"""OPDTrainer end to end on the tiny pair: the loss by hand, training runs, metrics, and the failures users hit."""

import inspect
import math

import pytest
import torch
from datasets import Dataset

from trl_opd import OPDTrainer

REQUIRED_METRICS = (
    "opd/reverse_kl", "opd/reverse_kl_std", "opd/teacher_logp", "opd/student_logp", "opd/advantage_mean",
    "opd/teacher_agreement", "opd/teacher_entropy",
    "data/completion_tokens_total", "data/completion_tokens_mean", "data/completion_tokens_per_second",
)


def _trainer(tiny, prompts, config, teacher=None, **kwargs):
    return OPDTrainer(
        model=str(tiny / "student"),
        teacher_model=str(tiny / "teacher") if teacher is None else teacher,
        args=config,
        train_dataset=prompts,
        **kwargs,
    )


@pytest.mark.parametrize(
    "objective, expected",
    [
        # A = [1, -1, 2], r = [1.5, 0.5, 1.0], epsilon 0.2. Clipped: -min(rA, clip(r)A) = [-1.2, 0.8, -2],
        # mean over the 3 unmasked tokens = -0.8. Unclipped: -rA = [-1.5, 0.5, -2] -> -1.0.
        ("clipped", -0.8),
        ("importance_sampling", -1.0),
    ],
)
def test_loss_equals_the_hand_computed_objective(tiny, prompts, make_config, objective, expected):
    trainer = _trainer(tiny, prompts.select(range(4)), make_config(opd_objective=objective, loss_type="dapo"))
    model = trainer.model
    model.eval()  # no accumulation scaling: the loss is the plain token mean
    prompt_ids = torch.tensor([[1, 263, 264, 201]])
    completion_ids = torch.tensor([[272, 260, 291, 287]])
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.tensor([[1, 1, 1, 0]])
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), 4
        )
    ratio = torch.tensor([[1.5, 0.5, 1.0, 10.0]])  # the last token is masked: its huge ratio and A must not count
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "old_per_token_logps": logps - ratio.log(),
        "advantages": torch.tensor([[1.0, -1.0, 2.0, 100.0]]),
        "num_items_in_batch": torch.tensor(3.0),
    }
    loss = trainer.compute_loss(model, inputs)
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_short_run_trains_the_student_and_logs_every_opd_metric(tiny, prompts, make_config, capsys):
    trainer = _trainer(tiny, prompts, make_config(max_steps=4, learning_rate=1e-2))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert f"On-policy distillation plan (trl_opd.trainer.plan):\n{trainer.plan.describe()}" in capsys.readouterr().out

    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    logs = [entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry]
    assert len(logs) == 4
    for entry in logs:
        assert set(REQUIRED_METRICS) <= set(entry)
        assert math.isfinite(entry["opd/reverse_kl"]) and entry["opd/reverse_kl"] > 0
        assert 0.0 <= entry["opd/teacher_agreement"] <= 1.0
        assert not {"reward", "reward_std", "frac_reward_zero_std"} & set(entry)  # no fake reward in the logs
    # the total counts every sampled token: it grows by each step's batch x mean length
    assert logs[0]["data/completion_tokens_total"] == pytest.approx(4 * logs[0]["data/completion_tokens_mean"])
    assert logs[-1]["data/completion_tokens_total"] > logs[0]["data/completion_tokens_total"]
    assert logs[0]["data/completion_tokens_per_second"] > 0
    # the teacher is frozen and not part of what gets saved
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())


def test_text_prompts_train_as_well_as_chat_prompts(tiny, make_config):
    text_prompts = Dataset.from_dict({"prompt": [f"What is {i} plus {i}?" for i in range(8)]})
    trainer = _trainer(tiny, text_prompts, make_config(max_steps=1))
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["opd/reverse_kl"])


def test_teacher_equal_to_student_gives_zero_kl_at_the_first_step(tiny, prompts, make_config):
    trainer = _trainer(tiny, prompts, make_config(max_steps=1), teacher=str(tiny / "student"))
    trainer.train()
    first = next(entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry)
    assert first["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert first["opd/reverse_kl_std"] == pytest.approx(0.0, abs=1e-3)
    assert first["opd/advantage_mean"] == pytest.approx(0.0, abs=1e-5)
    assert first["opd/teacher_logp"] == pytest.approx(first["opd/student_logp"], abs=1e-5)


def test_teacher_is_scored_once_per_generation_batch(tiny, prompts, make_config):
    # 2 optimizer steps x 2 accumulation micro-steps, one generation per 2 micro-steps: 2 generation batches of 8
    config = make_config(max_steps=2, gradient_accumulation_steps=2, steps_per_generation=2, teacher_batch_size=8)
    trainer = _trainer(tiny, prompts, config)
    calls = []
    trainer.teacher_model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    trainer.train()
    assert calls == [8, 8]


def test_non_finite_teacher_logps_stop_training_with_the_step(tiny, prompts, make_config):
    trainer = _trainer(tiny, prompts, make_config(max_steps=2))
    real_score = trainer.teacher.score

    def poisoned(*args):  # fault injection: a teacher returning NaN on one sampled token
        scores = real_score(*args)
        scores.logps[0, 0] = math.nan
        return scores

    trainer.teacher.score = poisoned
    with pytest.raises(FloatingPointError, match=r"Step 0: non-finite log-probs on sampled tokens \(teacher: 1"):
        trainer.train()


def test_num_generations_one_is_allowed_and_groups_still_work(make_config):
    assert make_config(num_generations=1, per_device_train_batch_size=3).num_generations == 1
    assert make_config(num_generations=4, per_device_train_batch_size=4).num_generations == 4
    with pytest.raises(ValueError, match="divisible by num_generations"):
        make_config(num_generations=4, per_device_train_batch_size=3)


# ---------------------------------------------------------------------------------------------- errors at start-up


def test_mismatched_tokenizer_fails_naming_both_models_and_the_token(tiny, prompts, make_config, tmp_path):
    from trl_opd.tiny import build_model, build_tokenizer

    other = build_tokenizer(vocab_size=300)  # other merges: the same ids mean other strings
    build_model(other).save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    message = r"student \(.*student\) and teacher \(.*other\) tokenizers differ: token id \d+ is '.*' for the student"
    with pytest.raises(ValueError, match=message):
        _trainer(tiny, prompts, make_config(), teacher=str(tmp_path / "other"))


def test_teacher_with_smaller_vocabulary_fails(tiny, tokenizer, prompts, make_config, tmp_path):
    from trl_opd.tiny import build_model

    small = build_model(tokenizer, vocab_size=len(tokenizer) - 10)
    small.save_pretrained(tmp_path / "small")
    tokenizer.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match=rf"outputs {len(tokenizer) - 10} logits .* can sample {len(tokenizer)}"):
        _trainer(tiny, prompts, make_config(), teacher=str(tmp_path / "small"))


def test_missing_prompt_column_and_empty_dataset_fail(tiny, make_config):
    questions = Dataset.from_dict({"question": ["What is 1 plus 1?"]})
    with pytest.raises(ValueError, match=r"no 'prompt' column \(columns: \['question'\]\).*prompt_column"):
        _trainer(tiny, questions, make_config())
    with pytest.raises(ValueError, match="train_dataset is empty"):
        _trainer(tiny, Dataset.from_dict({"prompt": []}), make_config())


def test_missing_teacher_fails(tiny, prompts, make_config):
    with pytest.raises(ValueError, match="needs a teacher"):
        OPDTrainer(model=str(tiny / "student"), args=make_config(), train_dataset=prompts)


def test_checkpoints_hold_the_student_and_its_state_but_never_the_teacher(tiny, prompts, make_config):
    from pathlib import Path

    from safetensors import safe_open

    trainer = _trainer(tiny, prompts, make_config(max_steps=1, save_strategy="steps", save_steps=1))
    trainer.train()
    checkpoint = Path(trainer.args.output_dir) / "checkpoint-1"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= files
    with safe_open(checkpoint / "model.safetensors", "pt") as saved:
        shapes = {name: tuple(saved.get_slice(name).get_shape()) for name in saved.keys()}
    assert shapes == {name: tuple(p.shape) for name, p in trainer.model.state_dict().items()}
    assert not any(96 in shape for shape in shapes.values())  # the teacher's hidden size is 96, the student's 64


def test_accuracy_is_logged_in_training_and_evaluation_and_never_trained_on(tiny, prompts, make_config):
    returned = {"train": [], "eval": []}

    def parity(completions, answer, **kwargs):  # a checker whose values the test can see: 1 for even-length answers
        values = [float(len(completion[-1]["content"]) % 2 == 0) for completion in completions]
        returned["train" if trainer.model.training else "eval"].append(sum(values) / len(values))
        return values

    trainer = OPDTrainer(
        model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
        eval_dataset=prompts.select(range(8)), accuracy_func=parity,
        args=make_config(max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4),
    )
    assert trainer.reward_funcs == []  # a metric, not a reward
    trainer.train()
    train_logs = [entry for entry in trainer.state.log_history if "accuracy" in entry]
    eval_logs = [entry for entry in trainer.state.log_history if "eval_accuracy" in entry]
    assert [entry["accuracy"] for entry in train_logs] == pytest.approx(returned["train"])
    assert eval_logs[0]["eval_accuracy"] == pytest.approx(sum(returned["eval"]) / len(returned["eval"]))
    assert math.isfinite(eval_logs[0]["eval_opd/reverse_kl"])
    assert all("reward" not in name for entry in train_logs for name in entry)  # no reward metrics: nothing trained


def test_the_loss_forward_instruction_projects_observes_and_reuses_as_told():
    from trl_opd.trainer.grpo_calls import LossForward

    grpo_calls, observed = [], []

    def grpo(x):
        grpo_calls.append(x)
        return torch.tensor([float(x)], requires_grad=True), None, None

    # compact replaces GRPO's projection; the observer sees the result detached, before anyone else reads it
    forward = LossForward(compact=lambda x: (torch.tensor([10.0 * x], requires_grad=True), None, None),
                          observe=observed.append)
    assert forward.run(grpo, 2)[0].item() == 20.0 and grpo_calls == []
    assert observed[0].item() == 20.0 and not observed[0].requires_grad
    # reuse: two objectives, one forward: GRPO's call runs once, and the observer once
    observed.clear()
    forward = LossForward(observe=observed.append, reuse=True)
    first, second = forward.run(grpo, 3), forward.run(grpo, 4)
    assert grpo_calls == [3] and first is second and len(observed) == 1
    # no instruction but the default: GRPO's call, every time
    forward = LossForward()
    forward.run(grpo, 5), forward.run(grpo, 6)
    assert grpo_calls == [3, 5, 6]


def test_grpo_attributes_are_restored_however_the_block_ends_and_unknown_ones_refused():
    from trl_opd.trainer.grpo_calls import grpo_attributes

    class Trainer:
        beta, epsilon_low = 0.1, 0.2

    trainer = Trainer()
    with pytest.raises(RuntimeError, match="inside"):
        with grpo_attributes(trainer, beta=0.0, epsilon_low=1.0):
            assert (trainer.beta, trainer.epsilon_low) == (0.0, 1.0)
            raise RuntimeError("inside")
    assert (trainer.beta, trainer.epsilon_low) == (0.1, 0.2)
    with pytest.raises(AttributeError, match="no attribute epsilon_hi"):  # a renamed attribute steers nothing
        with grpo_attributes(trainer, epsilon_hi=1.0):
            pass
    assert not hasattr(trainer, "epsilon_hi")


def _digit_reward(completions, **kwargs):
    return [float(any(ch.isdigit() for ch in str(c))) for c in completions]


@pytest.mark.parametrize("options", [dict(), dict(opd_estimator="topk", opd_topk=4),
                                     dict(opd_estimator="full", num_generations=2, opd_reward_combination="loss"),
                                     dict(steps_per_generation=2, gradient_accumulation_steps=1)],
                         ids=["sampled", "topk deferred", "full with rewards", "at generation"])
def test_the_batch_opd_hands_to_the_loss_holds_only_the_keys_its_table_declares(tiny, prompts, make_config, options):
    from trl import GRPOTrainer

    from trl_opd.trainer.batch import GRPO_KEYS_SET, OPD_KEYS

    rewards = [_digit_reward] if options.get("num_generations") else None
    trainer = _trainer(tiny, prompts, make_config(max_steps=1, **options), reward_funcs=rewards)
    rows = [prompts[i] for i in range(4)]
    grpo_keys = set(GRPOTrainer._generate_and_score_completions(trainer, rows))
    output = trainer._generate_and_score_completions(rows)
    assert set(output) - grpo_keys <= set(OPD_KEYS) | set(GRPO_KEYS_SET), set(output) - grpo_keys - set(OPD_KEYS)
    assert set(GRPO_KEYS_SET) - {"old_per_token_logps"} <= set(output)


def test_pass_sums_add_up_one_pass_over_a_generation_batch_then_start_again():
    from trl_opd.trainer.metrics import PassSums

    # 4 rows here in micro-batches of 2: the sums of both come back with the second, and a second pass starts at 0
    sums = PassSums(rows=4)
    assert sums.add(torch.tensor([1.0, 2.0]), rows=2) is None
    assert sums.add(torch.tensor([3.0, 5.0]), rows=2).tolist() == [4.0, 7.0]
    assert sums.add(torch.tensor([1.0, 1.0]), rows=2) is None
    assert sums.add(torch.tensor([1.0, 1.0]), rows=2).tolist() == [2.0, 2.0]


@pytest.mark.parametrize("estimator", ["sampled", "full"])
def test_completion_tokens_are_counted_once_per_generation_batch(tiny, prompts, make_config, estimator):
    # each generation batch is trained on twice within one optimizer step (num_iterations=2, 2 micro-batches each,
    # accumulation 4: GRPO's aligned case, no old log-probs); its tokens count once (old main: twice with a dense term
    # alone, whose metrics are logged from each loss forward)
    config = make_config(max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                         steps_per_generation=2, num_iterations=2, opd_estimator=estimator)
    trainer = _trainer(tiny, prompts, config)
    counted, original = [], trainer._generate_and_score_completions

    def record(inputs):
        output = original(inputs)
        if trainer.model.training:
            counted.append(int(output["action_mask"].sum()))
        return output

    trainer._generate_and_score_completions = record
    trainer.train()
    totals = [entry["data/completion_tokens_total"] for entry in trainer.state.log_history
              if "data/completion_tokens_total" in entry]
    assert len(counted) == 2
    assert totals[-1] == sum(counted)


# ---------------------------------------------------------------------------------------------- GRPO's arguments


def test_every_grpo_constructor_argument_is_accepted_and_passed_on(tiny, prompts, make_config, monkeypatch):
    # a GRPOTrainer(...) call ported to OPDTrainer must keep working: every argument reaches GRPO's constructor, here
    # recorded and stopped there. A TRL release that adds one fails this until OPD takes it too.
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from trl_opd.tiny import arithmetic_answer_reward

    class Recorded(Exception):
        pass

    received = {}

    def record(self, **kwargs):
        received.update(kwargs)
        raise Recorded

    class Environment:
        def reset(self, **kwargs):
            return None

    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first. b: the second.
        """
        return a + b

    def rollout(prompts, trainer):
        return {}

    tokenizer = AutoTokenizer.from_pretrained(tiny / "student")
    tokenizer.response_template = object()  # stands in for a tool-call parser, which tools require of the tokenizer
    given = dict(
        model=str(tiny / "student"), reward_funcs=[arithmetic_answer_reward], args=make_config(num_generations=2),
        train_dataset=prompts, eval_dataset=prompts.select(range(4)), processing_class=tokenizer,
        reward_processing_classes=[object()], callbacks=[object()], optimizers=(object(), object()),
        quantization_config=object(), peft_config=object(), tools=[add], rollout_func=rollout,
        environment_factory=Environment,
    )
    grpo_parameters = [name for name in inspect.signature(GRPOTrainer.__init__).parameters if name != "self"]
    assert sorted(given) == sorted(grpo_parameters)  # the test gives each of GRPO's arguments a value of its own
    assert [name for name in grpo_parameters if name not in inspect.signature(OPDTrainer.__init__).parameters] == []

    monkeypatch.setattr(GRPOTrainer, "__init__", record)
    with pytest.raises(Recorded):
        OPDTrainer(teacher_model=str(tiny / "teacher"), **given)
    assert sorted(received) == sorted(grpo_parameters)
    assert received.pop("reward_funcs") == given["reward_funcs"]  # a copy of the list
    assert received.pop("rollout_func").__wrapped__ is rollout  # wrapped by `action_mask_as_env_mask`
    resolved = received.pop("args")  # the config with the estimator's defaults filled in (`OPDConfig.resolved`)
    assert (given["args"].opd_estimator, given["args"].opd_coef) == ("sampled", None)
    assert vars(resolved) == {**vars(given["args"]), "opd_coef": 1.0}  # the sampled estimator's default weight
    assert {name: value for name, value in received.items() if value is not given[name]} == {}


def test_a_reward_model_reads_the_completions_with_its_own_tokenizer(tiny, prompts, make_config):
    # a reward model of another family than the student: GRPO renders each conversation with the tokenizer given for
    # it in reward_processing_classes (its chat template, its ids), never the student's
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

    from trl_opd.tiny import other_family_tokenizer

    reward_tokenizer = other_family_tokenizer()
    torch.manual_seed(0)
    reward_model = Qwen3ForSequenceClassification(Qwen3Config(
        vocab_size=len(reward_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=1))
    trainer = _trainer(tiny, prompts, make_config(max_steps=1, num_generations=2), reward_funcs=[reward_model],
                       reward_processing_classes=[reward_tokenizer])
    assert trainer.reward_processing_classes == [reward_tokenizer]
    read = []
    trainer.reward_funcs[0].register_forward_pre_hook(
        lambda module, args, kwargs: read.append((kwargs["input_ids"], kwargs["attention_mask"])), with_kwargs=True)
    trainer.train()

    (input_ids, attention_mask), = read
    assert input_ids.shape[0] == 4
    student_tokenizer = AutoTokenizer.from_pretrained(tiny / "student")
    for ids, mask in zip(input_ids, attention_mask, strict=True):
        ids = ids[mask.bool()].tolist()
        text = reward_tokenizer.decode(ids)
        assert text.startswith("<|user|>\nWhat is ") and "<|end|>\n<|assistant|>\n" in text  # its own template
        assert "<|im_start|>" not in text
        assert reward_tokenizer(text, add_special_tokens=False).input_ids == ids  # its own ids
        assert student_tokenizer(text, add_special_tokens=False).input_ids != ids


def test_reward_processing_classes_without_reward_functions_are_refused(tiny, prompts, make_config, tokenizer):
    with pytest.raises(ValueError, match="reward_processing_classes .* reward_funcs"):
        _trainer(tiny, prompts, make_config(), reward_processing_classes=[tokenizer])
