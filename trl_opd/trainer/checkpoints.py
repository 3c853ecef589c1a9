"""Which checkpoints are safe to resume from.

The Trainer writes a checkpoint in place, file by file, with `trainer_state.json` last. A run killed while saving
leaves a directory that looks like the newest checkpoint but is not whole; resuming must skip it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def is_complete(checkpoint: str | Path) -> bool:
    """A checkpoint is whole when its trainer state, written last, parses."""
    state = Path(checkpoint) / "trainer_state.json"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError):
        return False
    return True


def last_complete_checkpoint(output_dir: str | Path, *, before: int | None = None) -> str | None:
    """The newest whole `checkpoint-N` under `output_dir` (with N < `before`, if given), or None."""
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*") if (m := _CHECKPOINT.match(p.name))]
    for step, path in sorted(found, reverse=True):
        if before is not None and step >= before:
            continue
        if path.is_dir() and is_complete(path):
            return str(path)
    return None


def resolve_resume(resume_from_checkpoint, output_dir) -> str | None:
    """What `train(resume_from_checkpoint=...)` should load: True/"true"/"latest" mean the newest whole checkpoint."""
    if resume_from_checkpoint in (None, False, "", "false", "False"):
        return None
    if resume_from_checkpoint is True or str(resume_from_checkpoint).lower() in ("true", "latest"):
        latest = last_complete_checkpoint(output_dir)
        if latest is None:
            raise ValueError(f"No complete checkpoint to resume from in {output_dir}.")
        _check_checkpoint_weights(latest)
        return latest
    if not is_complete(resume_from_checkpoint):
        latest = last_complete_checkpoint(Path(resume_from_checkpoint).parent)
        raise ValueError(
            f"Checkpoint {resume_from_checkpoint} is incomplete (no readable trainer_state.json: the run was probably "
            f"stopped while saving it). The newest complete one is {latest}."
        )
    _check_checkpoint_weights(resume_from_checkpoint)
    return str(resume_from_checkpoint)


def _check_checkpoint_weights(checkpoint) -> None:
    """A checkpoint whose weight files are damaged names the file and the newest complete checkpoint before it."""
    from ..checks import check_weight_files

    try:
        check_weight_files(checkpoint, role="checkpoint's")
    except ValueError as error:
        named = _CHECKPOINT.match(Path(checkpoint).name)
        previous = last_complete_checkpoint(Path(checkpoint).parent, before=int(named.group(1)) if named else 0)
        raise ValueError(f"{error} Checkpoint {checkpoint} cannot be resumed; the newest complete one before it is "
                         f"{previous}.") from None


def old_checkpoints(output_dir: str | Path, *, overwrite: bool, own: tuple[str, ...] = ()) -> list[Path]:
    """The checkpoints a new (not resumed) run in `output_dir` must delete before it starts; raises if the directory
    holds anything and `overwrite` is not set: the new run's checkpoints would mix with the old ones, and a later
    resume could load the old run's newest. `own` names the folders the new run's trainer made there before
    training, which count only once they hold files (then another run's)."""
    output_dir = Path(output_dir)
    entries = sorted(output_dir.iterdir()) if output_dir.is_dir() else []
    found = [p.name for p in entries if not (p.name in own and p.is_dir() and not any(p.iterdir()))]
    if found and not overwrite:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise FileExistsError(
            f"output_dir {output_dir} already holds files ({shown}): a new run there would mix its checkpoints with "
            "the old ones. Resume that run (resume_from_checkpoint: true), start over in it (overwrite_output_dir: "
            "true, which deletes its checkpoints), or choose another output_dir."
        )
    return sorted(p for p in output_dir.glob("checkpoint-*") if p.is_dir())


# adapter_config.json field -> the recipe field that sets it
_ADAPTER_FIELDS = {"r": "lora_r", "lora_alpha": "lora_alpha", "target_modules": "lora_target_modules"}
# config.json fields that decide the shape of every saved tensor
_MODEL_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")


def check_resume_matches(checkpoint, model) -> None:
    """The checkpoint must have been saved by a run of this model and adapter: otherwise loading it fails with a raw
    state-dict mismatch. `model` is the (unwrapped) student, PEFT or not; names the recipe field that differs."""
    checkpoint = Path(checkpoint)
    adapter_file = checkpoint / "adapter_config.json"
    peft_config = getattr(model, "peft_config", {}).get("default")
    if adapter_file.exists() != (peft_config is not None):
        saved, now = ("a LoRA adapter", "full weights") if adapter_file.exists() else ("full weights", "a LoRA adapter")
        raise ValueError(f"Checkpoint {checkpoint} holds {saved}, and this run trains {now} (use_peft): resume with "
                         "the checkpoint's setting, or start a new run.")
    if peft_config is not None:
        saved = json.loads(adapter_file.read_text())
        for field, option in _ADAPTER_FIELDS.items():
            before, now = saved.get(field), getattr(peft_config, field, None)
            if isinstance(before, list) or isinstance(now, (set, list)):
                before, now = sorted(before or []), sorted(now or [])
            if before != now:
                raise ValueError(f"Checkpoint {checkpoint} was trained with {option}={before!r} ({adapter_file.name}), "
                                 f"this run has {now!r}: resume with the same {option}, or start a new run.")
        return
    config_file = checkpoint / "config.json"
    if config_file.exists():
        saved = json.loads(config_file.read_text())
        current = model.config.to_dict()
        for field in _MODEL_FIELDS:
            if field in saved and saved[field] != current.get(field):
                raise ValueError(f"Checkpoint {checkpoint} holds a model with {field}={saved[field]!r} (config.json), "
                                 f"this run's student has {current.get(field)!r}: resume with the same "
                                 "model_name_or_path, or start a new run.")
