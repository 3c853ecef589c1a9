"""What does this Python code print? An offline task with an exact checker, for real pretrained (code) models.

    print('-'.join(['rocket', 'garden', 'python']))    ->  rocket-garden-python
    print('vector'.title() + '7')                      ->  Vector7

Each program is one line from a few families (string methods, slicing and indexing, joins, sorting, splitting, `len`)
and is run here to get its answer, so every `solution` is right by construction. `printed_output_reward` checks an
answer exactly (after stripping the backticks or quotes models often add). No held-out program text is among the
training prompts.

A one-line program is read in one pass, no step-by-step work: completions are a few tokens, so a CPU run stays in
minutes. The families are the ones (of those tried) on which the Qwen2.5-Coder 1.5B teacher is clearly better than its
0.5B student; programs that need arithmetic or a loop were too hard for both (under 15% for either). The gap measured
here, with its standard error, is in `benchmarks/results/real_task_gap.json` (`benchmarks/real_task_gap.py`).

    trl-opd make-code-task artifacts/code_task     # seconds: no model is trained
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import re
from pathlib import Path

INSTRUCTION = "What does this Python code print? Reply with only the output."
# the same question for an agent with the code tool environment's `run_python` (trl_opd/envs/code_env)
TOOL_INSTRUCTION = ("What does this Python code print? Call the run_python tool to run it first, then reply with "
                    "only the output.")
WORDS = ("banana", "kernel", "tensor", "python", "gradient", "lambda", "matrix", "vector", "planet", "garden", "rocket",
         "silver", "window", "castle", "orange", "button", "thread", "socket", "module", "string", "number", "editor",
         "folder", "packet", "kitten", "anchor", "bridge", "candle", "dragon", "forest", "hammer", "island", "jacket",
         "ladder", "marble", "needle", "pencil", "rabbit", "saddle", "tunnel")
SENTENCES = ("the quick brown fox jumps", "deep learning needs more data", "small models learn very fast",
             "every token has a cost", "open the window after lunch", "a teacher scores each answer",
             "rivers run down to the sea", "green tea tastes rather bitter")


# One line of Python per family, printing a string or an integer, from a drawn word and the generator
_FAMILIES = (
    lambda rng, word: f"print('{word}'.upper())",
    lambda rng, word: f"print('{word}'.replace('{rng.choice(sorted(set(word)))}', '{rng.choice('xyz')}'))",
    lambda rng, word: f"print('{word}'[:{rng.randint(2, 4)}])",
    lambda rng, word: f"print('{word}'[{rng.randint(-3, -1)}])",
    lambda rng, word: f"print(len('{word}'))",
    lambda rng, word: f"print('{word}'.title() + '{rng.randint(1, 9)}')",
    lambda rng, word: f"print('-'.join({rng.sample(WORDS, 3)}))",
    lambda rng, word: f"print(sorted({rng.sample(WORDS, 3)})[0])",
    lambda rng, word: f"print('{rng.choice(SENTENCES)}'.split()[{rng.randint(0, 4)}])",
)


def _program(rng: random.Random, family: int) -> str:
    """A program of family `family`: string methods, slicing and indexing, joins, sorting, splitting, `len`."""
    word = rng.sample(WORDS, 2)[0]  # two drawn, one used: the draws the measured task was built with
    return _FAMILIES[family](rng, word)


def answer_text(completion: str) -> str:
    """The answer in a completion: stripped of whitespace, a code fence (with its language) or backticks, and
    matching quotes around it, which the models often add."""
    text = completion.strip()
    fenced = re.fullmatch(r"```[a-z]*\n?(.*?)\n?```", text, flags=re.DOTALL)
    text = (fenced.group(1) if fenced else text.strip("`")).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return text


def printed_output_reward(completions: list, solution: list[str], **kwargs) -> list[float]:
    """1.0 where the completion's answer (`answer_text`) is exactly what the program prints, else 0.0: a GRPO reward
    function, for `accuracy_func: trl_opd.envs.code_output.printed_output_reward`."""
    scores = []
    for completion, expected in zip(completions, solution, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        scores.append(float(answer_text(text) == expected))
    return scores


# the fields in which Qwen2.5-Coder states a tool's output when it replies in JSON after the call
ANSWER_FIELDS = ("return", "output", "result")


def stated_answers(completion: str) -> list[str]:
    """The answers a reply states: the reply itself (`answer_text`) and, where it is a JSON object (bare or in one
    code fence), its `ANSWER_FIELDS`. After a `run_python` call, Qwen2.5-Coder 0.5B and 1.5B restate the call as
    JSON with the tool's output in a "return" field instead of replying with the output alone."""
    from trl_opd.trainer.multiturn import json_reply

    value = json_reply(completion)
    fields = [value.get(key) for key in ANSWER_FIELDS] if isinstance(value, dict) else []
    return [answer_text(completion)] + [answer_text(str(field)) for field in fields
                                        if isinstance(field, str | int | float) and not isinstance(field, bool)]


def stated_output_reward(completions: list, solution: list[str], **kwargs) -> list[float]:
    """1.0 where the last reply states what the program prints, as its text or a JSON answer field
    (`stated_answers`), else 0.0: the tool agent's reward and accuracy, for GRPO and OPD alike
    (`accuracy_func: trl_opd.envs.code_output.stated_output_reward`). `printed_output_reward` is the strict grade."""
    scores = []
    for completion, expected in zip(completions, solution, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        scores.append(float(expected in stated_answers(text or "")))
    return scores


def run_program(source: str) -> str:
    """What `source` prints (one line, stripped)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(source, {})  # noqa: S102 - programs generated above, never user input
    return out.getvalue().strip()


def code_row(source: str, *, instruction: str = INSTRUCTION) -> dict:
    """One conversational prompt row with its `solution` (what the program prints)."""
    return {"prompt": [{"role": "user", "content": f"{instruction}\n\n```python\n{source}\n```"}],
            "solution": run_program(source)}


def code_rows(n: int, seed: int, *, distinct: bool = True, exclude: frozenset[str] = frozenset(),
              instruction: str = INSTRUCTION) -> list[dict]:
    """`n` random programs, the families in turn, none of whose text is in `exclude`; all different with
    `distinct` (the held-out set), else drawn with repeats (training prompts)."""
    rng = random.Random(seed)
    rows, seen, attempts = [], set(), 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n:
            raise ValueError(f"Could not draw {n} programs (only {len(rows)} found): ask for fewer.")
        source = _program(rng, len(rows) % len(_FAMILIES))
        if source not in exclude and not (distinct and source in seen):
            seen.add(source)
            rows.append(code_row(source, instruction=instruction))
    return rows


def _source(row: dict) -> str:
    return row["prompt"][0]["content"].split("```python\n", 1)[1].rsplit("\n```", 1)[0]


def make_code_task(directory: str | Path, *, train: int = 2048, heldout: int = 200, tools: bool = False) -> Path:
    """Write `train.jsonl` and `heldout.jsonl` (prompt, solution) under `directory`; no program is in both. With
    `tools`, the prompts offer the `run_python` tool (the same programs)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    instruction = TOOL_INSTRUCTION if tools else INSTRUCTION
    heldout_rows = code_rows(heldout, seed=2, instruction=instruction)
    train_rows = code_rows(train, seed=1, distinct=False, exclude=frozenset(_source(row) for row in heldout_rows),
                           instruction=instruction)
    for name, rows in (("train", train_rows), ("heldout", heldout_rows)):
        with open(directory / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trl-opd make-code-task", description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="artifacts/code_task")
    parser.add_argument("--train", type=int, default=2048, help="training prompts")
    parser.add_argument("--heldout", type=int, default=200, help="held-out prompts")
    parser.add_argument("--tools", action="store_true",
                        help="prompts that offer the run_python tool (trl-opd serve-env)")
    args = parser.parse_args(argv)
    directory = make_code_task(args.directory, train=args.train, heldout=args.heldout, tools=args.tools)
    print(f"{directory}: {args.train} training and {args.heldout} held-out programs (train.jsonl, heldout.jsonl)")


if __name__ == "__main__":
    main()
