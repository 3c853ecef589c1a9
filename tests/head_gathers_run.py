"""One OPD step with the `full` estimator, counting the all-gathers of the teacher's LM head in the loss and its
backward: run by tests/test_distributed.py under `accelerate launch` (ZeRO-3), not collected by pytest.

    accelerate launch --config_file CONFIG tests/head_gathers_run.py TINY_DIR OUTPUT_DIR RESULT.json

Completions are forced to 48 tokens, so each process's micro-batch holds 384 positions: two calls of the divergence
kernel on a CPU (256 positions each). Before the step's own loss, the same loss is computed once more without the
head held whole, forward only, and both losses and both counts are written.
"""

import json
import sys
from pathlib import Path

import deepspeed
import torch
from datasets import load_dataset

from trl_opd import OPDConfig, OPDTrainer
from trl_opd.tools import cli

tiny, output_dir, result = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
configured = cli._cpu_process_group()  # several CPU processes: gloo, set up before the arguments read the world size
world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
args = OPDConfig(
    output_dir=output_dir, per_device_train_batch_size=16 // world, num_generations=1, max_completion_length=48,
    generation_kwargs={"do_sample": False, "min_new_tokens": 48}, max_steps=1, learning_rate=1e-2, logging_steps=1,
    save_strategy="no", report_to="none", bf16=False, seed=0, opd_estimator="full",
    accelerator_config={"use_configured_state": True} if configured else None,
)
prompts = load_dataset("json", data_files=str(tiny / "train.jsonl"), split="train").select(range(16))
trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=args,
                     train_dataset=prompts)
head = trainer.teacher.output_head.weight
window, counts, losses = [False], {"held": 0, "plain": 0}, {}
gather_init = deepspeed.zero.GatheredParameters.__init__


def counting_init(self, params, *args, **kwargs):
    params = [params] if torch.is_tensor(params) else list(params)
    if window[0] and any(param is head for param in params):
        counts[window[0]] += 1
    gather_init(self, params, *args, **kwargs)


deepspeed.zero.GatheredParameters.__init__ = counting_init
compute_loss, training_step = trainer.compute_loss, trainer.training_step


def counted_loss(model, inputs, *args, **kwargs):
    if "plain" not in losses:  # the same loss without the head held whole (forward only)
        held, trainer.dense._held = trainer.dense._held, None  # the step's hold on the head, let go for this call
        window[0] = "plain"
        with torch.no_grad():
            losses["plain"] = compute_loss(model, inputs, *args, **kwargs).item()
        trainer.dense._held = held
    window[0] = "held"
    loss = compute_loss(model, inputs, *args, **kwargs)
    losses["held"] = loss.item()
    return loss


def counted_step(*args, **kwargs):
    try:
        return training_step(*args, **kwargs)
    finally:
        window[0] = False


trainer.compute_loss, trainer.training_step = counted_loss, counted_step
trainer.train()
positions = trainer.state.log_history[0].get("completions/mean_length")
if trainer.accelerator.is_main_process:
    result.write_text(json.dumps({"counts": counts, "losses": losses, "mean_length": positions}))
trainer.accelerator.wait_for_everyone()
trainer.accelerator.end_training()
