"""vLLM colocated with the trainer (`use_vllm: true, vllm_mode: colocate`) on a CPU.

TRL copies the student's weights into the colocated engine one tensor at a time, through each vLLM parameter's
`weight_loader`. vLLM's CPU build repacks every linear layer's weight for its own matrix kernels once the model is
loaded and leaves a plain parameter without a loader in its place, so that copy fails on the first sync
(`AttributeError: 'Parameter' object has no attribute 'weight_loader'`). vLLM's layer-wise reload takes the same
weights, in checkpoint names, and repacks them; on a GPU TRL's own copy is kept.
"""

from __future__ import annotations

from trl.generation.vllm_generation import VLLMGeneration


class ReloadingVLLMGeneration(VLLMGeneration):
    """TRL's colocated generation, its weight sync through vLLM's `reload_weights`; GRPO builds a `VLLMGeneration`
    and `reload_on_sync` makes it one of these."""

    def sync_weights(self) -> None:
        """The weights come from TRL's own walk over the student (adapters merged, ZeRO-3 parameters gathered one at a
        time, names as in the checkpoint); each is cloned, because the walk gives a gathered tensor back when it moves
        on."""
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        weights = ((name, param.detach().clone()) for name, param in self._iter_named_params())
        runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        self.llm.reset_prefix_cache()


def reload_on_sync(generation: VLLMGeneration) -> None:
    """Make GRPO's colocated `generation` sync by reload: its class becomes the subclass above, so every method TRL
    calls is still TRL's own except `sync_weights`."""
    if type(generation) is not VLLMGeneration:
        raise TypeError(f"expected TRL's VLLMGeneration, got {type(generation).__name__}: its weight sync would be "
                        "replaced unread")
    generation.__class__ = ReloadingVLLMGeneration
