"""The stock `/v1/completions` request that scores token ids on any vLLM server, and the reading of its answer.

Each sequence (prompt + completion) is sent as a prompt with `prompt_logprobs: k` and `max_tokens: 1`. The answer
holds one choice per sequence, numbered by `index`; a choice's `prompt_logprobs` has one entry per prompt position:
None at the first, then an object keyed by token id as text, `{"1234": {"logprob": -0.7, "rank": 1,
"decoded_token": " the"}, ...}`, with the token at that position and the k most likely ones. Read from it, at the
completion positions only: each sampled token's log-prob, its rank (1: the argmax) where the server gives one, and
with k the k most likely (token id, log-prob) pairs. The generated token, text and usage are ignored.
"""

from __future__ import annotations

import math

from .server_errors import TeacherServerError, reading


def completion_payload(model: str, sequences: list[list[int]], *, topk: int) -> dict:
    """The request that scores `sequences` (token ids): each as a prompt, with its per-position log-probs."""
    return {"model": model, "prompt": sequences, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": topk}


def completion_entries(answer: dict, *, url: str, count: int, first_index: int) -> list[list | None]:
    """Each of the `count` sequences' per-position entries (its choice's `prompt_logprobs`), in request order.

    `first_index` is the batch index of the first sequence, for the messages.
    """
    with reading(url, "/v1/completions", answer):
        choices = sorted(answer.get("choices", []), key=lambda choice: choice["index"])
        indices = [choice["index"] for choice in choices]
    if indices != list(range(count)):
        raise TeacherServerError(
            f"Teacher server {url} answered {len(choices)} choices for {count} sequences "
            f"(sequences {first_index}..{first_index + count - 1})."
        )
    entries = [choice.get("prompt_logprobs") for choice in choices]
    for i, sequence_entries in enumerate(entries):
        if sequence_entries is not None and not (isinstance(sequence_entries, list) and all(
                entry is None or isinstance(entry, dict) for entry in sequence_entries)):
            raise TeacherServerError(
                f"Teacher server {url}: sequence {first_index + i} came back with prompt_logprobs that are not a "
                f"list of per-position objects: {str(sequence_entries)[:200]!r}."
            )
    return entries


def read_entries(entries, prompt: list[int], completion: list[int], *, index: int, url: str, topk: int = 0):
    """The teacher's log-prob (and rank, if given) of each completion token, and with `topk` the k most likely
    (token, log-prob) pairs at each completion position in decreasing order, validated."""
    expected = len(prompt) + len(completion)
    if entries is None or len(entries) != expected:
        raise TeacherServerError(
            f"Teacher server {url}: sequence {index} came back with {0 if entries is None else len(entries)} "
            f"prompt log-prob entries, expected {expected} (one per token)."
        )
    values, ranks, top = [], [], []
    for position, token in enumerate(completion, start=len(prompt)):
        entry = entries[position] or {}
        scored = entry.get(str(token))
        logprob = scored.get("logprob") if isinstance(scored, dict) else None
        if not _is_number(logprob) or not math.isfinite(logprob):
            raise TeacherServerError(
                f"Teacher server {url}: sequence {index}, completion position {position - len(prompt)} (token "
                f"{token}) has log-prob {logprob!r}: expected a finite number."
            )
        values.append(logprob)
        ranks.append(scored.get("rank"))
        if topk:
            top.append(_top_entries(entry, topk, where=f"{url}: sequence {index}, position {position - len(prompt)}"))
    return values, (None if any(rank is None for rank in ranks) else ranks), top


def _top_entries(entry: dict, k: int, *, where: str) -> list[tuple[int, float]]:
    """The k most likely (token id, log-prob) pairs of one position's answer (the sampled token is there too)."""
    if not all(token.isdigit() and isinstance(scored, dict) and _is_number(scored.get("logprob"))
               for token, scored in entry.items()):
        raise TeacherServerError(
            f"Teacher server {where}: the top tokens are not token ids with numeric log-probs: {str(entry)[:200]!r}."
        )
    pairs = sorted(((int(token), scored["logprob"]) for token, scored in entry.items()), key=lambda pair: -pair[1])[:k]
    if len(pairs) < k or not all(math.isfinite(logp) for _, logp in pairs):
        raise TeacherServerError(
            f"Teacher server {where}: expected the {k} most likely tokens with finite log-probs, got {len(pairs)}. "
            f"Start the server with --max-logprobs {k} or more (trl-opd serve-teacher sets 20)."
        )
    return pairs


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
