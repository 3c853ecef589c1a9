"""A teacher behind a server that returns its final hidden states, its LM head held here: exact logits, so every
estimator (`full` included) and every statistic a local teacher gives, for a fraction of the logits' bytes.

`trl-opd serve-teacher MODEL --hidden-states` runs vLLM as a pooling server (the causal LM converted for token
embedding, every position pooled, no normalisation). Its `/opd/hidden` (`trl_opd/server_route`) answers the states
that enter the head, after the final norm, at the scored positions only, as raw bytes in the served dtype. Only the
head is read from the teacher's checkpoint here: its tensor alone, from the safetensors file that holds it, with the
logit transforms of the teacher's config (scale, soft cap) and `teacher_temperature`, which a local head can apply.

On the wire per scored token: hidden size x 2 bytes for a bf16 teacher (10 KB for a 5,120-wide 32B model) against
vocabulary x 4 for float32 logits (608 KB at 152,064 tokens) and some 200 bytes for a top-20.

The head is replicated on every process, not sharded under ZeRO-3: the full term projects every scored position
through the whole head at each step (a sharded head would be all-gathered each step, see `dense.py`), and it is a
small part of the teacher (a 152k x 5,120 bf16 head is 1.6 GB of a 32B model's 65 GB).
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import torch

from ..heads import OutputHead, head_token_stats, head_topk_logps, logit_scale
from .base import TeacherScores
from .local import OutsideMassCheck
from .server_errors import TeacherServerError, reading
from .vllm_server import VLLMServerTeacher

logger = logging.getLogger(__name__)
# What may travel, by the name the server gives
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NUMPY_VIEWS = {"float32": "<f4", "bfloat16": "<i2", "float16": "<f2"}  # numpy has no bfloat16: its bits travel


class HiddenStateTeacher(OutsideMassCheck, VLLMServerTeacher):
    """Scores completions from the teacher's final hidden states, fetched from `serve-teacher --hidden-states`
    servers at `urls`, through `head` (the teacher's, see `load_teacher_head`), as `LocalTeacher` does after its
    backbone. Takes `VLLMServerTeacher`'s arguments besides."""

    def __init__(self, urls, *, head: OutputHead, return_hidden: bool = False, student_vocab_size: int | None = None,
                 **kwargs):
        super().__init__(urls, **kwargs)
        self.output_head = head
        self.return_hidden = return_hidden  # keep the hidden states for the full estimator's term
        self.student_vocab_size = student_vocab_size  # the topk estimator compares the student's ids only

    def _check_scoring_kind(self, url: str) -> None:
        info = self.info.get(url, {})
        if not info.get("hidden_states"):
            kind = "vLLM's own server" if not info else "a log-prob server (started without --hidden-states)"
            raise TeacherServerError(
                f"Teacher server {url} is {kind} and cannot return the teacher's hidden states, which scoring through "
                "the teacher's head needs. Start it with `trl-opd serve-teacher MODEL --hidden-states` (vLLM 0.31 or "
                "later), or use opd_estimator: topk with a log-prob server."
            )
        width = self.output_head.hidden_size
        if info.get("hidden_size") != width:
            raise ValueError(
                f"Teacher server {url} returns hidden states of size {info.get('hidden_size')}, but the teacher head "
                f"loaded here takes {width}: the head must come from the served model's checkpoint "
                "(teacher_model_name_or_path names it beside teacher_server_url)."
            )
        if info.get("dtype") not in WIRE_DTYPES:
            raise ValueError(
                f"Teacher server {url} serves its hidden states as {info.get('dtype')!r}; the head takes "
                f"{', '.join(WIRE_DTYPES)}. Serve the teacher in one of them (vLLM's --dtype)."
            )

    def _score_chunk(self, url: str, prompts: list[list[int]], completions: list[list[int]], first_index: int):
        """Per sequence, the hidden states (n, H) that predict its n completion tokens, in the served dtype."""
        response = self._request("POST", url, "/opd/hidden", {
            "sequences": [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)],
            "score_from": [len(prompt) for prompt in prompts]}, raw=True)
        expected = [len(completion) for completion in completions]
        try:
            lengths = [int(n) for n in response.headers["X-OPD-Lengths"].split(",")]
            dtype, width = response.headers["X-OPD-Dtype"], int(response.headers["X-OPD-Hidden-Size"])
            flat = torch.from_numpy(np.frombuffer(response.content, dtype=_NUMPY_VIEWS[dtype]).copy())
        except (KeyError, ValueError) as error:
            raise TeacherServerError(f"Teacher server {url} sent a malformed /opd/hidden answer ({error!r}) for "
                                     f"sequences {first_index}..{first_index + len(prompts) - 1}.") from None
        if lengths != expected or flat.numel() != sum(expected) * width:
            raise TeacherServerError(
                f"Teacher server {url} answered /opd/hidden for sequences {first_index}.."
                f"{first_index + len(prompts) - 1} with {lengths} positions ({flat.numel()} values of width {width}), "
                f"expected {expected} (one per completion token)."
            )
        states = flat.view(WIRE_DTYPES[dtype]).view(-1, width)
        if not torch.isfinite(states).all():
            raise TeacherServerError(f"Teacher server {url} sent non-finite hidden states for sequences "
                                     f"{first_index}..{first_index + len(prompts) - 1}.")
        return list(states.split(expected))

    def score(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> TeacherScores:
        head, device = self.output_head, completion_ids.device
        hidden = torch.zeros(*completion_ids.shape, head.hidden_size, dtype=head.weight.dtype, device=device)
        for indices, future in self._submit(self._score_chunk, prompt_ids, prompt_mask, completion_ids,
                                            completion_mask):
            for i, states in zip(indices, future.result(), strict=True):
                hidden[i, : len(states)] = states.to(device, head.weight.dtype)
        valid = completion_mask.bool()
        logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=device)
        entropy, is_top1 = torch.zeros_like(logps), torch.zeros_like(valid)
        stats = head_token_stats(hidden[valid], head, completion_ids[valid])
        for out, values in zip((logps, entropy, is_top1), stats, strict=True):
            out.masked_scatter_(valid, values)
        scores = TeacherScores(logps=logps, is_top1=is_top1, entropy=entropy,
                               hidden=hidden if self.return_hidden else None)
        if self.topk:
            ids, top = head_topk_logps(hidden.flatten(0, 1), head, k=self.topk, vocab_size=self.student_vocab_size)
            scores.topk_ids, scores.topk_logps = ids.view(*hidden.shape[:2], -1), top.view(*hidden.shape[:2], -1)
        self._check_outside_mass(hidden, completion_ids, completion_mask, logps)
        return scores


def load_teacher_head(name: str, *, dtype: torch.dtype | None = None, device="cpu", temperature: float = 1.0,
                      trust_remote_code: bool = False) -> OutputHead:
    """The LM head of checkpoint `name` (a directory or Hub id) with its config's logit transforms, read alone from
    the safetensors file that holds it (the input embedding when the two are tied), as `dtype` (default: stored)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    text = config.get_text_config()
    start = time.perf_counter()
    (file, key), bias_at = _head_location(name, config, trust_remote_code)
    with safe_open(file, framework="pt") as tensors:
        weight = tensors.get_tensor(key)
    bias = None
    if bias_at:
        with safe_open(bias_at[0], framework="pt") as tensors:
            bias = tensors.get_tensor(bias_at[1])
    weight = _whole_under_zero3(weight.to(device=device, dtype=dtype or weight.dtype))
    bias = None if bias is None else _whole_under_zero3(bias.to(device=device, dtype=weight.dtype))
    logger.warning("Teacher head: %s from %s, %d x %d %s (%.2f GB) read in %.1f s.", key, file, *weight.shape,
                   str(weight.dtype).removeprefix("torch."), weight.nelement() * weight.element_size() / 1e9,
                   time.perf_counter() - start)
    return OutputHead(weight, bias, logit_scale(text), getattr(text, "final_logit_softcapping", None), temperature)


def _whole_under_zero3(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` marked as a whole ZeRO-3 parameter when ZeRO-3 is on: TRL's divergence kernel gathers both heads
    through DeepSpeed's status flag, which a plain tensor lacks; one that says it is available is left as it is."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        tensor.ds_status = ZeroParamStatus.AVAILABLE
    return tensor


def _head_location(name: str, config, trust_remote_code: bool):
    """(file, key) of the head's weight in checkpoint `name`, and of its bias or None, found from the model's own
    module names (built on the meta device: no weights) and the checkpoint's index."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import cached_file

    with torch.device("meta"):  # the class itself, not `from_config`, which under ZeRO-3 would partition it
        model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
        model = (model_class(config) if model_class is not None
                 else AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code))
    modules = {id(module): module_name for module_name, module in model.named_modules()}
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    candidates = [f"{modules[id(head)]}.weight"] if head is not None else []
    candidates += [f"{modules[id(embedding)]}.weight"] if tied else []
    index = cached_file(name, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    if index:
        files = json.loads(open(index).read())["weight_map"]
    else:
        single = cached_file(name, "model.safetensors", _raise_exceptions_for_missing_entries=False)
        if not single:
            raise FileNotFoundError(
                f"The teacher checkpoint {name!r} has no model.safetensors or model.safetensors.index.json: its head "
                "is read from safetensors. Name the served model's checkpoint in teacher_model_name_or_path."
            )
        from safetensors import safe_open

        with safe_open(single, framework="pt") as tensors:
            files = dict.fromkeys(tensors.keys(), "model.safetensors")
    key = next((candidate for candidate in candidates if candidate in files), None)
    if key is None:
        raise ValueError(
            f"The teacher checkpoint {name!r} holds no head tensor: looked for {' or '.join(candidates)} in "
            f"{'model.safetensors.index.json' if index else 'model.safetensors'}. Is it the served model's checkpoint?"
        )
    bias = key.removesuffix(".weight") + ".bias"
    has_bias = bias in files and getattr(head, "bias", None) is not None
    bias_at = (cached_file(name, files[bias]), bias) if has_bias else None
    return (cached_file(name, files[key]), key), bias_at


def server_infos(urls, args) -> dict[str, dict]:
    """url -> its `/opd/info` answer (no fields for a server without one, e.g. vLLM's own) and the served "model",
    once each server is up."""
    client = VLLMServerTeacher.from_env(urls, api_key_env=args.teacher_server_api_key_env,
                                       timeout=(10.0, args.teacher_server_timeout),
                                       max_retries=args.teacher_server_max_retries,
                                       startup_timeout=args.teacher_server_startup_timeout)
    try:
        infos = {}
        for url in client.urls:
            client._wait_until_up(url)
            client._has_compact_endpoint(url)
            answer = client._request("GET", url, "/v1/models")
            with reading(url, "/v1/models", answer):
                infos[url] = {**client.info.get(url, {}), "model": str(answer["data"][0]["id"])}
        return infos
    finally:
        client._pool.shutdown()


def serves_hidden_states(args, urls=None) -> bool:
    """Whether the teacher servers (`urls`, default the configured ones) return hidden states: all or none."""
    from .vllm_server import is_served

    urls = urls or args.teacher_server_url or args.teacher_model_name_or_path
    return is_served(urls) and all_hidden(server_infos(urls, args))


def all_hidden(infos: dict[str, dict]) -> bool:
    """Whether the servers whose `server_infos` these are return hidden states: all or none, else an error."""
    hidden = sorted(url for url, info in infos.items() if info.get("hidden_states"))
    if hidden and len(hidden) < len(infos):
        raise ValueError(
            f"The teacher servers differ: {', '.join(hidden)} return hidden states (--hidden-states) and "
            f"{', '.join(sorted(set(infos) - set(hidden)))} log-probs. Start them all the same way."
        )
    return bool(hidden)
