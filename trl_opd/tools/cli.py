"""`trl-opd` / `python -m trl_opd`: the command line. `trl-opd --help` lists the subcommands; a recipe is a YAML file,
or the name of one this package ships (`trl-opd recipes` lists them).

    trl-opd train --config smoke_cpu [--max_steps 5 ...]                 # parse -> build -> train -> save (and push)
    trl-opd --config recipes/smoke_cpu.yaml                              # the same: `train` is the default
    accelerate launch --config_file $(trl-opd config-path cpu) -m trl_opd --config smoke_cpu
    trl-opd check --config smoke_cpu                                     # one-batch preflight of a recipe

Nothing heavy is imported before a subcommand needs it: `trl-opd --help` answers at once, and each subcommand's module
is imported when it runs.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trl import ModelConfig

    from ..config import OPDConfig
    from .recipe import OPDScriptArguments

# each subcommand: what runs it ("module:function", given the arguments after the name) and its line in --help
COMMANDS = {
    "train": ("trl_opd.tools.cli:train_main", "train a recipe: trl-opd train --config smoke_cpu [--max_steps 5 ...]"),
    "check": ("trl_opd.tools.cli:check_main", "one batch of a recipe, checked before a long run (reference KL 0)"),
    "recipes": ("trl_opd.tools.packaged:recipes_main", "list the recipes this package ships, each with its purpose"),
    "config-path": ("trl_opd.tools.packaged:config_path_main",
                    "the path of a shipped accelerate config, for accelerate launch --config_file"),
    "make-tiny": ("trl_opd.tiny:main", "build the tiny local student and teacher the smoke recipes train (seconds)"),
    "make-tiny-agent": ("trl_opd.envs.tiny_agent:main", "build the tiny tool-using pair of the agent recipe"),
    "make-tiny-task": ("trl_opd.envs.addition:main", "build the addition task of the demo (two short SFT runs)"),
    "compare-demo": ("trl_opd.tools.demo:main", "how a demo run compares with the range measured over five seeds"),
    "make-code-task": ("trl_opd.envs.code_output:main", "build the code-output task of the real models' recipes"),
    "make-reasoning-task": ("trl_opd.envs.reasoning:main",
                            "build a reasoning-gym task (pip install 'trl_opd[reasoning]'), scored by its own grader"),
    "serve-teacher": ("trl_opd.tools.serve:main", "start a vLLM server that scores for teacher_server_url"),
    "serve-env": ("trl_opd.envs.code_env.server:main", "start the code tool environment server (OpenEnv)"),
    "push": ("trl_opd.tools.cli:push_main", "push a saved adapter or model to the Hub"),
}
USAGE = "usage: trl-opd <command> [options]    (trl-opd --config RECIPE trains: `train` is the default)"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        sys.exit(0 if argv else 2)  # a bare `trl-opd` asked for nothing
    if argv[0] == "--version":
        from .. import __version__

        print(f"trl-opd {__version__}")
        return
    name = "train" if argv[0].startswith("-") else argv.pop(0)
    if name not in COMMANDS:
        sys.exit(_unknown(name))
    module, function = COMMANDS[name][0].split(":")
    import importlib

    return getattr(importlib.import_module(module), function)(argv)


def help_text() -> str:
    width = max(map(len, COMMANDS))
    lines = [USAGE, "", "On-policy distillation of a student from a teacher, on TRL's GRPO trainer.", "", "commands:"]
    lines += [f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()]
    lines += ["", "`trl-opd <command> --help` for a command's options; `trl-opd recipes` for the shipped recipes."]
    return "\n".join(lines)


def _unknown(name: str) -> int:
    """The usage, what was not understood and the nearest command, on stderr; exit status 2, as argparse's."""
    lines = [USAGE, f"trl-opd: {name!r} is not a command."]
    close = difflib.get_close_matches(name, COMMANDS, n=1, cutoff=0.6)
    if close:
        lines.append(f"Did you mean `trl-opd {close[0]}`?")
    elif name.endswith((".yaml", ".yml")) or Path(name).exists():
        lines.append(f"Did you mean `trl-opd --config {name}`?")
    lines.append("`trl-opd --help` lists the commands.")
    print("\n".join(lines), file=sys.stderr)
    return 2


def train_main(argv: list[str]) -> None:
    """`trl-opd train`: parse the recipe and the options after it, train, save (and push)."""
    given = list(argv)  # as the user wrote them, for the command that resumes
    # TRL (and with it DeepSpeed) imported before the CPU process group is set up, as `end_processes` expects: a
    # group made first leaves gloo's threads running at exit under ZeRO-3 (tests/test_distributed.py's exit probe)
    from .recipe import make_parser  # noqa: F401

    argv = _with_recipe_path(argv)
    if _cpu_process_group():
        # the arguments must take the process group just set up rather than build their own
        argv = _with_configured_state(argv)
    script_args, training_args, model_args = _parsed(argv, "trl-opd train")
    recipe = argv[argv.index("--config") + 1] if "--config" in argv else None
    try:
        accelerator = train(script_args, training_args, model_args, recipe=recipe).accelerator
    except KeyboardInterrupt:
        sys.exit(_interrupted(given, training_args.output_dir))
    end_processes(accelerator)


def _interrupted(argv: list[str], output_dir: str) -> int:
    """Ctrl-C: one line saying which checkpoint is intact and the command that resumes from it; exit status 130."""
    import shlex

    from accelerate import PartialState

    from ..trainer.checkpoints import last_complete_checkpoint

    if PartialState().is_main_process:
        checkpoint = last_complete_checkpoint(output_dir)
        resume = shlex.join(["trl-opd", "train", *argv, "--resume_from_checkpoint", "true"])
        # on a line of its own: the progress bar the interrupt cut short has written no newline
        print("\n" + (f"Interrupted. {checkpoint} is the last complete checkpoint; resume with: {resume}" if checkpoint
                      else f"Interrupted. No complete checkpoint in {output_dir} to resume from (save_strategy saves "
                           "them)."), file=sys.stderr)
    return 130


def check_main(argv: list[str]) -> None:
    """`trl-opd check`: the preflight of a recipe; exit status 1 if the reference KL is not zero."""
    from .preflight import check  # TRL imported before the process group is set up, as in `train_main`

    argv = _with_recipe_path(argv)
    if _cpu_process_group():
        argv = _with_configured_state(argv)
    report = check(*_parsed(argv, "trl-opd check"))
    end_processes()
    sys.exit(0 if report["ok"] else 1)


def push_main(argv: list[str]) -> None:
    """`trl-opd push`: a trained output directory to the Hub (the trainer's own pushes are in `trainer/hub.py`)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="trl-opd push", description="Push a trained output directory to the Hub.")
    parser.add_argument("output_dir")
    parser.add_argument("--repo-id", required=True)
    parser.add_argument("--merge", action="store_true", help="push the adapter merged into its base model")
    parser.add_argument("--private", action="store_true")
    args = parser.parse_args(argv)
    from ..trainer.hub import HubPushError, push

    try:
        url = push(args.output_dir, args.repo_id, merge=args.merge, private=args.private or None)
    except HubPushError as error:
        raise SystemExit(str(error)) from None
    print(json.dumps({"pushed": args.output_dir, "to": url}))


def _parsed(argv: list[str], prog: str) -> tuple:
    """(script, training, model) arguments of a recipe and the options after it, each option's name checked first."""
    from .recipe import check_option_names, make_parser

    parser = make_parser(prog)
    check_option_names(parser, argv)
    return parser.parse_args_and_config(argv)


def _with_recipe_path(argv: list[str]) -> list[str]:
    """`argv` whose `--config` names a file: a path as given, or a shipped recipe's name (`smoke_cpu`)."""
    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        return argv
    from .packaged import recipe_path

    at = argv.index("--config") + 1
    return [*argv[:at], str(recipe_path(argv[at])), *argv[at + 1:]]


def train(script_args: OPDScriptArguments, training_args: OPDConfig, model_args: ModelConfig, *,
          recipe: str | None = None):
    """Build an OPDTrainer from parsed recipe arguments, train, save with a model card, and push if asked.

    Pushes are the Trainer's own, as in the Python API: the repo is created when the trainer is built (so an
    unreachable Hub stops the run before training), checkpoints are pushed as `hub_strategy` says, and the final
    model after its local save. With `push_merged` the final push is the adapter merged into its base model instead.
    """
    from ..trainer.hub import push, pushing
    from ..trainer.runs import RunFinished
    from .recipe import build_trainer

    repo_id = training_args.hub_model_id or Path(training_args.output_dir).absolute().name
    merged = training_args.push_to_hub and script_args.push_merged
    if not script_args.save_final_model and training_args.push_to_hub:
        raise ValueError("save_final_model: false saves no final model, and push_to_hub pushes it: remove one.")
    if merged and training_args.hub_strategy != "end":
        raise ValueError(
            f"push_merged pushes the merged model once, at the end, but hub_strategy "
            f"{getattr(training_args.hub_strategy, 'value', training_args.hub_strategy)} "
            "also pushes the adapter at each save into the same repo. Set hub_strategy: end with push_merged, or "
            "push the merged model later with `trl-opd push OUTPUT_DIR --repo-id ORG/NAME --merge`."
        )
    trainer = build_trainer(script_args, training_args, model_args)  # with push_to_hub: the repo, or an error now
    trainer.card_recipe, trainer.card_dataset = recipe, script_args.dataset_name
    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except RunFinished as finished:
        trainer.accelerator.print(str(finished))
        return trainer
    if trainer.eval_dataset is not None:
        print_eval_summary(trainer)
    output_dir = training_args.output_dir
    if not script_args.save_final_model:
        trainer.accelerator.print("Trained; the final model was not saved (save_final_model: false)")
        return trainer
    if merged:
        trainer.args.push_to_hub = False  # the final push is the merged model's, below
    with pushing(output_dir, repo_id, token=training_args.hub_token):
        trainer.save_model(output_dir)  # with push_to_hub, the Trainer pushes it with its model card
    if trainer.accelerator.is_main_process and not trainer.args.push_to_hub:  # a Trainer push wrote it already
        trainer.create_model_card()
    trainer.accelerator.print(f"Saved the trained {'adapter' if model_args.use_peft else 'model'} to {output_dir}")
    if trainer.eval_dataset is not None and trainer.accelerator.is_main_process:
        from ..evaluation import heldout_curve, write_heldout_curve

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
    from ..trainer.metrics import metric_text

    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    if not evals or evals[-1]["step"] != trainer.state.global_step:
        trainer.evaluate()
        evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    first, last = evals[0], evals[-1]
    lines = [f"Held-out evaluation, step {first['step']} -> step {last['step']}:"]
    for key, name in EVAL_SUMMARY_METRICS.items():
        if key in first and key in last:
            lines.append(f"  {name:<38} {metric_text(first[key], '.4f'):>8} -> {metric_text(last[key], '.4f'):>8}")
    trainer.accelerator.print("\n".join(lines))


def end_processes(accelerator=None) -> None:
    """Destroy the process groups, and free what holds them, while the interpreter is whole.

    A gloo process group still referenced at exit is destroyed during the interpreter's finalization, where a rank
    sometimes aborts ("terminate called without an active exception", SIGABRT) after its training and save
    succeeded. Under ZeRO-3 the groups outlive `destroy_process_group`: every partitioned parameter names its group,
    and DeepSpeed keeps each model it wrapped for the life of the process (on its forward-module stack, and in a
    method cache of its parameter coordinator). So: release the accelerator's engines, that module state and the
    caches, collect the models (the caller has dropped its trainer), and destroy through DeepSpeed, which also drops
    its own references to its groups. Their threads are then joined here, not at exit.
    """
    import functools
    import gc

    import torch.distributed
    from accelerate import PartialState

    if not torch.distributed.is_initialized():  # one process: no group to destroy
        if accelerator is not None:
            accelerator.end_training()
        return
    PartialState().wait_for_everyone()
    if accelerator is not None:
        accelerator.free_memory()
    if "deepspeed" in sys.modules:
        from deepspeed.runtime.zero import parameter_offload

        getattr(parameter_offload, "FWD_MODULE_STACK", []).clear()
    for cached in [obj for obj in gc.get_objects() if isinstance(obj, functools._lru_cache_wrapper)]:
        cached.cache_clear()
    gc.collect()
    if "deepspeed" in sys.modules:
        import deepspeed.comm

        if deepspeed.comm.is_initialized():
            deepspeed.comm.destroy_process_group()
    if accelerator is not None:
        accelerator.end_training()  # its trackers
    PartialState().destroy_process_group()  # where DeepSpeed did not
    gc.collect()


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
    from accelerate.utils import DistributedType

    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        _fsdp_state_on_cpu()
        return True
    if PartialState(backend="gloo").distributed_type == DistributedType.NO:
        # e.g. torchrun without accelerate's DeepSpeed settings: the Trainer would not wrap the model for data
        # parallelism, and each process would train its own copy of the student, never synchronised
        raise SystemExit(
            f"{os.environ['WORLD_SIZE']} CPU processes, and no DeepSpeed configuration to train them as one: each "
            "would train its own copy of the student. Launch with accelerate and a DeepSpeed config: accelerate "
            "launch --config_file recipes/accelerate/zero3_cpu.yaml -m trl_opd --config ...")
    return True


def _fsdp_state_on_cpu() -> None:
    """An FSDP launch on CPU processes: accelerate sets up its FSDP state only for GPU-like devices and would train
    plain data parallel here, while reporting FSDP in the launch config. Set up gloo across the processes and the
    state the launch names (its FSDP_* settings), for the Trainer's accelerator to take: `prepare` then shards the
    student with accelerate's own `fully_shard`, as on GPUs."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # from the launch's environment (its version is checked with the rest)
    state = Accelerator(cpu=True).state  # MULTI_CPU: gloo across the launch's processes
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin


if __name__ == "__main__":
    main()
