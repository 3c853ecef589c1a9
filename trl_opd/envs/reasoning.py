"""A reasoning task no one here wrote: prompts from one of reasoning-gym's procedural datasets, graded by that
dataset's own `score_answer`.

    trl-opd make-reasoning-task artifacts/reasoning_task    # seconds: no model is trained

Its default is the task of `recipes/reasoning_cpu.yaml`, chosen by measurement (`benchmarks/reasoning_task_gap.py`,
docs/reasoning.md): chain_sum with two or three terms of at most two digits, where the real pair's teacher
(Qwen2.5-Coder-1.5B-Instruct) beats its untrained student (0.5B) by more than 20 points held-out and answers fit in
16 tokens. `--dataset NAME` (with `--config KEY=VALUE ...`, the dataset's own settings) writes any other.

Each row's `prompt` is reasoning-gym's question as a user turn after its "direct" system prompt (answer between
<answer> and </answer> tags, no preamble), and its `solution` the dataset entry (question, gold answer, metadata) as
JSON, which the grade needs: some scorers read the metadata. Training prompts come from one seed and the held-out
prompts from another; no held-out question is among the training prompts.

The answer of a completion (`extract_answer`) is the text inside its last <answer>...</answer> pair, stripped, as
reasoning-gym's own `extract_answer` reads it. A completion without that pair has no answer and scores 0, as
reasoning-gym grades it: the tags are the format every prompt asks for, and following it is part of the task.
`reasoning_gym_reward` counts an answer correct only where `score_answer` gives it full marks (1.0): a few scorers
give partial credit (0.01 for any number, 0.05 for a wrong expression) that would otherwise count as a fraction of a
right answer.

reasoning-gym is an optional dependency: `pip install trl_opd[reasoning]`.
"""

from __future__ import annotations

import argparse
import json
from functools import cache
from pathlib import Path

DEFAULT_DATASET, DEFAULT_CONFIG = "chain_sum", {"max_terms": 3, "max_digits": 2}
SYSTEM_PROMPT = "direct"  # reasoning-gym's: "Answer the question directly. Provide your answer between <answer> ..."


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as error:
        raise ImportError("The reasoning task needs reasoning-gym: pip install 'trl_opd[reasoning]'.") from error
    return reasoning_gym


def reasoning_rows(dataset: str, *, size: int, seed: int, system_prompt: str = SYSTEM_PROMPT,
                   **config) -> list[dict]:
    """`size` rows (prompt, solution) of reasoning-gym's `dataset` drawn with `seed`; `config` is the dataset's own
    (its difficulty settings, e.g. `min_animals` for leg_counting)."""
    rg = _reasoning_gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if system_prompt not in SYSTEM_PROMPTS:
        raise ValueError(f"Unknown system prompt {system_prompt!r}; reasoning-gym has {sorted(SYSTEM_PROMPTS)}.")
    from reasoning_gym.factory import DATASETS

    if dataset not in DATASETS:
        from difflib import get_close_matches

        near = get_close_matches(dataset, DATASETS, n=1)
        raise ValueError(f"reasoning-gym has no dataset {dataset!r}" + (f"; did you mean {near[0]!r}?" if near else
                                                                         "; see reasoning_gym.factory.DATASETS."))
    try:
        entries = rg.create_dataset(dataset, size=size, seed=seed, **config)
    except (AssertionError, TypeError) as error:  # its configs validate with assert; an unknown key is a TypeError
        raise ValueError(f"reasoning-gym refused the settings {config} of {dataset!r}: {error}") from error
    return [{"prompt": [{"role": "system", "content": SYSTEM_PROMPTS[system_prompt]},
                        {"role": "user", "content": entry["question"]}],
             "solution": json.dumps(entry)} for entry in entries]


def extract_answer(completion: str) -> str | None:
    """The text inside the completion's last <answer>...</answer> pair, stripped (reasoning-gym's own reading);
    None where there is none."""
    from reasoning_gym.utils import extract_answer as tagged

    return tagged(completion, tag_name="answer")


@cache
def _scorer(dataset: str):
    return _reasoning_gym().get_score_answer_fn(dataset)


def score(completion: str, solution: str) -> float:
    """reasoning-gym's own score (0 to 1) of the completion's answer, for the entry `solution` (JSON)."""
    entry = json.loads(solution)
    return float(_scorer(entry["metadata"]["source_dataset"])(answer=extract_answer(completion), entry=entry))


def reasoning_gym_reward(completions: list, solution: list[str], **kwargs) -> list[float]:
    """1.0 where the completion's answer gets reasoning-gym's full marks, else 0.0: a GRPO reward function, for
    `accuracy_func: trl_opd.envs.reasoning.reasoning_gym_reward` (GRPO's reward, OPD's logged accuracy)."""
    scores = []
    for completion, entry in zip(completions, solution, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        scores.append(float(score(text or "", entry) >= 1.0))
    return scores


def _question(row: dict) -> str:
    return row["prompt"][-1]["content"]


def make_reasoning_task(directory: str | Path, *, dataset: str, train: int = 2048, heldout: int = 200,
                        seed: int = 1, heldout_seed: int = 2, **config) -> Path:
    """Write `train.jsonl` and `heldout.jsonl` (prompt, solution) under `directory`: `train` rows of `dataset` from
    `seed` and `heldout` from `heldout_seed`, the training rows whose question is held out dropped (so there may be
    fewer of them; the count is printed by the command)."""
    directory = Path(directory)
    heldout_rows = reasoning_rows(dataset, size=heldout, seed=heldout_seed, **config)
    held = {_question(row) for row in heldout_rows}
    train_rows = [row for row in reasoning_rows(dataset, size=train, seed=seed, **config) if _question(row) not in held]
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_rows), ("heldout", heldout_rows)):
        with open(directory / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return directory


def _config_value(text: str):
    """`key=value` on the command line: the value as JSON where it parses (numbers, lists), else the string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not key=value (e.g. min_animals=3).")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trl-opd make-reasoning-task", description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default="artifacts/reasoning_task")
    parser.add_argument("--dataset", help=f"a reasoning-gym dataset name (default {DEFAULT_DATASET}, with "
                        f"{' '.join(f'{k}={v}' for k, v in DEFAULT_CONFIG.items())} unless --config is given)")
    parser.add_argument("--train", type=int, default=2048, help="training prompts drawn (default %(default)s)")
    parser.add_argument("--heldout", type=int, default=200, help="held-out prompts (default %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="the training prompts' seed (default %(default)s)")
    parser.add_argument("--heldout-seed", type=int, default=2, help="the held-out prompts' (default %(default)s)")
    parser.add_argument("--config", type=_config_value, nargs="*", default=[], metavar="KEY=VALUE",
                        help="the dataset's own settings, e.g. --config min_animals=3 max_animals=5")
    args = parser.parse_args(argv)
    if args.dataset is None:
        args.dataset, args.config = DEFAULT_DATASET, args.config or list(DEFAULT_CONFIG.items())
    if args.seed == args.heldout_seed:
        parser.error("--seed and --heldout-seed must differ: the held-out prompts would be the training ones.")
    directory = make_reasoning_task(args.directory, dataset=args.dataset, train=args.train, heldout=args.heldout,
                                    seed=args.seed, heldout_seed=args.heldout_seed, **dict(args.config))
    kept = sum(1 for _ in open(directory / "train.jsonl"))
    print(f"{directory}: {kept} training prompts ({args.train - kept} dropped as held out) and {args.heldout} "
          f"held-out prompts of reasoning-gym's {args.dataset} (train.jsonl, heldout.jsonl)")


if __name__ == "__main__":
    main()
