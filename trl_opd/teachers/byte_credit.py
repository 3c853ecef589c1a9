"""The byte credit of a cross-tokenizer teacher: both models' probability of the sampled text, byte by byte.

A teacher with another tokenizer cannot score the student's tokens, only the text they spell. The byte credit gives
each student token i, ending at byte `b_i` of its run of sampled text, the log-ratio of the two models' probabilities
that the text goes on with that token's bytes,

    A_i = [log P_T(text[:b_i]) - log P_T(text[:b_{i-1}])] - [log P_S(text[:b_i]) - log P_S(text[:b_{i-1}])],

where P_M(text[:b]) is model M's probability that its text starts with those bytes (whatever tokens spell them). The
two sides are computed the same way, each along its own tokenisation of the text (`prefix_credit`): the teacher along
its tokenisation of the run, from its scoring pass; the student along its sampled tokens, from the old policy's
forward (`student_prefix_shift`). So:

- **An identical teacher is a fixed point**: where the two read the text in the same tokens (the teacher is the student,
  read through its own tokenizer, or another one that tokenises the text the same way) every term is the same on both
  sides and every A_i is 0, not only their sum.
- **Sums are exact**: over a finished turn (an end of turn closes it: no token goes on past it) the A_i add up to
  `log pi_T(text) - log pi_S(text)` on the two token paths, and over any chunk to the text-level log-ratio of the
  chunk's bytes given the text before them.
- **Each token answers for its own bytes**: a student writing "1", "3" where the teacher writes " 13" is credited for
  each digit by both models' odds of a number starting so, and the two models' probabilities that the number stops
  after "13" meet at the student's next token, the one that decides it.

Written with the student's own log-prob, `A_i = (log pi_T-credit_i - shift_i) - log pi_old(s_i)`, where `shift_i` is
the student's extension term `e_S(i) - e_S(i-1)`, `e_S(i) = log P_S(text[:b_i]) - log pi_S(s_1..s_i)` (0 where no
student token starts with the bytes of s_i, always at an end of turn): the trainer subtracts it from the teacher's
values, so the advantage keeps its usual form `log pi_T - log pi_old`.

Each prefix probability sums, over the tokens j of the path that could be the first to cross b (the one b falls in,
and each one before it whose bytes and the next ones' up to b start some token), the probability of the path's tokens
before j times that of any token at j whose bytes start with the text from j up to b:

    P_M(text[:b]) = sum_j p_M(t_<j) * sum_{v: bytes(v) start with text[start_j : b]} p_M(v | t_<j).

(Left out, on both sides alike: paths that leave the model's own tokenisation more than once before b.) The state
carried from token to token (the mass of tokens that could go on) starts afresh at each run of sampled text: after
the prompt, after an end of turn, after context the student did not sample. A run that ends without an end of turn is
credited up to the probability that the text starts with it, whatever token comes next.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable

import torch

from ..alignment import ByteVocabulary
from ..heads import OutputHead, head_set_logps
from .base import TeacherScorer, TeacherScores
from .local import LocalTeacher

# A served teacher's extension mass is read from its most likely tokens at each position: vLLM's default cap
SERVED_EXTENSION_TOPK = 20


def token_anchors(pieces: list[bytes], path_pieces: list[bytes], chunk: list[int], *, offset: int,
                  stop: bool = False) -> list:
    """For each student token of one run of text: (k, the position from `offset` of the path token its last byte
    falls in, b, where that byte ends in the text, the text) or None for a token in no chunk (or of no bytes). The
    text is (its bytes, where each path token starts, `offset`), one object shared by the run's tokens. The path is
    the teacher's tokens of the run, or the student's own (`path_pieces` = `pieces`). With `stop`, one more anchor
    for the end of turn that closes the run, the path token right after it: (its position, None, the text)."""
    text = (b"".join(pieces), [0, *itertools.accumulate(len(piece) for piece in path_pieces)], offset)
    anchors = []
    for end, piece, index in zip(itertools.accumulate(len(piece) for piece in pieces), pieces, chunk, strict=True):
        if index < 0 or not piece:
            anchors.append(None)
            continue
        k = bisect.bisect_left(text[1], end) - 1  # the last path token starting before b
        anchors.append((offset + k, end, text))
    return anchors + [(offset + len(path_pieces), None, text)] * stop


def prefix_credit(vocabulary: ByteVocabulary, rows: list, path_logps: torch.Tensor,
                  set_logps: Callable[[list], list[float]]) -> list[dict[int, float]]:
    """Each anchored student token's `log P(text[:b_i]) - log P(text[:b_{i-1}])` along one model's path.

    Args:
        vocabulary: the path's tokens as bytes.
        rows: per row, (the path's token ids, each student token's anchor (see `token_anchors`)).
        path_logps: (B, L) the model's log-prob of each path token; 0 on tokens outside every chunk (context).
        set_logps: the model's log-probability of each query (row, path position, token ids): of any of those tokens
            there.

    Returns, per row, {student token index: its credit}, in order.
    """
    path_logps = path_logps.float().cpu()
    prefixes, queries = [], []  # each anchored token: (its path end, its terms (path position, query index))
    for row, (path_ids, anchors) in enumerate(rows):
        prefixes.append({})
        for i, anchor in enumerate(anchors):
            if anchor is None:
                continue
            k, end, text = anchor
            terms = [] if end is None else _crossing_terms(vocabulary, path_ids, k, end, text)  # None: an end of turn
            if all(j == k and ids == [path_ids[k]] for j, ids in terms):  # the path token itself
                prefixes[row][i] = (k + 1, [], text)
                continue
            prefixes[row][i] = (k, [(j, len(queries) + n) for n, (j, _) in enumerate(terms)], text)
            queries += [(row, j, ids) for j, ids in terms]
    masses = set_logps(queries)
    credits = []
    for row, row_prefixes in enumerate(prefixes):
        credits.append({})
        end, mass, current = 0, 0.0, None
        for i, (next_end, terms, text) in row_prefixes.items():
            if text is not current:  # a new run of sampled text: nothing carried into it
                end, mass, current = text[2], 0.0, text
            # each term j: log p(t_j .. t_{k-1}) below the tokens before k, so log p(extensions at j) - those
            next_mass = torch.tensor([masses[q] - path_logps[row, j:next_end].sum() for j, q in terms]).logsumexp(0)
            next_mass = next_mass.item() if terms else 0.0
            credits[row][i] = (path_logps[row, end:next_end].sum() + (next_mass - mass)).item()
            end, mass = next_end, next_mass
    return credits


def _crossing_terms(vocabulary: ByteVocabulary, path_ids: list[int], k: int, end: int, text) -> list:
    """The path tokens j that could be the first to cross byte `end` (from the one it falls in, `k`, back to the
    first one before it at which no token starts with the text up to `end`), each with those tokens' ids."""
    data, starts, offset = text
    terms = []
    for j in range(k - offset, -1, -1):
        ids = vocabulary.extensions(data[starts[j] : end])
        if j == k - offset and path_ids[k] not in ids:  # an added token in the text is its own
            ids = [*ids, path_ids[k]]
        if not ids:
            break
        terms.append((offset + j, ids))
    return terms


def byte_credit(teacher: ByteVocabulary, scorer: TeacherScorer, scores: TeacherScores, rows: list, in_chunk, valid,
                aligned, chunk_ends) -> TeacherScores:
    """The teacher's side of the byte credit: each aligned student token's `log P_T(text[:b_i]) -
    log P_T(text[:b_{i-1}])` along the teacher's tokens. `rows` are `CrossTokenizerTeacher._translate`'s."""
    scored = torch.where(in_chunk, scores.logps.float(), 0.0)  # (B, T_teacher), context and padding 0
    credits = prefix_credit(teacher, [(row[0], row[3]) for row in rows], scored,
                            lambda queries: _set_logps(scorer, scores, queries, rows))
    logps = torch.zeros(valid.shape)
    for row, row_credits in enumerate(credits):
        positions = valid[row].nonzero().flatten().tolist()
        for i, value in row_credits.items():
            logps[row, positions[i]] = value
    logps = logps.to(valid.device)
    return TeacherScores(logps=torch.where(aligned, logps, 0.0), aligned=aligned, text_chunk_ends=chunk_ends)


def student_prefix_shift(vocabulary: ByteVocabulary, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                         sampled: torch.Tensor, stop_ids, token_logps: torch.Tensor, hidden: torch.Tensor,
                         head: OutputHead) -> torch.Tensor:
    """The student's side of the byte credit, as a shift of the teacher's values: `e_S(i) - e_S(i-1)` per sampled
    token (B, T), from the old policy's log-probs of the sampled tokens `token_logps` (B, T) and its final hidden
    states before each completion token `hidden` (B, T, H) with its `head`. Every process projects (a collective
    under ZeRO-3), even with nothing to ask."""
    rows = []
    for ids, keep, action in zip(completion_ids.tolist(), completion_mask.bool().tolist(), sampled.tolist(),
                                 strict=True):
        anchors = [None] * len(ids)
        for start, end, stop in sampled_parts(ids, [a if k else 0 for a, k in zip(action, keep, strict=True)],
                                              stop_ids):
            pieces = vocabulary(ids[start:end])
            anchors[start : end + stop] = token_anchors(pieces, pieces, [0] * len(pieces), offset=start, stop=stop)
        rows.append((ids, anchors))
    scored = torch.where(sampled.bool() & completion_mask.bool(), token_logps.float(), 0.0)
    width = hidden.size(1)
    flat = hidden.flatten(0, 1)
    credits = prefix_credit(vocabulary, rows, scored, lambda queries: head_set_logps(
        flat, head, [row * width + j for row, j, _ in queries], [torch.tensor(ids) for *_, ids in queries]))
    shift = torch.zeros(completion_ids.shape)
    for row, row_credits in enumerate(credits):
        for i, value in row_credits.items():
            shift[row, i] = value - scored[row, i].item()
    return shift.to(completion_ids.device)


def sampled_parts(ids: list[int], action: list[int], stop_ids):
    """(start, end, stopped) for each run of sampled tokens between stop tokens: `ids[start:end]` is its text, and
    `ids[end]` the stop token that closes it if `stopped`. Each is a text of its own for the byte credit."""
    position = 0
    for sampled, group in itertools.groupby(action):
        length = len(list(group))
        if sampled:
            part = position
            for k in range(position, position + length + 1):
                if k < position + length and ids[k] not in stop_ids:
                    continue
                stopped = k < position + length
                if k > part or stopped:
                    yield part, k, stopped
                part = k + 1
        position += length


def _set_logps(scorer: TeacherScorer, scores: TeacherScores, queries: list, rows: list) -> list[float]:
    """For each query (row, teacher position, token ids): the teacher's log-probability of any of those tokens
    there. Exact from a local teacher's final states; from a served teacher's top entries plus the scored token,
    a lower bound that misses only what lies outside its top `SERVED_EXTENSION_TOPK`."""
    if isinstance(scorer, LocalTeacher):  # every process projects, even nothing, as ZeRO-3 needs
        hidden = scores.hidden.flatten(0, 1)
        width = scores.hidden.size(1)
        return head_set_logps(hidden, scorer.output_head, [row * width + j for row, j, _ in queries],
                              [torch.tensor(ids, dtype=torch.long) for *_, ids in queries])
    masses = []
    for row, j, ids in queries:
        entries = dict(zip(scores.topk_ids[row, j].tolist(), scores.topk_logps[row, j].tolist(), strict=True))
        entries[rows[row][0][j]] = scores.logps[row, j].item()
        allowed = set(ids)
        found = [logp for token, logp in entries.items() if token in allowed]
        masses.append(torch.tensor(found).logsumexp(0).item() if found else -math.inf)
    return masses
