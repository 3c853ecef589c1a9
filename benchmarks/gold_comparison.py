"""Cross-tokenizer OPD against TRL's GOLD (ULD loss), side by side, each at its own best learning rate.

Two trainers distil the same student from a teacher of another model family, on the same prompts:
- OPD: `OPDTrainer` with `teacher_tokenizer_mode="cross"`, `opd_estimator="sampled"` and the default byte credit
  (`teacher_cross_credit` "byte"): the teacher reads the student's sampled text through its own chat template and
  tokenizer, and its log-prob of each byte span becomes the student token's advantage.
- GOLD: `trl.experimental.gold.GOLDTrainer` with `use_uld_loss=True` (Universal Logit Distillation, extended: the
  two tokenizations aligned by byte offsets), `teacher_tokenizer_name_or_path` the teacher's, and `lmbda=1.0`, so
  that every batch is the student's own samples, as in OPD.
- Not run by default (`--trainers ... gold-teacher-template`): GOLD with one change, the teacher reading each prompt
  through its own chat template as OPD's does (a subclass that swaps the prompt text the teacher reads; the samples,
  the alignment and the loss are GOLD's), to tell GOLD's loss from GOLD's prompt handling (see "What GOLD sees").

Pairs (`cross_tokenizer.py`'s, imported from it):
- `tiny`: the addition task's student (digits one per token, ChatML) from the task's teacher of another family
  (`make_other_family_teacher`: multi-digit number tokens, other special tokens and chat template), full fine-tuning,
  batch 32, completions of at most 40 tokens, 300 steps, 200 held-out prompts.
- `real`: SmolLM2-135M-Instruct (LoRA r=8, alpha 16, all linear layers) from Qwen2.5-Coder-0.5B-Instruct on the code
  task (what a short Python program prints), batch 8, completions of at most 16 tokens, 24 steps, 100 held-out
  prompts; by Hub id, read from OPD_MODELS_DIR where it is set (`trl_opd.models_dir`).

Each trainer runs at each learning rate of a sweep (`--learning-rates`; by default 1e-4, 3e-4, 1e-3 for `tiny` and
2e-4, 5e-4, 1e-3 for `real`, the same for both trainers: Adam's step is about the learning rate whatever the loss's
scale, so ULD's smaller loss and gradients, an L1 distance between probability vectors, do not call for another range;
`--opd-learning-rates` and `--gold-learning-rates` set one trainer's, and the table marks a best learning rate at the
edge of its sweep). The best is the lowest held-out KL per character after training (per completion, a student that
collapses to one-character answers would win). Everything else is the same for both, and checked where it can be: the
student's initial trainable weights (the LoRA's initialisation included: a digest per run), seed, steps, prompts per
step and their order (both draw them with TRL's `RepeatSampler` under the same seed: a digest per run), one completion
per prompt sampled at temperature 1.0, top_p 1.0, top_k 0, at most the pair's completion length, from the same prompt
tokens (the student's chat template with the generation prompt: each GOLD run compares its prompt tokens with OPD's
for every training row and stops if any differ), stopping at the student's EOS, dropout off, float32, no gradient
checkpointing, AdamW with the same defaults and linear decay, no checkpoints.

What GOLD sees. GOLD is an SFT-style trainer, so its rows are prompt/completion conversations: the row's chat
`prompt` and, as `completion`, one assistant message holding the row's `solution`. GOLD renders the row with the
student's chat template and keeps the prompt part (the tokens up to the assistant's generation prompt) as `prompts`.
With `lmbda=1` every optimizer step is on-policy (`random.random() <= lmbda` always holds): `_fill_buffer` sends each
slice to `generate_on_policy_outputs`, which samples from those prompt tokens and replaces `input_ids`, `labels`
(the sampled tokens, up to and including the first EOS) and the prompt and completion texts, so the `solution` never
enters the loss (each run records whether any off-policy loss was logged: none was). The teacher then reads
`original_prompt_text`, the student's rendering of the prompt decoded back to text (special tokens written out),
tokenized by the teacher's tokenizer, followed by the decoded completion (its EOS written out as text) and the
teacher's own EOS. So, unlike OPD's teacher, GOLD's never sees its own chat template: for `tiny` its prompt is ChatML
text, which its tokenizer splits into ordinary tokens, and for `real` it is ChatML (Qwen's format too) with SmolLM2's
default system prompt instead of Qwen's. The "before" evaluation records the teacher's greedy accuracy both ways.

The ULD loss (`ULDLoss` with `use_extended_uld=True` and `uld_token_merge_strategy="observed"`, TRL's defaults). For
each completion: the student's and the teacher's softmax distributions over their own vocabularies at the completion
positions (the student's last label token, its EOS where it stopped, and the teacher's appended EOS left out), the
two token sequences split into groups at the byte boundaries both tokenizations share; a group of several tokens
becomes one vector, the distribution at its first position times the probabilities of the group's later sampled
tokens (so not a distribution). Each vector is sorted in descending order, which drops the token identities, the
shorter vocabulary is zero-padded, and the loss is the L1 distance between the student's and the teacher's sorted
vectors, summed over the vocabulary, averaged over the groups, then over the batch. It is not a KL, its gradient
only matches the shapes of the two distributions, and `beta` plays no part in it (only the optional hybrid loss,
`--gold-hybrid`, uses it, as a JSD on the tokens whose strings both vocabularies hold; it is set to 1.0, reverse KL,
OPD's direction). With "observed" each position's distribution is the one at the completion token's own position
(predicting the next token); "bayesian" (`--gold-merge-strategy bayesian`) takes them one position earlier, so that
each predicts its own token, and merges a group from its last position (the chain rule). Extended ULD needs
byte-level BPE tokenizers, which both pairs have; GOLD ran as it is in every configuration tried.

Measured on held-out prompts, the same way for every run, before and after
(`trl_opd.evaluation.heldout_text_reverse_kl`, each model reading through its own tokenizer and chat template):
KL(student || teacher) of the student's sampled completions per completion and per character, the accuracy of those
samples and of the student's greedy answers. The "before" evaluation runs once per pair. Each run trains in a fresh
subprocess of this script, which records the seconds per step of `trainer.train()` and the growth of resident memory
in training: the peak (`ru_maxrss`, reset to the current size just before `train()` through /proc/self/clear_refs)
less the resident memory then (models loaded, trainer built).

    .venv/bin/trl-opd make-tiny-task artifacts/tiny_task
    .venv/bin/python benchmarks/gold_comparison.py --pair tiny          # 6 runs of 300 steps
    make real-models && .venv/bin/trl-opd make-code-task artifacts/code_task
    export OPD_MODELS_DIR=~/.cache/real-models      # offline: where `make real-models` put the Hub's models
    .venv/bin/python benchmarks/gold_comparison.py --pair real          # 6 runs of 24 steps
    .venv/bin/python benchmarks/gold_comparison.py --pair real --from-json   # the tables of a saved run

`--resume` keeps the runs already in the JSON file (same settings) and adds the missing ones, e.g. another learning
rate or trainer (`--resume --trainers gold-teacher-template`). Results go to
benchmarks/results/gold_comparison_<pair>.json (`--json` elsewhere), rewritten after each run.

Time, on an otherwise idle 2-core CPU (from runs of 3 to 5 steps): `tiny` 0.30 s/step for OPD and 0.27 for GOLD and
a few seconds per evaluation, about 2 minutes a run and 12 for the default 6 (plus a minute, once, to build the
teacher of another family); `real` 12.6 s/step for OPD and 13.8 for GOLD, about 2 minutes per evaluation (4 for the
one before, with the teacher's accuracy both ways) and 20 to 30 seconds to load, about 8 minutes a run and 55 for the
default 6. With another process busy on the same cores, torch's threads wait on each other and steps ran 10 to 40
times slower: run it alone.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cross_tokenizer import PAIRS as CROSS_PAIRS  # noqa: E402 (the benchmarks folder is not a package)
from cross_tokenizer import accuracy_func  # noqa: E402

TRAINERS = ("opd", "gold", "gold-teacher-template")
LABELS = {"opd": "OPD", "gold": "GOLD", "gold-teacher-template": "GOLD, teacher's own template"}
PAIRS = {
    pair: dict(task=CROSS_PAIRS[pair]["task"], student=CROSS_PAIRS[pair]["student"],
               teacher=CROSS_PAIRS[pair]["arms"]["other family"][0], batch_size=CROSS_PAIRS[pair]["batch_size"],
               max_completion_length=CROSS_PAIRS[pair]["max_completion_length"], lora_r=CROSS_PAIRS[pair]["lora_r"],
               steps=steps, eval_prompts=eval_prompts, learning_rates=learning_rates)
    for pair, steps, eval_prompts, learning_rates in (("tiny", 300, 200, (1e-4, 3e-4, 1e-3)),
                                                       ("real", 24, 100, (2e-4, 5e-4, 1e-3)))
}
LOGGED = ("step", "loss", "grad_norm", "learning_rate", "opd/reverse_kl", "on_policy_loss", "off_policy_loss",
          "opd/unaligned_token_fraction")


# ------------------------------------------------------------------ shared by the workers


def paths(pair: str) -> tuple[str, str, str, str]:
    """The student's and the teacher's names as the JSON keeps them, and the directories they are read from."""
    from trl_opd.models_dir import resolve_model

    settings = PAIRS[pair]
    task = Path(settings["task"])
    student = str(task / settings["student"]) if pair == "tiny" else settings["student"]
    teacher = str(task / settings["teacher"]) if pair == "tiny" else settings["teacher"]
    return student, teacher, resolve_model(student), resolve_model(teacher)


def load_pair(pair: str, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, _, student_dir, teacher_dir = paths(pair)
    tokenizer = AutoTokenizer.from_pretrained(student_dir, padding_side="left")
    teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    torch.manual_seed(seed)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    return student, tokenizer, teacher, teacher_tokenizer


def heldout_rows(pair: str, count: int) -> list[dict]:
    with open(Path(PAIRS[pair]["task"]) / "heldout.jsonl") as lines:
        return [json.loads(line) for line in lines][:count]


def evaluate(student, tokenizer, teacher, teacher_tokenizer, heldout: list[dict], pair: str, seed: int) -> dict:
    from trl_opd.evaluation import heldout_text_reverse_kl

    begin = time.perf_counter()
    metrics = heldout_text_reverse_kl(
        student, tokenizer, teacher, teacher_tokenizer, [row["prompt"] for row in heldout], seed=seed,
        max_new_tokens=PAIRS[pair]["max_completion_length"], solutions=[row["solution"] for row in heldout],
        accuracy_func=accuracy_func(pair), greedy_accuracy=True,
    )
    return {**metrics, "seconds": time.perf_counter() - begin}


def teacher_greedy_accuracy(teacher, teacher_tokenizer, tokenizer, heldout: list[dict], pair: str, *,
                            student_rendering: bool, batch_size: int = 16) -> float:
    """The teacher's greedy accuracy on `heldout`, reading each prompt through its own chat template (as OPD's teacher
    does) or, with `student_rendering`, the student's rendering as text with the teacher's special tokens added (as
    GOLD's teacher does)."""
    import torch

    from trl_opd.evaluation import stop_token_ids, until_first_stop

    stop_ids = stop_token_ids(teacher, teacher_tokenizer)
    renderer = tokenizer if student_rendering else teacher_tokenizer
    texts = []
    for start in range(0, len(heldout), batch_size):
        rows = heldout[start : start + batch_size]
        prompts = [renderer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
                   for row in rows]
        batch = teacher_tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                                  add_special_tokens=student_rendering)
        with torch.no_grad():
            completion = teacher.generate(
                **batch, do_sample=False, temperature=None, top_k=None, top_p=None, max_new_tokens=PAIRS[pair][
                    "max_completion_length"], pad_token_id=teacher_tokenizer.pad_token_id, eos_token_id=stop_ids,
            )[:, batch["input_ids"].size(1) :]
        completion = completion.masked_fill(~until_first_stop(completion, stop_ids), teacher_tokenizer.pad_token_id)
        texts += teacher_tokenizer.batch_decode(completion, skip_special_tokens=True)
    scores = accuracy_func(pair)(completions=[[{"role": "assistant", "content": text}] for text in texts],
                                 solution=[row["solution"] for row in heldout],
                                 prompts=[row["prompt"] for row in heldout])
    scored = [score for score in scores if score is not None]
    return sum(scored) / len(scored) if scored else float("nan")


def current_rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak_rss() -> bool:
    """Set the process's peak resident memory (`ru_maxrss`) to its current one, so that the next reading is the peak
    from here on (Linux's clear_refs); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def order_digest(trainer, count: int) -> str:
    """A digest of the first `count` prompt indices the trainer's sampler draws (a fresh sampler: the trainer's own
    is not advanced)."""
    indices = []
    for index in trainer._get_train_sampler():
        indices.append(index)
        if len(indices) == count:
            break
    return hashlib.sha256(json.dumps(indices).encode()).hexdigest()[:16]


def weights_digest(model) -> str:
    """A digest of the trainable weights (the LoRA's, or the whole student's), names included."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            digest.update(name.encode())
            digest.update(parameter.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def prompt_mismatches(trainer, tokenizer, rows: list[dict]) -> int:
    """How many training rows GOLD would sample from other prompt tokens than OPD (GRPO renders each prompt with
    `apply_chat_template(..., add_generation_prompt=True, tokenize=True)`)."""
    dataset = trainer.train_dataset
    mismatches = 0
    for row, input_ids, completion_mask in zip(rows, dataset["input_ids"], dataset["completion_mask"], strict=True):
        gold_prompt = input_ids[: completion_mask.index(1) if 1 in completion_mask else len(input_ids)]
        opd_prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
        mismatches += list(gold_prompt) != list(opd_prompt)
    return mismatches


def teacher_template_gold(gold_trainer):
    """`GOLDTrainer` with one change, for the `gold-teacher-template` arm: in training, the teacher reads each prompt
    through its own chat template (as OPD's teacher does) instead of the student's rendering. The student's samples,
    the alignment (completion-relative byte offsets) and the loss are GOLD's."""

    class TeacherTemplateGOLD(gold_trainer):
        teacher_prompts: dict[str, str] = {}  # the student's rendering, as GOLD decodes it -> the teacher's

        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)
            if not self.model.training:
                return inputs
            return {**inputs, "original_prompt_text": [self.teacher_prompts[text]
                                                       for text in inputs["original_prompt_text"]]}

    return TeacherTemplateGOLD


def teacher_prompts(tokenizer, teacher_tokenizer, rows: list[dict]) -> dict[str, str]:
    """Each training prompt's rendering by the student as GOLD's on-policy path decodes it (its prompt tokens, special
    tokens written out), mapped to the teacher's own rendering."""
    mapping = {}
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        key = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        mapping[key] = teacher_tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    return mapping


# ------------------------------------------------------------------ workers (each run in a fresh subprocess)


def shared_settings(settings: dict, args, run_name: str) -> tuple[dict, dict]:
    """What every trainer of a comparison gets: the pair's LoRA (as `peft_config=`, none for full fine-tuning) and the
    training arguments all of them share (`settings`: the pair's; `args`: the run's steps, rate, seed and workdir)."""
    peft = {}
    if settings["lora_r"]:
        from peft import LoraConfig

        r = settings["lora_r"]
        peft["peft_config"] = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", task_type="CAUSAL_LM")
    common = dict(
        output_dir=str(Path(args.workdir) / run_name), max_steps=args.steps,
        per_device_train_batch_size=settings["batch_size"], gradient_accumulation_steps=1, num_generations=1,
        learning_rate=args.learning_rate, max_completion_length=settings["max_completion_length"], temperature=1.0,
        top_p=1.0, top_k=0, seed=args.seed, logging_steps=max(args.steps // 4, 1), save_strategy="no",
        report_to="none", bf16=False, activation_checkpointing=False, disable_dropout=True, disable_tqdm=True,
    )
    return peft, common


def work_before(args) -> dict:
    """The evaluation before training, shared by every run of the pair, and the teacher's accuracy both ways."""
    student, tokenizer, teacher, teacher_tokenizer = load_pair(args.pair, args.seed)
    heldout = heldout_rows(args.pair, args.eval_prompts)
    before = evaluate(student, tokenizer, teacher, teacher_tokenizer, heldout, args.pair, args.eval_seed)
    begin = time.perf_counter()
    before["teacher_accuracy_greedy"] = {
        way: teacher_greedy_accuracy(teacher, teacher_tokenizer, tokenizer, heldout, args.pair,
                                     student_rendering=way == "student's rendering (GOLD)")
        for way in ("own template (OPD)", "student's rendering (GOLD)")
    }
    before["teacher_accuracy_seconds"] = time.perf_counter() - begin
    return before


def work_train(args) -> dict:
    import transformers
    from datasets import Dataset

    pair, settings = args.pair, PAIRS[args.pair]
    student, tokenizer, teacher, teacher_tokenizer = load_pair(pair, args.seed)
    _, _, _, teacher_dir = paths(pair)
    with open(Path(settings["task"]) / "train.jsonl") as lines:
        rows = [json.loads(line) for line in lines]
    heldout = heldout_rows(pair, args.eval_prompts)
    peft, common = shared_settings(settings, args, f"{pair}-{args.trainer}-{args.learning_rate:g}")
    transformers.set_seed(args.seed)  # the same LoRA initialisation for both trainers
    checks = {}
    if args.trainer == "opd":
        from trl_opd import OPDConfig, OPDTrainer

        config = OPDConfig(**common, opd_estimator="sampled", teacher_tokenizer_mode="cross",
                           teacher_cross_credit="byte", overwrite_output_dir=True)
        trainer = OPDTrainer(model=student, teacher_model=teacher, args=config, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer, teacher_processing_class=teacher_tokenizer, **peft)
    else:
        from trl.experimental.gold import GOLDConfig, GOLDTrainer

        # GOLD trains on prompt/completion conversations; with lmbda=1 the completion is replaced by the student's
        # own sample before any loss (see the module's docstring)
        gold_rows = [{"prompt": row["prompt"], "completion": [{"role": "assistant", "content": row["solution"]}]}
                     for row in rows]
        config = GOLDConfig(
            **common, lmbda=1.0, beta=1.0, seq_kd=False, use_uld_loss=True, teacher_tokenizer_name_or_path=teacher_dir,
            use_extended_uld=True, uld_token_merge_strategy=args.gold_merge_strategy,
            uld_use_hybrid_loss=args.gold_hybrid,
        )
        gold = GOLDTrainer if args.trainer == "gold" else teacher_template_gold(GOLDTrainer)
        trainer = gold(model=student, teacher_model=teacher, args=config, train_dataset=Dataset.from_list(gold_rows),
                       processing_class=tokenizer, **peft)
        if args.trainer == "gold-teacher-template":
            trainer.teacher_prompts = teacher_prompts(tokenizer, teacher_tokenizer, rows)
        checks["prompt_token_mismatches"] = prompt_mismatches(trainer, tokenizer, rows)
        if checks["prompt_token_mismatches"]:
            raise ValueError(f"GOLD would sample from other prompt tokens than OPD for "
                             f"{checks['prompt_token_mismatches']} of {len(rows)} training rows.")
    checks["prompt_order_digest"] = order_digest(trainer, settings["batch_size"] * args.steps)
    checks["initial_weights_digest"] = weights_digest(trainer.model)

    gc.collect()
    peak_reset = reset_peak_rss()
    rss_before, peak_before = current_rss_mb(), peak_rss_mb()
    begin = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - begin
    peak_after = peak_rss_mb()
    after = evaluate(trainer.model, tokenizer, teacher, teacher_tokenizer, heldout, pair, args.eval_seed)
    log = [{key: entry[key] for key in LOGGED if key in entry} for entry in trainer.state.log_history
           if "loss" in entry]
    if args.trainer != "opd":
        checks["off_policy_steps_logged"] = sum("off_policy_loss" in entry for entry in log)
    return {"trainer": args.trainer, "learning_rate": args.learning_rate, "steps": args.steps,
            "train_seconds": seconds, "seconds_per_step": seconds / args.steps, "after": after,
            "rss_before_train_mb": rss_before, "peak_rss_mb": peak_after,
            "peak_rss_growth_mb": peak_after - rss_before,
            # without a reset, a peak set while loading and not exceeded in training: the growth is an upper bound
            "peak_set_before_training": not peak_reset and peak_after <= peak_before, "checks": checks, "log": log}


# ------------------------------------------------------------------ orchestration


def results_file(path: Path, settings: dict, *, seed: int, pair: str, resume: bool):
    """A comparison's results (the runs saved at `path` with the same settings and seed when resuming, else none yet)
    and the function that writes them there, called after each run."""
    from trl_opd.tools.comparison import describe_machine

    results = {"machine": describe_machine(), "date": time.strftime("%Y-%m-%d"), "seed": seed, "pair": pair,
               "settings": settings, "before": None, "runs": []}
    if resume and path.exists():
        saved = json.loads(path.read_text())
        if saved["settings"] != settings or saved["seed"] != seed:
            raise SystemExit(f"{path} holds runs with other settings: resume with the same ones, or pass --json.")
        results.update(before=saved["before"], runs=saved["runs"])

    def save() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")

    return results, save


def worker_command(args, worker: str, output: Path, trainer: str | None = None, lr: float | None = None) -> list:
    command = [sys.executable, str(Path(__file__).resolve()), "--pair", args.pair, "--steps", str(args.steps),
               "--eval-prompts", str(args.eval_prompts), "--seed", str(args.seed), "--eval-seed", str(args.eval_seed),
               "--workdir", args.workdir, "--gold-merge-strategy", args.gold_merge_strategy,
               "--worker", worker, "--worker-output", str(output)]
    if args.gold_hybrid:
        command.append("--gold-hybrid")
    if trainer is not None:
        command += ["--trainer", trainer, "--learning-rate", repr(lr)]
    return command


def run_worker(args, worker: str, trainer: str | None = None, lr: float | None = None) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "result.json"
        subprocess.run(worker_command(args, worker, output, trainer, lr), check=True)
        return json.loads(output.read_text())


def settings_of(args) -> dict:
    student, teacher, _, _ = paths(args.pair)
    settings = PAIRS[args.pair]
    return {"student": student, "teacher": teacher, "task": settings["task"], "batch_size": settings["batch_size"],
            "max_completion_length": settings["max_completion_length"], "lora_r": settings["lora_r"],
            "steps": args.steps, "eval_prompts": args.eval_prompts, "eval_seed": args.eval_seed,
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "num_generations": 1,
            "opd": {"teacher_tokenizer_mode": "cross", "opd_estimator": "sampled", "teacher_cross_credit": "byte"},
            "gold": {"use_uld_loss": True, "lmbda": 1.0, "beta": 1.0, "use_extended_uld": True,
                     "uld_token_merge_strategy": args.gold_merge_strategy, "uld_use_hybrid_loss": args.gold_hybrid}}


def best_runs(runs: list[dict]) -> dict[str, dict]:
    """Each trainer's run with the lowest held-out KL per character after training: per completion, a student that
    collapses to one-character answers would win (GOLD at lr 1e-3 on the tiny pair: 15.7 nats per completion, 13.9
    per character)."""
    def kl(run: dict) -> float:
        value = run["after"]["reverse_kl_per_char"]
        return math.inf if value is None or math.isnan(value) else value

    trainers = sorted({run["trainer"] for run in runs}, key=TRAINERS.index)
    return {trainer: min((run for run in runs if run["trainer"] == trainer), key=kl) for trainer in trainers}


def print_table(results: dict) -> None:
    from trl_opd.tools.comparison import describe_machine

    settings, before, runs = results["settings"], results["before"], results["runs"]
    print(f"\n{results.get('machine', describe_machine())}, {results.get('date', '')}, seed {results['seed']}: "
          f"{Path(settings['student']).name} from {Path(settings['teacher']).name}, {settings['steps']} steps of "
          f"{settings['batch_size']} prompts, completions of at most {settings['max_completion_length']} tokens, "
          f"{settings['eval_prompts']} held-out prompts; GOLD: ULD, {settings['gold']['uld_token_merge_strategy']} "
          f"merge{', hybrid' if settings['gold']['uld_use_hybrid_loss'] else ''}\n")
    teacher = before.get("teacher_accuracy_greedy", {})
    if teacher:
        print("Teacher's greedy accuracy: " + ", ".join(f"{way} {value:.1%}" for way, value in teacher.items()) + "\n")
    header = ("| trainer | learning rate | KL(student ‖ teacher) per completion, before → after | per character | "
              "accuracy, greedy | accuracy, sampled | s/step | peak memory growth (MB) |")
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|"

    def row(run: dict, note: str = "") -> str:
        after = run["after"]
        return (f"| {LABELS[run['trainer']]} | {run['learning_rate']:g}{note} | "
                f"{before['reverse_kl_per_sequence']:.2f} → {after['reverse_kl_per_sequence']:.2f} | "
                f"{before['reverse_kl_per_char']:.3f} → {after['reverse_kl_per_char']:.3f} | "
                f"{before['accuracy_greedy']:.1%} → {after['accuracy_greedy']:.1%} | "
                f"{before['accuracy']:.1%} → {after['accuracy']:.1%} | {run['seconds_per_step']:.2f} | "
                f"{run['peak_rss_growth_mb']:.0f}{'*' if run.get('peak_set_before_training') else ''} |")

    print("Each trainer at its best learning rate (lowest KL per character after training):\n")
    print(header + "\n" + rule)
    for trainer, run in best_runs(runs).items():
        swept = sorted(r["learning_rate"] for r in runs if r["trainer"] == trainer)
        edge = " (edge of the sweep)" if len(swept) > 1 and run["learning_rate"] in (swept[0], swept[-1]) else ""
        print(row(run, edge))
    print("\nThe whole sweep:\n")
    print(header + "\n" + rule)
    for run in sorted(runs, key=lambda r: (TRAINERS.index(r["trainer"]), r["learning_rate"])):
        print(row(run))
    digests = {key: {run["checks"].get(key) for run in runs} for key in ("prompt_order_digest",
                                                                         "initial_weights_digest")}
    same = {key: "not recorded" if None in values else "yes" if len(values) == 1 else "NO"
            for key, values in digests.items()}
    off_policy = sum(run["checks"].get("off_policy_steps_logged", 0) for run in runs)
    print(f"\nSame prompts in the same order in every run: {same['prompt_order_digest']}; same initial trainable "
          f"weights: {same['initial_weights_digest']}; GOLD logging periods with off-policy batches: {off_policy}. "
          f"Evaluation: {before['seconds']:.0f} s before training.")
    if any(run.get("peak_set_before_training") for run in runs):
        print("* the process's peak was set while loading, before training: an upper bound.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="tiny")
    parser.add_argument("--steps", type=int, default=None, help="default: the pair's (tiny 300, real 24)")
    parser.add_argument("--eval-prompts", type=int, default=None, help="default: the pair's (tiny 200, real 100)")
    parser.add_argument("--seed", type=int, default=0, help="training seed (prompt order, sampling, LoRA init)")
    parser.add_argument("--eval-seed", type=int, default=1234, help="seed of the held-out evaluation's samples")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=None,
                        help="the sweep, for both trainers (default: the pair's)")
    parser.add_argument("--opd-learning-rates", type=float, nargs="+", default=None, help="OPD's own sweep")
    parser.add_argument("--gold-learning-rates", type=float, nargs="+", default=None, help="GOLD's own sweep")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=["opd", "gold"],
                        help="gold-teacher-template: GOLD with the teacher reading its own chat template (not run "
                             "by default)")
    parser.add_argument("--gold-merge-strategy", choices=("observed", "bayesian"), default="observed",
                        help="GOLD's uld_token_merge_strategy (TRL's default: observed)")
    parser.add_argument("--gold-hybrid", action="store_true",
                        help="GOLD's uld_use_hybrid_loss: JSD (beta 1, reverse KL) on the shared vocabulary")
    parser.add_argument("--workdir", default="artifacts/gold_comparison")
    parser.add_argument("--json", default=None, help="default: benchmarks/results/gold_comparison_<pair>.json")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in the JSON (same settings)")
    parser.add_argument("--from-json", action="store_true", help="print the tables of a saved run")
    parser.add_argument("--worker", choices=("before", "train"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trainer", choices=TRAINERS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--learning-rate", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or PAIRS[args.pair]["steps"]
    args.eval_prompts = args.eval_prompts or PAIRS[args.pair]["eval_prompts"]
    path = Path(args.json or f"benchmarks/results/gold_comparison_{args.pair}.json")
    if args.from_json:
        print_table(json.loads(path.read_text()))
        return
    if args.worker:
        result = work_before(args) if args.worker == "before" else work_train(args)
        Path(args.worker_output).write_text(json.dumps(result))
        return

    if args.pair == "tiny":
        from trl_opd.envs.addition import make_other_family_teacher

        make_other_family_teacher(PAIRS["tiny"]["task"])
    default = args.learning_rates or list(PAIRS[args.pair]["learning_rates"])
    sweep = {"opd": args.opd_learning_rates or default, "gold": args.gold_learning_rates or default}
    sweep["gold-teacher-template"] = sweep["gold"]
    results, save = results_file(path, settings_of(args), seed=args.seed, pair=args.pair, resume=args.resume)
    if results["before"] is None:
        results["before"] = run_worker(args, "before")
        save()
    done = {(run["trainer"], run["learning_rate"]) for run in results["runs"]}
    arms = sorted({(lr, trainer) for trainer in args.trainers for lr in sweep[trainer]},
                  key=lambda arm: (arm[0], TRAINERS.index(arm[1])))  # by learning rate, the trainers interleaved
    for lr, trainer in arms:
        if (trainer, lr) in done:
            continue
        results["runs"].append(run_worker(args, "train", trainer, lr))
        save()
    print_table(results)


if __name__ == "__main__":
    main()
