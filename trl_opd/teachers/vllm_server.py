"""A teacher behind one or more vLLM OpenAI-compatible servers, over plain HTTP (the client needs no vllm).

Each sequence (prompt + student completion, as token ids) is scored through `trl-opd serve-teacher`'s compact
endpoint (`/opd/score`, `trl_opd/server_route`) where the server has it, else as a prompt of the stock
`/v1/completions` with `prompt_logprobs` (`completions_response` reads that answer). Start a server with
`trl-opd serve-teacher MODEL`.

vLLM refuses a prompt that leaves no room for one output token, whatever the request asks for, so a sequence can be
at most the server's `--max-model-len` less one token long.
"""

from __future__ import annotations

import base64
import itertools
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests
import torch

from ..secrets import mask_urls, masked
from .base import SourceSupport, TeacherScores
from .completions_response import completion_entries, completion_payload, read_entries
from .server_errors import TeacherServerError, reading

logger = logging.getLogger(__name__)
WAIT_NOTE_EVERY = 10.0  # seconds between the lines that say a start-up wait goes on

# A probe that exercises words, digits, punctuation and whitespace, for the tokenizer comparison
_TOKENIZER_PROBE = "Distil: 12 + 7 = 19, isn't it?\n  The answer is 19."


def is_server_url(name) -> bool:
    return isinstance(name, str) and name.startswith(("http://", "https://"))


# host:port with no scheme (a server address missing its http://), and a scheme other than http(s)
_BARE_ADDRESS = re.compile(r"^(localhost|\d{1,3}(\.\d{1,3}){3}|[\w-]+(\.[\w-]+)+|\[[0-9a-fA-F:]+\]):\d+(/.*)?$")
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def check_server_address(option: str, value) -> None:
    """A teacher named as a server must be an http(s) URL; a path or Hub id is not checked here."""
    if not isinstance(value, str):
        return
    scheme = _SCHEME.match(value)
    if scheme and scheme.group(1).lower() not in ("http", "https"):
        raise ValueError(
            f"{option} {masked(value)!r} uses the scheme {scheme.group(1)!r}: teacher servers are reached over "
            "http:// or https://."
        )
    if not scheme and _BARE_ADDRESS.match(value):
        raise ValueError(
            f"{option} {masked(value)!r} looks like a server address without its scheme: write "
            f"'http://{masked(value)}' (or https://). As written it would be read as a model path or Hub id."
        )


def is_served(source) -> bool:
    """A teacher given as a server URL or a list of them."""
    return is_server_url(source) or (isinstance(source, list) and all(is_server_url(url) for url in source))


def served_urls(args) -> list[str]:
    """The served teacher's server URLs: `teacher_server_url`, or a URL given as `teacher_model_name_or_path`."""
    return args.teacher_server_url or [args.teacher_model_name_or_path]


SUPPORT = SourceSupport(
    name="served",
    chooses=("teacher_server_url",),
    option="a served teacher (teacher_server_url)",
    estimators=("sampled", "topk", "full"),
    off_trainer=True,
    own_tokenizer=True,
    teacher_temperature=True,
    not_loaded="a served teacher is loaded by its server (serve-teacher's options set its dtype)",
    default_estimator="servers",
    returns="log-probs, top-1, top-k; final hidden states from `serve-teacher --hidden-states` (`served_hidden.py`)",
    describe=lambda args: "served by vLLM at " + ", ".join(masked(served_urls(args))),
)

class VLLMServerTeacher:
    """Scores completions with vLLM servers at `urls`, spreading each batch across them concurrently.

    Args:
        urls: base URLs, e.g. `http://127.0.0.1:8000`.
        batch_size: sequences per request.
        timeout: (connect, read) seconds per request.
        max_retries: retries of a request after a connection error, a timeout or a 5xx answer, with exponential
            backoff from `backoff` seconds. A 4xx answer is not retried.
        api_key: sent as a bearer token (vLLM's `--api-key`); never logged or put in an error message.
        startup_timeout: seconds `connect` waits for a server that refuses connections or answers 503 (still
            loading its model: minutes for a large teacher) before giving up.
        topk: also read the teacher's k most likely tokens at each position (the topk estimator). The server must
            allow k (vLLM's `--max-logprobs`; `trl-opd serve-teacher` sets 20).
    """

    def __init__(
        self,
        urls: str | list[str],
        *,
        batch_size: int = 8,
        timeout: tuple[float, float] = (5.0, 300.0),
        max_retries: int = 3,
        backoff: float = 1.0,
        api_key: str | None = None,
        topk: int = 0,
        startup_timeout: float = 240.0,
    ):
        self.urls = [url.rstrip("/") for url in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("VLLMServerTeacher needs at least one server URL.")
        self.batch_size, self.timeout, self.max_retries, self.backoff = batch_size, timeout, max_retries, backoff
        self.topk, self.startup_timeout = topk, startup_timeout
        self._session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=4 * len(self.urls))
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"
        self._pool = ThreadPoolExecutor(max_workers=2 * len(self.urls), thread_name_prefix="opd-teacher")
        self.models: dict[str, str] = {}  # url -> served model id, filled by `connect`
        # url -> whether it has `trl-opd serve-teacher`'s compact scoring endpoint (`/opd/score`), filled by `connect`
        self.compact: dict[str, bool] = {}
        self.max_model_lens: dict[str, int] = {}  # url -> the server's --max-model-len, where `connect` could read it
        self.info: dict[str, dict] = {}  # url -> its /opd/info answer (a `trl-opd serve-teacher` server), by `connect`

    @classmethod
    def from_env(cls, urls, *, api_key_env: str | None, **kwargs) -> VLLMServerTeacher:
        return cls(urls, api_key=os.environ.get(api_key_env) if api_key_env else None, **kwargs)

    # ------------------------------------------------------------------ HTTP

    def _request(self, method: str, url: str, path: str, payload: dict | None = None, *, raw: bool = False):
        """The JSON object `url` answers (with `raw`, the response itself), retried as the class says."""
        last = "no attempt"
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self._session.request(method, url + path, json=payload, timeout=self.timeout)
            except (requests.ConnectionError, requests.Timeout) as error:
                last = f"{type(error).__name__}"
                continue
            if response.status_code >= 500:
                last = f"HTTP {response.status_code}"
                continue
            if response.status_code >= 400:
                raise TeacherServerError(
                    f"Teacher server {url} refused {method} {path}: HTTP {response.status_code}: {response.text[:300]}"
                )
            if raw:
                return response
            if not response.content:
                return {}
            try:
                answer = response.json()
            except ValueError:
                raise TeacherServerError(
                    f"Teacher server {url} answered {method} {path} with HTTP {response.status_code} but not JSON: "
                    f"{response.text[:200]!r}. Is this URL a vLLM server?"
                ) from None
            if not isinstance(answer, dict):
                raise TeacherServerError(
                    f"Teacher server {url} answered {method} {path} with {type(answer).__name__} JSON, expected an "
                    f"object: {response.text[:200]!r}."
                )
            return answer
        raise TeacherServerError(
            f"Teacher server {url} did not answer {method} {path} after {self.max_retries + 1} attempts "
            f"(last: {last}). Is it running? Start one with `trl-opd serve-teacher MODEL`."
        )

    # ------------------------------------------------------------------ start-up

    def connect(self, tokenizer, *, student_name: str, cross_tokenizer: bool = False) -> None:
        """Check every server is healthy, tokenizes like `tokenizer` and scores a probe. Raises before training.

        `tokenizer` is the student's, or with `cross_tokenizer` the teacher's own (named by `student_name` then). The
        probe request also warms the server up (its first scoring request is the slow one).
        """
        whose = "the teacher tokenizer" if cross_tokenizer else "the student"
        why = ("teacher_tokenizer_name_or_path must be the served model's tokenizer." if cross_tokenizer else
               "The teacher scores the student's token ids as they are, so both must share one vocabulary (or set "
               "teacher_tokenizer_mode: cross for a teacher from another model family).")
        expected = tokenizer(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
        for url in self.urls:
            self._wait_until_up(url)
            answer = self._request("GET", url, "/v1/models")
            with reading(url, "/v1/models", answer):
                served_model = answer["data"][0]
                model = self.models[url] = str(served_model["id"])
            if isinstance(served_model.get("max_model_len"), int):  # vLLM reports it; other servers may not
                self.max_model_lens[url] = served_model["max_model_len"]
            answer = self._request(
                "POST", url, "/tokenize", {"model": model, "prompt": _TOKENIZER_PROBE, "add_special_tokens": False}
            )
            with reading(url, "/tokenize", answer):
                served = list(answer["tokens"])
            if served != expected:
                position = _first_difference(served, expected)
                raise ValueError(
                    f"The teacher served at {mask_urls(url)} ({model}) tokenizes differently from {whose} "
                    f"({student_name}): on the probe {_TOKENIZER_PROBE!r}, token {position} is "
                    f"{served[position] if position < len(served) else None} on the server and "
                    f"{expected[position] if position < len(expected) else None} for {whose}. {why}"
                )
            # every special and added token (chat markers such as <|im_end|>, <think>, tool tags) and bos/eos
            added = [t.content for _, t in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())]
            for token in dict.fromkeys([tokenizer.eos_token, tokenizer.bos_token, *added]):
                if token is None:
                    continue
                answer = self._request("POST", url, "/tokenize", {"model": model, "prompt": token,
                                                                  "add_special_tokens": False})
                with reading(url, "/tokenize", answer):
                    ids = list(answer["tokens"])
                if ids != [tokenizer.convert_tokens_to_ids(token)]:
                    raise ValueError(
                        f"The teacher served at {mask_urls(url)} ({model}) does not read {whose}'s special token "
                        f"{token!r} as id {tokenizer.convert_tokens_to_ids(token)} (it reads {ids})."
                    )
            self.compact[url] = self._has_compact_endpoint(url)
            self._check_scoring_kind(url)
            try:
                self._score_chunk(url, [expected[:1]], [expected[1:]], first_index=0)
            except TeacherServerError as error:
                if self.topk and "HTTP 400" in str(error):
                    raise TeacherServerError(
                        f"{error}\nThe teacher is asked for its {self.topk} most likely tokens per position (the "
                        f"topk estimator's opd_topk, or a cross-tokenizer teacher's byte credit): start the server "
                        f"with --max-logprobs {self.topk} or more, or lower opd_topk (or set teacher_cross_credit: "
                        f"chunk)."
                    ) from error
                raise

    def _wait_until_up(self, url: str) -> None:
        """Until `url`/health answers 200, for at most `startup_timeout` seconds: a server that is still loading its
        model refuses connections or answers 503. Any other answer is passed on as `_request` reads it."""
        start = time.monotonic()
        deadline, next_note, noted = start + self.startup_timeout, start, False
        while True:
            try:
                response = self._session.get(url + "/health", timeout=self.timeout)
                if response.status_code == 200:
                    if noted:
                        logger.warning("Teacher server %s is up, after %.0f s.", mask_urls(url),
                                       time.monotonic() - start)
                    return
                if response.status_code != 503:
                    break
                last = "HTTP 503: loading its model"
            except (requests.ConnectionError, requests.Timeout) as error:
                last = f"{type(error).__name__}: nothing answers yet"
            now = time.monotonic()
            if now >= next_note and now < deadline:  # never a silent wait
                logger.warning("Waiting for the teacher server %s (%s): %.0f s of at most %g s "
                               "(teacher_server_startup_timeout).", mask_urls(url), last, now - start,
                               self.startup_timeout)
                next_note, noted = now + WAIT_NOTE_EVERY, True
            if now >= deadline:
                raise TeacherServerError(
                    f"Teacher server {url} was not up after {self.startup_timeout:g} s (last: {last}). Is it running? "
                    "Start one with `trl-opd serve-teacher MODEL`; a large teacher takes minutes to load: raise "
                    "teacher_server_startup_timeout to wait longer."
                )
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        self._request("GET", url, "/health")  # any other answer: an error as every request reports it

    # ------------------------------------------------------------------ scoring

    def _has_compact_endpoint(self, url: str) -> bool:
        """Whether the server answers `/opd/info` (a server started by `trl-opd serve-teacher`): its `/opd/score`
        returns only the scored positions, as arrays. Any other vLLM server is scored through `/v1/completions`."""
        try:
            answer = self._request("GET", url, "/opd/info")
        except TeacherServerError as error:
            if "HTTP 404" in str(error):
                return False
            raise
        self.info[url] = answer
        return answer.get("version") == 1

    def _check_scoring_kind(self, url: str) -> None:
        """A server that returns hidden states (`serve-teacher --hidden-states`) gives no log-probs itself."""
        if self.info.get(url, {}).get("hidden_states"):
            raise TeacherServerError(
                f"Teacher server {url} returns the teacher's hidden states (started with --hidden-states), not "
                "log-probs: score through it with its head (`HiddenStateTeacher`, which the trainer chooses for such "
                "a server), or start it without --hidden-states."
            )

    def _score_chunk(self, url: str, prompts: list[list[int]], completions: list[list[int]], first_index: int):
        """Per sequence: the teacher's log-prob of each completion token (n,), whether it is the argmax (n,) or None
        when the server does not say, and its top `topk` ids and log-probs (n, k)."""
        if self.compact.get(url):
            return self._score_compact(url, prompts, completions, first_index)
        sequences = [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]
        answer = self._request("POST", url, "/v1/completions",
                               completion_payload(self.models.get(url, ""), sequences, topk=self.topk))
        scored = []
        for i, entries in enumerate(completion_entries(answer, url=url, count=len(sequences), first_index=first_index)):
            values, ranks, top = read_entries(entries, prompts[i], completions[i], index=first_index + i, url=url,
                                              topk=self.topk)
            n = len(values)
            scored.append((torch.tensor(values, dtype=torch.float32),
                           None if ranks is None else torch.tensor(ranks) == 1,
                           torch.tensor([[token for token, _ in row] for row in top], dtype=torch.long).view(n, -1),
                           torch.tensor([[logp for _, logp in row] for row in top]).view(n, -1)))
        return scored

    def _score_compact(self, url: str, prompts: list[list[int]], completions: list[list[int]], first_index: int):
        """`_score_chunk` through the compact endpoint (`trl_opd/server_route`)."""
        answer = self._request("POST", url, "/opd/score", {
            "sequences": [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)],
            "score_from": [len(prompt) for prompt in prompts], "topk": self.topk})
        with reading(url, "/opd/score", answer):
            lengths = [int(n) for n in answer["lengths"]]
            arrays = {name: torch.from_numpy(np.frombuffer(base64.b64decode(answer[name]), dtype=dtype).copy())
                      for name, dtype in (("logprobs", "<f4"), ("ranks", "<i4"), ("topk_ids", "<i4"),
                                          ("topk_logprobs", "<f4"))}
        expected = [len(completion) for completion in completions]
        total = sum(expected)
        if lengths != expected or any(len(arrays[name]) != total * width for name, width in (
                ("logprobs", 1), ("ranks", 1), ("topk_ids", self.topk), ("topk_logprobs", self.topk))):
            raise TeacherServerError(
                f"Teacher server {url} answered /opd/score for sequences {first_index}.."
                f"{first_index + len(prompts) - 1} with {lengths} scored positions, expected {expected} (one per "
                f"completion token, {self.topk} top entries each)."
            )
        bad = ~torch.isfinite(arrays["logprobs"])
        if bad.any():
            flat = int(bad.nonzero()[0])
            row = next(i for i, end in enumerate(itertools.accumulate(expected)) if flat < end)
            raise TeacherServerError(
                f"Teacher server {url}: sequence {first_index + row}, completion position {flat - sum(expected[:row])} "
                f"has log-prob {arrays['logprobs'][flat].item()}: expected a finite number."
            )
        values, ranks = arrays["logprobs"].split(expected), arrays["ranks"].split(expected)
        top_ids = arrays["topk_ids"].long().view(total, self.topk).split(expected)
        top_logps = arrays["topk_logprobs"].view(total, self.topk).split(expected)
        return [(v, r == 1, ids, logps) for v, r, ids, logps in zip(values, ranks, top_ids, top_logps, strict=True)]

    def _check_fits(self, url: str, prompt_length: int, completion_length: int, *, index: int) -> None:
        """Raise if a sequence is too long for the server at `url` (it keeps one position for an output token)."""
        limit = self.max_model_lens.get(url)
        if limit is None or prompt_length + completion_length < limit:
            return
        raise TeacherServerError(
            f"Teacher server {url} cannot score sequence {index}: its prompt ({prompt_length} tokens) plus completion "
            f"({completion_length} tokens) is {prompt_length + completion_length} tokens, and a server started with "
            f"--max-model-len {limit} scores at most {limit - 1} (vLLM keeps one position for an output token). "
            f"Restart the server with --max-model-len {prompt_length + completion_length + 1} or more (the longest "
            "prompt plus max_completion_length, plus one), or lower max_completion_length or shorten the prompts."
        )

    def _submit(self, score_chunk, prompt_ids, prompt_mask, completion_ids, completion_mask) -> list:
        """`score_chunk(url, prompts, completions, first_index)` on chunks of `batch_size` sequences, spread across
        the servers and run concurrently: (row indices, future) per chunk. Fully masked rows are not sent."""
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        completions = [ids[mask.bool()].tolist() for ids, mask in zip(completion_ids, completion_mask, strict=True)]
        scored = [i for i in range(len(completions)) if completions[i]]  # nothing to score in an empty completion
        chunks = []
        for chunk_number, start in enumerate(range(0, len(scored), self.batch_size)):
            indices = scored[start : start + self.batch_size]
            url = self.urls[chunk_number % len(self.urls)]
            for i in indices:
                self._check_fits(url, len(prompts[i]), len(completions[i]), index=i)
            chunks.append((indices, url))
        # sent only once every sequence is known to fit: a refused one would fail its whole chunk with a vLLM message
        return [(indices, self._pool.submit(score_chunk, url, [prompts[i] for i in indices],
                                            [completions[i] for i in indices], indices[0]))
                for indices, url in chunks]

    def score(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> TeacherScores:
        rows, num_completion = completion_ids.shape
        futures = self._submit(self._score_chunk, prompt_ids, prompt_mask, completion_ids, completion_mask)
        logps = torch.zeros(rows, num_completion)
        is_top1 = torch.zeros(rows, num_completion, dtype=torch.bool)
        topk_ids = torch.zeros(rows, num_completion, self.topk, dtype=torch.long)
        topk_logps = torch.zeros(rows, num_completion, self.topk)
        has_rank = True
        for indices, future in futures:
            for i, (values, top1, top_ids, top_logps) in zip(indices, future.result(), strict=True):
                n = len(values)
                logps[i, :n] = values
                if top1 is None:
                    has_rank = False
                else:
                    is_top1[i, :n] = top1
                topk_ids[i, :n], topk_logps[i, :n] = top_ids, top_logps
        device = completion_ids.device
        scores = TeacherScores(logps=logps.to(device), is_top1=is_top1.to(device) if has_rank else None)
        if self.topk:
            scores.topk_ids, scores.topk_logps = topk_ids.to(device), topk_logps.to(device)
        return scores


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
