"""Multi-turn rollouts: only the tokens the student sampled are distilled; observations are context only."""

import math
import re

import pytest
import torch

from trl_opd import OPDTrainer

# What code appends between two student turns: the observation message and the next assistant header
OBSERVED = "Observation: 7"
OBSERVATION = f"\n<|im_start|>user\n{OBSERVED}<|im_end|>\n<|im_start|>assistant\n"


def scripted_rollout(prompts, trainer):
    """GRPO's `rollout_func` path: even rows are two student turns around an observation, with an `action_mask`;
    odd rows are one turn and carry no mask (the trainer falls back to the completion mask there).

    A turn that stopped at the token limit gets its end-of-turn token appended by code, masked 0 like the
    observation; one the student ended itself keeps its sampled end-of-turn token, masked 1.
    """
    tokenizer = trainer.processing_class
    model = trainer.accelerator.unwrap_model(trainer.model)
    eos, observation = tokenizer.eos_token_id, tokenizer.encode(OBSERVATION)

    def turn(ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=True, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
        return out[0, len(ids):].tolist()

    def said(ids: list[int]) -> dict:
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}

    result = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "action_mask": [], "completion_messages": []}
    for i, prompt in enumerate(prompts):
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"]
        first = turn(prompt_ids, 6)
        if i % 2:
            completion, mask, messages = first, None, [said(first)]
        else:
            closing = [] if first[-1] == eos else [eos]  # appended by code, not sampled
            context = first + closing + observation
            second = turn(prompt_ids + context, 6)
            completion = context + second
            mask = [1] * len(first) + [0] * (len(closing) + len(observation)) + [1] * len(second)
            messages = [said(first), {"role": "user", "content": OBSERVED}, said(second)]
        result["prompt_ids"].append(prompt_ids)
        result["completion_ids"].append(completion)
        result["action_mask"].append(mask)
        result["completion_messages"].append(messages)
    return result


def _trainer(tiny, prompts, make_config, **overrides):
    config = make_config(max_completion_length=64, per_device_train_batch_size=4, **overrides)
    return OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                      train_dataset=prompts, rollout_func=scripted_rollout)


def _batch(trainer, prompts):
    torch.manual_seed(0)
    rows = [dict(prompts[i]) for i in range(4)]
    return rows, trainer._generate_and_score_completions(rows)


@pytest.mark.parametrize("estimator", ["sampled", "topk", "full"])
def test_no_gradient_reaches_observation_or_template_positions(tiny, prompts, make_config, estimator):
    trainer = _trainer(tiny, prompts, make_config, opd_estimator=estimator)
    rows, batch = _batch(trainer, prompts)
    mask = batch["action_mask"]
    assert (mask == 0).logical_and(batch["completion_mask"] == 1).any(), "the batch must hold observations"

    # the final hidden state at a position feeds only that position's logits, so its gradient is zero exactly when
    # the gradient of the loss with respect to those logits is
    hidden = []
    student = trainer.accelerator.unwrap_model(trainer.model)
    hook = student.model.register_forward_hook(
        lambda module, args, out: hidden.append(out.last_hidden_state) or out.last_hidden_state.retain_grad()
    )
    try:
        trainer.compute_loss(trainer.model, batch).backward()
    finally:
        hook.remove()
    num_prompt, num_completion = batch["prompt_ids"].size(1), batch["completion_ids"].size(1)
    grad = hidden[0].grad[:, num_prompt - 1 : num_prompt + num_completion - 1].abs().sum(-1)  # (B, T)
    assert grad[mask == 0].max() == 0  # observations, template tokens, padding: exactly zero
    assert (grad[mask == 1] > 0).all()  # every sampled token: non-zero


def test_teacher_scores_actions_with_the_whole_sequence_as_context(tiny, prompts, make_config):
    trainer = _trainer(tiny, prompts, make_config)
    _, batch = _batch(trainer, prompts)
    scores = trainer.teacher.score(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                                   batch["completion_mask"])
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():  # one plain forward of the teacher over prompt, turns and observations together
        logits = trainer.teacher_model(input_ids=input_ids, attention_mask=attention_mask).logits
    num_completion = batch["completion_ids"].size(1)
    logps = logits[:, -num_completion - 1 : -1].log_softmax(-1)
    expected = logps.gather(-1, batch["completion_ids"][..., None])[..., 0]
    actions = batch["action_mask"].bool()
    torch.testing.assert_close(scores.logps[actions], expected[actions], atol=1e-5, rtol=1e-5)


def test_grpo_reads_a_rollout_s_action_mask_as_its_env_mask(tiny, prompts, make_config):
    # GRPO computes from its mask of sampled tokens before this package reads the batch: vLLM's importance-sampling
    # ratio (old main summed it over the observations too, which can mask a whole multi-turn row out) and the logged
    # completion lengths, which show the mask it read
    trainer = _trainer(tiny, prompts, make_config)
    rows, batch = _batch(trainer, prompts)
    lengths = [int(batch["completion_mask"][i].sum()) if row["action_mask"] is None else sum(row["action_mask"])
               for i, row in enumerate(rows)]
    assert sum(lengths) < batch["completion_mask"].sum()  # the observations are left out: the check can fail
    mode = "train" if trainer.model.training else "eval"
    assert trainer._metrics[mode]["completions/mean_length"][-1] == pytest.approx(sum(lengths) / len(lengths))


def test_mixed_batch_trains_with_the_fallback_mask_on_rows_without_one(tiny, prompts, make_config):
    trainer = _trainer(tiny, prompts, make_config, max_steps=2)
    rows, batch = _batch(trainer, prompts)
    for i, row in enumerate(rows):
        length = int(batch["completion_mask"][i].sum())
        expected = batch["completion_mask"][i] if row["action_mask"] is None else torch.tensor(
            row["action_mask"] + [0] * (batch["completion_mask"].size(1) - length)
        )
        assert torch.equal(batch["action_mask"][i], expected)
    assert batch["num_items_in_batch"] == batch["action_mask"].sum()

    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    logs = [entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["opd/reverse_kl"]) for entry in logs)
    assert all(0.0 < entry["opd/action_token_fraction"] < 1.0 for entry in logs)


def test_an_action_mask_of_the_wrong_length_is_refused(tiny, prompts, make_config):
    def bad_rollout(prompts, trainer):
        result = scripted_rollout(prompts, trainer)
        result["action_mask"][0] = result["action_mask"][0][:-1] if result["action_mask"][0] else [1]
        return result

    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                         args=make_config(max_completion_length=64), rollout_func=bad_rollout)
    with pytest.raises(ValueError, match=r"Row 0: the rollout's action_mask has \d+ entries but its completion has"):
        trainer._generate_and_score_completions([dict(prompts[i]) for i in range(4)])


@pytest.mark.parametrize("path", ["environment_factory", "tools"])
def test_tool_rollouts_distil_only_what_the_student_sampled(tiny_agent, make_config, path):
    from datasets import load_dataset

    from trl_opd.envs import ARITHMETIC_TOOLS, ArithmeticToolEnv
    from trl_opd.trainer.multiturn import render_action_mask

    prompts = load_dataset("json", data_files=str(tiny_agent / "train.jsonl"), split="train")
    multi_turn = {"environment_factory": ArithmeticToolEnv} if path == "environment_factory" else {
        "tools": ARITHMETIC_TOOLS}
    trainer = OPDTrainer(
        model=str(tiny_agent / "student"), teacher_model=str(tiny_agent / "teacher"), train_dataset=prompts,
        args=make_config(max_steps=2, per_device_train_batch_size=8, max_completion_length=128,
                         max_tool_calling_iterations=3, opd_estimator=None),  # the default: full, one local teacher
        **multi_turn,
    )
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions([dict(prompts[i]) for i in range(8)])
    tokenizer, eos = trainer.processing_class, trainer.processing_class.eos_token_id
    observations = 0
    for ids, completion_mask, mask in zip(batch["completion_ids"], batch["completion_mask"], batch["action_mask"],
                                          strict=True):
        ids, mask = ids[completion_mask.bool()].tolist(), mask[completion_mask.bool()].tolist()
        text = render_action_mask(tokenizer, ids, mask, context=("[", "]"))
        # outside the brackets: the student's turns, each ending with the end-of-turn token it sampled; inside: one
        # tool result and the template tokens around it, never anything the student sampled
        for span in re.findall(r"\[(.*?)\]", text, flags=re.DOTALL):
            assert re.fullmatch(r"\n<\|im_start\|>tool\n.*<\|im_end\|>\n<\|im_start\|>assistant\n", span, re.DOTALL)
            observations += 1
        starts = [t for t in range(1, len(mask)) if mask[t - 1] == 1 and mask[t] == 0]
        assert all(ids[t - 1] == eos for t in starts)
    assert observations > 0, "no rollout called a tool"
    if path == "tools":
        return  # the same tool loop as the environment's; training is checked once

    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    logs = [entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry]
    assert all(math.isfinite(entry["opd/reverse_kl"] + entry["opd/reverse_kl_dense"]) for entry in logs)
    assert all(0.0 < entry["opd/action_token_fraction"] < 1.0 for entry in logs)


def test_an_observation_longer_than_the_completion_budget_is_dropped_and_its_rollout_ends_at_the_call(
        tiny_agent, make_config):
    """A tool result that would push the completion past max_completion_length (a fault injected: every result is
    4000 characters) is never shown, scored or trained on: GRPO's tool loop drops it and the rollout ends with the
    student's call, which is still distilled like any turn it sampled."""
    from datasets import load_dataset

    from trl_opd.envs import ArithmeticToolEnv

    flood = "9" * 4000

    class FloodingToolEnv(ArithmeticToolEnv):
        def _serve(self, name, a, b, result):
            super()._serve(name, a, b, result)
            return flood

    prompts = load_dataset("json", data_files=str(tiny_agent / "train.jsonl"), split="train")
    trainer = OPDTrainer(
        model=str(tiny_agent / "student"), teacher_model=str(tiny_agent / "teacher"), train_dataset=prompts,
        environment_factory=FloodingToolEnv,
        args=make_config(max_steps=1, per_device_train_batch_size=8, max_completion_length=128,
                         max_tool_calling_iterations=3, opd_estimator=None),
    )
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions([dict(prompts[i]) for i in range(8)])
    called = [bool(environment.calls) for environment in trainer.environments]
    assert any(called), "no rollout called a tool"
    tokenizer = trainer.processing_class
    for row, ids, completion_mask, mask in zip(range(8), batch["completion_ids"], batch["completion_mask"],
                                               batch["action_mask"], strict=True):
        valid = completion_mask.bool()
        assert mask[valid].all(), f"rollout {row}: a position outside the student's own tokens"
        text = tokenizer.decode(ids[valid])
        assert "9999" not in text and "<|im_start|>tool" not in text
        if called[row]:  # it ends with its call: the end-of-turn token it sampled, nothing after
            assert "<tool_call>" in text and ids[valid][-1] == tokenizer.eos_token_id
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry]
    assert logs and all(math.isfinite(entry["loss"] + entry["opd/reverse_kl"]) for entry in logs)
    assert all(entry["opd/action_token_fraction"] == 1.0 for entry in logs)  # no observation left in any rollout


def test_untagged_tool_calls_reach_the_tool_loop_and_are_refused_without_one(tiny_agent, tiny, prompts, make_config):
    from datasets import load_dataset
    from trl.chat_template_utils import parse_response

    from trl_opd.envs import ArithmeticToolEnv

    rows = load_dataset("json", data_files=str(tiny_agent / "train.jsonl"), split="train")
    bare = '{"name": "add", "arguments": {"a": 3, "b": 4}}'
    call = [{"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}]
    for untagged in (False, True):
        trainer = OPDTrainer(model=str(tiny_agent / "student"), teacher_model=str(tiny_agent / "teacher"),
                             train_dataset=rows, environment_factory=ArithmeticToolEnv,
                             args=make_config(untagged_tool_calls=untagged))
        tokenizer = trainer._tokenizer  # the one GRPO's tool loop parses with
        ids = tokenizer(bare + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        prefix = tokenizer.apply_chat_template(rows[0]["prompt"], tokenize=True, add_generation_prompt=True,
                                               return_dict=False)
        assert parse_response(tokenizer, ids, prefix=prefix).get("tool_calls") == (call if untagged else None)
    # a rollout function parses its own calls: the option would do nothing there
    with pytest.raises(ValueError, match="untagged_tool_calls parses tool calls for GRPO's tool loop"):
        _trainer(tiny, prompts, make_config, untagged_tool_calls=True)


def test_render_action_mask_brackets_what_is_not_distilled(tokenizer):
    from trl_opd.trainer.multiturn import render_action_mask

    ids = tokenizer.encode("The answer" + OBSERVATION + "is 7.")
    observation = len(tokenizer.encode("The answer")), len(tokenizer.encode("The answer" + OBSERVATION))
    mask = [0 if observation[0] <= i < observation[1] else 1 for i in range(len(ids))]
    assert render_action_mask(tokenizer, ids, mask) == f"The answer⟦{OBSERVATION}⟧is 7."


def test_an_environment_with_its_own_reward_needs_groups(tiny_agent, make_config):
    from datasets import load_dataset

    from trl_opd.envs import ArithmeticToolEnv

    class Rewarded(ArithmeticToolEnv):
        def get_reward(self) -> float:
            return 1.0

    prompts = load_dataset("json", data_files=str(tiny_agent / "train.jsonl"), split="train")
    with pytest.raises(ValueError, match=r"Reward functions need groups .* set num_generations >= 2"):
        OPDTrainer(model=str(tiny_agent / "student"), teacher_model=str(tiny_agent / "teacher"), train_dataset=prompts,
                   environment_factory=Rewarded, args=make_config(max_completion_length=128))


def _recorded_teacher_prompts(trainer, scorer=None):
    """Wraps the teacher's scorer (or `scorer`, e.g. the one a cross-tokenizer teacher wraps) to keep the prompt ids
    it is given (left padding removed)."""
    scorer = trainer.teacher if scorer is None else scorer
    seen, score = [], scorer.score

    def record(prompt_ids, prompt_mask, *args, **kwargs):
        seen.extend(ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True))
        return score(prompt_ids, prompt_mask, *args, **kwargs)

    scorer.score = record
    return seen


@pytest.mark.parametrize("teacher_prompt", ["teacher_system_prompt", "teacher_prompt_column"])
def test_the_teacher_sees_an_environments_reset_observation_with_its_own_context(tiny_agent, make_config,
                                                                                 teacher_prompt):
    # GRPO appends what reset() returns to the prompt's last message; the teacher-only prompt must keep it (old main
    # rebuilt the teacher's prompt from the dataset row and dropped it)
    from datasets import load_dataset

    from trl_opd.envs import ArithmeticToolEnv

    class Briefed(ArithmeticToolEnv):
        def reset(self, **row):
            super().reset(**row)
            return " Briefing: the tools are exact."

    system = "You are an expert."
    prompts = load_dataset("json", data_files=str(tiny_agent / "train.jsonl"), split="train").select(range(4))
    prompts = prompts.map(lambda row: {"teacher_prompt": [{"role": "system", "content": system}, *row["prompt"]]})
    option = {"teacher_system_prompt": system} if teacher_prompt == "teacher_system_prompt" else {
        "teacher_prompt_column": "teacher_prompt"}
    trainer = OPDTrainer(
        model=str(tiny_agent / "student"), teacher_model=str(tiny_agent / "teacher"), train_dataset=prompts,
        environment_factory=Briefed, args=make_config(max_completion_length=32, max_tool_calling_iterations=1,
                                                      **option),
    )
    seen = _recorded_teacher_prompts(trainer)
    torch.manual_seed(0)
    rows = [dict(prompts[i]) for i in range(4)]
    trainer._generate_and_score_completions(rows)
    tokenizer = trainer.processing_class
    for row, ids in zip(rows, seen, strict=True):
        user = {**row["prompt"][-1], "content": row["prompt"][-1]["content"] + " Briefing: the tools are exact."}
        expected = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, *row["prompt"][:-1], user], tools=trainer.tools or None,
            add_generation_prompt=True,
        )["input_ids"]
        assert ids == list(expected)


def test_a_truncated_completion_with_an_action_mask_is_masked_out_not_refused(tiny, prompts, make_config):
    # GRPO zeroes a truncated row's completion mask (mask_truncated_completions); old main then refused its
    # action_mask as having the wrong length
    trainer = _trainer(tiny, prompts, make_config, mask_truncated_completions=True)
    torch.manual_seed(0)
    rows, batch = _batch(trainer, prompts)
    truncated = [i for i in range(4) if batch["completion_mask"][i].sum() == 0]
    assert any(rows[i]["action_mask"] is not None for i in truncated), "no multi-turn row was truncated"
    for i in range(4):
        if i in truncated:
            assert batch["action_mask"][i].sum() == 0  # nothing of a masked-out row is distilled
        elif rows[i]["action_mask"] is not None:
            length = int(batch["completion_mask"][i].sum())
            assert batch["action_mask"][i, :length].tolist() == rows[i]["action_mask"]
    assert batch["num_items_in_batch"] == batch["action_mask"].sum()


def _own_rendering(prompts, trainer):
    """`scripted_rollout` with prompts the rollout rendered its own way (a prefix the trainer's template lacks)."""
    result = scripted_rollout(prompts, trainer)
    result["prompt_ids"] = [trainer.processing_class.encode("Q: ") + ids for ids in result["prompt_ids"]]
    return result


def test_a_teacher_only_prompt_needs_a_rollout_that_renders_prompts_like_the_trainer(tiny, prompts, make_config):
    # the teacher-only prompt is rendered with the trainer's template: that adds only the teacher's context if the
    # rollout rendered the student's prompt the same way; otherwise the two prompts would differ in more than that
    rows = [dict(prompts[i]) for i in range(4)]
    for rollout, fails in ((scripted_rollout, False), (_own_rendering, True)):
        trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                             args=make_config(max_completion_length=64, teacher_system_prompt="Be exact."),
                             rollout_func=rollout)
        seen = _recorded_teacher_prompts(trainer)
        torch.manual_seed(0)
        if fails:
            with pytest.raises(ValueError, match="Row 0: the rollout function's prompt_ids are not the student's"):
                trainer._generate_and_score_completions(rows)
            continue
        trainer._generate_and_score_completions(rows)
        system = [{"role": "system", "content": "Be exact."}]
        expected = [trainer.processing_class.apply_chat_template(system + row["prompt"], add_generation_prompt=True)[
            "input_ids"] for row in rows]
        assert seen == [list(ids) for ids in expected]


def _without_messages(prompts, trainer):
    """`scripted_rollout` without the completions' chat messages."""
    result = scripted_rollout(prompts, trainer)
    del result["completion_messages"]
    return result


def test_a_cross_tokenizer_teacher_needs_a_rollout_that_renders_prompts_like_the_trainer(tiny, tiny_other_teacher,
                                                                                          prompts, make_config):
    # a teacher with another tokenizer reads the prompt messages through its own template: that is the prompt the
    # student read only if the rollout rendered the messages as the trainer does; it reads the observations between
    # turns through its template too, from the messages the rollout returns
    from transformers import AutoTokenizer

    teacher_tokenizer = AutoTokenizer.from_pretrained(tiny_other_teacher)
    refusals = {_own_rendering: "Row 0: the rollout function's prompt_ids are not the student's",
                _without_messages: "Row 0: the completion has observations between the student's turns"}
    for rollout in (scripted_rollout, *refusals):
        trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny_other_teacher), train_dataset=prompts,
                             args=make_config(max_completion_length=64, teacher_tokenizer_mode="cross"),
                             rollout_func=rollout)
        seen = _recorded_teacher_prompts(trainer, trainer.teacher.scorer)
        completions, score = [], trainer.teacher.scorer.score

        def record(prompt_ids, prompt_mask, completion_ids, completion_mask, score=score, completions=completions):
            completions.extend(ids[mask.bool()].tolist() for ids, mask in zip(completion_ids, completion_mask,
                                                                               strict=True))
            return score(prompt_ids, prompt_mask, completion_ids, completion_mask)

        trainer.teacher.scorer.score = record
        rows = [dict(prompts[i]) for i in range(4)]  # GRPO adds a rollout's fields to them
        torch.manual_seed(0)
        if rollout in refusals:
            with pytest.raises(ValueError, match=refusals[rollout]):
                trainer._generate_and_score_completions(rows)
            continue
        trainer._generate_and_score_completions(rows)
        assert seen == [teacher_tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
                        for row in rows]
        observed = f"\n<|user|>\n{OBSERVED}<|end|>\n<|assistant|>\n"  # the teacher's template, not the student's
        for i, ids in enumerate(completions):
            text = teacher_tokenizer.decode(ids)
            assert f"<|im_start|>user\n{OBSERVED}" not in text
            assert (observed in text) == (i % 2 == 0)  # even rows are two turns around the observation
