"""GRPO's clipped policy objective, reused for the teacher's advantages and combined with the rewards'.

With the teacher alone, GRPO's `_compute_loss` runs on the teacher's (B, T) advantages, its objective unclipped where
`opd_objective: importance_sampling` asks. Beside reward functions with `opd_reward_combination: loss`, the loss is
`L_RL + opd_loss_coef * L_OPD`: two calls of GRPO's loss on one student forward, the second adding only its policy
term.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .metrics import wrapped_logps_call


class PolicyObjectiveMixin:
    """Mixed into OPDTrainer before GRPOTrainer, whose `_compute_loss` it calls. Reads GRPO's `args`, `accelerator`,
    `_metrics`, `reward_funcs`, `epsilon_low`/`epsilon_high`, `beta`, `_entropy_bonus_enabled` and
    `aux_loss_enabled`, and sets the last five for the duration of one call."""

    def _policy_loss(self, model, inputs) -> torch.Tensor:
        """GRPO's loss on the batch's advantages: the teacher's, summed with the rewards', or both objectives."""
        if "teacher_advantages" not in inputs:  # teacher only (the OPD objective), or rewards' advantages summed
            with self._opd_objective(enabled=not self.reward_funcs):
                return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        with self._one_student_forward():
            rl_loss = super()._compute_loss(model, inputs)
            if self.args.opd_loss_coef == 0.0:
                return rl_loss
            with self._policy_term_only(mode), self._opd_objective():
                opd_loss = super()._compute_loss(model, {**inputs, "advantages": inputs["teacher_advantages"]})
        # GRPO's loss is divided for gradient accumulation; the metrics are on the scale of the logged `loss`
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        for name, value in (("rl/loss", rl_loss), ("opd/loss", opd_loss)):
            self._metrics[mode][name].append(self.accelerator.gather(value.detach()).mean().item() * accumulation)
        return rl_loss + self.args.opd_loss_coef * opd_loss

    @contextmanager
    def _opd_objective(self, enabled: bool = True):
        """Within the block, GRPO's objective is the OPD one: unclipped with `opd_objective: importance_sampling`
        (clip(r, 0, inf) == r for r = exp(.) > 0, so GRPO's min(r A, clip(r) A) becomes r A exactly)."""
        if not enabled or self.args.opd_objective != "importance_sampling":
            yield
            return
        saved = self.epsilon_low, self.epsilon_high
        self.epsilon_low, self.epsilon_high = 1.0, float("inf")
        try:
            yield
        finally:
            self.epsilon_low, self.epsilon_high = saved

    @contextmanager
    def _one_student_forward(self):
        """Within the block, the student's log-probs are computed once and reused: two objectives, one forward."""
        cache = {}

        def once(compute):
            def cached(*args, **kwargs):
                if "result" not in cache:
                    cache["result"] = compute(*args, **kwargs)
                return cache["result"]

            return cached

        with wrapped_logps_call(self, once):
            yield

    @contextmanager
    def _policy_term_only(self, mode: str):
        """The second objective adds only its clipped policy term: the KL penalty, entropy bonus and MoE auxiliary
        loss are already in the first. Its clip-ratio metrics are logged under `opd/`."""
        saved = self.beta, self._entropy_bonus_enabled, self.aux_loss_enabled
        self.beta, self._entropy_bonus_enabled, self.aux_loss_enabled = 0.0, False, False
        lengths = {name: len(values) for name, values in self._metrics[mode].items()}
        try:
            yield
        finally:
            self.beta, self._entropy_bonus_enabled, self.aux_loss_enabled = saved
            for name in [n for n, values in self._metrics[mode].items() if len(values) > lengths.get(n, 0)]:
                added = self._metrics[mode][name][lengths.get(name, 0):]
                del self._metrics[mode][name][lengths.get(name, 0):]
                if name.startswith("clip_ratio/"):
                    self._metrics[mode][f"opd/{name}"].extend(added)

