"""Multi-turn rollouts: which completion tokens are the student's actions, and so are distilled.

A multi-turn completion interleaves what the student sampled (its turns, each ending with the end-of-turn token it
sampled) with what code added: tool or environment observations and the chat-template tokens around them (the
newline after an end-of-turn token, the observation's role header, the next assistant header). Only the sampled
tokens are actions. The teacher scores the whole sequence, observations included, as context; the advantage, the
loss and every `opd/*` metric count actions only.

Token ids are never re-tokenised: GRPO's tool loop appends observation ids to the sampled ids, and a rollout function
returns ids, so what is scored is exactly what was sampled.
"""

from __future__ import annotations

import functools
import json
import re

import torch


def action_mask(inputs: list[dict], completion_mask: torch.Tensor, tool_mask: torch.Tensor | None) -> torch.Tensor:
    """1 exactly on the completion tokens the student sampled, (B, T).

    A row whose input carries an `action_mask` (a rollout function's extra field: one 0/1 per completion token) uses
    it. Other rows fall back to `completion_mask * tool_mask`: GRPO's tool loop (`tools`, `environment_factory`) sets
    the tool mask to 0 on observations and the template tokens around them, a rollout function's `env_mask` becomes
    it, and without either every completion token is an action.
    """
    mask = completion_mask * tool_mask if tool_mask is not None else completion_mask.clone()
    for i, row in enumerate(inputs):
        given = row.get("action_mask")
        if given is None:
            continue
        length = int(completion_mask[i].sum())
        # GRPO zeroes the whole mask of a truncated completion (`mask_truncated_completions`): its length is unknown
        # here, only that it fits the batch, and it stays masked out
        masked_out = length == 0
        if (len(given) > completion_mask.size(1)) if masked_out else (len(given) != length):
            raise ValueError(
                f"Row {i}: the rollout's action_mask has {len(given)} entries but its completion has "
                f"{length if not masked_out else f'at most {completion_mask.size(1)}'} tokens. Return one 0/1 per "
                "completion token: 1 where the student sampled the token, 0 elsewhere."
            )
        if masked_out:
            mask[i] = 0
            continue
        mask[i, :length] = torch.as_tensor(given, dtype=mask.dtype, device=mask.device)
    return mask


def action_mask_as_env_mask(rollout_func):
    """`rollout_func`, its rows' `action_mask` also given to GRPO as `env_mask` (rows without one: every token), so
    that what GRPO computes from the mask of sampled tokens before this package reads it (vLLM's importance-sampling
    ratio, the logged completion lengths) leaves the observations out too. A rollout that returns its own `env_mask`
    is left as it is."""
    if rollout_func is None:
        return None

    @functools.wraps(rollout_func)
    def rollout(prompts, trainer):
        output = rollout_func(prompts, trainer)
        masks = output.get("action_mask")
        if masks is None or "env_mask" in output:
            return output
        env_mask = []  # one entry per completion token, as GRPO pads it (a wrong length is refused by `action_mask`)
        for mask, ids in zip(masks, output["completion_ids"], strict=True):
            mask = [1] * len(ids) if mask is None else list(mask)[: len(ids)]
            env_mask.append(mask + [0] * (len(ids) - len(mask)))
        return {**output, "env_mask": env_mask}

    return rollout


def skip_first(mask: torch.Tensor, count: int) -> torch.Tensor:
    """`mask` (B, T) without each row's first `count` completion positions (`opd_skip_first_tokens`)."""
    kept = mask.clone()
    kept[:, :count] = 0
    return kept


def render_action_mask(tokenizer, completion_ids: list[int], mask: list[int], *, context=("⟦", "⟧")) -> str:
    """The completion as text with every run of non-action tokens (observations, template tokens, padding excluded
    by the caller) wrapped in `context` brackets: what the teacher reads but the student is not trained on."""
    pieces, start = [], 0
    for end in range(1, len(completion_ids) + 1):
        if end == len(completion_ids) or mask[end] != mask[start]:
            text = tokenizer.decode(completion_ids[start:end])
            pieces.append(text if mask[start] else f"{context[0]}{text}{context[1]}")
            start = end
    return "".join(pieces)


def check_environments(environments: list | None, accelerator) -> None:
    """Stop, on every rank at once, before a batch whose rollouts lost their environment is scored or trained on.

    GRPO turns an exception raised in a tool into an error message for the model and goes on, so a rollout whose
    environment server died would be trained on as if the model had been told an error. An environment reports such
    a loss in its `failure` attribute (None or a message; `trl_opd.envs.code_env.CodeToolClient` sets it).
    """
    if environments is None:  # no environment_factory (the same on every rank)
        return
    failures = [environment.failure for environment in environments if getattr(environment, "failure", None)]
    count = torch.tensor(float(len(failures)), device=accelerator.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # every rank, however its group was set up: accelerate's reduce is a no-op where it believes it is alone
        # (2 CPU processes whose gloo group it did not set up as MULTI_CPU)
        torch.distributed.all_reduce(count)
    if count.item():
        detail = f": {failures[0]}" if failures else " on another process"
        raise RuntimeError(
            f"Rollouts of this batch lost their environment{detail}. The batch was not trained on and the last "
            "checkpoint is intact: restart the environment server and resume (resume_from_checkpoint: true)."
        )


def with_response_parser(tokenizer):
    """The tokenizer with a parser for its tool calls, as GRPO's tool loop needs.

    TRL sets one for chat templates it knows by their exact text and refuses any other at start-up.
    Qwen2.5-Coder-1.5B-Instruct's template differs from Qwen2.5's in one line of its tool instructions (doubled
    braces around the example call) and its calls are the same `<tool_call>{json}</tool_call>`: a template TRL does
    not know that asks for that format is parsed as Qwen2.5's; any other is refused, saying what to set.
    """
    from trl.chat_template_utils import add_response_schema, qwen3_template

    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None):
        return tokenizer
    try:
        return add_response_schema(tokenizer)
    except ValueError as unknown:
        if "<tool_call>" not in (tokenizer.chat_template or ""):
            raise ValueError(
                "TRL cannot parse tool calls in this tokenizer's chat template, so no tool call would ever run. Set "
                "its `response_template` (see transformers' chat response parsing docs) before training."
            ) from unknown
        tokenizer.response_template = qwen3_template  # what TRL sets for Qwen2.5's template: <tool_call>{json}
        return tokenizer


def set_tool_call_parser(tokenizer, args, *, multi_turn: bool) -> None:
    """Give the student's tokenizer the tool-call parser GRPO's tool loop reads (`with_response_parser`), also
    reading untagged JSON calls with `args.untagged_tool_calls`; refused without tools or an environment."""
    if args.untagged_tool_calls and not multi_turn:
        raise ValueError("untagged_tool_calls parses tool calls for GRPO's tool loop, and this run has none: pass "
                         "tools or an environment_factory, or remove untagged_tool_calls.")
    if multi_turn:
        with_response_parser(tokenizer)
    if args.untagged_tool_calls:
        read_untagged_tool_calls(tokenizer)


_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", flags=re.DOTALL)


def json_reply(content: str):
    """The JSON value a turn consists of, bare or in one code fence; None if the turn is anything else."""
    text = content.strip()
    fenced = _FENCE.fullmatch(text)
    try:
        return json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return None


def untagged_tool_calls(content: str) -> list[dict] | None:
    """The calls in a turn that is nothing but a JSON tool call (or a list of them), bare or in one code fence:
    `{"name": "run_python", "arguments": {"code": "print(1)"}}`; None for anything else."""
    value = json_reply(content)
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(call, dict) and set(call) == {"name", "arguments"} and
                            isinstance(call["name"], str) and isinstance(call["arguments"], dict) for call in calls):
        return None
    return [{"type": "function", "function": call} for call in calls]


def read_untagged_tool_calls(tokenizer) -> None:
    """Make `tokenizer.parse_response` (what GRPO's tool loop calls) also read `untagged_tool_calls` from a turn
    without tagged calls. Only this tokenizer object changes; nothing is saved with it."""
    if getattr(tokenizer, "_reads_untagged_tool_calls", False):
        return
    parse = tokenizer.parse_response

    def parse_response(*args, **kwargs):
        parsed = parse(*args, **kwargs)
        calls = None if parsed.get("tool_calls") else untagged_tool_calls(parsed.get("content") or "")
        return {**parsed, "content": "", "tool_calls": calls} if calls else parsed

    tokenizer.parse_response = parse_response
    tokenizer._reads_untagged_tool_calls = True
