"""The two ways this package steers code of GRPO's that it calls rather than copies, each in one place.

- `LossForward`: how GRPO's student log-prob call (`_get_per_token_logps_and_entropies`) runs inside one loss
  computation. `OPDTrainer` overrides that method once, at class level; the loss sets the instruction for the
  duration of its call (`OPDTrainer._compute_loss`), and every other call (old and reference log-probs, the teacher
  sources that run the student) is GRPO's, unchanged.
- `grpo_attributes`: GRPO's attributes set to other values for one call of its code (its loss with the OPD objective,
  its reward call for the accuracy metric), restored however the call ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

LogpsCall = Callable[..., tuple]  # GRPO's `_get_per_token_logps_and_entropies` signature, bound to the trainer


@dataclass
class LossForward:
    """The instruction for the student's log-prob call of one loss computation (one micro-batch)."""

    # replaces GRPO's projection of every position: the completion's positions only (`student.completion_logps`)
    compact: LogpsCall | None = None
    # called with the forward's detached log-probs (B, T) as soon as they exist, before GRPO's loss reads the batch's
    # advantages: where the teacher's advantages are formed in the loss forward (`advantages.py`)
    observe: Callable[[torch.Tensor], None] | None = None
    # the first call's result is returned to later calls: two objectives (L_RL + coef * L_OPD) on one forward
    reuse: bool = False
    _result: tuple | None = field(default=None, repr=False)

    def run(self, grpo_call: LogpsCall, *args, **kwargs) -> tuple:
        if self.reuse and self._result is not None:
            return self._result
        result = (self.compact or grpo_call)(*args, **kwargs)
        if self.observe is not None:
            self.observe(result[0].detach())
        if self.reuse:
            self._result = result
        return result


@contextmanager
def grpo_attributes(trainer, **values) -> Iterator[None]:
    """Within the block, each of GRPO's attributes named is `values[name]`; all are restored after, however the block
    ends. An attribute the trainer does not have is an error (a TRL that renamed it would otherwise be steered by
    nothing)."""
    missing = [name for name in values if not hasattr(trainer, name)]
    if missing:
        raise AttributeError(f"GRPOTrainer has no attribute {', '.join(missing)}: this TRL is not the one trl_opd "
                             "steers (see tests/test_trl_hooks.py).")
    saved = {name: getattr(trainer, name) for name in values}
    for name, value in values.items():
        setattr(trainer, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(trainer, name, value)
