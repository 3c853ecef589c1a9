"""One OPD step of a student passed as a model that moved after loading (an SFT stage in the same process), with the
student as its own starting teacher: run by tests/test_distributed.py under `accelerate launch`, not collected by
pytest.

    accelerate launch --config_file CONFIG tests/instance_run.py TINY_DIR OUTPUT_DIR KIND RESULT.json

Writes the trainer's log history. The teacher reads what the student reads and the reward is constant, so the
first step's KL is 0 exactly when the teacher starts from the student as passed, not from its checkpoint.
"""

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import deepspeed
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM

from trl_opd import OPDConfig, OPDTrainer
from trl_opd.tools import cli

tiny, output_dir, kind, result = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
configured = cli._cpu_process_group()  # several CPU processes: gloo, set up before the arguments read the world size
world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
args = OPDConfig(
    output_dir=output_dir, per_device_train_batch_size=8 // world, num_generations=2, max_completion_length=8,
    max_steps=1, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", bf16=False, seed=0,
    student_as_teacher=kind, opd_estimator="full", generation_kwargs={"do_sample": False},
    accelerator_config={"use_configured_state": True} if configured else None,
)
student = AutoModelForCausalLM.from_pretrained(tiny / "student", dtype=torch.float32)  # partitioned as it loads
torch.manual_seed(0)
partitioned = [parameter for parameter in student.parameters() if hasattr(parameter, "ds_id")]
gathered = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0) if partitioned else nullcontext()
with torch.no_grad(), gathered:  # process 0's move, partitioned to all
    moved = 0.0
    for parameter in student.parameters():
        parameter.add_(torch.randn_like(parameter) * 0.3)
        moved = max(moved, parameter.abs().max().item())
assert moved > 0.3, "the student did not move"
prompts = load_dataset("json", data_files=str(tiny / "train.jsonl"), split="train").select(range(16))
trainer = OPDTrainer(model=student, args=args, train_dataset=prompts,
                     reward_funcs=[lambda completions, **kwargs: [1.0] * len(completions)])
trainer.train()
if trainer.accelerator.is_main_process:
    result.write_text(json.dumps(trainer.state.log_history))
trainer.accelerator.wait_for_everyone()
trainer.accelerator.end_training()
