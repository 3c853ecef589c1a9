"""OPDTrainer and its parts. `opd_trainer.py` is the step, in order; each other module is one part it calls (see
docs/development.md, "One training step").

`from trl_opd.trainer import OPDTrainer` works; importing a part (`trl_opd.trainer.metrics`) does not load the trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .opd_trainer import OPDTrainer as OPDTrainer


def __getattr__(name: str):
    if name == "OPDTrainer":
        from .opd_trainer import OPDTrainer

        return OPDTrainer
    raise AttributeError(f"module 'trl_opd.trainer' has no attribute {name!r}")
