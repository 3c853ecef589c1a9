"""Model cards and Hub pushes of a trained student: the PEFT adapter by default, merged weights when asked.

The Trainer's own push does the uploads, for the CLI and the Python API alike: with `push_to_hub` it creates the repo
when the trainer is built (an unreachable Hub stops the run before any training), pushes at each save as
`hub_strategy` says, and at the end, each time with this package's model card (`OPDTrainer.create_model_card`). If
the last push fails, one error says so and points at the complete local copy, which `trl-opd push OUTPUT_DIR
--repo-id ORG/NAME` can push later.
"""

from __future__ import annotations

import json
import logging
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..secrets import without_secrets
from ..teachers import local
from ..teachers.sources import source_support
from .metrics import metric_text

# The facts behind the model card, kept beside it so a merged copy can get its own card
CARD_FACTS = "opd_training.json"
# What a push leaves out: resumable training state, not the model
_IGNORE = ["checkpoint-*", "checkpoint-*/**", "*.pt", "*.pth", "training_args.bin", "runs/**", "completions/**"]


class HubPushError(RuntimeError):
    """The Hub could not take a push. The local output directory is complete."""


def describe_teacher(args) -> str:
    """The teacher as the model card shows it (its source's `describe`): server URLs without their credentials."""
    return (source_support(args) or local.SUPPORT).describe(args)  # a teacher passed as a model: local


logger = logging.getLogger(__name__)
_WARNED_LOCAL: set[str] = set()
_DIVERGENCES = {
    "reverse_kl": "the reverse KL(student || teacher)",
    "forward_kl": "the forward KL(teacher || student)",
    "jsd": "the generalised Jensen-Shannon divergence (mixture {beta:g} * teacher + {rest:g} * student)",
}
_PACKAGES = ("trl_opd", "trl", "transformers", "torch", "peft", "datasets", "accelerate")


def objective_text(settings: dict, rewards: str | None = None) -> str:
    """What the run's loss was, in words, from the card's settings: the sampled-token advantage, the dense divergence
    and its direction, with their weights, and the rewards beside them."""
    estimator, coef = settings.get("opd_estimator"), settings.get("opd_coef")
    objective = ("GRPO's clipped policy-gradient objective" if settings.get("opd_objective", "clipped") == "clipped"
                 else "an unclipped importance-sampled policy-gradient objective")
    sampled = ("the per-token difference log pi_teacher - log pi_student of each sampled token was the advantage of "
               f"{objective}")
    if estimator == "sampled" and settings.get("opd_constant_advantage"):
        text = ("A control run (opd_constant_advantage): every sampled token's advantage in "
                f"{objective} was the same negative constant, the mean magnitude of the teacher's per-token "
                f"advantages opd_coef * (log pi_teacher - log pi_student) over the batch (opd_coef {coef:g}); the "
                "teacher's per-token signal itself was not trained on.")
    elif estimator == "sampled":
        text = f"{sampled[0].upper()}{sampled[1:]} (opd_coef {coef:g})."
    else:
        from ..loss import divergence_name

        beta = settings.get("opd_divergence_beta", 1.0)
        divergence = _DIVERGENCES[divergence_name(beta)].format(beta=beta, rest=1 - beta)
        where = ("over the full vocabulary" if estimator == "full" else
                 f"over the teacher's top {settings.get('opd_topk')} tokens, the rest of the vocabulary as one bucket")
        text = (f"The loss was {divergence} at each sampled position, {where} (opd_dense_coef "
                f"{settings.get('opd_dense_coef', 1.0):g})")
        text += f"; beside it, {sampled} (opd_coef {coef:g})." if coef else (
            ", with no sampled-token advantage (opd_coef 0).")
    if rewards:
        how = ("its advantages summed with the teacher's" if settings.get("opd_reward_combination") == "advantage" else
               f"GRPO's loss on them plus opd_loss_coef {settings.get('opd_loss_coef', 1.0):g} times the teacher's")
        text += f" Rewards ({rewards}) joined the teacher's signal: {how}."
    return text


def framework_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    return versions


def is_local_path(name: str) -> bool:
    """A model named by a path on this machine, which the Hub cannot link as `base_model`."""
    return bool(name) and (name.startswith((".", "/", "~")) or Path(name).exists())


def model_card(*, base_model: str, teacher: str, recipe: str | None, dataset: str | None, settings: dict,
               metrics: dict, is_adapter: bool, versions: dict | None = None, repo_id: str | None = None) -> str:
    """README.md text: YAML front matter for the Hub, then what was trained how, and how to load it. A local path
    is left out of the front matter's `base_model` (the Hub would link nothing) and named with a warning."""
    local_base = is_local_path(base_model)
    front = ["---", *([] if local_base else [f"base_model: {base_model}"]),
             "library_name: " + ("peft" if is_adapter else "transformers"),
             "tags:", "- trl", "- trl_opd", "- on-policy-distillation"]
    if dataset:
        front.append(f"datasets:\n- {dataset}")
    front.append("---")
    name = repo_id or "REPO_ID"  # a placeholder only where no Hub id was set
    load = (
        f'from peft import AutoPeftModelForCausalLM\n\nmodel = AutoPeftModelForCausalLM.from_pretrained("{name}")'
        if is_adapter else
        f'from transformers import AutoModelForCausalLM\n\nmodel = AutoModelForCausalLM.from_pretrained("{name}")'
    )
    if is_adapter:
        load += f'  # and its base model, {base_model}' + (" (a local path: see above)" if local_base else "")

    def rows(values: dict) -> str:
        return "\n".join(f"| `{k}` | {v} |" for k, v in values.items()) or "| (none logged) | |"

    metrics = {name: metric_text(value) for name, value in metrics.items()}  # None: logged as not applicable
    rewards = settings.get("reward_funcs")
    warning = ([f"> **base_model is a local path** ({base_model}): the Hub cannot link it. Before publishing, set "
                "`base_model:` in the front matter above to the student's Hub id.", ""] if local_base else [])

    return "\n".join([
        *front, "",
        f"# {'LoRA adapter' if is_adapter else 'Model'} trained by on-policy distillation",
        "",
        *warning,
        f"- **Base model (student):** {base_model}",
        f"- **Teacher:** {teacher}",
        f"- **Recipe:** {recipe or 'Python API'}",
        f"- **Dataset:** {dataset or 'not recorded'}",
        "",
        "The student sampled its own completions and the teacher scored exactly those tokens (trl_opd's OPDTrainer "
        "on TRL's GRPOTrainer). " + objective_text(settings, rewards),
        "",
        "## Settings", "", "| setting | value |", "|---|---|", rows(settings), "",
        "## Final metrics", "", "| metric | value |", "|---|---|", rows(metrics), "",
        "## Use", "", "```python", load, "```", "",
        *(["## Framework versions", "", *(f"- {k}: {v}" for k, v in versions.items()), ""] if versions else []),
    ])


def write_model_card(trainer, output_dir, *, recipe: str | None = None, dataset: str | None = None,
                     is_adapter: bool | None = None) -> Path:
    """Write README.md for what `trainer` saved in `output_dir` (an adapter if `is_adapter`, by default if
    `output_dir` holds one)."""
    args = trainer.args
    settings_names = ("opd_estimator", "opd_coef", "opd_dense_coef", "opd_divergence_beta", "opd_topk",
                      "opd_objective", "kl_discount_factor",
                      "loss_type", "num_generations", "max_completion_length", "temperature", "teacher_temperature",
                      "learning_rate", "max_steps",
                      "per_device_train_batch_size", "gradient_accumulation_steps", "opd_loss_coef",
                      "opd_reward_combination")
    settings = {name: getattr(args, name) for name in settings_names}
    if args.opd_constant_advantage:  # shown only in the control runs it makes
        settings["opd_constant_advantage"] = True
    if trainer.reward_funcs:
        settings["reward_funcs"] = ", ".join(trainer.reward_func_names)
    logged = [entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry]
    metrics = {"step": trainer.state.global_step}
    if logged:
        metrics.update({k: v if v is None else round(v, 4)  # None: GRPO's "applied to no completion"
                        for k, v in logged[-1].items() if k.startswith(("opd/", "loss", "reward"))})
    base_model = getattr(trainer.accelerator.unwrap_model(trainer.model).config, "_name_or_path", "")
    facts = dict(base_model=base_model, teacher=describe_teacher(args), recipe=recipe, dataset=dataset,
                 settings=settings, metrics=metrics, versions=framework_versions(),
                 repo_id=getattr(trainer, "hub_model_id", None) or args.hub_model_id)
    if is_local_path(base_model) and base_model not in _WARNED_LOCAL:  # once a run, not with every checkpoint
        _WARNED_LOCAL.add(base_model)
        logger.warning("The model card's base model is a local path (%s): the Hub cannot link it; its README.md says "
                       "so. Set base_model in its front matter to the student's Hub id before publishing.", base_model)
    (Path(output_dir) / CARD_FACTS).write_text(json.dumps(facts, indent=1, default=str))
    path = Path(output_dir) / "README.md"
    if is_adapter is None:
        is_adapter = (Path(output_dir) / "adapter_config.json").exists()
    path.write_text(model_card(**facts, is_adapter=is_adapter))
    return path


def merged_copy(output_dir, destination) -> Path:
    """The adapter in `output_dir` merged into its base model, saved (with tokenizer and card) to `destination`."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained(output_dir).merge_and_unload()
    model.save_pretrained(destination)
    AutoTokenizer.from_pretrained(output_dir).save_pretrained(destination)
    facts = Path(output_dir) / CARD_FACTS
    if facts.exists():  # the same card, for full weights
        (Path(destination) / CARD_FACTS).write_text(facts.read_text())
        (Path(destination) / "README.md").write_text(model_card(**json.loads(facts.read_text()), is_adapter=False))
    return Path(destination)


def push(output_dir, repo_id: str, *, token: str | None = None, private: bool | None = None, merge: bool = False,
         endpoint: str | None = None) -> str:
    """Push `output_dir` (adapter or model, card, tokenizer) to `repo_id`; the merged model if `merge`."""
    from huggingface_hub import HfApi

    output_dir = Path(output_dir)
    if not (output_dir / "adapter_config.json").exists() and not (output_dir / "config.json").exists():
        raise FileNotFoundError(f"{output_dir} holds no saved model or adapter to push.")
    with tempfile.TemporaryDirectory() as scratch:
        folder = merged_copy(output_dir, scratch) if merge else output_dir
        with pushing(output_dir, repo_id, token=token):
            api = HfApi(endpoint=endpoint, token=token)
            url = api.create_repo(repo_id, private=private, exist_ok=True)
            api.upload_folder(repo_id=repo_id, folder_path=str(folder), ignore_patterns=_IGNORE)
    return str(url)


def hub_reason(error: Exception, token: str | None) -> str:
    """What went wrong with the Hub, without the token the client used (the argument, HF_TOKEN or the stored login)."""
    from huggingface_hub import get_token

    return without_secrets(f"{type(error).__name__}: {error}", token, get_token())


@contextmanager
def pushing(output_dir, repo_id: str, *, token: str | None = None):
    """Within the block, any failure of the Hub client (network, auth, offline mode, server errors) becomes one
    HubPushError that says nothing is lost and how to push the saved output later."""
    output_dir = Path(output_dir)
    try:
        yield
    except Exception as error:
        raise HubPushError(
            f"Could not push {output_dir} to the Hub repo {repo_id!r} ({hub_reason(error, token)}). Nothing is lost: "
            f"the trained {'adapter' if (output_dir / 'adapter_config.json').exists() else 'model'} and its model "
            f"card are saved in {output_dir}. Push them later with `trl-opd push {output_dir} --repo-id {repo_id}`."
        ) from None


class HubMixin:
    """Mixed into OPDTrainer before GRPOTrainer: the Trainer's Hub hooks with this package's model card, and an early
    stop when the repo cannot be created. Reads the Trainer's `args` and `is_world_process_zero`."""

    card_recipe: str | None = None  # what the model card names as the recipe and the dataset (set by the CLI)
    card_dataset: str | None = None

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, **kwargs):
        """This package's model card (`hub.write_model_card`) in output_dir, which every push of the Trainer's
        uploads: the end of training and, through `_push_from_checkpoint`, each save under `hub_strategy`."""
        if not self.is_world_process_zero():
            return
        write_model_card(self, self.args.output_dir, recipe=self.card_recipe,
                         dataset=dataset_name or self.card_dataset, is_adapter=kwargs.get("is_adapter"))

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """The Trainer creates the repo when it is built with push_to_hub: if the Hub cannot take it, stop now, with
        the reason (never the token), before anything is trained."""
        try:
            super().init_hf_repo(token=token, private=private)
        except Exception as error:
            repo_id = self.args.hub_model_id or Path(self.args.output_dir).absolute().name
            raise HubPushError(
                f"Could not create the Hub repo {repo_id!r} ({hub_reason(error, token or self.args.hub_token)}), so "
                "nothing was trained. Check the network and the token, or set push_to_hub: false and push the "
                "output later with `trl-opd push OUTPUT_DIR --repo-id ORG/NAME`."
            ) from None

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self.is_world_process_zero() and self.args.hub_strategy != "end":  # the card goes up with the checkpoint
            self.create_model_card(is_adapter=(Path(checkpoint_folder) / "adapter_config.json").exists())
        super()._push_from_checkpoint(checkpoint_folder)
