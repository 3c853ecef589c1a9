"""`trl-opd` / `python -m trl_opd`: parse a recipe -> build the trainer -> train -> save (and push).

    trl-opd --config recipes/smoke_cpu.yaml [--max_steps 5 ...]        # train (also: trl-opd train --config ...)
    accelerate launch --config_file recipes/accelerate/cpu.yaml -m trl_opd --config recipes/smoke_cpu.yaml
    trl-opd make-tiny artifacts/tiny                                    # the local models the smoke recipe uses
    trl-opd make-tiny-agent artifacts/tiny_agent                        # the tool-using pair of the agent recipe
    trl-opd serve-teacher MODEL [--port 8000] [vllm args]               # a vLLM server for teacher_server_url
    trl-opd check --config recipes/smoke_cpu.yaml                       # one-batch preflight of a recipe
    trl-opd push outputs/smoke --repo-id ORG/NAME [--merge]             # push a saved adapter/model to the Hub
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig, ScriptArguments, TrlParser

from .config import OPDConfig
from .prompts import with_system_message

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


def make_parser() -> TrlParser:
    return TrlParser((OPDScriptArguments, OPDConfig, ModelConfig), prog="trl-opd")


# where the CPU recipes expect their tiny models, and the command that builds them there
_BUILDERS = {"artifacts/tiny_task": "make-tiny-task", "artifacts/tiny_agent": "make-tiny-agent"}


def _require_local_path(path: str | None, what: str) -> None:
    """A path-looking model name that does not exist is a missing build step, not a Hub id: say so now."""
    if path and (path.startswith((".", "/")) or path.startswith("artifacts/")) and not Path(path).exists():
        builder = next((f"trl-opd {command} {directory}" for directory, command in _BUILDERS.items()
                        if directory in path), "trl-opd make-tiny artifacts/tiny")
        raise FileNotFoundError(
            f"{what} {path!r} does not exist. For the CPU recipes, build the tiny models first: `{builder}`."
        )


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
        _require_local_path(name if name.startswith((".", "/", "artifacts/")) else f"./{name}", "dataset_name")
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

    from .trainer import OPDTrainer

    _require_local_path(model_args.model_name_or_path, "model_name_or_path")
    _require_local_path(training_args.teacher_model_name_or_path, "teacher_model_name_or_path")
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


def train(script_args: OPDScriptArguments, training_args: OPDConfig, model_args: ModelConfig, *,
          recipe: str | None = None):
    """Build an OPDTrainer from parsed recipe arguments, train, save with a model card, and push if asked.

    Pushes are the Trainer's own, as in the Python API: the repo is created when the trainer is built (so an
    unreachable Hub stops the run before training), checkpoints are pushed as `hub_strategy` says, and the final
    model after its local save. With `push_merged` the final push is the adapter merged into its base model instead.
    """
    from .hub import push, pushing

    repo_id = training_args.hub_model_id or Path(training_args.output_dir).absolute().name
    merged = training_args.push_to_hub and script_args.push_merged
    if merged and training_args.hub_strategy != "end":
        raise ValueError(
            f"push_merged pushes the merged model once, at the end, but hub_strategy {training_args.hub_strategy!r} "
            "also pushes the adapter at each save into the same repo. Set hub_strategy: end with push_merged, or "
            "push the merged model later with `trl-opd push OUTPUT_DIR --repo-id ORG/NAME --merge`."
        )
    trainer = build_trainer(script_args, training_args, model_args)  # with push_to_hub: the repo, or an error now
    trainer.card_recipe, trainer.card_dataset = recipe, script_args.dataset_name
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if trainer.eval_dataset is not None:
        print_eval_summary(trainer)
    output_dir = training_args.output_dir
    if merged:
        trainer.args.push_to_hub = False  # the final push is the merged model's, below
    with pushing(output_dir, repo_id, token=training_args.hub_token):
        trainer.save_model(output_dir)  # with push_to_hub, the Trainer pushes it with its model card
    if trainer.accelerator.is_main_process and not trainer.args.push_to_hub:  # a Trainer push wrote it already
        trainer.create_model_card()
    trainer.accelerator.print(f"Saved the trained {'adapter' if model_args.use_peft else 'model'} to {output_dir}")
    if trainer.eval_dataset is not None and trainer.accelerator.is_main_process:
        from .evaluation import heldout_curve, write_heldout_curve

        written = write_heldout_curve(heldout_curve(trainer.state.log_history), output_dir)
        print(f"Held-out curve: {', '.join(map(str, written))}")
    if training_args.push_to_hub and trainer.accelerator.is_main_process:
        if merged:
            url = push(output_dir, repo_id, token=training_args.hub_token, private=training_args.hub_private_repo,
                       merge=True)
        else:
            url = f"the Hub repo {trainer.hub_model_id}"
        trainer.accelerator.print(f"Pushed to {url}")
    return trainer


EVAL_SUMMARY_METRICS = {
    "eval_accuracy": "accuracy", "eval_opd/reverse_kl": "reverse KL (sampled tokens)",
    **{f"eval_opd/{divergence}_{term}": f"{label} ({'exact, full vocabulary' if term == 'dense' else 'top-k'})"
       for divergence, label in (("reverse_kl", "reverse KL"), ("forward_kl", "forward KL"), ("jsd", "JSD"))
       for term in ("dense", "topk")},
}


def print_eval_summary(trainer) -> None:
    """Held-out metrics at the first and the last evaluation, evaluating once more if the last step had none."""
    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    if not evals or evals[-1]["step"] != trainer.state.global_step:
        trainer.evaluate()
        evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    first, last = evals[0], evals[-1]
    lines = [f"Held-out evaluation, step {first['step']} -> step {last['step']}:"]
    for key, name in EVAL_SUMMARY_METRICS.items():
        if key in first and key in last:
            lines.append(f"  {name:<38} {first[key]:8.4f} -> {last[key]:8.4f}")
    trainer.accelerator.print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["make-tiny"]:
        from .testing import main as make_tiny_main

        return make_tiny_main(argv[1:])
    if argv[:1] == ["make-tiny-agent"]:
        from .envs.tiny_agent import main as make_tiny_agent_main

        return make_tiny_agent_main(argv[1:])
    if argv[:1] == ["make-tiny-task"]:
        from .envs.addition import main as make_tiny_task_main

        return make_tiny_task_main(argv[1:])
    if argv[:1] == ["make-code-task"]:
        from .envs.code_output import main as make_code_task_main

        return make_code_task_main(argv[1:])
    if argv[:1] == ["serve-teacher"]:
        from .serve import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["push"]:
        from .hub import main as push_main

        return push_main(argv[1:])
    command = argv.pop(0) if argv[:1] in (["check"], ["train"]) else "train"
    if _cpu_process_group():
        # the arguments must take the process group just set up rather than build their own
        argv = _with_configured_state(argv)
    if command == "check":
        from .preflight import check

        report = check(*make_parser().parse_args_and_config(argv))
        sys.exit(0 if report["ok"] else 1)
    script_args, training_args, model_args = make_parser().parse_args_and_config(argv)
    recipe = argv[argv.index("--config") + 1] if "--config" in argv else None
    trainer = train(script_args, training_args, model_args, recipe=recipe)
    # a process group left for the interpreter to tear down can abort a rank at exit (gloo's threads), failing a
    # launch whose training and save succeeded
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


def _with_configured_state(argv: list[str]) -> list[str]:
    """`argv` whose accelerator_config (from the command line, else the recipe) also says use_configured_state."""
    import json

    import yaml

    config = {}
    if "--config" in argv:
        config = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text()).get("accelerator_config") or {}
    if "--accelerator_config" in argv:
        config = argv[argv.index("--accelerator_config") + 1]
    config = json.loads(config) if isinstance(config, str) else dict(config)
    return [*argv, "--accelerator_config", json.dumps({**config, "use_configured_state": True})]


def _cpu_process_group() -> bool:
    """Several processes on a machine without GPUs: accelerate picks no backend and believes it is alone (so
    DeepSpeed's batch-size check fails). Set up gloo before any argument parsing reads the world size."""
    import torch

    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or torch.cuda.is_available():
        return False
    from accelerate import PartialState

    PartialState(backend="gloo")
    return True


if __name__ == "__main__":
    main()
