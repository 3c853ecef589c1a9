"""The byte credit of a cross-tokenizer teacher: each student token's teacher log-prob by the byte-level chain rule.

`CrossTokenizerTeacher` aligns the two tokenisations and scores the teacher's tokens, recording where each student
token's bytes end among the teacher's tokens (`token_anchors`); `byte_credit` turns those scores, and the teacher's
distribution where a teacher token could go on past a student token's last byte, into one value per student token.
"""

from __future__ import annotations

import bisect
import itertools
import math

import torch

from ..alignment import ByteVocabulary
from ..heads import head_set_logps
from .base import TeacherScorer, TeacherScores
from .local import LocalTeacher

# A served teacher's extension mass is read from its most likely tokens at each position: vLLM's default cap
SERVED_EXTENSION_TOPK = 20


def token_anchors(pieces: list[bytes], teacher_pieces: list[bytes], chunk: list[int], *, offset: int) -> list:
    """For each student token of one text: (k, the position from `offset` of the teacher token its last byte falls
    in, b, where that byte ends in the text, the text) or None for a token in no chunk (or of no bytes). The text is
    (its bytes, where each teacher token starts, `offset`), one object shared by the text's tokens."""
    text = (b"".join(pieces), [0, *itertools.accumulate(len(piece) for piece in teacher_pieces)], offset)
    anchors = []
    for end, piece, index in zip(itertools.accumulate(len(piece) for piece in pieces), pieces, chunk, strict=True):
        if index < 0 or not piece:
            anchors.append(None)
            continue
        k = bisect.bisect_left(text[1], end) - 1  # the last teacher token starting before b
        anchors.append((offset + k, end, text))
    return anchors


def byte_credit(teacher: ByteVocabulary, scorer: TeacherScorer, scores: TeacherScores, rows: list, in_chunk, valid,
                aligned, chunk_ends) -> TeacherScores:
    """Each aligned student token's teacher log-prob by the byte-level chain rule, `log P_T(text[:b_i]) -
    log P_T(text[:b_{i-1}])`, where `b_i` is where token i ends and P_T(text[:b]) is the teacher's probability
    that its text starts with those bytes: the sum over the teacher tokens j that could be the first to cross b
    (the one b falls in, or one before it) of the probability of the teacher's tokens before j times that of any
    token at j whose bytes start with the text from j up to b,

        P_T(text[:b]) = sum_j p_T(t_<j) * sum_{v: bytes(v) start with text[start_j : b]} p_T(v | t_<j).

    (Left out: paths that leave the teacher's own tokenisation of the text more than once before b, and a j
    before the first one, going back from b, at which no token starts with the text up to b; a teacher gives
    them next to nothing.) Where only the token b falls in can cross it, and no other token
    starts with its bytes up to b, this is the teacher tokens' own log-prob; always so at an end of turn.

    So a student token is credited with the teacher's probability of its own bytes given the text before them,
    and the teacher's probability that a token stops where the student's next token goes on (a number or a word
    ends) goes to that next token, the one that decides it. Over a finished completion the values add up to
    the log-prob of its text.
    """
    scored = torch.where(in_chunk, scores.logps.float(), 0.0).cpu()  # (B, T_teacher), context and padding 0
    # each anchored student token's log P_T as (teacher tokens before `end`, summed) + `mass`
    prefixes, queries = [], []  # queries: (row, teacher position, extension ids), asked of the teacher
    for row, (teacher_ids, _, _, anchors) in enumerate(rows):
        prefixes.append({})
        for i, anchor in enumerate(anchors):
            if anchor is None:
                continue
            k, end, text = anchor
            terms = []  # the teacher tokens that could cross b, back to the first one before k that none can
            if text is not None:  # not an end of turn
                data, starts, offset = text
                for j in range(k - offset, -1, -1):
                    ids = teacher.extensions(data[starts[j] : end])
                    if j == k - offset and teacher_ids[k] not in ids:  # an added token in the text is its own
                        ids = [*ids, teacher_ids[k]]
                    if not ids:
                        break
                    terms.append((offset + j, ids))
            if all(j == k and ids == [teacher_ids[k]] for j, ids in terms):  # the token itself
                prefixes[row][i] = (k + 1, [])
                continue
            prefixes[row][i] = (k, [(j, len(queries) + n) for n, (j, _) in enumerate(terms)])
            queries += [(row, j, ids) for j, ids in terms]
    masses = _set_logps(scorer, scores, queries, rows)
    logps = torch.zeros(valid.shape)
    for row, row_prefixes in enumerate(prefixes):
        positions = valid[row].nonzero().flatten().tolist()
        end, mass = 0, 0.0
        for i, (next_end, terms) in row_prefixes.items():
            # each term j: log p_T(t_j .. t_{k-1}) below the tokens before k, so log p(extensions at j) - those
            next_mass = torch.tensor([masses[q] - scored[row, j:next_end].sum() for j, q in terms]).logsumexp(0)
            next_mass = next_mass.item() if terms else 0.0
            logps[row, positions[i]] = scored[row, end:next_end].sum() + (next_mass - mass)
            end, mass = next_end, next_mass
    logps = logps.to(valid.device)
    return TeacherScores(logps=torch.where(aligned, logps, 0.0), aligned=aligned, text_chunk_ends=chunk_ends)

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
