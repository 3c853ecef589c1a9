"""A teacher with its own tokenizer and chat template: it scores the text the student sampled.

Per row, the teacher reads its own rendering of the prompt (the same messages, through its chat template) and then
the student's completion as text, tokenised its way. The student's tokens and the teacher's are cut into chunks at
every byte offset where both end a token (`alignment.align_bytes`): over a chunk both sides spell the same bytes
after the same text, and the chunks' log-prob differences add up to `log pi_T(text) - log pi_S(text)`. Inside a
chunk, the teacher's log-prob is shared among the student's tokens one of two ways (`credit`):

- `byte` (the default): each student token gets both models' probability that the text goes on with its bytes,
  given the text before them: the teacher's along its own tokens, read from its whole next-token distribution where
  a teacher token could go on (`byte_credit`), less the student's, read the same way along the student's tokens
  (the trainer's old-policy forward, `byte_credit.student_prefix_shift`). A student that writes "1", "3" where the
  teacher writes " 13" is credited for each digit, and the two models' probabilities that the number stops after
  "13" meet at the student token after it, which decides that. An identical teacher gives every token 0.
- `chunk`: the chunk's log-prob stands on its last student token (`chunk_ends`) and every token of the chunk gets
  the chunk's advantage (`loss.opd_advantages`), which also credits each token with the choices after it in the
  chunk. On the addition task, with a teacher that writes numbers in multi-digit tokens, this drifts away from the
  teacher where `byte` learns (benchmarks/cross_tokenizer.py).

What is scored:
- Each run of tokens the student sampled is its own text: up to each stop token (the student's end of turn), which
  becomes the teacher's end of turn (the token its template closes an assistant turn with), a chunk of one token on
  each side. The text is read as plain text: characters that spell a special token (a student writing `<`, `|`,
  `im`, `_end`, ... ) are read as those characters, never as the teacher's token; a special token the student
  sampled as such is the teacher's token of the same text where it has one (`<|im_start|>`), else its text.
  Where both vocabularies spell every id alike, the teacher reads the student's own ids.
- Runs the student did not sample are context, and no chunk is made of them. Between two of the student's turns
  (multi-turn observations and the template tokens around them) the teacher reads its own rendering of the
  observations: the completion's messages through its chat template (`observations`), from its end of turn to its
  next assistant header. Before the first sampled token (a prefill of the turn) and where a chat prompt's completion
  comes without its messages (a text prompt), it reads the context's text, tokenised its way. Context after the last
  sampled token changes no score and is not sent.
- Bytes that spell no character (a completion cut inside a UTF-8 character, sampled bytes that form none) are read
  by the teacher as its single-byte tokens, which a byte-level vocabulary has for every byte. A teacher without a
  token for such a byte, or whose tokenizer changes the text (a normalizer), reads the run only up to there: its
  chunks end at the last common boundary before it, and the student tokens past it are not distilled.
"""

from __future__ import annotations

import itertools

import torch
from trl.trainer.utils import pad

from ..alignment import ByteVocabulary, align_bytes
from .base import TeacherScorer, TeacherScores
from .byte_credit import SERVED_EXTENSION_TOPK, byte_credit, sampled_parts, token_anchors
from .local import LocalTeacher

CROSS_CREDITS = ("byte", "chunk")  # how a chunk's log-prob is shared among its student tokens (`teacher_cross_credit`)

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


def _between(runs: list) -> list[int]:
    """The indices of the context runs (flag 0) with a run of sampled tokens on each side."""
    return [n for n, (_, _, sampled) in enumerate(runs) if not sampled and 0 < n < len(runs) - 1]


class CrossTokenizerTeacher:
    """Wraps a scorer of teacher token ids (`LocalTeacher`, `VLLMServerTeacher`) for a student with another
    tokenizer.

    Args:
        scorer: scores teacher token ids.
        student_tokenizer / teacher_tokenizer: fast tokenizers, each lossless on text (checked here).
        stop_ids: the student's end-of-turn token ids (GRPO's `eos_token_ids`).
        tools / chat_template_kwargs: passed to the teacher's chat template, as GRPO passes them to the student's
            (`tools`: unless a row brings its own, as with several environments).
        credit: "byte" or "chunk" (see the module). "byte" reads a local teacher's final states (`return_hidden`)
            and a served teacher's top `SERVED_EXTENSION_TOPK` entries at each position (`topk`).
    """

    def __init__(self, scorer: TeacherScorer, *, student_tokenizer, teacher_tokenizer, stop_ids,
                 tools=None, chat_template_kwargs=None, credit: str = "byte"):
        if credit not in CROSS_CREDITS:
            raise ValueError(f"credit={credit!r}: choose one of {CROSS_CREDITS}.")
        self.credit = credit
        if credit == "byte":  # the teacher's whole next-token distribution where a token may go on: its final states
            if isinstance(scorer, LocalTeacher):
                scorer.return_hidden = True
                scorer.student_vocab_size = None  # another vocabulary: no dense term whose coverage to warn about
            elif scorer is not None:  # a served teacher sends its top entries
                scorer.topk = max(scorer.topk, SERVED_EXTENSION_TOPK)
        self.scorer = scorer
        self.student = ByteVocabulary.of(student_tokenizer)
        self.teacher = ByteVocabulary.of(teacher_tokenizer)
        self.student.check_lossless(role="student")
        self.teacher.check_lossless(role="teacher")
        self.same_vocabulary = self.student.table == self.teacher.table and set(
            self.student.tokenizer.added_tokens_decoder) == set(self.teacher.tokenizer.added_tokens_decoder)
        # each student added token that the teacher has too, as text (`<|im_start|>`): the teacher's id of it
        teacher_added = {token.content: index for index, token in self.teacher.tokenizer.added_tokens_decoder.items()}
        self._counterparts = {index: teacher_added[token.content]
                              for index, token in self.student.tokenizer.added_tokens_decoder.items()
                              if token.content in teacher_added}
        self.teacher_tokenizer = self.teacher.tokenizer
        self.stop_ids = set(stop_ids)
        self.end_of_turn = end_of_turn_id(self.teacher_tokenizer)
        self.tools = tools or None
        self.chat_template_kwargs = chat_template_kwargs or {}

    def _tools(self, tools: list | None) -> list | None:
        """A row's tools (None: the trainer's), `or None` as GRPO passes them (some templates render boilerplate for
        an empty list)."""
        return (self.tools if tools is None else tools) or None

    def prompt_ids(self, prompt, tools: list | None = None) -> list[int]:
        """The teacher's ids of one prompt: chat messages through its own chat template (with the row's `tools`),
        text as its tokenizer reads text (special tokens added, as GRPO does for a text prompt)."""
        if isinstance(prompt, str):
            return self.teacher_tokenizer(text=prompt)["input_ids"]
        return self.teacher_tokenizer.apply_chat_template(
            prompt, tools=self._tools(tools), add_generation_prompt=True, tokenize=True, return_dict=True,
            **self.chat_template_kwargs,
        )["input_ids"]

    def observations(self, prompt, messages: list[dict], tools: list | None = None) -> list[list[int]]:
        """The teacher's own rendering of what follows each of the student's turns that another turn follows: its
        end-of-turn token, the observations (tool results, user messages: the messages between the two assistant
        messages, possibly none) and its next assistant header, as teacher ids.

        `messages` is the completion as chat messages: each student turn an assistant message (its content and any
        parsed `tool_calls`, which some templates need to render a tool's reply), the observations between them. The
        turn is rendered with a marker for its content, after the prompt and the turns before it, and the teacher
        reads from the first end of turn after the marker: its own syntax for the student's tool calls, which the
        student wrote its way in the sampled text, is never read.
        """
        turns = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
        end_of_turn = self.teacher_tokenizer.decode([self.end_of_turn])
        rendered = []
        for k, following in itertools.pairwise(turns):
            turn = {**messages[k], "content": _MARKER}
            text = self.teacher_tokenizer.apply_chat_template(
                [*prompt, *messages[:k], turn, *messages[k + 1 : following]], tools=self._tools(tools),
                add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs,
            )
            after = text.rindex(_MARKER) + len(_MARKER)
            closed = text.find(end_of_turn, after)
            rendered.append(self.teacher.encode(text[closed if closed >= 0 else after:]))
        return rendered

    def translate(self, ids: list[int], action: list[int], observations: list[list[int]] | None = None,
                  ) -> tuple[list[int], list[int], list[int]]:
        """One completion (its tokens, without padding) in the teacher's tokens. `observations`: the teacher's
        rendering of the context between each two runs of sampled tokens (`observations()`); None reads that
        context's text.

        Returns the teacher's completion ids, the chunk index of each of them and of each student token (-1: in no
        chunk, i.e. context or past the aligned text).
        """
        return self._translate(ids, action, observations)[:3]

    def _translate(self, ids: list[int], action: list[int], observations: list[list[int]] | None = None):
        """`translate`, plus each student token's anchor (see `token_anchors`), or None where not aligned."""
        teacher_ids, teacher_chunk, student_chunk = [], [], [-1] * len(ids)
        anchors = [None] * len(ids)
        chunks = 0
        runs = list(_runs(action))
        rendered = dict(zip(_between(runs), observations, strict=True)) if observations is not None else {}
        for n, (start, end, sampled) in enumerate(runs):
            if not sampled:  # context: read by the teacher, never distilled
                if 0 < n == len(runs) - 1:  # after the last sampled token: it changes no score, so is not sent
                    continue
                if n in rendered:  # the teacher's own; its end of turn is the student's if the student sampled it
                    context = rendered[n]
                    if ids[start - 1] in self.stop_ids and teacher_ids[-1:] == context[:1] == [self.end_of_turn]:
                        context = context[1:]
                else:
                    context = self._read(ids[start:end])
                teacher_ids += context
                teacher_chunk += [-1] * len(context)
                continue
            for part, k, stopped in sampled_parts(ids[start:end], [1] * (end - start), self.stop_ids):
                part, k = part + start, k + start
                pieces = self.student(ids[part:k])
                text_ids = self._read(ids[part:k])
                teacher_pieces = self.teacher(text_ids)
                own, theirs, count = align_bytes(pieces, teacher_pieces)
                student_chunk[part:k] = [c + chunks if c >= 0 else -1 for c in own]
                anchors[part : k + stopped] = token_anchors(pieces, teacher_pieces, own, offset=len(teacher_ids),
                                                            stop=stopped)
                teacher_ids += text_ids
                teacher_chunk += [c + chunks if c >= 0 else -1 for c in theirs]
                chunks += count
                if stopped:  # the student's end of turn, scored as the teacher's
                    student_chunk[k] = chunks
                    teacher_ids.append(ids[k] if self.same_vocabulary else self.end_of_turn)
                    teacher_chunk.append(chunks)
                    chunks += 1
        return teacher_ids, teacher_chunk, student_chunk, anchors

    def _read(self, ids: list[int]) -> list[int]:
        """The teacher's ids for the student's `ids` (sampled text, or context read as text): the same ids where both
        vocabularies spell every id alike (the student's own tokenisation, which the teacher can score as it is);
        else the text they spell, the teacher's way, as plain text (`ByteVocabulary.encode_bytes`: a special token
        spelled out in characters is read as those characters), with each of the student's own added tokens read
        as the teacher's token of the same text where it has one (`<|im_start|>` of two ChatML families) and as its
        text elsewhere. Stops where the teacher has no token for a byte."""
        if self.same_vocabulary:
            return list(ids)
        out, plain = [], []

        def flush() -> bool:  # the plain text so far, the teacher's way; False if it could not spell all of it
            data = b"".join(self.student(plain))
            read = self.teacher.encode_bytes(data)
            out.extend(read)
            plain.clear()
            return sum(map(len, self.teacher(read))) == len(data)

        for token in ids:
            counterpart = self._counterparts.get(token)
            if counterpart is None:
                plain.append(token)
                continue
            if not flush():
                return out
            out.append(counterpart)
        flush()
        return out

    def side_by_side(self, ids: list[int], action: list[int], observations: list[list[int]] | None = None, *,
                     width: int = 110) -> str:
        """One completion in both tokenisations, a column per chunk (`·` between the tokens inside it) and ⟦...⟧
        around what is not distilled (context, or text past the aligned part), wrapped at `width` characters."""
        teacher_ids, teacher_chunk, student_chunk = self.translate(ids, action, observations)

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

    def row_observations(self, prompt, messages: list[dict] | None, action: list[int], *, row: int = 0,
                         tools: list | None = None):
        """`observations(prompt, messages)` for a chat prompt, checked against the completion's runs of context
        between sampled runs (`action`); None for a text prompt (it has no template). A chat prompt's completion with
        such context needs its messages."""
        if isinstance(prompt, str):
            return None
        between = len(_between(list(_runs(action))))
        if messages is None:
            if between:
                raise ValueError(
                    f"Row {row}: the completion has observations between the student's turns, and a teacher with "
                    "another tokenizer reads them through its own chat template, from the completion's messages. A "
                    "rollout function must return them as `completion_messages`: per row, one assistant message "
                    "per student turn and the observations between them (tool or user messages)."
                )
            return None
        observations = self.observations(prompt, messages, tools)
        if len(observations) != between:
            raise ValueError(
                f"Row {row}: the completion has {between} runs of context between runs of sampled tokens, but its "
                f"messages have {len(observations)} places between two assistant messages: give one assistant "
                "message per student turn and the observations between them, in the order of the completion."
            )
        return observations

    @torch.no_grad()
    def score(self, prompts: list, completion_ids, completion_mask, action_mask, conversations: list | None = None,
              tools: list | None = None) -> TeacherScores:
        """`prompts` are the rows' prompts as the teacher should read them (chat messages or text); `action_mask`
        (B, T) marks the tokens the student sampled; `conversations`, each row's completion as chat messages (None:
        a single turn, or context read as text; see `row_observations`); `tools`, the tools each row's prompt was
        rendered with (None: the trainer's)."""
        device, valid = completion_ids.device, completion_mask.bool()
        conversations = [None] * len(prompts) if conversations is None else conversations
        tools = [None] * len(prompts) if tools is None else tools
        rows = []
        for i, (ids, keep, action) in enumerate(zip(completion_ids, valid, action_mask, strict=True)):
            ids, action = ids[keep].tolist(), action[keep].tolist()
            observations = self.row_observations(prompts[i], conversations[i], action, row=i, tools=tools[i])
            rows.append(self._translate(ids, action, observations))
        pad_id = self.teacher_tokenizer.pad_token_id
        pad_id = self.end_of_turn if pad_id is None else pad_id
        prompt_ids = [torch.tensor(self.prompt_ids(prompt, row_tools)) for prompt, row_tools in zip(prompts, tools,
                                                                                                     strict=True)]
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
        if self.credit == "chunk":
            logps = torch.where(chunk_ends, chunk_logps.gather(1, student_chunk.clamp(min=0)), 0.0)
            return TeacherScores(logps=logps, chunk_ends=chunk_ends, aligned=aligned, text_chunk_ends=chunk_ends)
        return byte_credit(self.teacher, self.scorer, scores, rows, teacher_chunk < num_chunks, valid, aligned,
                           chunk_ends)
