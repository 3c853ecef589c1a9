"""The prepared GPU check: the GPU recipes' path on one GPU, with models built from real configs, part by part.

    python3 benchmarks/gpu_check.py --wheels outputs/gpu_wheels --parts cost check --budget 280 --out-dir OUT
    python3 benchmarks/gpu_check.py --wheels outputs/gpu_wheels --parts train zero3 --launch-timeout 150 \
        --budget 280 --out-dir OUT                                       # the two calls of docs/gpu.md, one GPU
    python3 benchmarks/gpu_check.py --wheels outputs/gpu_wheels --parts train --steps-per-generation 4 8 \
        --budget 280 --out-dir OUT                                       # the third, if time is left
    .venv/bin/python benchmarks/gpu_check.py --dry-run --parts zero3 --runs full+lora   # CPU, tiny shapes (CI)

It builds randomly initialised models from real shapes once into WORK/models (a Qwen3-1.7B-shaped student with its
tied head, a Qwen3-8B-shaped teacher, vocabulary 151,936, bfloat16; `--dry-run`: hidden 64/96, 2 layers, float32)
and a word-level tokenizer over that vocabulary, then runs the parts asked for:

  check   `trl-opd check` under ZeRO-3 with zero.Init, one process, full fine-tuning: the reference pass's KL is 0
  zero3   each of `--runs`: a few steps under ZeRO-3 against a single-device run of the same recipe (greedy decoding,
          fp32 master weights on both sides), every logged loss, KL and gradient norm compared
  cost    teacher scoring, and OPD's scoring plus loss forward and backward beside TRL's DistillationTrainer's loss
          forward and backward (its teacher forward inside) on the same micro-batch: seconds and peak memory
  train   the flagship recipe (recipes/opd.yaml: LoRA, the `full` estimator, 16 completions a micro-step, 4
          micro-steps) on one device, generation by the Trainer, for each of `--steps-per-generation`: seconds per
          step, tokens per second per GPU, the generation share of the step, and the completions' mean length
          against `--train-completion-length` (benchmarks/step_breakdown.py's timers)

Each launch runs in its own process group, under `--launch-timeout` and what is left of `--budget`; its training
writes no weights (no checkpoint, `save_final_model: false`): its steps are read from the launch's log, and its
output folder is deleted as soon as it ends. The report
(OUT/gpu_check.json) and the logs' tails (OUT/logs.tar.gz) are rewritten as each part or run finishes.
docs/gpu.md is the runbook: the two calls for one GPU, what each part prints, the time and memory expected.
"""

from __future__ import annotations

import argparse
import ast
import gc
import hashlib
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

import yaml

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
PACKAGES = ("torch", "transformers", "peft", "accelerate", "trl", "datasets", "deepspeed", "pyarrow", "safetensors",
            "tokenizers", "math-verify", "trl_opd")
ZERO3_RUNS = {  # the most telling first: a short --budget drops the last
    "full+lora": ["--opd_estimator", "full", "--use_peft", "true", "--lora_r", "16", "--lora_target_modules",
                  "all-linear"],
    "full+tied-head": ["--opd_estimator", "full", "--use_peft", "false"],
    "topk+lora": ["--opd_estimator", "topk", "--use_peft", "true", "--lora_r", "16", "--lora_target_modules",
                  "all-linear"],
}
TRAIN_STEPS = 3  # generation batches the train part runs: the first is its warm-up, the others are measured
COMPARED = ("loss", "grad_norm", "opd/reverse_kl", "opd/reverse_kl_dense", "opd/reverse_kl_topk")
MAX_LAUNCH_SECONDS = 300
MIN_LAUNCH_SECONDS = 30  # less left of --budget than this: the launch is skipped, not started to be killed
REPORT_SECONDS = 10  # kept back from --budget to write the report and the tarball
LOG_TAIL_BYTES = 200_000  # of each log in logs.tar.gz: 16 MiB is the most one returned file may hold


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def environment(work: Path, when: str) -> dict:
    """`df -h` of the work folder and the version `pip show` gives for each of PACKAGES (None: not installed),
    printed and returned."""
    disk = subprocess.run(["df", "-h", str(work)], capture_output=True, text=True).stdout.strip()
    shown = subprocess.run([sys.executable, "-m", "pip", "show", *PACKAGES], capture_output=True, text=True).stdout
    versions = dict.fromkeys(PACKAGES)
    names = {canonical(name): name for name in PACKAGES}
    name = None
    for line in shown.splitlines():
        if line.startswith("Name:"):
            name = names.get(canonical(line.split(":", 1)[1].strip()))
        elif line.startswith("Version:") and name:
            versions[name] = line.split(":", 1)[1].strip()
    print(f"== {when}\n{disk}\n" + ", ".join(f"{name} {version or '(not installed)'}"
                                            for name, version in versions.items()), flush=True)
    return {"df": disk, "packages": versions}


def install_wheels(directory: Path, target: Path) -> None:
    """What the GPU machine lacks, from the wheels in `directory` (no registry there), installed into `target` once
    (a second call with the same wheels reuses it), put first on this process's path and on PYTHONPATH for the
    processes it launches."""
    wheels = sorted(directory.glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no wheels in {directory}: bundle them with benchmarks/gpu_wheels.py")
    stamp, digest = target / ".installed", hashlib.sha256(b"".join(wheel.read_bytes() for wheel in wheels)).hexdigest()
    if not (stamp.exists() and stamp.read_text() == digest):
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)], check=True)
        stamp.write_text(digest)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))


def pair_paths(directory: Path) -> dict[str, Path]:
    return {"student": directory / "student", "teacher": directory / "teacher", "prompts": directory / "prompts.jsonl"}


def build_pair(directory: Path, *, dry_run: bool, vocab_size: int) -> dict[str, Path]:
    """A student and a teacher of the chosen shapes with one word-level tokenizer, saved under `directory` unless
    already there (each is written beside its place and moved in, so a killed build leaves no half model)."""
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
    paths = pair_paths(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(("student", "teacher")):
        if paths[name].exists():
            continue
        torch.manual_seed(seed)
        config = Qwen3Config(vocab_size=vocab_size, max_position_embeddings=4096, bos_token_id=None,
                             eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"], **shapes[name])
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        partial = directory / f"{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(paths[name])
        del model
    if device == "cuda":  # the launches that follow need the memory this process's allocator would keep
        gc.collect()
        torch.cuda.empty_cache()
    with paths["prompts"].open("w") as out:
        for i in range(256):
            text = " ".join(f"w{(i * 7 + j * 13) % 1000}" for j in range(12))
            out.write(json.dumps({"prompt": [{"role": "user", "content": text}]}) + "\n")
    return paths


def launch_config(directory: Path, *, dry_run: bool, zero3: bool) -> Path:
    """An accelerate config for one process: ZeRO-3 with zero.Init (bf16 on a GPU), or a plain single device (bf16
    autocast on a GPU)."""
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


def recipe_args(pair: dict[str, Path], output_dir: Path, *, dry_run: bool, zero3: bool, steps: int,
                extra: list[str]) -> list[str]:
    """The recipe of every launch. On a GPU both layouts keep fp32 master weights and compute in bf16: ZeRO-3 holds a
    bf16 student and fp32 masters in its optimizer; the single device loads the student in float32 under bf16
    autocast (a bf16 student there would train with bf16 AdamW state, and part from ZeRO-3 from step 2). The teacher
    is bf16 on both. No weights are written: no checkpoint, no final model."""
    if dry_run:
        precision = ["--bf16", "false", "--dtype", "float32"]
    else:
        precision = ["--bf16", "true", "--dtype", "bfloat16" if zero3 else "float32",
                     "--teacher_model_init_kwargs", '{"dtype": "bfloat16"}']
    return [
        "--model_name_or_path", str(pair["student"]), "--teacher_model_name_or_path", str(pair["teacher"]),
        "--dataset_name", str(pair["prompts"]), "--output_dir", str(output_dir), "--max_steps", str(steps),
        "--per_device_train_batch_size", "8", "--num_generations", "2", "--max_completion_length", "32",
        "--learning_rate", "1e-4", "--logging_steps", "1", "--save_strategy", "no", "--save_final_model", "false",
        "--disable_tqdm", "true",
        "--report_to", "none", "--seed", "0", "--generation_kwargs", '{"do_sample": false}', *precision,
        "--activation_checkpointing", "true", "--disable_dropout", "true", *extra,
    ]


def accelerate_command(config: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "-m", "trl_opd", *args]


def launch(command: list[str], *, log: Path, timeout: float) -> tuple[dict, str]:
    """Run `command` in a session of its own, its output to `log`; past `timeout` seconds its whole process group is
    killed, so that no worker keeps the GPU. Returns its outcome (status ok, failed or timed out) and its output."""
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:  # also when this process is stopped (SIGTERM is turned into SystemExit in main)
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                try:
                    os.killpg(process.pid, sig)  # the launcher's workers too, even once the launcher has exited
                    process.wait(timeout=wait)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
    text = log.read_text(errors="replace")
    status = "timed out" if returncode is None else "ok" if returncode == 0 else "failed"
    outcome = {"status": status, "returncode": returncode, "seconds": round(time.perf_counter() - start, 1)}
    if status != "ok":
        outcome["tail"] = text[-3000:]
    return outcome, text


class Limits:
    """How long the next launch may run: --launch-timeout, cut to what is left of --budget less REPORT_SECONDS;
    None when that is under MIN_LAUNCH_SECONDS."""

    def __init__(self, launch_timeout: float, budget: float | None):
        self.launch_timeout = launch_timeout
        self.deadline = None if budget is None else time.monotonic() + budget

    def next(self) -> float | None:
        if self.deadline is None:
            return self.launch_timeout
        left = self.deadline - time.monotonic() - REPORT_SECONDS
        return min(self.launch_timeout, left) if left >= MIN_LAUNCH_SECONDS else None


SKIPPED = {"status": "skipped", "reason": "too little of --budget left"}


def check_part(pair, work: Path, *, dry_run: bool, limits: Limits) -> dict:
    timeout = limits.next()
    if timeout is None:
        return {"ok": False, **SKIPPED}
    output_dir = work / "runs" / "check"
    shutil.rmtree(output_dir, ignore_errors=True)  # the CLI refuses a used output_dir (a call stopped mid-launch)
    args = ["check", *recipe_args(pair, output_dir, dry_run=dry_run, zero3=True, steps=1, extra=[])]
    config = launch_config(work, dry_run=dry_run, zero3=True)
    outcome, text = launch(accelerate_command(config, args), log=work / "logs" / "check.log", timeout=timeout)
    shutil.rmtree(output_dir, ignore_errors=True)
    line = next((row for row in text.splitlines() if row.startswith("reference as teacher:")), None)
    return {"ok": outcome["status"] == "ok" and line is not None and "OK, 0 as expected" in line, **outcome,
            "reference_line": line}


def logged_steps(text: str) -> list[dict]:
    """The compared values of each training step, from the dicts the Trainer prints per logging step
    (`{'loss': '0.04033', 'grad_norm': '0.5906', ...}`, floats as strings of 4 significant digits)."""
    steps = []
    for line in text.replace("\r", "\n").splitlines():
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}") and "'loss'" in line):
            continue
        try:
            entry = ast.literal_eval(line)
        except (ValueError, SyntaxError):
            continue
        if isinstance(entry, dict) and "loss" in entry:
            steps.append({key: float(entry[key]) for key in COMPARED if key in entry})
    return steps


def largest_gap(zero3: list[dict], single: list[dict]) -> float:
    """The largest relative difference between the two runs' logged values, each first widened by the log's rounding
    (half a unit of the 4th significant digit on each side): 0 when they agree to what the log can show."""
    if len(zero3) != len(single) or not zero3 or any(a.keys() != b.keys() for a, b in zip(zero3, single, strict=True)):
        return math.inf
    gap = 0.0
    for a, b in zip(zero3, single, strict=True):
        for key in a:
            if not (math.isfinite(a[key]) and math.isfinite(b[key])):
                return math.inf
            scale = max(abs(a[key]), abs(b[key]), 1e-12)
            rounding = 10 ** (math.floor(math.log10(scale)) - 3)
            gap = max(gap, max(abs(a[key] - b[key]) - rounding, 0.0) / max(abs(b[key]), 1e-6))
    return gap


def zero3_run(pair, work: Path, name: str, *, dry_run: bool, steps: int, limits: Limits) -> dict:
    """One of ZERO3_RUNS under ZeRO-3, then on a single device if ZeRO-3 finished; each output folder deleted once
    its launch ends."""
    # On a GPU both sides keep fp32 master weights and multiply in bf16 (see recipe_args): they differ only where a
    # value is rounded to bf16 (ZeRO-3's residual stream and gradients are bf16, autocast's fp32), never in the update
    # rule. bf16 keeps 8 significant bits (0.4% a rounding); through 28 layers that moves the hidden states by about
    # sqrt(56) x 0.2% = 1.5%, and the logged means over 256 tokens by less. 2e-2 allows that, not a wrong gradient
    # or a missed update. At fp32 on CPU (dry run) the two agree to 1e-4, beyond the log's 4 digits.
    tolerance = 1e-4 if dry_run else 2e-2
    result = {"tolerance": tolerance}
    for layout in ("zero3", "single"):
        timeout = limits.next()
        if timeout is None or result.get("zero3", {}).get("status", "ok") != "ok":
            result[layout] = dict(SKIPPED) if timeout is None else {"status": "skipped",
                                                                    "reason": "ZeRO-3 did not finish"}
            continue
        output_dir = work / "runs" / f"{name}-{layout}"
        shutil.rmtree(output_dir, ignore_errors=True)
        args = recipe_args(pair, output_dir, dry_run=dry_run, zero3=layout == "zero3", steps=steps,
                           extra=ZERO3_RUNS[name])
        config = launch_config(work, dry_run=dry_run, zero3=layout == "zero3")
        outcome, text = launch(accelerate_command(config, args), log=work / "logs" / f"zero3-{name}-{layout}.log",
                               timeout=timeout)
        shutil.rmtree(output_dir, ignore_errors=True)
        result[layout] = {**outcome, "steps": logged_steps(text)}
        if outcome["status"] == "ok" and len(result[layout]["steps"]) != steps:
            result[layout].update(status="failed", reason=f"{len(result[layout]['steps'])} steps in the log")
    statuses = {result[layout]["status"] for layout in ("zero3", "single")}
    if statuses == {"ok"}:
        gap = largest_gap(result["zero3"]["steps"], result["single"]["steps"])
        result.update(status="agree" if gap <= tolerance else "disagree",  # None: steps or keys differ, or NaN
                      largest_relative_gap=gap if math.isfinite(gap) else None)
    else:
        result["status"] = next(s for s in ("timed out", "failed", "skipped") if s in statuses)
    return result


def train_part(pair, work: Path, *, dry_run: bool, steps_per_generation: int, completion_length: int,
               limits: Limits) -> dict:
    """The flagship recipe, timed stage by stage for a few steps in a process of its own (see the module
    docstring); its output folder deleted once it ends."""
    timeout = limits.next()
    if timeout is None:
        return dict(SKIPPED)
    accumulation = yaml.safe_load((ROOT / "recipes" / "opd.yaml").read_text())["gradient_accumulation_steps"]
    per_generation = max(1, steps_per_generation // accumulation)  # optimizer steps a generation batch serves
    steps = per_generation * TRAIN_STEPS
    output_dir, result_file = work / "runs" / f"train-{steps_per_generation}", work / "logs" / "train.json"
    result_file.unlink(missing_ok=True)
    precision = (["--bf16", "false", "--dtype", "float32", "--teacher_model_init_kwargs", '{"dtype": "float32"}']
                 if dry_run else ["--bf16", "true", "--dtype", "bfloat16"])
    command = [sys.executable, str(ROOT / "benchmarks" / "step_breakdown.py"), "--recipe",
               str(ROOT / "recipes" / "opd.yaml"), "--steps", str(steps), "--json", str(result_file),
               "--model_name_or_path", str(pair["student"]), "--teacher_model_name_or_path", str(pair["teacher"]),
               "--dataset_name", str(pair["prompts"]), "--prompt_column", "prompt", "--prompt_as_user_message",
               "false", "--use_vllm", "false", "--max_completion_length", str(completion_length),
               "--steps_per_generation", str(steps_per_generation), "--output_dir", str(output_dir),
               "--warmup_steps", "0", "--disable_tqdm", "true", "--save_final_model", "false", *precision]
    outcome, _ = launch(command, log=work / "logs" / f"train-{steps_per_generation}.log", timeout=timeout)
    shutil.rmtree(output_dir, ignore_errors=True)
    if outcome["status"] == "ok":
        outcome.update(json.loads(result_file.read_text()))
        outcome["tokens_per_second_per_gpu"] = outcome.pop("tokens_per_second_per_process")
    return {**outcome, "ok": outcome["status"] == "ok", "steps_per_generation": steps_per_generation}


def cost_part(work: Path, *, dry_run: bool, limits: Limits) -> dict:
    """`measure_cost` in a process of its own (under the launch timeout, its memory returned when it ends)."""
    timeout = limits.next()
    if timeout is None:
        return {"ok": False, **SKIPPED}
    result_path = work / "cost.json"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--measure-cost", str(result_path), "--work",
               str(work), *(["--dry-run"] if dry_run else [])]
    outcome, _ = launch(command, log=work / "logs" / "cost.log", timeout=timeout)
    shutil.rmtree(work / "runs" / "cost", ignore_errors=True)
    measured = json.loads(result_path.read_text()) if outcome["status"] == "ok" else {}
    return {"ok": outcome["status"] == "ok", **outcome, **measured}


def cost_shapes(dry_run: bool) -> tuple[int, int, int]:
    """(rows scored, completion tokens, micro-batch), sized by arithmetic (docs/gpu.md has the sums): at 8 x 2064
    tokens the student's activations take about 4 GiB checkpointed and 42-52 GiB not (an earlier estimate put 16
    rows at ~103 GiB); weights 18.5 GiB, the student's gradients 3.2, the heads' tiles and TRL's kernel a few more.
    Peaks about 30 GiB for either trainer, under 90 GiB of the GPU's 139 even if checkpointing did not take."""
    return (8, 64, 4) if dry_run else (32, 2048, 8)


def measure_cost(pair, work: Path, *, dry_run: bool) -> dict:
    """Teacher scoring, and a loss forward and backward, this package's `full` estimator beside TRL's trainer."""
    import torch

    rows, length, micro = cost_shapes(dry_run)
    device = torch.device("cuda" if torch.cuda.is_available() and not dry_run else "cpu")
    generator = torch.Generator().manual_seed(0)
    batch = {"prompt_ids": torch.randint(3, 1000, (rows, 16), generator=generator).to(device),
             "completion_ids": torch.randint(3, 1000, (rows, length), generator=generator).to(device)}
    batch["prompt_mask"], batch["completion_mask"] = (torch.ones_like(batch[key])
                                                      for key in ("prompt_ids", "completion_ids"))
    common = dict(output_dir=str(work / "runs" / "cost"), per_device_train_batch_size=micro,
                  max_completion_length=length, report_to="none", save_strategy="no", bf16=not dry_run,
                  activation_checkpointing=True, use_cpu=dry_run)
    dtype = torch.float32 if dry_run else torch.bfloat16
    result = {"rows": rows, "prompt_tokens": 16, "completion_tokens": length, "micro_batch": micro,
              "opd": opd_cost(pair, batch, common, dtype=dtype, micro=micro)}
    result["trl"] = trl_cost(pair, batch, common, dtype=dtype, micro=micro)
    trl_seconds = max(result["trl"]["loss_with_teacher_forward"]["seconds"], 1e-9)
    result["compared"] = ("opd.scoring_and_loss (teacher scoring, then the loss forward and backward) against "
                          "trl.loss_with_teacher_forward (its loss forward and backward, the teacher's forward "
                          "inside), on the same micro-batch; opd.loss alone is the loss without the scoring")
    result["opd_vs_trl_seconds"] = round(result["opd"]["scoring_and_loss"]["seconds"] / trl_seconds, 3)
    result["opd_loss_alone_vs_trl_seconds"] = round(result["opd"]["loss"]["seconds"] / trl_seconds, 3)
    return result


def timed(run, model) -> dict:
    """Seconds and peak device memory of `run()`, after one untimed warm-up call; the model's gradients are dropped
    before each call, so both calls allocate them."""
    import torch

    cuda = next(model.parameters()).device.type == "cuda"
    model.zero_grad(set_to_none=True)
    run()
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if not cuda:
        return {"seconds": round(seconds, 3), "peak_gib": None, "above_start_gib": None}
    peak = torch.cuda.max_memory_allocated()
    return {"seconds": round(seconds, 3), "peak_gib": round(peak / 2**30, 2),
            "above_start_gib": round((peak - before) / 2**30, 2)}


def with_checkpointing(model) -> bool:
    """Activation checkpointing switched on, as `Trainer.train()` would (the cost stage never calls it); whether it
    took."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name; the GPU machine's transformers has the old
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return bool(model.is_activation_checkpointing)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return bool(model.is_gradient_checkpointing)


def released(trainer) -> float | None:
    """Free a trainer's models: the trainer, its accelerator and callbacks refer to one another, so every reference
    it holds is dropped before the collector runs; then the allocator's cache is returned. GiB still allocated."""
    import torch

    trainer.accelerator.free_memory()
    vars(trainer).clear()
    gc.collect()
    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    return round(torch.cuda.memory_allocated() / 2**30, 3)


def opd_cost(pair, batch: dict, common: dict, *, dtype, micro: int) -> dict:
    from datasets import load_dataset

    from trl_opd import OPDConfig, OPDTrainer

    prompts = load_dataset("json", data_files=str(pair["prompts"]), split="train")
    opd = OPDTrainer(model=str(pair["student"]), teacher_model=str(pair["teacher"]), train_dataset=prompts,
                     args=OPDConfig(**common, num_generations=2, opd_estimator="full",
                                    model_init_kwargs={"dtype": dtype}))
    result = {"checkpointing": with_checkpointing(opd.model), **opd_timings(opd, batch, micro)}
    result["allocated_after_release_gib"] = released(opd)
    return result


def opd_timings(opd, batch: dict, micro: int) -> dict:
    import torch

    from trl_opd.trainer.multiturn import action_mask

    opd.model.train()
    opd.current_gradient_accumulation_steps = 1
    ids = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")

    def generated(rows: int) -> dict:  # what generation hands the scoring, a fresh dict each time
        part = {key: batch[key][:rows] for key in ids}
        part["advantages"] = torch.zeros(rows, device=part["prompt_ids"].device)
        opd._set_action_mask(part, action_mask([{} for _ in range(rows)], part["completion_mask"], None))
        return part

    def score(part: dict):
        return opd.teacher.score(*(part[key] for key in ids))

    def loss(scores):
        signal = opd._signal(generated(micro), scores, in_loss_forward=opd.plan.advantages_in_loss_forward)
        opd.compute_loss(opd.model, signal).backward()

    whole, scores = generated(len(batch["prompt_ids"])), score(generated(micro))
    return {"teacher_scoring_all_rows": timed(lambda: score(whole), opd.model),
            "loss": timed(lambda: loss(scores), opd.model),
            "scoring_and_loss": timed(lambda: loss(score(generated(micro))), opd.model)}


def trl_cost(pair, batch: dict, common: dict, *, dtype, micro: int) -> dict:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    prompts = load_dataset("json", data_files=str(pair["prompts"]), split="train")
    trl = DistillationTrainer(
        model=AutoModelForCausalLM.from_pretrained(pair["student"], dtype=dtype),
        teacher_model=AutoModelForCausalLM.from_pretrained(pair["teacher"], dtype=dtype),
        args=DistillationConfig(**common, beta=1.0), train_dataset=prompts)
    result = {"checkpointing": with_checkpointing(trl.model)}
    trl.model.train()
    inputs = {key: value[:micro] for key, value in batch.items()}
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    result["loss_with_teacher_forward"] = timed(lambda: trl.compute_loss(trl.model, dict(inputs)).backward(),
                                                trl.model)
    result["allocated_after_release_gib"] = released(trl)
    return result


def summary(part: str, result: dict) -> str:
    """The line a part prints when it ends."""
    verdict = "OK" if result.get("ok") or result.get("status") == "agree" else result.get("status", "FAILED")
    if result.get("status") == "skipped" and part in ("check", "cost"):
        return f"{part}: skipped ({result['reason']})"
    if part == "check":
        return f"check: {verdict} ({result.get('reference_line')}) in {result.get('seconds')} s"
    if part == "train":
        if not result.get("ok"):
            return f"train steps_per_generation={result.get('steps_per_generation')}: {verdict}"
        return (f"train steps_per_generation={result['steps_per_generation']}: OK, {result['seconds_per_step']:.1f} s "
                f"a step, {result['tokens_per_second_per_gpu']:.0f} tokens/s/GPU, generation "
                f"{result['generation_share']:.0%} of the step; completions {result['completion_mean_length']:.0f} "
                f"of at most {result['max_completion_length']} tokens ({result['completion_clipped_ratio']:.0%} at "
                "the limit; random weights rarely stop early)")
    if part == "cost":
        if not result.get("ok"):
            return f"cost: {verdict}"
        opd, trl = result["opd"], result["trl"]

        def measured(entry: dict) -> str:
            return f"{entry['seconds']} s, peak {entry['peak_gib']} GiB"

        return (f"cost: OK, OPD scoring+loss {measured(opd['scoring_and_loss'])} vs TRL loss with its teacher "
                f"forward {measured(trl['loss_with_teacher_forward'])}: {result['opd_vs_trl_seconds']}x; OPD loss "
                f"alone {measured(opd['loss'])}; scoring {result['rows']} x {result['completion_tokens']} tokens "
                f"{measured(opd['teacher_scoring_all_rows'])}")
    sides = "; ".join(f"{layout} {result[layout]['status']}" + (f" in {result[layout]['seconds']} s"
                      if "seconds" in result[layout] else "") for layout in ("zero3", "single"))
    if "largest_relative_gap" not in result:
        return f"zero3 {part}: {result['status']} ({sides})"
    gap = result["largest_relative_gap"]
    return (f"zero3 {part}: {result['status']} over {len(result['zero3']['steps'])} steps, largest relative gap "
            f"{'not comparable' if gap is None else f'{gap:.1e}'} (tolerance {result['tolerance']:g}); {sides}")


def save(report: dict, out_dir: Path, logs: Path, since: float) -> None:
    """The report, and the last LOG_TAIL_BYTES of each log this invocation wrote, under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    with tarfile.open(out_dir / "logs.tar.gz.partial", "w:gz") as tar:
        for log in sorted(logs.glob("*.log")):
            if log.stat().st_mtime >= since:
                with log.open("rb") as file:
                    file.seek(max(log.stat().st_size - LOG_TAIL_BYTES, 0))
                    data = file.read()
                info = tarfile.TarInfo(f"logs/{log.name}")
                info.size, info.mtime = len(data), int(log.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
    (out_dir / "logs.tar.gz.partial").replace(out_dir / "logs.tar.gz")


def run_parts(args, report: dict, work: Path, pair: dict, limits: Limits, write) -> None:
    """Each part in turn, its result in `report` (and written) as it ends; zero3's after each run."""
    for part in args.parts:
        try:
            if part == "zero3":
                report["zero3"] = {"runs": {}}
                for name in args.runs:
                    result = zero3_run(pair, work, name, dry_run=args.dry_run, steps=args.steps, limits=limits)
                    report["zero3"]["runs"][name] = result
                    write()
                    print(summary(name, result), flush=True)
                    for layout in ("zero3", "single"):
                        if result[layout].get("tail"):
                            print(f"-- {layout}:\n" + result[layout]["tail"][-1500:], flush=True)
                continue
            if part == "train":
                report["train"] = {"runs": {}}
                for spg in args.steps_per_generation:
                    result = train_part(pair, work, dry_run=args.dry_run, steps_per_generation=spg,
                                        completion_length=args.train_completion_length, limits=limits)
                    report["train"]["runs"][str(spg)] = result
                    write()
                    print(summary("train", result), flush=True)
                    if not result["ok"] and result.get("tail"):
                        print(result["tail"][-1500:], flush=True)
                continue
            if part == "check":
                report["check"] = check_part(pair, work, dry_run=args.dry_run, limits=limits)
            else:
                report["cost"] = cost_part(work, dry_run=args.dry_run, limits=limits)
            print(summary(part, report[part]), flush=True)
            if not report[part]["ok"] and report[part].get("tail"):
                print(report[part]["tail"][-1500:], flush=True)
        except Exception as error:  # one part failing still reports the others, and what this part finished
            report.setdefault(part, {}).update(ok=False, error=f"{type(error).__name__}: {error}",
                                               traceback=traceback.format_exc()[-3000:])
            print(f"{part}: FAILED {type(error).__name__}: {error}", flush=True)
        write()


def verdict(report: dict) -> tuple[bool, list[str]]:
    """Whether every part and run that ran passed, and what --budget left out."""
    runs = report.get("zero3", {}).get("runs", {})
    trains = report.get("train", {}).get("runs", {})
    skipped = [part for part in ("check", "cost") if report.get(part, {}).get("status") == "skipped"]
    skipped += [f"zero3 {name}" for name, run in runs.items() if run["status"] == "skipped"]
    skipped += [f"train {spg}" for spg, run in trains.items() if run["status"] == "skipped"]
    ok = (all(report[part].get("ok") for part in ("check", "cost") if part in report
              and report[part].get("status") != "skipped")
          and all(run["ok"] or run["status"] == "skipped" for run in trains.values())
          and "error" not in report.get("train", {})
          and "error" not in report.get("zero3", {})
          and all(run["status"] in ("agree", "skipped") for run in runs.values()))
    return ok and not report.get("interrupted") and "error" not in report, skipped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (what CI runs)")
    parser.add_argument("--wheels", type=Path, help="first install the wheels benchmarks/gpu_wheels.py bundled here")
    parser.add_argument("--work", type=Path, default=Path("outputs/gpu_check"),
                        help="models (built once, reused by later calls), installed wheels, logs")
    parser.add_argument("--out-dir", type=Path, default=Path("outputs/gpu_check_out"),
                        help="where gpu_check.json and logs.tar.gz are written")
    parser.add_argument("--parts", nargs="+", default=["cost", "check", "zero3"],
                        choices=["cost", "check", "zero3", "train"], help="run in this order")
    parser.add_argument("--steps-per-generation", nargs="+", type=int, default=[4],
                        help="the train part's runs: GRPO's steps_per_generation (4: one generation batch a step, "
                             "as the flagship; 8: each serves two steps, the second one update stale)")
    parser.add_argument("--train-completion-length", type=int,
                        help="the train part's max_completion_length (default 512; 16 with --dry-run; the flagship "
                             "recipe's is 2048)")
    parser.add_argument("--runs", nargs="+", default=list(ZERO3_RUNS), choices=list(ZERO3_RUNS),
                        help="the zero3 part's runs, in this order")
    parser.add_argument("--steps", type=int, help="training steps of each zero3 run (default 3; 2 with --dry-run)")
    parser.add_argument("--launch-timeout", type=int, default=240, help=f"seconds, at most {MAX_LAUNCH_SECONDS}")
    parser.add_argument("--budget", type=float, help="seconds for this whole call: launches that would not fit in "
                        "what is left are skipped, and a launch is cut to it")
    parser.add_argument("--measure-cost", type=Path, help=argparse.SUPPRESS)  # the cost part's own process
    args = parser.parse_args(argv)
    if not 0 < args.launch_timeout <= MAX_LAUNCH_SECONDS:
        parser.error(f"--launch-timeout must be between 1 and {MAX_LAUNCH_SECONDS} seconds")
    args.steps = args.steps or (2 if args.dry_run else 3)
    args.train_completion_length = args.train_completion_length or (16 if args.dry_run else 512)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = args.work.resolve()
    if args.measure_cost:
        sys.path.insert(0, str(ROOT))  # this tree's trl_opd, as the launches (run from ROOT) import it
        args.measure_cost.write_text(json.dumps(measure_cost(pair_paths(work / "models"), work,
                                                             dry_run=args.dry_run)) + "\n")
        return
    limits, started = Limits(args.launch_timeout, args.budget), time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped call still kills its launches, keeps its report
    (work / "logs").mkdir(parents=True, exist_ok=True)
    report = {"dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d %H:%M"), "parts": args.parts,
              "runs": args.runs if "zero3" in args.parts else None, "steps": args.steps,
              "launch_timeout": args.launch_timeout, "budget": args.budget,
              "environment": {"start": environment(work, "environment")}}

    def write():
        save(report, args.out_dir, work / "logs", started)

    try:
        if args.wheels:
            install_wheels(args.wheels.resolve(), work / "site")
            report["environment"]["after_wheels"] = environment(work, "after installing the wheels")
        import torch

        report.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      torch=torch.__version__)
        start = time.perf_counter()
        pair = build_pair(work / "models", dry_run=args.dry_run, vocab_size=1024 if args.dry_run else VOCAB)
        report["build_seconds"] = round(time.perf_counter() - start, 1)
        print(f"models ready in {work / 'models'} ({report['build_seconds']} s)", flush=True)
        write()
        run_parts(args, report, work, pair, limits, write)
    except SystemExit:
        report["interrupted"] = True  # by SIGTERM: what finished is kept, the rest did not run
        raise
    except Exception as error:  # installing or building failed: no part ran
        report["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        report["disk_at_end"] = subprocess.run(["df", "-h", str(work)], capture_output=True, text=True).stdout.strip()
        report["seconds"] = round(time.time() - started, 1)
        report["ok"], report["skipped"] = verdict(report)
        write()
    print(f"{'OK' if report['ok'] else 'FAILED'} in {report['seconds']} s"
          + (f" (skipped for lack of --budget: {', '.join(report['skipped'])})" if report["skipped"] else "")
          + f"; report {args.out_dir / 'gpu_check.json'}, logs {args.out_dir / 'logs.tar.gz'}")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
