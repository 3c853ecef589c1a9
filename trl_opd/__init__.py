"""trl_opd: on-policy distillation on top of TRL's GRPO trainer.

`import trl_opd` is cheap: the trainer and config (which import TRL, transformers and torch) load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_LAZY = {
    "OPDConfig": "trl_opd.config",
    "OPDTrainer": "trl_opd.trainer.opd_trainer",
    "LocalTeacher": "trl_opd.teachers",
    "VLLMServerTeacher": "trl_opd.teachers",
    "TeacherScorer": "trl_opd.teachers",
    "TeacherScores": "trl_opd.teachers",
}
__all__ = [
    "LocalTeacher", "OPDConfig", "OPDTrainer", "TeacherScorer", "TeacherScores", "VLLMServerTeacher", "__version__"
]

if TYPE_CHECKING:
    from .config import OPDConfig
    from .teachers import LocalTeacher, TeacherScorer, TeacherScores, VLLMServerTeacher
    from .trainer.opd_trainer import OPDTrainer


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trl_opd' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names too, before their first use loads them (tab completion finds `OPDTrainer`)."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
