"""GRPO's clipped policy objective, reused for the teacher's advantages and combined with the rewards'.

With the teacher alone, GRPO's `_compute_loss` runs on the teacher's (B, T) advantages, its objective unclipped where
`opd_objective: importance_sampling` asks. Beside reward functions with `opd_reward_combination: loss`, the loss is
`L_RL + opd_loss_coef * L_OPD`: two calls of GRPO's loss on one student forward (`grpo_calls.LossForward.reuse`),
the second adding only its policy term. `OPDTrainer._policy_loss` makes those calls with the attribute values here
(`grpo_calls.grpo_attributes`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# The second objective adds only its clipped policy term: the KL penalty, entropy bonus and MoE auxiliary loss are
# already in the first
POLICY_TERM_ONLY = {"beta": 0.0, "_entropy_bonus_enabled": False, "aux_loss_enabled": False}


def opd_objective(args) -> dict:
    """GRPO's attributes that make its objective the OPD one: unclipped with `opd_objective: importance_sampling`
    (clip(r, 0, inf) == r for r = exp(.) > 0, so GRPO's min(r A, clip(r) A) becomes r A exactly); none otherwise."""
    if args.opd_objective != "importance_sampling":
        return {}
    return {"epsilon_low": 1.0, "epsilon_high": float("inf")}


@contextmanager
def metrics_renamed_opd(store: dict) -> Iterator[None]:
    """The metrics GRPO's loss logs within the block, to `store` (one mode's), are the second objective's: its
    clip-ratio metrics are kept under `opd/`, the rest (the first objective logged them already) dropped."""
    lengths = {name: len(values) for name, values in store.items()}
    try:
        yield
    finally:
        for name in [n for n, values in store.items() if len(values) > lengths.get(n, 0)]:
            added = store[name][lengths.get(name, 0):]
            del store[name][lengths.get(name, 0):]
            if name.startswith("clip_ratio/"):
                store[f"opd/{name}"].extend(added)
