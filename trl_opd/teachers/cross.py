"""A teacher with its own tokenizer and chat template: it scores the text the student sampled, chunk by chunk.

Per row, the teacher reads its own rendering of the prompt (the same messages, through its chat template) and then
the student's completion as text, tokenised its way. The student's tokens and the teacher's are cut into chunks at
every byte offset where both end a token (`alignment.align_bytes`); the teacher's log-prob of a chunk (the sum over
its tokens) is returned on the chunk's last student token, with `chunk_ends` marking it, and every student token of
the chunk gets the chunk's advantage (`loss.opd_advantages`).

What is scored:
- Each run of tokens the student sampled is its own text: up to each stop token (the student's end of turn), which
  becomes the teacher's end of turn (the token its template closes an assistant turn with), a chunk of one token on
  each side.
- Runs the student did not sample (multi-turn observations and the template tokens around them) are context: the
  teacher reads their text, tokenised its way (special tokens it shares, such as ChatML's, are read as such), and no
  chunk is made of them.
- Bytes that spell no character (a completion cut inside a UTF-8 character, sampled bytes that form none) are read
  by the teacher as its single-byte tokens, which a byte-level vocabulary has for every byte. A teacher without a
  token for such a byte, or whose tokenizer changes the text (a normalizer), reads the run only up to there: its
  chunks end at the last common boundary before it, and the student tokens past it are not distilled.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import pad

from ..alignment import ByteVocabulary, align_bytes
from .base import TeacherScorer, TeacherScores

_MARKER = "OPD_END_OF_TURN_PROBE"


def end_of_turn_id(tokenizer) -> int:
    """The token the tokenizer's chat template closes an assistant message with (ChatML's `<|im_end|>`, Llama 3's
    `<|eot_id|>`, Gemma's `<end_of_turn>`), or its eos token when the template adds no special token there."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _MARKER}], tokenize=False
        )
        after = tokenizer(text[text.rindex(_MARKER) + len(_MARKER):], add_special_tokens=False)["input_ids"]
        if after and after[0] in special:
            return after[0]
    if tokenizer.eos_token_id is None:
        raise ValueError(f"The teacher's tokenizer ({tokenizer.name_or_path}) has no eos token and its chat template "
                         "closes no assistant turn with a special token, so the student's end of turn has no "
                         "counterpart to score. Give the tokenizer an eos_token.")
    return tokenizer.eos_token_id


def _runs(flags: list[int]):
    """(start, end, flag) for each maximal run of equal flags."""
    start = 0
    for end in range(1, len(flags) + 1):
        if end == len(flags) or flags[end] != flags[start]:
            yield start, end, flags[start]
            start = end


class CrossTokenizerTeacher:
    """Wraps a scorer of teacher token ids (`LocalTeacher`, `VLLMServerTeacher`) for a student with another
    tokenizer.

    Args:
        scorer: scores teacher token ids.
        student_tokenizer / teacher_tokenizer: fast tokenizers, each lossless on text (checked here).
        stop_ids: the student's end-of-turn token ids (GRPO's `eos_token_ids`).
        tools / chat_template_kwargs: passed to the teacher's chat template, as GRPO passes them to the student's.
    """

    def __init__(self, scorer: TeacherScorer, *, student_tokenizer, teacher_tokenizer, stop_ids,
                 tools=None, chat_template_kwargs=None):
        self.scorer = scorer
        self.student = ByteVocabulary.of(student_tokenizer)
        self.teacher = ByteVocabulary.of(teacher_tokenizer)
        self.student.check_lossless(role="student")
        self.teacher.check_lossless(role="teacher")
        self.teacher_tokenizer = self.teacher.tokenizer
        self.stop_ids = set(stop_ids)
        self.end_of_turn = end_of_turn_id(self.teacher_tokenizer)
        self.tools = tools or None
        self.chat_template_kwargs = chat_template_kwargs or {}

    def prompt_ids(self, prompt) -> list[int]:
        """The teacher's ids of one prompt: chat messages through its own chat template, text as its tokenizer
        reads text (special tokens added, as GRPO does for a text prompt)."""
        if isinstance(prompt, str):
            return self.teacher_tokenizer(text=prompt)["input_ids"]
        return self.teacher_tokenizer.apply_chat_template(
            prompt, tools=self.tools, add_generation_prompt=True, tokenize=True, return_dict=True,
            **self.chat_template_kwargs,
        )["input_ids"]

    def translate(self, ids: list[int], action: list[int]) -> tuple[list[int], list[int], list[int]]:
        """One completion (its tokens, without padding) in the teacher's tokens.

        Returns the teacher's completion ids, the chunk index of each of them and of each student token (-1: in no
        chunk, i.e. context or past the aligned text).
        """
        teacher_ids, teacher_chunk, student_chunk = [], [], [-1] * len(ids)
        chunks = 0
        for start, end, sampled in _runs(action):
            if not sampled:  # context: read by the teacher, never distilled
                context = self.teacher.encode_bytes(b"".join(self.student(ids[start:end])))
                teacher_ids += context
                teacher_chunk += [-1] * len(context)
                continue
            part = start
            for k in range(start, end + 1):
                if k < end and ids[k] not in self.stop_ids:
                    continue
                pieces = self.student(ids[part:k])
                text_ids = self.teacher.encode_bytes(b"".join(pieces))
                own, theirs, count = align_bytes(pieces, self.teacher(text_ids))
                student_chunk[part:k] = [c + chunks if c >= 0 else -1 for c in own]
                teacher_ids += text_ids
                teacher_chunk += [c + chunks if c >= 0 else -1 for c in theirs]
                chunks += count
                if k < end:  # the student's end of turn, scored as the teacher's
                    student_chunk[k] = chunks
                    teacher_ids.append(self.end_of_turn)
                    teacher_chunk.append(chunks)
                    chunks += 1
                part = k + 1
        return teacher_ids, teacher_chunk, student_chunk

    def side_by_side(self, ids: list[int], action: list[int], *, width: int = 110) -> str:
        """One completion in both tokenisations, a column per chunk (`·` between the tokens inside it) and ⟦...⟧
        around what is not distilled (context, or text past the aligned part), wrapped at `width` characters."""
        teacher_ids, teacher_chunk, student_chunk = self.translate(ids, action)

        def segments(vocabulary, token_ids, chunks):
            grouped = []
            for token, chunk in zip(token_ids, chunks, strict=True):
                piece = vocabulary([token])[0].decode(errors="backslashreplace").replace("\n", "\\n")
                if grouped and grouped[-1][0] == chunk:
                    grouped[-1][1].append(piece)
                else:
                    grouped.append((chunk, [piece]))
            return [(chunk, "·".join(pieces) if chunk >= 0 else f"⟦{''.join(pieces)}⟧") for chunk, pieces in grouped]

        ours, theirs = segments(self.student, ids, student_chunk), segments(self.teacher, teacher_ids, teacher_chunk)
        columns = []
        while ours or theirs:  # chunks come in the same order on both sides; context may stand on one side only
            if ours and theirs and ours[0][0] == theirs[0][0]:
                columns.append((ours.pop(0)[1], theirs.pop(0)[1]))
            elif ours and ours[0][0] < 0:
                columns.append((ours.pop(0)[1], ""))
            else:
                columns.append(("", theirs.pop(0)[1]))
        lines, student_line, teacher_line = [], "student |", "teacher |"
        for student_text, teacher_text in columns:
            size = max(len(student_text), len(teacher_text))
            if len(student_line) + size + 1 > width and student_line != "student |":
                lines += [student_line, teacher_line, ""]
                student_line, teacher_line = "student |", "teacher |"
            student_line += student_text.ljust(size) + "|"
            teacher_line += teacher_text.ljust(size) + "|"
        return "\n".join(lines + [student_line, teacher_line])

    @torch.no_grad()
    def score(self, prompts: list, completion_ids, completion_mask, action_mask) -> TeacherScores:
        """`prompts` are the rows' prompts as the teacher should read them (chat messages or text); `action_mask`
        (B, T) marks the tokens the student sampled."""
        device, valid = completion_ids.device, completion_mask.bool()
        rows = [self.translate(ids[keep].tolist(), action[keep].tolist())
                for ids, keep, action in zip(completion_ids, valid, action_mask, strict=True)]
        pad_id = self.teacher_tokenizer.pad_token_id
        pad_id = self.end_of_turn if pad_id is None else pad_id
        prompt_ids = [torch.tensor(self.prompt_ids(prompt)) for prompt in prompts]
        teacher_ids = [torch.tensor(row[0], dtype=torch.long) for row in rows]
        # the teacher's own completion, right-padded; a row with no tokens keeps one masked pad (never scored)
        teacher_completion = pad([ids if len(ids) else torch.tensor([pad_id]) for ids in teacher_ids],
                                 padding_value=pad_id).to(device)
        teacher_mask = pad([torch.ones(max(len(ids), 1), dtype=torch.long) * bool(len(ids)) for ids in teacher_ids],
                           padding_value=0).to(device)
        scores = self.scorer.score(
            pad(prompt_ids, padding_value=pad_id, padding_side="left").to(device),
            pad([torch.ones_like(ids) for ids in prompt_ids], padding_value=0, padding_side="left").to(device),
            teacher_completion, teacher_mask,
        )
        # each chunk's teacher log-prob: a sum over its teacher tokens (the last column collects the rest)
        num_chunks = max((max(row[1], default=-1) + 1 for row in rows), default=0)
        teacher_chunk = pad([torch.tensor(row[1] or [-1], dtype=torch.long) for row in rows],
                            padding_value=-1).to(device)
        teacher_chunk = torch.where(teacher_chunk >= 0, teacher_chunk, num_chunks)
        chunk_logps = torch.zeros(len(rows), num_chunks + 1, device=device).scatter_add_(
            1, teacher_chunk, torch.where(teacher_mask.bool(), scores.logps.float(), 0.0))
        student_chunk = torch.full(completion_ids.shape, -1, dtype=torch.long, device=device)
        student_chunk[valid] = torch.tensor([c for row in rows for c in row[2]], dtype=torch.long, device=device)
        aligned = student_chunk >= 0
        next_chunk = torch.cat([student_chunk[:, 1:], student_chunk.new_full((len(rows), 1), -1)], dim=1)
        chunk_ends = aligned & (next_chunk != student_chunk)
        logps = torch.where(chunk_ends, chunk_logps.gather(1, student_chunk.clamp(min=0)), 0.0)
        return TeacherScores(logps=logps, chunk_ends=chunk_ends, aligned=aligned)
