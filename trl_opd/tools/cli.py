"""`trl-opd` / `python -m trl_opd`: parse a recipe -> build the trainer -> train -> save (and push).

    trl-opd --config recipes/smoke_cpu.yaml [--max_steps 5 ...]        # train (also: trl-opd train --config ...)
    accelerate launch --config_file recipes/accelerate/cpu.yaml -m trl_opd --config recipes/smoke_cpu.yaml
    trl-opd make-tiny artifacts/tiny                                    # the local models the smoke recipe uses
    trl-opd make-tiny-agent artifacts/tiny_agent                        # the tool-using pair of the agent recipe
    trl-opd serve-teacher MODEL [--port 8000] [vllm args]               # a vLLM server for teacher_server_url
    trl-opd serve-env [--port 8765]                                     # the code tool environment (OpenEnv) server
    trl-opd check --config recipes/smoke_cpu.yaml                       # one-batch preflight of a recipe
    trl-opd push outputs/smoke --repo-id ORG/NAME [--merge]             # push a saved adapter/model to the Hub
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from trl import ModelConfig

from ..config import OPDConfig
from ..trainer.metrics import metric_text
from .recipe import OPDScriptArguments, build_trainer, make_parser


def train(script_args: OPDScriptArguments, training_args: OPDConfig, model_args: ModelConfig, *,
          recipe: str | None = None):
    """Build an OPDTrainer from parsed recipe arguments, train, save with a model card, and push if asked.

    Pushes are the Trainer's own, as in the Python API: the repo is created when the trainer is built (so an
    unreachable Hub stops the run before training), checkpoints are pushed as `hub_strategy` says, and the final
    model after its local save. With `push_merged` the final push is the adapter merged into its base model instead.
    """
    from ..trainer.hub import push, pushing

    repo_id = training_args.hub_model_id or Path(training_args.output_dir).absolute().name
    merged = training_args.push_to_hub and script_args.push_merged
    if not script_args.save_final_model and training_args.push_to_hub:
        raise ValueError("save_final_model: false saves no final model, and push_to_hub pushes it: remove one.")
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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["make-tiny"]:
        from ..tiny import main as make_tiny_main

        return make_tiny_main(argv[1:])
    if argv[:1] == ["make-tiny-agent"]:
        from ..envs.tiny_agent import main as make_tiny_agent_main

        return make_tiny_agent_main(argv[1:])
    if argv[:1] == ["make-tiny-task"]:
        from ..envs.addition import main as make_tiny_task_main

        return make_tiny_task_main(argv[1:])
    if argv[:1] == ["make-code-task"]:
        from ..envs.code_output import main as make_code_task_main

        return make_code_task_main(argv[1:])
    if argv[:1] == ["serve-teacher"]:
        from .serve import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["serve-env"]:
        from ..envs.code_env.server import main as serve_env_main

        return serve_env_main(argv[1:])
    if argv[:1] == ["push"]:
        from ..trainer.hub import main as push_main

        return push_main(argv[1:])
    command = argv.pop(0) if argv[:1] in (["check"], ["train"]) else "train"
    if _cpu_process_group():
        # the arguments must take the process group just set up rather than build their own
        argv = _with_configured_state(argv)
    if command == "check":
        from .preflight import check

        report = check(*make_parser().parse_args_and_config(argv))
        end_processes()
        sys.exit(0 if report["ok"] else 1)
    script_args, training_args, model_args = make_parser().parse_args_and_config(argv)
    recipe = argv[argv.index("--config") + 1] if "--config" in argv else None
    accelerator = train(script_args, training_args, model_args, recipe=recipe).accelerator
    end_processes(accelerator)


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

    if PartialState(backend="gloo").distributed_type == DistributedType.NO:
        # e.g. torchrun without accelerate's DeepSpeed settings: the Trainer would not wrap the model for data
        # parallelism, and each process would train its own copy of the student, never synchronised
        raise SystemExit(
            f"{os.environ['WORLD_SIZE']} CPU processes, and no DeepSpeed configuration to train them as one: each "
            "would train its own copy of the student. Launch with accelerate and a DeepSpeed config: accelerate "
            "launch --config_file recipes/accelerate/zero3_cpu.yaml -m trl_opd --config ...")
    return True


if __name__ == "__main__":
    main()
