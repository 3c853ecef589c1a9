"""A tiny tool-using student/teacher pair for the arithmetic tool task, built locally in about a minute on a CPU.

Both models share one tokenizer whose chat template renders tool calls in the Qwen3 format (`<tool_call>` JSON
`</tool_call>`) and carries the matching `response_template`, so GRPOTrainer's tool loop accepts it as is. The
default "compact" template lists the tools in one short system line; "qwen3" uses TRL's stored Qwen3 template
(a ~300-token tools system prompt here). Training sequences are built the way the tool loop builds rollouts (sampled
assistant turns joined by the template's tool-result suffixes), and the loss covers assistant tokens only.

    python -m trl_opd.envs.tiny_agent artifacts/tiny_agent
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from ..tiny import digit_split_bpe
from .arithmetic import ArithmeticToolEnv, arithmetic_tool_rows, gold_trajectory, write_rows

# ChatML with the tools as one system line, "Tools: add(a, b) multiply(a, b)", and tool results as a `tool` turn.
# Prefix-preserving, so the tool loop uses it unchanged.
COMPACT_CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}{%- set fn = tool.function or tool %}"
    "{{ ' ' + fn.name + '(' + (fn.parameters.properties | list | join(', ')) + ')' }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set call = tool_call.function or tool_call %}"
    "{%- if not loop.first or message.content %}{{ '\\n' }}{%- endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{{ call.arguments if call.arguments is string else call.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]


def agent_tools() -> list:
    """The environment's tool methods, as the trainer passes them to the chat template."""
    env = ArithmeticToolEnv()
    return [env.add, env.multiply]


def build_agent_tokenizer(template: str = "compact", *, vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE tokenizer trained on rendered gold trajectories, digits split one per token.

    Single digits make copying a number from the question or a tool result a plain token copy, whatever the spacing
    around it. `template` is "compact" or "qwen3".
    """
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import add_response_schema, qwen3_chat_template, qwen3_template

    chat_template = {"compact": COMPACT_CHAT_TEMPLATE, "qwen3": qwen3_chat_template}[template]
    renderer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token="<|im_end|>")
    renderer.chat_template = chat_template
    tools = agent_tools()
    corpus = [renderer.apply_chat_template(gold_trajectory(row), tools=tools, tokenize=False)
              for row in arithmetic_tool_rows(500, seed)]
    wrapped = digit_split_bpe(corpus, vocab_size=vocab_size)
    wrapped.add_tokens(TOOL_CALL_TOKENS)  # whole, and not special: decoding keeps them, as Qwen3's tokenizer does
    wrapped.chat_template = chat_template
    if template == "qwen3":
        add_response_schema(wrapped)  # TRL recognises its own template; done again by the trainer if missing
    else:
        wrapped.response_template = qwen3_template  # saved in tokenizer_config.json
    return wrapped


def _assistant_text(message: dict, eos: str) -> str:
    """What the model samples for one assistant turn, in the format the response template parses."""
    calls = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
             for c in message.get("tool_calls") or []]
    body = "\n".join(f"<tool_call>\n{call}\n</tool_call>" for call in calls)
    return (message.get("content") or "") + ("\n" if message.get("content") and body else "") + body + eos


def loop_chat_template(tokenizer) -> str | None:
    """The template the trainer's tool loop renders with: the tokenizer's own (None) if prefix-preserving, else TRL's
    training variant of it."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    return None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)


def rollout_ids(
    tokenizer, messages: list[dict], tools: list, chat_template: str | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation as the tool loop builds them, and 1 on the assistant's own tokens.

    The prompt is rendered with the generation header; each assistant turn is tokenized on its own (as if sampled)
    and followed by the tool-result suffix that the trainer takes from the difference of two renders with
    `chat_template` (see `loop_chat_template`).
    """
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = tokenizer.apply_chat_template(messages[:first], tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        turn = tokenizer(_assistant_text(messages[i], tokenizer.eos_token), add_special_tokens=False)["input_ids"]
        ids, mask = ids + turn, mask + [1] * len(turn)
        results = []
        while i + 1 < len(messages) and messages[i + 1]["role"] == "tool":
            results.append(messages[i + 1])
            i += 1
        if results:
            suffix = tool_suffix_ids(tokenizer, messages[i - len(results)], results, chat_template)
            ids, mask = ids + suffix, mask + [0] * len(suffix)
        i += 1
    return ids, mask


def tool_suffix_ids(tokenizer, call: dict, results: list[dict], chat_template) -> list[int]:
    """The ids the trainer appends after a sampled tool call: the results and the next assistant header."""
    head = [{"role": "user", "content": "dummy"}, {**call, "content": ""}]
    prefix = tokenizer.apply_chat_template(head, tokenize=True, return_dict=False, chat_template=chat_template)
    full = tokenizer.apply_chat_template(head + results, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, chat_template=chat_template)
    end = max(j for j, t in enumerate(prefix) if t == tokenizer.eos_token_id) + 1
    return full[end:]


def encode_trajectories(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """`rollout_ids` of each row's gold trajectory."""
    tools, chat_template = agent_tools(), loop_chat_template(tokenizer)
    return [rollout_ids(tokenizer, gold_trajectory(row), tools, chat_template) for row in rows]


def train_on_trajectories(model, tokenizer, examples: list[tuple[list[int], list[int]]], *, steps: int,
                          batch_size: int = 16, lr: float = 5e-3, seed: int = 0) -> float:
    """Next-token training on (ids, assistant mask) examples, loss on assistant tokens only; returns the last loss.

    Runs on one thread: for a model this small, a second thread costs more in synchronisation than it saves.
    """
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / max(steps, 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    try:
        for _ in range(steps):
            batch = rng.sample(examples, batch_size)
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)  # (B, T)
            labels = torch.full((batch_size, width), -100)
            attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
            for row, (ids, mask) in enumerate(batch):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                labels[row, : len(ids)] = torch.tensor(ids).masked_fill(torch.tensor(mask) == 0, -100)
                attention_mask[row, : len(ids)] = 1
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
        model.eval()
    return loss.item()


def make_tiny_agent(directory: str | Path, *, template: str = "compact", student_steps: int = 150,
                    teacher_steps: int = 800, overwrite: bool = False) -> Path:
    """Build `student/`, `teacher/`, `train.jsonl` and `heldout.jsonl` under `directory` (cached: skipped if built
    there with the same settings).

    The teacher is trained until it emits well-formed tool calls and mostly right answers; the student, from a
    different initialisation, for far fewer steps, so the teacher/student gap is real.
    """
    from trl_opd.tiny import build_model

    directory = Path(directory)
    done = directory / "DONE"
    settings = {"template": template, "student_steps": student_steps, "teacher_steps": teacher_steps}
    if done.exists() and not overwrite and json.loads(done.read_text()) == settings:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_agent_tokenizer(template)
    examples = encode_trajectories(tokenizer, arithmetic_tool_rows(1024, seed=10))
    for name, steps, seed in (("student", student_steps, 0), ("teacher", teacher_steps, 1)):
        model = build_model(tokenizer, seed=seed)
        model.config.max_position_embeddings = 1024  # the tools system prompt plus a few turns
        train_on_trajectories(model, tokenizer, examples, steps=steps, seed=seed)
        model.save_pretrained(directory / name)
        tokenizer.save_pretrained(directory / name)
    write_rows(directory / "train.jsonl", arithmetic_tool_rows(512, seed=1))
    write_rows(directory / "heldout.jsonl", arithmetic_tool_rows(64, seed=2))
    done.write_text(json.dumps(settings) + "\n")
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trl-opd make-tiny-agent", description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="artifacts/tiny_agent")
    parser.add_argument("--template", choices=["compact", "qwen3"], default="compact")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    print(make_tiny_agent(args.directory, template=args.template, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
