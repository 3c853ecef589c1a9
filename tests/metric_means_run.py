"""One OPD step whose processes hold different completion token counts, recording the per-token values behind the
token-level metrics it logs: run by tests/test_distributed.py under `accelerate launch` (ZeRO-3), not collected by
pytest.

    accelerate launch --config_file CONFIG tests/metric_means_run.py TINY_DIR OUTPUT_DIR RESULT.json ESTIMATOR OPD_COEF

Sampled completions of up to 12 tokens (the tiny student ends them at varying lengths), 2 micro-batches of 4 rows a
process, one generation batch. Writes the step's log entry and, per process and micro-batch in training order, the
sampled tokens (`completion_ids`), the distilled tokens (`mask`), `old_logp - teacher_logp` at them (`reverse_kl`),
the dense term per token (`dense`, 0 off the mask; for 'topk' also `mass`, each model's top-k probability per
position) and the student's entropy at each distilled token (`entropy`), from whichever path computed it.
"""

import json
import sys
from pathlib import Path

import torch
from datasets import load_dataset

import trl_opd.trainer.dense
import trl_opd.trainer.opd_trainer
import trl_opd.trainer.student
from trl_opd import OPDConfig, OPDTrainer
from trl_opd.tools import cli
from trl_opd.trainer.advantages import scores_kept

tiny, output_dir, result, estimator, opd_coef = (Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4],
                                                 float(sys.argv[5]))
configured = cli._cpu_process_group()  # several CPU processes: gloo, set up before the arguments read the world size
args = OPDConfig(
    output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=1,
    max_completion_length=12, max_steps=1, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
    bf16=False, seed=0, opd_estimator=estimator, opd_coef=opd_coef,
    accelerator_config={"use_configured_state": True} if configured else None,
)
micro_batches = []  # this process's, in training order


def recorded(function, record):
    def call(*args, **kwargs):
        out = function(*args, **kwargs)
        record(out)
        return out

    return call


def record_dense(out):
    divergence, mass = out if isinstance(out, tuple) else (out, None)
    micro_batches[-1]["dense"] = divergence.detach().tolist()
    if mass is not None:
        micro_batches[-1]["mass"] = mass.tolist()


def record_entropy(out):  # head_token_stats at the distilled positions: (logps, entropy, is_top1)
    micro_batches[-1]["entropy"] = out[1].tolist()


trl_opd.trainer.dense.dense_divergence = recorded(trl_opd.trainer.dense.dense_divergence, record_dense)
trl_opd.trainer.dense.dense_topk_divergence = recorded(trl_opd.trainer.dense.dense_topk_divergence, record_dense)
lean = trl_opd.trainer.opd_trainer  # the dense-only path
lean.head_token_stats = recorded(lean.head_token_stats, record_entropy)
compact = trl_opd.trainer.student  # GRPO's, on a CPU
compact.head_token_stats = recorded(compact.head_token_stats, record_entropy)


class RecordingTrainer(OPDTrainer):
    def _compute_loss(self, model, inputs):
        micro_batches.append({"completion_ids": inputs["completion_ids"].tolist(),
                              "mask": inputs["action_mask"].tolist()})
        return super()._compute_loss(model, inputs)

    def _form_advantages(self, inputs, old_per_token_logps):
        reverse_kl = (old_per_token_logps - scores_kept(inputs).logps) * inputs["action_mask"]
        micro_batches[-1]["reverse_kl"] = reverse_kl.tolist()
        super()._form_advantages(inputs, old_per_token_logps)


prompts = load_dataset("json", data_files=str(tiny / "train.jsonl"), split="train").select(range(16))
trainer = RecordingTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=args,
                           train_dataset=prompts)
trainer.train()
ranks = [None] * trainer.accelerator.num_processes
torch.distributed.all_gather_object(ranks, micro_batches)
if trainer.accelerator.is_main_process:
    result.write_text(json.dumps({"logged": trainer.state.log_history[0], "ranks": ranks}))
trainer.accelerator.wait_for_everyone()
trainer.accelerator.end_training()
