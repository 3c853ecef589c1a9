"""`trl-opd check --config recipe.yaml`: a one-batch preflight of a recipe, before the long run.

It builds the recipe's trainer twice and scores one generation batch each time: once with the reference model (the
student's own starting point) as the teacher, where `opd/reverse_kl` must be 0 if rollout, old log-probs and teacher
scoring line up, and once with the recipe's teacher. Constructing the trainers runs the tokenizer checks; the chat
template rendering of the first prompt is shown for student and teacher side by side.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import tempfile

import torch
from transformers import AutoTokenizer, TrainerCallback

from ..prompts import teacher_context, teacher_prompt
from ..trainer import teacher_inputs
from ..trainer.advantages import is_deferred
from ..trainer.metrics import metric_text
from .recipe import build_trainer, load_prompts

# Everything that names a teacher, reset so that the reference pass uses ref_as_teacher alone
_REFERENCE_PASS = dict(
    ref_as_teacher=True, opd_estimator="sampled", opd_coef=None, opd_divergence_beta=1.0, opd_dense_coef=None,
    opd_topk=None,
    teacher_model_name_or_path=None, teacher_server_url=None, student_as_teacher=None, teacher_ema_rate=None,
    teacher_ema_steps=None, teachers=None, teacher_route_column="teacher", teacher_model_init_kwargs=None,
    sync_ref_model=False,  # one step: GRPO's reference, the teacher here, would not move, and it is refused with it
    teacher_adapter_name_or_path=None, teacher_temperature=1.0, teacher_system_prompt=None,
    teacher_prompt_template=None, teacher_prompt_column=None,
    teacher_tokenizer_mode="same", teacher_tokenizer_name_or_path=None,
)
ZERO_KL_TOLERANCE = 1e-4


class _PreflightDone(Exception):
    """Raised by `_FirstBatch` once the batch is scored, to leave `train()` before its first update."""


class _FirstBatch(TrainerCallback):
    """Runs `preflight()` at the start of `train()`, where the first step would run: the DeepSpeed engine (which
    gathers ZeRO-3's partitioned parameters around each forward), the optimizer and the generation backend exist then,
    and not before."""

    def __init__(self, preflight):
        self.preflight, self.result = preflight, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.result = self.preflight()
        raise _PreflightDone


def _one_batch_metrics(script_args, training_args, model_args, dataset) -> tuple[dict, object, dict, list]:
    """The opd/* metrics of one generation batch of `dataset`, from a trainer built as the recipe builds it and run
    as its first step runs; also the trainer, the scored batch and its rows."""
    trainer = build_trainer(script_args, training_args, model_args, train_dataset=dataset)

    def first_batch():
        batch = next(iter(trainer.get_train_dataloader()))
        trainer.model_wrapped.train()
        output = trainer._generate_and_score_completions(batch)
        if is_deferred(output):  # the advantages (and their metrics) are formed in the loss forward
            trainer.current_gradient_accumulation_steps = training_args.gradient_accumulation_steps  # as the loop does
            with torch.no_grad():
                trainer.compute_loss(trainer.model_wrapped, output)
        return output, batch

    callback = _FirstBatch(first_batch)
    trainer.add_callback(callback)
    try:
        trainer.train()
    except _PreflightDone:
        pass
    finally:
        trainer.remove_callback(callback)
    if callback.result is None:
        raise RuntimeError("trl-opd check: training ended before its first batch was scored.")
    output, batch = callback.result
    metrics = trainer._metrics["train"]
    opd = {name: sum(values) / len(values) for name, values in metrics.items() if name.startswith("opd/")}
    return opd, trainer, output, batch


def _release(trainer) -> None:
    """Free what a preflight trainer holds (its DeepSpeed engine, optimizer and models) before the next is built."""
    trainer.accelerator.free_memory()
    if trainer.is_deepspeed_enabled:  # a second Accelerator may not bring a DeepSpeed plugin into a state that has one
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()  # the process group (PartialState) stays, as the Trainer's own sweeps do
    trainer.model = trainer.model_wrapped = trainer.optimizer = trainer.teacher = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _render(tokenizer, prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def check(script_args, training_args, model_args, *, echo=None) -> dict:
    """Run the preflight and print a report (from the main process only, under a multi-process launch); returns it,
    with `ok` False if the reference KL is not zero. Its trainers write to a scratch directory, removed after."""
    from accelerate import PartialState

    if echo is None:
        echo = print if PartialState().is_main_process else (lambda *args, **kwargs: None)
    scratch = tempfile.mkdtemp(prefix="trl-opd-check-")
    try:
        return _check(script_args, training_args, model_args, echo=echo, scratch=scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check(script_args, training_args, model_args, *, echo, scratch: str) -> dict:
    dataset = load_prompts(script_args, script_args.dataset_train_split,
                           teacher_prompt_column=training_args.teacher_prompt_column)
    common = dict(max_steps=1, report_to="none", generation_batch_size=None, save_strategy="no", push_to_hub=False,
                  output_dir=scratch, eval_strategy="no", log_completions=False,
                  # the process group the recipe's arguments set up, kept (building arguments pops this flag)
                  accelerator_config={**training_args.accelerator_config.to_dict(), "use_configured_state": True})
    reference_args = dataclasses.replace(training_args, **common, **_REFERENCE_PASS)
    teacher_args = dataclasses.replace(training_args, **common)
    rows = dataset.select(range(min(len(dataset), teacher_args.generation_batch_size)))

    reference, reference_trainer, *_ = _one_batch_metrics(script_args, reference_args, model_args, rows)
    _release(reference_trainer)
    del reference_trainer
    cross = training_args.teacher_tokenizer_mode == "cross"
    echo("tokenizers: the teacher has its own, and both give text back byte for byte (teacher_tokenizer_mode: "
         "cross; checked at start-up)" if cross else
         "tokenizers: the student and the teacher agree (checked at start-up)")
    teacher, trainer, output, batch = _one_batch_metrics(script_args, teacher_args, model_args, rows)
    echo(f"the run's plan (decided once, printed at the start of training):\n{trainer.plan.describe()}")

    prompt = rows[0]["prompt"]
    shown_to_teacher = teacher_prompt(rows[0], prompt, **teacher_context(training_args))
    student_tokenizer = trainer.processing_class
    teacher_name = teacher_args.teacher_model_name_or_path  # as build_trainer resolved it (OPD_MODELS_DIR)
    routed = training_args.teacher_route_column if training_args.teachers else None
    first_route = rows[0][routed] if routed else "teacher"
    teacher_tokenizer = trainer.teacher_tokenizers[first_route] if cross else (
        AutoTokenizer.from_pretrained(teacher_name) if teacher_name else student_tokenizer)
    echo(f"first prompt, student's chat template: {_render(student_tokenizer, prompt)!r}")
    echo(f"first prompt, teacher's chat template{f' ({first_route})' if routed else ''}: "
         f"{_render(teacher_tokenizer, shown_to_teacher)!r}")
    echo("  (the teacher reads its own rendering, shown here)" if cross else
         "  (the teacher scores the student's rendering of its own prompt, token for token; a different template "
         "here means the teacher's own format differs from what it will see)")

    row = _echo_rollout(trainer.processing_class, output, echo)
    if cross:
        length = int(output["completion_mask"][row].sum())
        ids = output["completion_ids"][row, :length].tolist()
        sampled = output["sampled_mask"][row, :length].tolist()  # the student's turns, observations between them
        route = batch[row][routed] if routed else None
        scorer = trainer.teacher.scorers[route] if routed else trainer.teacher
        observations = scorer.row_observations(teacher_inputs.teacher_prompt_messages(trainer, batch, output)[row],
                                               teacher_inputs.completion_messages(trainer, batch)[row], sampled,
                                               row=row, tools=teacher_inputs.prompt_tools(trainer, len(batch))[row])
        echo(f"the same rollout in both tokenisations{f' (teacher {route})' if routed else ''}, one column per chunk "
             "(each chunk's teacher log-prob is compared with the sum of its student tokens'; ⟦...⟧ is not "
             "distilled; between turns the teacher reads its own rendering of the observations):\n"
             + scorer.side_by_side(ids, sampled, observations))

    kl = reference["opd/reverse_kl"]
    ok = abs(kl) <= ZERO_KL_TOLERANCE
    echo(f"reference as teacher: opd/reverse_kl = {kl:.6f} "
         f"({'OK, 0 as expected' if ok else f'FAILED: should be 0 within {ZERO_KL_TOLERANCE}'})")
    details = ", ".join(f"{name} = {metric_text(value, '.4f')}" for name, value in sorted(teacher.items()))
    echo(f"recipe's teacher: {details}")
    _release(trainer)
    return {"ok": ok, "reference": reference, "teacher": teacher, "plan": dataclasses.asdict(trainer.plan)}


def _echo_rollout(tokenizer, output, echo) -> int:
    """One rollout with what is distilled: a multi-turn one (observations present) if the batch has any. Returns its
    row."""
    from ..trainer.multiturn import render_action_mask

    completion_mask, action_mask = output["completion_mask"], output["action_mask"]
    multi_turn = ((completion_mask - action_mask) > 0).any(-1).nonzero().flatten().tolist()
    row = multi_turn[0] if multi_turn else 0
    length = int(completion_mask[row].sum())
    rendered = render_action_mask(tokenizer, output["completion_ids"][row, :length].tolist(),
                                  action_mask[row, :length].tolist())
    prompt = tokenizer.decode(output["prompt_ids"][row][output["prompt_mask"][row].bool()])
    echo(f"a sampled rollout; the student is trained on every completion token outside ⟦...⟧ (the teacher reads all, "
         f"prompt included):\n⟦{prompt}⟧{rendered}")
    return row
