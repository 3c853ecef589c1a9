"""A compact scoring endpoint inside vLLM's OpenAI-compatible server: `trl-opd serve-teacher` loads it with
`--middleware opd_scoring_route.opd_scoring` (this directory on the server's PYTHONPATH). Every other request goes to
the server unchanged.

    GET  /opd/info   -> {"version": 1, "hidden_states": false}, or for a pooling server (`serve-teacher
                        --hidden-states`) {"version": 1, "hidden_states": true, "hidden_size": H, "dtype": "bfloat16"}
    POST /opd/score  {"sequences": [[token id, ...], ...], "score_from": [first scored position, ...], "topk": k}
                     -> {"lengths": [scored positions per sequence], "logprobs": float32[N], "ranks": int32[N],
                         "topk_ids": int32[N, k], "topk_logprobs": float32[N, k]}   (arrays: base64, little-endian)
    POST /opd/hidden {"sequences": ..., "score_from": ...}  (a pooling server)
                     -> the final hidden states that predict each scored token, (N, H) raw little-endian bytes in the
                        served dtype (bfloat16 as its 16 bits); headers X-OPD-Lengths (scored positions per
                        sequence, comma-separated), X-OPD-Dtype, X-OPD-Hidden-Size

The stock `/v1/completions` answer with `prompt_logprobs` spends most of its time outside the model: it decodes every
top entry to text and builds, then encodes as JSON, one object per entry at every position of the prompt. Here the
engine is asked for the same log-probs (`prompt_logprobs=k`, raw as the server's `--logprobs-mode` says) without
detokenising, in vLLM's flat container, and only the scored positions go back, as arrays. A pooling server pools
every position's final hidden state (the head's input, after the final norm), and only the scored ones go back.

Runs in vLLM's interpreter: it imports only the standard library, numpy, and what vLLM's server itself imports.
"""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
from fastapi.responses import JSONResponse, Response

VERSION = 1


async def opd_scoring(request, call_next):
    path = request.url.path
    if path == "/opd/info" and request.method == "GET":
        return JSONResponse(_info(request.app.state.engine_client.model_config))
    if path == "/opd/hidden" and request.method == "POST":
        return await _hidden(request)
    if path != "/opd/score" or request.method != "POST":
        return await call_next(request)
    try:
        body = await request.json()
        sequences, score_from, topk = _sequences(body), body["score_from"], int(body.get("topk", 0))
        if topk < 0:
            raise ValueError(f"topk must be 0 or more, got {topk}")
    except (KeyError, TypeError, ValueError) as error:
        return JSONResponse({"error": f"bad /opd/score request: {error}"}, status_code=400)

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=topk, detokenize=False,
                            flat_logprobs=True)
    engine = request.app.state.engine_client
    try:
        scored = await asyncio.gather(*(_prompt_logprobs(engine, TokensPrompt(prompt_token_ids=ids), params)
                                        for ids in sequences))
    except ValueError as error:  # vLLM's own refusal: a sequence too long, topk over --max-logprobs, ...
        return JSONResponse({"error": str(error)}, status_code=400)

    logprobs, ranks, top_ids, top_logprobs, lengths = [], [], [], [], []
    for ids, start, flat in zip(sequences, score_from, scored, strict=True):
        starts = np.asarray(flat.start_indices[start:], dtype=np.int64)  # each position: its token, then the top k
        values = np.asarray(flat.logprobs, dtype=np.float32)
        tokens = np.asarray(flat.token_ids, dtype=np.int32)
        if len(starts) != len(ids) - start or not np.array_equal(tokens[starts], np.asarray(ids[start:])):
            return JSONResponse({"error": "the engine's prompt log-probs do not line up with the sequence"},
                                status_code=500)
        lengths.append(len(starts))
        logprobs.append(values[starts])
        ranks.append(np.asarray(flat.ranks, dtype=np.int32)[starts])
        at = starts[:, None] + 1 + np.arange(topk)
        top_ids.append(tokens[at])
        top_logprobs.append(values[at])
    return JSONResponse({"lengths": lengths, **{name: _encode(arrays) for name, arrays in (
        ("logprobs", logprobs), ("ranks", ranks), ("topk_ids", top_ids), ("topk_logprobs", top_logprobs))}})


def _info(model_config) -> dict:
    """What this server scores with: the final hidden states (a pooling server) or log-probs (a generating one)."""
    hidden = model_config.runner_type == "pooling"
    info = {"version": VERSION, "hidden_states": hidden}
    if hidden:
        info.update(hidden_size=model_config.get_hidden_size(), dtype=str(model_config.dtype).removeprefix("torch."))
    return info


def _sequences(body: dict) -> list:
    """The request's `sequences`, checked against its `score_from`."""
    sequences, score_from = body["sequences"], body["score_from"]
    if not (isinstance(sequences, list) and isinstance(score_from, list) and len(sequences) == len(score_from)):
        raise ValueError("sequences and score_from must be lists of the same length")
    for ids, start in zip(sequences, score_from, strict=True):
        if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
            raise ValueError("each sequence must be a list of token ids")
        if not (isinstance(start, int) and 1 <= start <= len(ids)):
            raise ValueError(f"score_from {start!r} must be in [1, {len(ids)}] (position 0 has no log-prob)")
    return sequences


# What travels: the model's own dtype, so no bit is lost or added; the client refuses another
_WIRE_DTYPES = ("float32", "bfloat16", "float16")


async def _hidden(request):
    """POST /opd/hidden: the final hidden states (the head's input) at the positions that predict each sequence's
    tokens from `score_from` on, as one (N, hidden) array in the served dtype."""
    try:
        body = await request.json()
        sequences, score_from = _sequences(body), body["score_from"]
    except (KeyError, TypeError, ValueError) as error:
        return JSONResponse({"error": f"bad /opd/hidden request: {error}"}, status_code=400)
    info = _info(request.app.state.engine_client.model_config)
    if not info["hidden_states"]:
        return JSONResponse({"error": "this server generates and cannot return hidden states: start it with "
                                      "`trl-opd serve-teacher MODEL --hidden-states`"}, status_code=400)
    if info["dtype"] not in _WIRE_DTYPES:
        return JSONResponse({"error": f"the model is served as {info['dtype']}; hidden states travel as one of "
                                      f"{', '.join(_WIRE_DTYPES)} (vLLM's --dtype)"}, status_code=400)
    import torch
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    params = PoolingParams(task="token_embed", use_activation=False)
    engine = request.app.state.engine_client
    try:
        pooled = await asyncio.gather(*(_pooled(engine, TokensPrompt(prompt_token_ids=ids), params)
                                        for ids in sequences))
    except ValueError as error:  # vLLM's own refusal: a sequence too long, ...
        return JSONResponse({"error": str(error)}, status_code=400)
    dtype = getattr(torch, info["dtype"])
    states = []
    for ids, start, data in zip(sequences, score_from, pooled, strict=True):
        if data.shape != (len(ids), info["hidden_size"]):
            return JSONResponse({"error": f"the engine pooled {tuple(data.shape)} for a sequence of {len(ids)}"},
                                status_code=500)
        states.append(data[start - 1 : -1].to(dtype))  # the state at i - 1 predicts token i
    flat = torch.cat(states).contiguous()
    raw = (flat.view(torch.int16) if dtype == torch.bfloat16 else flat).numpy()  # numpy has no bfloat16: its bits
    lengths = ",".join(str(len(ids) - start) for ids, start in zip(sequences, score_from, strict=True))
    return Response(raw.astype(raw.dtype.newbyteorder("<")).tobytes(), media_type="application/octet-stream",
                    headers={"X-OPD-Lengths": lengths, "X-OPD-Dtype": info["dtype"],
                             "X-OPD-Hidden-Size": str(info["hidden_size"])})


async def _pooled(engine, prompt, params):
    final = None
    async for output in engine.encode(prompt, params, request_id=f"opd-hidden-{uuid.uuid4().hex}"):
        final = output
    return final.outputs.data


async def _prompt_logprobs(engine, prompt, params):
    final = None
    async for output in engine.generate(prompt, params, request_id=f"opd-score-{uuid.uuid4().hex}"):
        final = output
    return final.prompt_logprobs


def _encode(arrays: list) -> str:
    if not arrays:
        return ""
    return base64.b64encode(np.concatenate(arrays).astype(arrays[0].dtype.newbyteorder("<")).tobytes()).decode()
