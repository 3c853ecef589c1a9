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


def last_complete_checkpoint(output_dir: str | Path) -> str | None:
    """The newest whole `checkpoint-N` under `output_dir`, or None."""
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*") if (m := _CHECKPOINT.match(p.name))]
    for _, path in sorted(found, reverse=True):
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
        return latest
    if not is_complete(resume_from_checkpoint):
        latest = last_complete_checkpoint(Path(resume_from_checkpoint).parent)
        raise ValueError(
            f"Checkpoint {resume_from_checkpoint} is incomplete (no readable trainer_state.json: the run was probably "
            f"stopped while saving it). The newest complete one is {latest}."
        )
    return str(resume_from_checkpoint)
