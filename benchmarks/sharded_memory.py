"""Memory per rank of one training step under DeepSpeed ZeRO-3 and under FSDP2 (2 CPU processes each) against one
process, same batch.

A random student (hidden 128) and teacher (hidden 192), 2 layers each, with a 65,536-token vocabulary, so that the LM
heads (8.4M and 12.6M parameters) dominate, as on real models; full fine-tuning, 16 completions of 32 tokens per
step (16 x 1 or 8 x 2 processes), `zero3_cpu.json` (every tensor partitioned) and `fsdp2_cpu.yaml` (one unit per
decoder layer, the embeddings and the head with the final norm units of their own). For each estimator, on step 2 (after
the optimizer's state exists) each rank reports:
- resident: the tensor storage alive when the step starts (weights, gradients, optimizer state, DeepSpeed's buffers),
  each storage counted once (an FSDP2 parameter by its local shard);
- loss peak: the largest tensor memory allocated on top of that by the loss forward and backward (the student's
  forward, the dense term, the backward; under ZeRO-3 the gathers of every layer and head), by
  `trl_opd.tools.testing.TensorMemoryMeter`, up to the optimizer's update;
- step peak: the same over the whole step (generation, teacher scoring, loss, backward and update).
Prints the markdown table of docs/scale-and-hub.md.

    .venv/bin/python benchmarks/sharded_memory.py
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).parents[1]
ESTIMATORS = ("sampled", "topk", "full")
VOCAB, ROWS, COMPLETION = 65536, 16, 32


def build_pair(directory: Path) -> None:
    from trl_opd.tiny import build_model, build_tokenizer, write_prompts

    tokenizer = build_tokenizer()
    for name, hidden_size, seed in (("student", 128, 0), ("teacher", 192, 1)):
        model = build_model(tokenizer, vocab_size=VOCAB, hidden_size=hidden_size, seed=seed)
        model.save_pretrained(directory / name)
        tokenizer.save_pretrained(directory / name)
    write_prompts(directory / "train.jsonl", 64, seed=1)


def resident_bytes() -> int:
    """Bytes of all tensor storages alive (each once), as far as Python holds them."""
    import torch

    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            if type(obj).__name__ == "DTensor":  # a wrapper: its local shard is counted as a tensor of its own
                continue
            try:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # FSDP2's unsharded parameter between uses: its storage freed (resized to 0)
                continue
    return sum(seen.values())


def worker(argv: list[str]) -> None:
    """One run (launched directly or by `accelerate launch`): train 2 steps, measure the second, write rank's JSON."""
    from transformers import TrainerCallback

    from trl_opd.tools import cli, recipe
    from trl_opd.tools.testing import TensorMemoryMeter
    from trl_opd.trainer import OPDTrainer

    class SecondStepMemory(TrainerCallback):
        """Step 2, from its start to its end (generation, scoring, loss, backward, optimizer update), and its loss
        alone (the loss forward and backward, up to the optimizer's update)."""

        def __init__(self, trainer):
            self.trainer, self.step, self.loss, self.resident, self.loss_peak = trainer, None, None, 0, None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.resident = resident_bytes()
                self.step = TensorMemoryMeter().__enter__()

        def loss_starts(self):
            if self.step is not None and self.loss is None and self.loss_peak is None:
                self.loss = TensorMemoryMeter().__enter__()

        def update_starts(self):  # the optimizer's update: under DeepSpeed inside the backward call, else after it
            if self.loss is not None:
                self.loss_peak = self.loss.peak
                self.loss.__exit__(None, None, None)
                self.loss = None

        def on_step_end(self, args, state, control, **kwargs):
            if self.step is None:
                return
            self.step.__exit__(None, None, None)
            out = Path(args.output_dir) / f"memory-rank{self.trainer.accelerator.process_index}.json"
            out.write_text(json.dumps({"resident": self.resident, "step": self.step.peak, "loss": self.loss_peak}))
            self.step = None

    def wrap(cls, name, before=None, after=None):
        original = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            if before is not None:
                before()
            result = original(self, *args, **kwargs)
            if after is not None:
                after()
            return result

        setattr(cls, name, wrapped)

    original_train = OPDTrainer.train
    callbacks = []

    def train(self, *args, **kwargs):
        callbacks.append(SecondStepMemory(self))
        self.add_callback(callbacks[0])
        return original_train(self, *args, **kwargs)

    OPDTrainer.train = train
    wrap(OPDTrainer, "compute_loss", before=lambda: callbacks[0].loss_starts())
    wrap(OPDTrainer, "training_step", after=lambda: callbacks[0].update_starts())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        from deepspeed import DeepSpeedEngine

        wrap(DeepSpeedEngine, "step", before=lambda: callbacks[0].update_starts())
    if cli._cpu_process_group():
        argv += ["--accelerator_config", '{"use_configured_state": true}']
    cli.train(*recipe.make_parser().parse_args_and_config(argv))


def run(pair: Path, estimator: str, processes: int, output_dir: Path, engine: str = "zero3") -> list[dict]:
    args = [
        "--model_name_or_path", str(pair / "student"), "--teacher_model_name_or_path", str(pair / "teacher"),
        "--dataset_name", str(pair / "train.jsonl"), "--output_dir", str(output_dir), "--opd_estimator", estimator,
        "--per_device_train_batch_size", str(ROWS // processes), "--num_generations", "1",
        "--max_completion_length", str(COMPLETION), "--generation_kwargs", '{"min_new_tokens": 32}',
        "--max_steps", "2", "--learning_rate", "1e-4", "--save_strategy", "no", "--report_to", "none",
        "--bf16", "false", "--logging_steps", "1", "--seed", "0",
    ]
    if processes == 1:
        command = [sys.executable, __file__, "--worker", *args]
    else:
        from trl_opd.tools.testing import free_port

        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "recipes" / "accelerate" / f"{engine}_cpu.yaml"), "--num_processes", str(processes),
                   "--main_process_port", str(free_port()),
                   __file__, "--worker", *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{estimator} x{processes} {engine} failed:\n{result.stderr[-4000:]}")
    return [json.loads((output_dir / f"memory-rank{rank}.json").read_text()) for rank in range(processes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    known, rest = parser.parse_known_args()
    if known.worker:
        return worker(rest)
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        pair = Path(tmp) / "pair"
        build_pair(pair)
        print("| estimator | 1 process: resident + loss peak (step peak) | ZeRO-3, per rank of 2 | FSDP2, per rank "
              "of 2 | per rank / 1 process, resident + loss peak: ZeRO-3, FSDP2 |")
        print("|---|---:|---:|---:|---:|")
        for estimator in ESTIMATORS:
            (single,) = run(pair, estimator, 1, Path(tmp) / f"{estimator}-1")
            zero3 = max(run(pair, estimator, 2, Path(tmp) / f"{estimator}-2"), key=lambda r: r["resident"] + r["loss"])
            fsdp2 = max(run(pair, estimator, 2, Path(tmp) / f"{estimator}-fsdp2", engine="fsdp2"),
                        key=lambda r: r["resident"] + r["loss"])

            def cell(r):
                return (f"{r['resident'] / mib:.0f} + {r['loss'] / mib:.0f} = {(r['resident'] + r['loss']) / mib:.0f} "
                        f"MiB ({r['step'] / mib:.0f})")

            def ratio(r, single=single):
                return (r["resident"] + r["loss"]) / (single["resident"] + single["loss"])

            print(f"| {estimator} | {cell(single)} | {cell(zero3)} | {cell(fsdp2)} | {ratio(zero3):.2f}, "
                  f"{ratio(fsdp2):.2f} |", flush=True)


if __name__ == "__main__":
    main()
