"""The private TRL pieces OPDTrainer relies on. A TRL upgrade that changes any of them fails here, loudly."""

import inspect

import trl
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import _ForwardRedirection


def _params(function):
    return list(inspect.signature(function).parameters)


def test_trl_series():
    assert trl.__version__.startswith("1.16."), "trl_opd is built against trl 1.16; re-check the hooks below first"


def test_grpo_hooks_keep_their_signatures():
    assert _params(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    rewards_params = ["self", "inputs", "prompts", "completions", "completion_ids_list"]
    assert _params(GRPOTrainer._calculate_rewards) == rewards_params
    assert _params(GRPOTrainer._compute_loss) == ["self", "model", "inputs"]
    assert _params(GRPOTrainer._get_per_token_logps_and_entropies)[:5] == [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep"
    ]
    assert "batch_size" in _params(GRPOTrainer._get_per_token_logps_and_entropies)
    assert _params(GRPOTrainer.training_step) == ["self", "model", "inputs", "num_items_in_batch"]
    assert _params(GRPOTrainer.log) == ["self", "logs", "start_time"]


def test_grpo_loss_still_takes_per_token_advantages_and_our_clip_bounds():
    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'advantages = inputs["advantages"]' in source and "advantages.dim() == 1" in source
    assert "torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)" in source
    assert 'inputs.get("old_per_token_logps")' in source


def test_grpo_logs_entropy_as_each_micro_batchs_token_mean_over_all_processes():
    # the dense-only path, which runs no GRPO loss, logs `entropy` the same way (dense.py `_log_lean_forward_metrics`)
    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'self._metrics[mode]["entropy"].append(global_masked_mean(entropies))' in source
    assert "local_sum, local_count = (x * mask).sum(), mask.sum().float()" in source
    assert 'totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")' in source


def test_grpo_generation_output_and_state_we_read():
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for key in ('"prompt_ids"', '"prompt_mask"', '"completion_ids"', '"completion_mask"', '"advantages"'):
        assert f"{key}:" in source
    for metric in ("reward", "reward_std", "frac_reward_zero_std"):
        assert f'self._metrics[mode]["{metric}"]' in source
    assert 'self._logs["advantages"].extend(all_process_advantages.tolist())' in source
    assert "No reward source provided" in inspect.getsource(GRPOTrainer.__init__)


def test_grpo_config_group_size_check_is_a_plain_comparison():
    assert "if self.num_generations < 2:" in inspect.getsource(GRPOConfig.__post_init__)


def test_forward_redirection_takes_the_wrapper_the_module_and_the_method():
    # the dense term and the local teacher's backbone call run through it (inside the wrapper's forward)
    assert list(_params(_ForwardRedirection.__call__))[:4] == ["self", "wrapper_module", "original_module", "method"]


def test_the_vllm_and_hub_pieces_we_hook_into():
    from transformers import Trainer
    from trl.generation.vllm_generation import VLLMGeneration

    # colocated vLLM: GRPO builds self.vllm_generation, whose sync we replace on a CPU (colocate.sync_by_reload)
    assert "self.vllm_generation = VLLMGeneration(" in inspect.getsource(GRPOTrainer.__init__)
    assert _params(VLLMGeneration.sync_weights) == ["self"] and _params(VLLMGeneration._iter_named_params) == ["self"]
    assert "model_runner.model.load_weights" in inspect.getsource(VLLMGeneration.sync_weights)
    # the dense-only vLLM path turns this flag off: GRPO's old log-prob forward and its ratio both read it
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in source
    # the Trainer's pushes: the repo at construction, a push per save, the card each push writes
    assert "self.init_hf_repo()" in inspect.getsource(Trainer.__init__)
    assert _params(Trainer.init_hf_repo) == ["self", "token", "private"]
    assert _params(Trainer._push_from_checkpoint) == ["self", "checkpoint_folder"]
    assert "self.create_model_card(model_name=model_name, **kwargs)" in inspect.getsource(Trainer.push_to_hub)


def test_what_grpo_logs_and_makes_that_opd_reads_around_it():
    # a metric with no valid value in the logging window is logged as None (shown as not applicable in the card)
    assert "metrics[key] = sum(valid) / len(valid) if valid else None" in inspect.getsource(GRPOTrainer.log)
    # log_completions: the constructor makes output_dir/completions, which a new run's output_dir check allows
    assert 'os.makedirs(os.path.join(self.args.output_dir, "completions"), exist_ok=True)' in inspect.getsource(
        GRPOTrainer.__init__)


def test_every_loss_type_grpo_sums_its_policy_term_by_is_one_trl_opd_sums_its_terms_by():
    """A loss_type TRL adds would be summed by GRPO one way and OPD's dense term (loss.aggregate_as_loss_type)
    another, or refused mid-training: this names it first."""
    import ast
    import textwrap

    from trl_opd.loss import LOSS_TYPES

    tree = ast.parse(textwrap.dedent(inspect.getsource(GRPOTrainer._compute_loss)))
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and ast.unparse(node.left) == "self.loss_type":
            for comparator in node.comparators:
                named |= {constant.value for constant in ast.walk(comparator)
                          if isinstance(constant, ast.Constant) and isinstance(constant.value, str)}
    assert named, "GRPO's _compute_loss no longer compares self.loss_type: re-read how it sums its loss"
    unknown, gone = named - set(LOSS_TYPES), set(LOSS_TYPES) - named
    assert not unknown, f"TRL's _compute_loss knows loss_type(s) {sorted(unknown)} that trl_opd.loss does not sum"
    assert not gone, f"trl_opd.loss sums loss_type(s) {sorted(gone)} that TRL's _compute_loss no longer has"
