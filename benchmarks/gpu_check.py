"""The prepared GPU check: the GPU recipes' path on one GPU, with models built from real configs, in one JSON.

    python benchmarks/gpu_check.py --out gpu_check.json                      # one GPU, about 8 minutes
    python benchmarks/gpu_check.py --wheels DIR --out gpu_check.json         # first install gpu_wheels.py's bundle
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check.json       # CPU, tiny shapes (CI: keeps it working)

It builds randomly initialised models from real shapes (a Qwen3-1.7B-shaped student with its tied head, a
Qwen3-8B-shaped teacher, vocabulary 151,936, bfloat16; `--dry-run`: hidden 64/96, 2 layers, float32) and a
word-level tokenizer over that vocabulary, then checks:

  check      `trl-opd check` under ZeRO-3 with zero.Init, one process: exit status and the reference pass's KL (0)
  zero3      3 steps under ZeRO-3 against a plain single-device run of the same recipe (greedy decoding, so both see
             the same completions), for the `full` and `topk` estimators with LoRA and `full` with the tied head
             trained in full: every step's loss, KL and gradient norm, and whether they agree (bf16: 2e-2 relative)
  cost       the teacher scoring 64 x 2048 completion tokens, and one `full`-estimator loss forward and backward at
             micro-batch 16 with gradient checkpointing beside TRL's DistillationTrainer's on the same batch: seconds
             and peak device memory of each, measured in the same run

The machine it is made for has torch, transformers, peft and accelerate and reaches no package registry: what else
it needs (trl, datasets, deepspeed, math-verify, this package) comes as the wheels `benchmarks/gpu_wheels.py` bundles
into `--wheels DIR`, installed offline into WORK/site before anything else runs and imported from there first by this
process and those it launches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
VOCAB = 151_936
# Qwen3-1.7B and Qwen3-8B as their configs give them (the student's head tied to its embeddings)
REAL = {
    "student": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "teacher": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
TINY = {
    "student": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
    "teacher": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=3,
                    num_key_value_heads=1, head_dim=32, tie_word_embeddings=False),
}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def install_wheels(directory: Path, target: Path) -> None:
    """What the GPU machine lacks, from the wheels in `directory` (no registry there), installed into `target`, put
    first on this process's path and on PYTHONPATH for the ones it launches (all of them `python -m`)."""
    wheels = sorted(map(str, directory.glob("*.whl")))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                    "--upgrade", "--target", str(target), *wheels], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))


def build_pair(directory: Path, *, dry_run: bool, vocab_size: int) -> dict[str, Path]:
    """A student and a teacher of the chosen shapes with one word-level tokenizer, saved under `directory`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = [f"w{i}" for i in range(vocab_size - len(specials) - 3)] + ["user", "assistant", "system"]
    vocab = {token: i for i, token in enumerate([*specials, *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=specials[1:2])
    tokenizer.chat_template = CHATML
    shapes = TINY if dry_run else REAL
    dtype = torch.float32 if dry_run else torch.bfloat16
    device = "cpu" if dry_run or not torch.cuda.is_available() else "cuda"
    paths = {}
    for seed, name in enumerate(("student", "teacher")):
        paths[name] = directory / name
        if (paths[name] / "config.json").exists():
            continue
        torch.manual_seed(seed)
        config = Qwen3Config(vocab_size=vocab_size, max_position_embeddings=4096, bos_token_id=None,
                             eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"], **shapes[name])
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        del model
    prompts = directory / "prompts.jsonl"
    with prompts.open("w") as out:
        for i in range(256):
            text = " ".join(f"w{(i * 7 + j * 13) % 1000}" for j in range(12))
            out.write(json.dumps({"prompt": [{"role": "user", "content": text}]}) + "\n")
    paths["prompts"] = prompts
    return paths


def launch_config(directory: Path, *, dry_run: bool, zero3: bool) -> Path:
    """An accelerate config for one process: ZeRO-3 with zero.Init (bf16 on a GPU), or a plain single device."""
    path = directory / f"{'zero3' if zero3 else 'single'}.yaml"
    lines = ["compute_environment: LOCAL_MACHINE", "machine_rank: 0", "main_training_function: main",
             "num_machines: 1", "num_processes: 1", "rdzv_backend: static", "same_network: true", "use_cpu: false"]
    if not (zero3 and dry_run):  # a DeepSpeed config file sets its own precision
        lines.append("mixed_precision: " + ("'no'" if dry_run else "bf16"))
    if zero3:
        deepspeed = ([f"  deepspeed_config_file: {ROOT / 'recipes' / 'accelerate' / 'zero3_cpu.json'}"] if dry_run
                     else ["  offload_optimizer_device: none", "  offload_param_device: none", "  zero_stage: 3",
                           "  zero3_save_16bit_model: true"])
        lines += ["distributed_type: DEEPSPEED", "deepspeed_config:", "  zero3_init_flag: true", *deepspeed]
    else:
        lines += ["distributed_type: 'NO'"]
    path.write_text("\n".join(lines) + "\n")
    return path


def recipe_args(pair: dict[str, Path], output_dir: Path, *, dry_run: bool, steps: int, extra: list[str]) -> list[str]:
    return [
        "--model_name_or_path", str(pair["student"]), "--teacher_model_name_or_path", str(pair["teacher"]),
        "--dataset_name", str(pair["prompts"]), "--output_dir", str(output_dir), "--max_steps", str(steps),
        "--per_device_train_batch_size", "8", "--num_generations", "2", "--max_completion_length", "32",
        "--learning_rate", "1e-4", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", str(steps),
        "--report_to", "none", "--seed", "0", "--generation_kwargs", '{"do_sample": false}',
        "--bf16", "false" if dry_run else "true", "--dtype", "float32" if dry_run else "bfloat16",
        "--gradient_checkpointing", "true", "--disable_dropout", "true", "--overwrite_output_dir", "true", *extra,
    ]


def launch(config: Path, args: list[str], *, log: Path, timeout: int) -> tuple[int, str, float]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "-m", "trl_opd",
               *args]
    start = time.perf_counter()
    with log.open("w") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    return result.returncode, log.read_text(), time.perf_counter() - start


def check_part(pair, work: Path, *, dry_run: bool) -> dict:
    config = launch_config(work, dry_run=dry_run, zero3=True)
    args = ["check", *recipe_args(pair, work / "check", dry_run=dry_run, steps=1, extra=[])]
    rc, text, seconds = launch(config, args, log=work / "check.log", timeout=600)
    line = next((row for row in text.splitlines() if row.startswith("reference as teacher:")), None)
    return {"ok": rc == 0 and line is not None and "OK, 0 as expected" in line, "returncode": rc,
            "reference_line": line, "seconds": round(seconds, 1), "tail": None if rc == 0 else text[-3000:]}


ZERO3_RUNS = {
    "full+lora": ["--opd_estimator", "full", "--use_peft", "true", "--lora_r", "16", "--lora_target_modules",
                  "all-linear"],
    "topk+lora": ["--opd_estimator", "topk", "--use_peft", "true", "--lora_r", "16", "--lora_target_modules",
                  "all-linear"],
    "full+tied-head": ["--opd_estimator", "full", "--use_peft", "false"],
}
COMPARED = ("loss", "grad_norm", "opd/reverse_kl", "opd/reverse_kl_dense", "opd/reverse_kl_topk")


def zero3_part(pair, work: Path, *, dry_run: bool, steps: int) -> dict:
    tolerance = 1e-4 if dry_run else 2e-2
    results = {}
    for name, extra in ZERO3_RUNS.items():
        histories = {}
        for layout in ("zero3", "single"):
            config = launch_config(work, dry_run=dry_run, zero3=layout == "zero3")
            output_dir = work / f"{name}-{layout}"
            args = recipe_args(pair, output_dir, dry_run=dry_run, steps=steps, extra=extra)
            rc, text, seconds = launch(config, args, log=work / f"{name}-{layout}.log", timeout=900)
            if rc != 0:
                histories[layout] = {"returncode": rc, "tail": text[-3000:]}
                continue
            state = json.loads((output_dir / f"checkpoint-{steps}" / "trainer_state.json").read_text())
            logged = [entry for entry in state["log_history"] if "loss" in entry]
            histories[layout] = {"seconds": round(seconds, 1),
                                 "steps": [{k: entry[k] for k in COMPARED if k in entry} for entry in logged]}
        agree = all("steps" in h for h in histories.values()) and all(
            abs(a[k] - b[k]) <= tolerance * max(abs(b[k]), 1e-6)
            for a, b in zip(histories["zero3"]["steps"], histories["single"]["steps"], strict=True) for k in a)
        results[name] = {"agree": agree, "tolerance": tolerance, **histories}
    return results


def cost_part(pair, work: Path, *, dry_run: bool) -> dict:
    """Teacher scoring and one loss forward/backward, this package's `full` estimator beside TRL's trainer."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    from trl_opd import OPDConfig, OPDTrainer

    rows, length, micro = (8, 64, 4) if dry_run else (64, 2048, 16)
    device = torch.device("cuda" if torch.cuda.is_available() and not dry_run else "cpu")
    dtype = torch.float32 if dry_run else torch.bfloat16
    prompts = load_dataset("json", data_files=str(pair["prompts"]), split="train")
    common = dict(output_dir=str(work / "cost"), per_device_train_batch_size=micro, max_completion_length=length,
                  report_to="none", save_strategy="no", bf16=not dry_run, gradient_checkpointing=True,
                  use_cpu=dry_run)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def measured(run) -> dict:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        run()
        sync()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        return {"seconds": round(seconds, 3), "peak_gib": None if peak is None else round(peak, 2)}

    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 1000, (rows, 16), generator=generator).to(device)
    completion_ids = torch.randint(3, 1000, (rows, length), generator=generator).to(device)
    ones = torch.ones_like
    opd = OPDTrainer(model=str(pair["student"]), teacher_model=str(pair["teacher"]), train_dataset=prompts,
                     args=OPDConfig(**common, num_generations=2, opd_estimator="full",
                                    model_init_kwargs={"dtype": dtype}))
    scores = {}
    result = {"rows": rows, "completion_tokens": length, "micro_batch": micro}
    result["teacher_scoring"] = measured(lambda: scores.update(
        out=opd.teacher.score(prompt_ids, ones(prompt_ids), completion_ids, ones(completion_ids))))

    def micro_batch(source: dict, start: int) -> dict:
        part = {key: value[start:start + micro] if torch.is_tensor(value) and value.dim() else value
                for key, value in source.items()}
        part["num_items_in_batch"] = source["num_items_in_batch"]
        return part

    generated = {"prompt_ids": prompt_ids, "prompt_mask": ones(prompt_ids), "completion_ids": completion_ids,
                 "completion_mask": ones(completion_ids), "advantages": torch.zeros(rows, device=device)}
    opd._action_mask([{} for _ in range(rows)], generated)
    opd.model.train()
    opd.current_gradient_accumulation_steps = 1
    batch = opd._finish_with_scores(generated, scores["out"])
    result["opd_full_loss_fwd_bwd"] = measured(lambda: opd.compute_loss(opd.model, micro_batch(batch, 0)).backward())
    opd.accelerator.free_memory()
    opd = scores = batch = None  # the OPD trainer's models freed before TRL's load
    trl = DistillationTrainer(
        model=AutoModelForCausalLM.from_pretrained(pair["student"], dtype=dtype),
        teacher_model=AutoModelForCausalLM.from_pretrained(pair["teacher"], dtype=dtype),
        args=DistillationConfig(**common, beta=1.0), train_dataset=prompts)
    trl.model.train()
    inputs = {**generated, "num_items_in_batch": generated["num_items_in_batch"]}
    result["trl_distillation_loss_fwd_bwd"] = measured(
        lambda: trl.compute_loss(trl.model, micro_batch(inputs, 0)).backward())
    opd_seconds = result["opd_full_loss_fwd_bwd"]["seconds"]
    result["opd_vs_trl_seconds"] = round(opd_seconds / max(result["trl_distillation_loss_fwd_bwd"]["seconds"], 1e-9), 3)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (what CI runs)")
    parser.add_argument("--wheels", type=Path, help="first install the wheels benchmarks/gpu_wheels.py bundled here")
    parser.add_argument("--work", type=Path, default=Path("outputs/gpu_check"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=["check", "zero3", "cost"], choices=["check", "zero3", "cost"])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.wheels:
        install_wheels(args.wheels, (args.work / "site").resolve())
    import torch

    report = {"dry_run": args.dry_run, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    start = time.perf_counter()
    pair = build_pair(args.work / "models", dry_run=args.dry_run, vocab_size=1024 if args.dry_run else VOCAB)
    report["build_seconds"] = round(time.perf_counter() - start, 1)
    for part in args.parts:
        try:
            if part == "check":
                report["check"] = check_part(pair, args.work, dry_run=args.dry_run)
            elif part == "zero3":
                report["zero3"] = zero3_part(pair, args.work, dry_run=args.dry_run, steps=args.steps)
            else:
                report["cost"] = cost_part(pair, args.work, dry_run=args.dry_run)
        except Exception as error:  # one part failing still reports the others
            report[part] = {"error": f"{type(error).__name__}: {error}"}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["ok"] = (report.get("check", {}).get("ok", True)
                    and all(run.get("agree") for run in report.get("zero3", {}).values() if isinstance(run, dict))
                    and "error" not in report.get("cost", {}))
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
