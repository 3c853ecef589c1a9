"""A recipe's arguments and what they build: the dataset arguments beyond TRL's, the parser of a recipe, its prompts
(loaded and brought to the trainer's format), reward functions and the trainer itself.

`cli.py` (train, save, push) and `preflight.py` (`trl-opd check`) both build a run from here.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig, ScriptArguments, TrlParser

from ..checks import check_local_path
from ..config import OPDConfig
from ..prompts import with_system_message

_LOCAL_DATA_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class OPDScriptArguments(ScriptArguments):
    """Dataset arguments of a recipe, beyond TRL's `dataset_name`, `dataset_config` and split names."""

    prompt_column: str = field(
        default="prompt",
        metadata={"help": "Column holding the prompt, renamed to 'prompt' (e.g. 'question' for DeepMath-103K)."},
    )
    prompt_as_user_message: bool = field(
        default=False,
        metadata={
            "help": "Wrap a text prompt as one user chat message, so the student's chat template is applied to it."
        },
    )
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "A system message before each prompt, for the student and the teacher alike: before the user "
                          "message that prompt_as_user_message makes, or merged into chat prompts' own system "
                          "message. Text prompts without prompt_as_user_message are refused."},
    )
    push_merged: bool = field(
        default=False,
        metadata={"help": "With push_to_hub and a LoRA student: push the adapter merged into its base model."},
    )
    save_final_model: bool = field(
        default=True,
        metadata={"help": "Save the trained model (or adapter) and its model card to output_dir at the end. false: "
                          "a run read from its logs only (the prepared GPU check's), which writes no weights."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "GRPO reward functions mixed with the teacher signal (see opd_reward_combination), each a name "
            "from trl.rewards (e.g. accuracy_reward) or a dotted import path (my_module.my_reward)."
        },
    )
    accuracy_func: str | None = field(
        default=None,
        metadata={
            "help": "A reward function (trl.rewards name or import path) logged as `accuracy`, never trained on, "
            "e.g. trl_opd.envs.tool_answer_reward."
        },
    )
    environment_factory: str | None = field(
        default=None,
        metadata={
            "help": "Dotted import path of an environment class for multi-turn rollouts (GRPO's environment_factory), "
            "e.g. trl_opd.envs.ArithmeticToolEnv. Only the tokens the student samples are distilled."
        },
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "A separate dataset (file, saved directory or Hub id) to evaluate on, its `dataset_test_split` "
            "split; default: dataset_name's test split. Evaluation runs with eval_strategy, e.g. 'steps'."
        },
    )
    tools: list[str] | None = field(
        default=None,
        metadata={"help": "Dotted import paths of tool functions the student may call (GRPO's tools)."},
    )


def make_parser(prog: str = "trl-opd train") -> TrlParser:
    return TrlParser((OPDScriptArguments, OPDConfig, ModelConfig), prog=prog)


def check_option_names(parser: TrlParser, argv: list[str]) -> None:
    """Every option a recipe (`--config`) or the command line names is one the parser knows; else exit 2 naming it,
    with the nearest known name, before any option's value is read."""
    import difflib

    import yaml

    known = {name.removeprefix("--") for action in parser._actions for name in action.option_strings}
    named = [("the command line", token.removeprefix("--").split("=")[0]) for token in argv
             if token.startswith("--") and token != "--config"]
    if "--config" in argv and argv.index("--config") + 1 < len(argv):
        recipe = argv[argv.index("--config") + 1]
        config = yaml.safe_load(Path(recipe).read_text()) if Path(recipe).is_file() else None
        named += [(f"recipe {recipe}", key) for key in (config if isinstance(config, dict) else {}) if key != "env"]
    unknown = [(where, name) for where, name in named if name not in known]
    if not unknown:
        return
    lines = []
    for where, name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        lines.append(f"{where}: unknown option {name!r}." + (f" Did you mean {close[0]!r}?" if close else ""))
    lines.append(f"`{parser.prog} --help` lists the options.")
    print("\n".join(lines), file=sys.stderr)
    sys.exit(2)


# where the CPU recipes expect their tiny models, and the command that builds them there
def load_prompts(script_args: OPDScriptArguments, split: str, name: str | None = None, *,
                 teacher_prompt_column: str | None = None):
    """Load one split of `name` (default: the recipe's dataset_name) and bring it to the trainer's format: a
    'prompt' column of text or chat messages. A teacher-only prompt column gets the same treatment as 'prompt' (the
    user-message wrapping and the system message), so the teacher's prompt is built by the student's rules."""
    from datasets import load_dataset, load_from_disk

    name = name or script_args.dataset_name
    if name is None:
        raise ValueError("The recipe sets no dataset_name (a Hub dataset id, a saved dataset directory or a file).")
    suffix = Path(name).suffix
    if suffix in _LOCAL_DATA_FORMATS:
        check_local_path(name if name.startswith((".", "/", "artifacts/")) else f"./{name}", "dataset_name")
        try:
            dataset = load_dataset(_LOCAL_DATA_FORMATS[suffix], data_files={split: name}, split=split)
        except StopIteration:  # what the json loader raises on a file without rows
            raise ValueError(f"Dataset file {name!r} is empty: there are no prompts in it.") from None
    elif Path(name).is_dir() and (Path(name) / "dataset_dict.json").exists():
        dataset = load_from_disk(name)[split]
    else:
        dataset = load_dataset(name, name=script_args.dataset_config, split=split,
                               streaming=script_args.dataset_streaming)
    if script_args.prompt_column != "prompt":
        if "prompt" in (dataset.column_names or []):
            dataset = dataset.remove_columns("prompt")
        dataset = dataset.rename_column(script_args.prompt_column, "prompt")
    columns = ["prompt", *([teacher_prompt_column] if teacher_prompt_column in (dataset.column_names or []) else [])]
    system = script_args.system_prompt
    if script_args.prompt_as_user_message:
        head = [{"role": "system", "content": system}] if system else []
        dataset = dataset.map(lambda row: {c: [*head, {"role": "user", "content": row[c]}] for c in columns})
    elif system:
        for column in columns:
            first = next(iter(dataset), {}).get(column)  # an empty dataset is refused by the trainer, naming it
            if isinstance(first, str):
                raise ValueError(
                    f"system_prompt goes in front of chat prompts, but the {column!r} column holds text. Set "
                    "prompt_as_user_message: true to make each text prompt a user message after the system prompt."
                )
        dataset = dataset.map(lambda row: {c: with_system_message(row[c], system) for c in columns})
    return dataset


def check_held_out(script_args: OPDScriptArguments) -> None:
    """Evaluation must not read the training prompts: every split of a local file is the whole file."""
    train, held_out = script_args.dataset_name, script_args.eval_dataset_name or script_args.dataset_name
    if Path(train).suffix in _LOCAL_DATA_FORMATS and Path(held_out).resolve() == Path(train).resolve():
        raise ValueError(
            f"Evaluation would read the training prompts: dataset_name {train!r} is one file, so its "
            f"{script_args.dataset_test_split!r} split is that same file. Set eval_dataset_name to a file of held-out "
            "prompts, or eval_strategy: no."
        )


def load_reward_funcs(names: list[str] | None) -> list:
    """Reward functions from names in `trl.rewards` or dotted import paths (resolved from the working directory)."""
    import trl.rewards

    funcs = []
    for name in names or []:
        if "." not in name:
            if not hasattr(trl.rewards, name):
                raise ValueError(f"Unknown reward function {name!r}: not in trl.rewards, and not a dotted import path.")
            funcs.append(getattr(trl.rewards, name))
        else:
            funcs.append(import_object(name, "reward function"))
    return funcs


def import_object(name: str, what: str):
    """The object at dotted path `name` (`package.module.attribute`), importable from the working directory too."""
    import importlib

    if "." not in name:
        raise ValueError(f"{what.capitalize()} {name!r} is not a dotted import path (e.g. my_module.my_object).")
    module_name, attribute = name.rsplit(".", 1)
    sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Cannot import {what} {name!r}: {error}") from error
    finally:
        sys.path.remove(os.getcwd())


def build_trainer(script_args: OPDScriptArguments, training_args: OPDConfig, model_args: ModelConfig,
                  train_dataset=None):
    """An OPDTrainer from parsed recipe arguments (the recipe's train split unless `train_dataset` is given)."""
    from trl import get_peft_config

    from ..models_dir import resolve_model
    from ..trainer.opd_trainer import OPDTrainer

    # a Hub id mirrored in OPD_MODELS_DIR is read from there, and named so downstream (model card, `trl-opd check`)
    model_args.model_name_or_path = resolve_model(model_args.model_name_or_path)
    training_args.teacher_model_name_or_path = resolve_model(training_args.teacher_model_name_or_path)
    if isinstance(training_args.teacher_tokenizer_name_or_path, str):
        training_args.teacher_tokenizer_name_or_path = resolve_model(training_args.teacher_tokenizer_name_or_path)
    check_local_path(model_args.model_name_or_path, "model_name_or_path")
    check_local_path(training_args.teacher_model_name_or_path, "teacher_model_name_or_path")
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    environment = script_args.environment_factory
    column = training_args.teacher_prompt_column
    if training_args.eval_strategy != "no":
        check_held_out(script_args)
    if train_dataset is None:
        train_dataset = load_prompts(script_args, script_args.dataset_train_split, teacher_prompt_column=column)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = load_prompts(script_args, script_args.dataset_test_split, script_args.eval_dataset_name,
                                    teacher_prompt_column=column)
    return OPDTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        reward_funcs=load_reward_funcs(script_args.reward_funcs),
        peft_config=get_peft_config(model_args),
        environment_factory=environment and import_object(environment, "environment_factory"),
        accuracy_func=load_reward_funcs([script_args.accuracy_func])[0] if script_args.accuracy_func else None,
        tools=[import_object(name, "tool") for name in script_args.tools] if script_args.tools else None,
    )
