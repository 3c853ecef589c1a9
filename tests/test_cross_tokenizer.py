"""Teachers with another tokenizer: byte alignment, exact chunk sums, the byte-level credit, the teacher's own
template, and the refusals."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_opd import OPDTrainer
from trl_opd.alignment import ByteVocabulary, align_bytes
from trl_opd.loss import opd_advantages, opd_metric_sums, opd_metrics_from_sums
from trl_opd.teachers import LocalTeacher
from trl_opd.teachers.cross import CrossTokenizerTeacher
from trl_opd.teachers.local import freeze_teacher
from trl_opd.tiny import OTHER_SPECIAL_TOKENS, build_model, other_family_tokenizer

# the same text in both tokenisers, with characters of 2, 3 and 4 UTF-8 bytes that byte-level tokens split
TEXTS = ["3 plus 4 is 7. The answer is 7.", "café 中文 🙂 → 12 times 3 is 36.", "naïve π ≥ 3, 数字 答案 üb"]


def _recorded(scorer) -> tuple[list, list]:
    """Wraps the scorer of teacher ids that a cross-tokenizer teacher calls, to keep the prompt ids and completion
    ids it is given (padding removed), row by row in the order it receives them."""
    prompts, completions, score = [], [], scorer.score

    def record(prompt_ids, prompt_mask, completion_ids, completion_mask):
        prompts.extend(ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True))
        completions.extend(ids[mask.bool()].tolist() for ids, mask in zip(completion_ids, completion_mask,
                                                                           strict=True))
        return score(prompt_ids, prompt_mask, completion_ids, completion_mask)

    scorer.score = record
    return prompts, completions


# ------------------------------------------------------------------------------------------------- the alignment


def test_chunks_are_cut_where_both_tokenisations_end_a_token():
    student = [b"ab", b"c", b"de", b"\xe4", b"\xb8\xad"]  # "abcde中", the last character split 1 + 2 bytes
    teacher = [b"a", b"bc", b"d", b"e\xe4\xb8", b"\xad"]  # split 2 + 1, inside a token that also holds "e"
    assert align_bytes(student, teacher) == ([0, 0, 1, 1, 1], [0, 0, 1, 1, 1], 2)
    # a cut inside a character: both end a token after its first byte
    assert align_bytes([b"\xe4", b"\xb8\xad"], [b"\xe4", b"\xb8", b"\xad"]) == ([0, 1], [0, 1, 1], 2)
    # where the two texts part (the teacher tokenised a shorter or a normalised text), no chunk reaches past it
    assert align_bytes([b"ab", b"cd", b"ef"], [b"ab", b"cd", b"eX"]) == ([0, 1, -1], [0, 1, -1], 2)
    assert align_bytes([b"ab", b"c", b"\xe4"], [b"ab", b"c"]) == ([0, 1, -1], [0, 1], 2)


def test_tokens_are_read_as_bytes_and_lossy_tokenizers_are_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = other_family_tokenizer()
    vocabulary = ByteVocabulary(tokenizer)
    vocabulary.check_lossless(role="teacher")
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert b"".join(vocabulary(ids)) == text.encode()
    assert vocabulary([tokenizer.eos_token_id]) == [b"<|end|>"]  # special tokens stand for their text
    # bytes that spell no character (a cut inside one, or stray continuation bytes) as the single-byte tokens
    data = "ab中".encode()[:-1] + b"\x80cd"
    assert b"".join(vocabulary(vocabulary.encode_bytes(data))) == data

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "answer": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the spaces: not lossless
    with pytest.raises(ValueError, match=r"student's tokenizer .* does not give text back byte for byte"):
        ByteVocabulary(PreTrainedTokenizerFast(tokenizer_object=words)).check_lossless(role="student")


# ------------------------------------------------------------------------------------------------ the cross scorer


@pytest.fixture(scope="module")
def other_teacher(tiny_other_teacher):
    return freeze_teacher(AutoModelForCausalLM.from_pretrained(tiny_other_teacher))


def _completions(tokenizer, texts, *, eos=True):
    """Right-padded completions spelling `texts` in `tokenizer`'s own tokens, each closed by its eos."""
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * eos for text in texts]
    width = max(map(len, rows))
    ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return ids, mask


def _sequence_logp(model, prompt: list[int], completion: list[int]) -> float:
    """log pi(completion | prompt) by one plain, unpadded forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logps = model(ids).logits.float().log_softmax(-1)[0, len(prompt) - 1 : -1]
    return logps.gather(-1, torch.tensor(completion)[:, None]).sum().item()


def _prefix_logp(model, prompt: list[int], teacher_ids: list[int], table: list[bytes], added, *, cut: int) -> float:
    """log P_T(the text's first `cut` bytes), by its definition with one plain forward: the sum, over every teacher
    token j starting before byte `cut`, of the probability of the teacher tokens before j times that of any plain
    token at j whose bytes start with the text from j to `cut` (searched over the whole vocabulary); where `cut`
    closes an end of turn, the log-prob of the tokens up to it."""
    starts = [0, *itertools.accumulate(len(table[t]) for t in teacher_ids)]
    text = b"".join(table[t] for t in teacher_ids)
    k = max(j for j in range(len(teacher_ids)) if starts[j] < cut)
    ids = torch.tensor([prompt + teacher_ids])
    with torch.no_grad():
        logps = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)  # at each teacher position
    token_logps = logps.gather(-1, torch.tensor(teacher_ids)[:, None])[:, 0]
    if teacher_ids[k] in added:
        return token_logps[: k + 1].sum().item()
    terms = []
    for j in range(k + 1):
        starting = [v for v, piece in enumerate(table) if piece.startswith(text[starts[j] : cut]) and v not in added]
        if starting:
            terms.append(token_logps[:j].sum() + logps[j, starting].logsumexp(0))
    return torch.stack(terms).logsumexp(0).item()


@pytest.mark.parametrize("credit", ["byte", "chunk"])
def test_signals_add_up_to_the_whole_text_log_prob_difference(tiny, tokenizer, tiny_other_teacher, other_teacher,
                                                              credit):
    """Sum over the completion of (teacher signal - log pi_S(token)) = log pi_T(text) - log pi_S(text), each side by
    a plain forward over its own tokens: the student's sampled ids; the teacher's tokenisation of the text plus its
    end of turn, after each model's own rendering of the prompt. Multi-byte characters split inside tokens
    included. A completion cut inside a character (no end of turn) is read by the teacher with its single-byte
    tokens; by chunk, its sum is those tokens' log-prob; by byte, the teacher's probability that its text starts
    with those bytes (`_prefix_logp`), whatever its last token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    student = AutoModelForCausalLM.from_pretrained(tiny / "student")
    teacher_tokenizer = AutoTokenizer.from_pretrained(tiny_other_teacher)
    cross = CrossTokenizerTeacher(LocalTeacher(other_teacher, batch_size=2), student_tokenizer=tokenizer,
                                  teacher_tokenizer=teacher_tokenizer, stop_ids=[tokenizer.eos_token_id],
                                  credit=credit)
    prompts = [[{"role": "user", "content": f"Say {text[:5]}"}] for text in TEXTS]
    completion_ids, completion_mask = _completions(tokenizer, TEXTS)
    cut = len(tokenizer(TEXTS[2], add_special_tokens=False)["input_ids"]) - 2  # row 2: cut inside "ü", no eos
    completion_ids[2, cut:], completion_mask[2, cut:] = tokenizer.pad_token_id, 0
    scores = cross.score(prompts, completion_ids, completion_mask, completion_mask)

    student_bytes = ByteVocabulary(tokenizer)
    pieces = student_bytes(completion_ids[1][completion_mask[1].bool()].tolist())
    assert any(len(piece) == 1 and 0x80 <= piece[0] < 0xC0 for piece in pieces)  # a token ends inside a character
    student_prompt = [tokenizer.apply_chat_template(p, add_generation_prompt=True)["input_ids"] for p in prompts]
    teacher_prompt = [teacher_tokenizer.apply_chat_template(p, add_generation_prompt=True)["input_ids"]
                      for p in prompts]
    for i in range(len(TEXTS)):
        sampled = completion_ids[i][completion_mask[i].bool()].tolist()
        spelled = b"".join(student_bytes([t for t in sampled if t != tokenizer.eos_token_id]))
        text = spelled.decode(errors="ignore")
        dangling = spelled[len(text.encode()):]  # row 2: the first byte of "ü"
        assert bool(dangling) == (i == 2)
        teacher_ids = teacher_tokenizer(text, add_special_tokens=False)["input_ids"]
        teacher_ids += [teacher_tokenizer.convert_tokens_to_ids(bytes_to_unicode()[b]) for b in dangling]
        teacher_ids += [teacher_tokenizer.eos_token_id] if sampled[-1] == tokenizer.eos_token_id else []
        teacher_logp = _sequence_logp(other_teacher, teacher_prompt[i], teacher_ids)
        if credit == "byte" and i == 2:
            table, added = ByteVocabulary(teacher_tokenizer).table, set(teacher_tokenizer.added_tokens_decoder)
            teacher_logp = _prefix_logp(other_teacher, teacher_prompt[i], teacher_ids, table, added,
                                        cut=len(spelled))
            assert teacher_logp > _sequence_logp(other_teacher, teacher_prompt[i], teacher_ids) + 0.01
        expected = teacher_logp - _sequence_logp(student, student_prompt[i], sampled)
        with torch.no_grad():
            student_logps = student(torch.tensor([student_prompt[i] + sampled])).logits.log_softmax(-1)[
                0, len(student_prompt[i]) - 1 : -1].gather(-1, torch.tensor(sampled)[:, None])[:, 0]
        chunk_signal = (scores.logps[i, : len(sampled)] - student_logps).sum().item()
        assert chunk_signal == pytest.approx(expected, abs=1e-4)
    assert scores.aligned[completion_mask.bool()].all()  # every sampled token is in a chunk
    assert not scores.aligned[~completion_mask.bool()].any()
    assert scores.text_chunk_ends.sum() < completion_mask.sum()  # chunks of several student tokens exist
    assert (scores.chunk_ends is None) == (credit == "byte")  # by byte, every token is its own step


def test_by_byte_each_token_gets_the_teacher_probability_of_its_own_bytes(tiny, tokenizer, tiny_other_teacher,
                                                                          other_teacher):
    """By byte, student token i's teacher signal is log P_T(text[:b_i]) - log P_T(text[:b_{i-1}]), each prefix
    probability by its definition (`_prefix_logp`, plain forwards, extension ids searched over the whole teacher
    vocabulary). Where a student token ends inside a teacher token, it gets the teacher's probability of any token
    starting with its bytes; where it ends one the teacher could go on, the teacher's probability that it stops
    there goes to the next student token."""
    teacher_tokenizer = AutoTokenizer.from_pretrained(tiny_other_teacher)
    cross = CrossTokenizerTeacher(LocalTeacher(other_teacher, batch_size=2), student_tokenizer=tokenizer,
                                  teacher_tokenizer=teacher_tokenizer, stop_ids=[tokenizer.eos_token_id])
    prompts = [[{"role": "user", "content": f"Say {text[:5]}"}] for text in TEXTS[:2]]
    completion_ids, completion_mask = _completions(tokenizer, TEXTS[:2])
    scores = cross.score(prompts, completion_ids, completion_mask, completion_mask)

    student_bytes, teacher_bytes = ByteVocabulary(tokenizer), ByteVocabulary(teacher_tokenizer)
    added = set(teacher_tokenizer.added_tokens_decoder)
    inside = 0
    for i, text in enumerate(TEXTS[:2]):
        prompt = teacher_tokenizer.apply_chat_template(prompts[i], add_generation_prompt=True)["input_ids"]
        teacher_ids = teacher_tokenizer(text, add_special_tokens=False)["input_ids"] + [teacher_tokenizer.eos_token_id]
        teacher_ends = set(itertools.accumulate(len(piece) for piece in teacher_bytes(teacher_ids)))
        sampled = completion_ids[i][completion_mask[i].bool()].tolist()
        ends = list(itertools.accumulate(len(piece) if token != tokenizer.eos_token_id
                                         else len(teacher_bytes.table[teacher_tokenizer.eos_token_id])
                                         for token, piece in zip(sampled, student_bytes(sampled), strict=True)))
        prefixes = [_prefix_logp(other_teacher, prompt, teacher_ids, teacher_bytes.table, added, cut=end)
                    for end in ends]
        expected = torch.tensor(prefixes).diff(prepend=torch.zeros(1))
        torch.testing.assert_close(scores.logps[i, : len(sampled)], expected, atol=1e-4, rtol=0)
        inside += sum(end not in teacher_ends for end in ends)
    assert inside  # some student tokens end inside a teacher token


def test_with_one_bpe_tokenizer_chunk_credit_is_per_token_and_byte_credit_moves_only_the_stops(tiny, tokenizer):
    """Teacher and student share a BPE tokenizer and the completions are its own tokenisations: by chunk, every
    token is a chunk and gets its own log-prob, as on the same-tokenizer path; by byte, the completion sums are the
    same and a token differs only where another token starts with its bytes (the teacher's probability of stopping
    there moves to the next token)."""
    teacher = freeze_teacher(AutoModelForCausalLM.from_pretrained(tiny / "teacher"))
    prompts = [[{"role": "user", "content": "Say it"}] for _ in TEXTS[:2]]
    completion_ids, completion_mask = _completions(tokenizer, TEXTS[:2])
    prompt_ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True)["input_ids"] for p in prompts]
    per_token = LocalTeacher(teacher, batch_size=2).score(torch.tensor(prompt_ids), torch.ones(len(prompt_ids),
                                                          len(prompt_ids[0]), dtype=torch.long),
                                                          completion_ids, completion_mask).logps
    valid = completion_mask.bool()
    by = {credit: CrossTokenizerTeacher(LocalTeacher(teacher, batch_size=2), student_tokenizer=tokenizer,
                                        teacher_tokenizer=tokenizer, stop_ids=[tokenizer.eos_token_id],
                                        credit=credit).score(prompts, completion_ids, completion_mask, completion_mask)
          for credit in ("chunk", "byte")}
    assert by["chunk"].chunk_ends[valid].all()
    # log-probs summed in two orders: round-off scales with their magnitude (1e-6 of the largest, ~8 ulps)
    scale = per_token.abs().max().item()
    torch.testing.assert_close(by["chunk"].logps[valid], per_token[valid], rtol=1e-6, atol=1e-6 * scale)
    sums = per_token.sum(1)  # sums of T terms: T times the per-term tolerance
    torch.testing.assert_close(by["byte"].logps.sum(1), sums, rtol=1e-6,
                               atol=1e-6 * per_token.size(1) * per_token.abs().max().item())
    vocabulary = ByteVocabulary(tokenizer)
    extendable = torch.tensor([[len(vocabulary.extensions(vocabulary.table[t])) > 1 and keep
                                for t, keep in zip(ids.tolist(), row.tolist(), strict=True)]
                               for ids, row in zip(completion_ids, valid, strict=True)])
    moved = torch.cat([torch.zeros(len(TEXTS[:2]), 1, dtype=torch.bool), extendable[:, :-1]], dim=1) & valid
    same = valid & ~extendable & ~moved
    assert extendable.any() and same.any()
    torch.testing.assert_close(by["byte"].logps[same], per_token[same], rtol=1e-6, atol=1e-6 * scale)
    assert (by["byte"].logps[extendable] > per_token[extendable] + 1e-6).all()  # "may go on" is likelier


def test_observations_never_enter_a_distilled_chunk(tokenizer):
    teacher_tokenizer = other_family_tokenizer()
    cross = CrossTokenizerTeacher(None, student_tokenizer=tokenizer, teacher_tokenizer=teacher_tokenizer,
                                  stop_ids=[tokenizer.eos_token_id])
    turn = tokenizer("12 plus 7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    observation = tokenizer("\n<|im_start|>user\nresult: 19 café<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)["input_ids"]
    answer = tokenizer("is 19.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = turn + observation + answer
    action = [1] * len(turn) + [0] * len(observation) + [1] * len(answer)
    teacher_ids, teacher_chunk, student_chunk = cross.translate(ids, action)

    assert all(chunk == -1 for chunk, a in zip(student_chunk, action, strict=True) if not a)
    assert all(chunk >= 0 for chunk, a in zip(student_chunk, action, strict=True) if a)
    # the teacher reads the observation as context, in its own tokens, outside every chunk
    context = teacher_tokenizer(tokenizer.decode(observation), add_special_tokens=False)["input_ids"]
    start = teacher_chunk.index(-1)
    assert teacher_ids[start : start + len(context)] == context
    assert teacher_chunk[start : start + len(context)] == [-1] * len(context)
    # each sampled end of turn is the teacher's own end-of-turn token, a chunk of its own
    ends = [k for k, token in enumerate(ids) if token == tokenizer.eos_token_id and action[k]]
    assert len(ends) == 2
    for k in ends:
        assert student_chunk.count(student_chunk[k]) == 1
        assert teacher_ids[teacher_chunk.index(student_chunk[k])] == teacher_tokenizer.convert_tokens_to_ids("<|end|>")
    assert OTHER_SPECIAL_TOKENS[1] == "<|end|>"


def test_observations_are_read_through_the_teachers_own_chat_template(tokenizer):
    # the teacher reads what comes between two student turns as its template renders the messages: its own role
    # markers, never the student's; its end of turn is the student's own where the student sampled one
    teacher_tokenizer = other_family_tokenizer()
    eos = tokenizer.eos_token_id
    cross = CrossTokenizerTeacher(None, student_tokenizer=tokenizer, teacher_tokenizer=teacher_tokenizer,
                                  stop_ids=[eos])
    prompt = [{"role": "user", "content": "What is 12 plus 7?"}]
    messages = [{"role": "assistant", "content": "12 plus 7"}, {"role": "tool", "content": "19 café"},
                {"role": "assistant", "content": "is 19."}]

    def student(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def teacher(text):
        return teacher_tokenizer(text, add_special_tokens=False)["input_ids"]

    observation = student("\n<|im_start|>tool\n19 café<|im_end|>\n<|im_start|>assistant\n")  # the student's way
    answer = student("is 19.") + [eos]
    end = teacher_tokenizer.convert_tokens_to_ids("<|end|>")
    rendered = teacher("\n<|tool|>\n19 café<|end|>\n<|assistant|>\n")  # OTHER_CHAT_TEMPLATE's, by hand
    observations = cross.observations(prompt, messages)
    assert observations == [[end, *rendered]]
    for stopped in (True, False):  # the student sampled its end of turn, or code closed a turn cut at the limit
        turn = student("12 plus 7") + ([eos] if stopped else [])
        closing = [] if stopped else [eos]
        ids = turn + closing + observation + answer
        action = [1] * len(turn) + [0] * (len(closing) + len(observation)) + [1] * len(answer)
        teacher_ids, teacher_chunk, student_chunk = cross.translate(ids, action, observations)
        # sampled: the teacher's tokens of the same text, each end of turn its own; context: its own rendering
        assert teacher_ids == teacher("12 plus 7") + [end] + rendered + teacher("is 19.") + [end]
        assert [token for token, chunk in zip(teacher_ids, teacher_chunk, strict=True) if chunk < 0] == (
            rendered if stopped else [end, *rendered])
        assert all((chunk >= 0) == bool(a) for chunk, a in zip(student_chunk, action, strict=True))
        assert "<|im_start|>" not in teacher_tokenizer.decode(teacher_ids)
        assert cross.row_observations(prompt, messages, action) == observations
        # a chat prompt's observations need the messages; a text prompt's are read as text
        with pytest.raises(ValueError, match="Row 3: the completion has observations between the student's turns"):
            cross.row_observations(prompt, None, action, row=3)
        assert cross.row_observations("What is 12 plus 7?", None, action) is None
        with pytest.raises(ValueError, match="Row 2: the completion has 1 runs of context between runs of sampled "
                                             "tokens, but its messages have 0 places"):
            cross.row_observations(prompt, messages[:1], action, row=2)


def test_chunk_advantages_go_to_every_token_of_the_chunk():
    teacher = torch.tensor([[0.0, -3.0, 0.0, 0.0, -1.0, 0.0]])  # chunk log-probs on each chunk's last token
    old = torch.tensor([[-0.5, -1.0, -0.2, -0.3, -0.4, -9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    ends = torch.tensor([[False, True, False, False, True, False]])
    # chunk 1: -3 - (-1.5) = -1.5 on tokens 0-1; chunk 2: -1 - (-0.9) = -0.1 on tokens 2-4; padding 0
    expected = torch.tensor([[-1.5, -1.5, -0.1, -0.1, -0.1, 0.0]])
    torch.testing.assert_close(opd_advantages(teacher, old, mask, chunk_ends=ends), expected)
    torch.testing.assert_close(opd_advantages(teacher, old, mask, coef=2.0, chunk_ends=ends), 2 * expected)
    # discount: one factor per chunk, so chunk 1 adds 0.5 * chunk 2
    discounted = torch.tensor([[-1.55, -1.55, -0.1, -0.1, -0.1, 0.0]])
    torch.testing.assert_close(opd_advantages(teacher, old, mask, discount=0.5, chunk_ends=ends), discounted)
    # one chunk per token is the per-token advantage, bit for bit
    per_token = torch.randn(1, 6)
    assert torch.equal(opd_advantages(per_token, old, mask, discount=0.3, chunk_ends=mask.bool()),
                       opd_advantages(per_token, old, mask, discount=0.3))
    metrics = opd_metrics_from_sums(opd_metric_sums(teacher_per_token_logps=teacher, old_per_token_logps=old,
                                                    advantages=expected, mask=mask, chunk_ends=ends))
    assert metrics["opd/reverse_kl"] == pytest.approx((1.5 + 0.1) / 5)  # the chunks' sum, per student token
    assert metrics["opd/teacher_logp"] == pytest.approx(-4.0 / 5)


# ------------------------------------------------------------------------------------------------- in the trainer


def _byte_pair(tmp_path):
    """A student and a teacher over one byte-per-token tokenizer: whatever the student samples, text or stray bytes,
    is the tokenizer's own tokenisation of its bytes, so the cross path must reproduce the same-tokenizer path
    exactly."""
    tokenizer = other_family_tokenizer(vocab_size=len(OTHER_SPECIAL_TOKENS) + 256)
    for name, hidden, seed in (("student", 64, 0), ("teacher", 96, 1)):
        build_model(tokenizer, hidden_size=hidden, seed=seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    return tmp_path / "student", tmp_path / "teacher"


def test_with_one_tokenizer_the_cross_path_is_the_same_path(tmp_path, prompts, make_config):
    student, teacher = _byte_pair(tmp_path)
    runs = {}
    for mode in ("same", "cross"):
        config = make_config(output_dir=str(tmp_path / mode), teacher_tokenizer_mode=mode, max_steps=3,
                             max_completion_length=12)
        trainer = OPDTrainer(model=str(student), teacher_model=str(teacher), args=config,
                             train_dataset=prompts.select(range(12)))
        trainer.train()
        runs[mode] = trainer
    same, cross = runs["same"], runs["cross"]
    # the same values up to round-off: the same-tokenizer path takes the sampling policy's log-probs from the loss
    # forward (`advantages.py`), the byte credit from a no-grad forward of its own (it needs the final states too)
    for before, after in zip(same.state.log_history[:-1], cross.state.log_history[:-1], strict=True):
        for name, value in before.items():
            if name.startswith(("opd/", "loss", "grad_norm")) and name not in ("opd/teacher_agreement",
                                                                                  "opd/teacher_entropy"):
                assert after[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
        assert after["opd/aligned_chunk_tokens_mean"] == 1.0 and after["opd/unaligned_token_fraction"] == 0.0
    for p, q in zip(same.model.parameters(), cross.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_the_teacher_reads_the_prompt_through_its_own_chat_template(tiny, prompts, make_config, tiny_other_teacher):
    config = make_config(teacher_tokenizer_mode="cross", max_steps=1, teacher_system_prompt="Be exact.")
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny_other_teacher), args=config,
                         train_dataset=prompts.select(range(4)))
    seen, _ = _recorded(trainer.teacher.scorer)
    trainer.train()
    teacher_tokenizer = AutoTokenizer.from_pretrained(tiny_other_teacher)
    expected = [teacher_tokenizer.apply_chat_template([{"role": "system", "content": "Be exact."}, *row["prompt"]],
                                                      add_generation_prompt=True)["input_ids"]
                for row in prompts.select(range(4))]
    assert sorted(seen) == sorted(expected)  # in the order the sampler drew them
    assert all(ids[0] == teacher_tokenizer.convert_tokens_to_ids("<|system|>") for ids in seen)
    logged = trainer.state.log_history[0]
    assert logged["opd/aligned_chunk_tokens_mean"] >= 1.0
    assert logged["opd/unaligned_token_fraction"] == 0.0
    assert "opd/teacher_agreement" not in logged  # a chunk has no single argmax to agree with


def test_cross_tokenizer_configurations_that_cannot_work_are_refused(tiny, prompts, make_config,
                                                                      tiny_other_teacher):
    with pytest.raises(ValueError, match="opd_estimator='topk' compares the two models over one vocabulary"):
        make_config(teacher_tokenizer_mode="cross", opd_estimator="topk", teacher_model_name_or_path="x")
    with pytest.raises(ValueError, match="ref_as_teacher is the student's own model"):
        make_config(teacher_tokenizer_mode="cross", ref_as_teacher=True)
    with pytest.raises(ValueError, match="a mapping of routed teacher names to tokenizers, but there are no routed"):
        make_config(teacher_tokenizer_mode="cross", teacher_model_name_or_path="x",
                    teacher_tokenizer_name_or_path={"a": "x"})
    with pytest.raises(ValueError, match="names 'c', which is not among the routed teachers"):
        make_config(teacher_tokenizer_mode="cross", teachers={"a": "x", "b": "y"},
                    teacher_tokenizer_name_or_path={"c": "x"})
    with pytest.raises(ValueError, match=r"teachers\['b'\] is served.*name it in teacher_tokenizer_name_or_path"):
        make_config(teacher_tokenizer_mode="cross", teachers={"a": "x", "b": "http://127.0.0.1:9"},
                    teacher_tokenizer_name_or_path={"a": "x"})
    with pytest.raises(ValueError, match="teacher_tokenizer_name_or_path is the tokenizer of a teacher from another"):
        make_config(teacher_tokenizer_name_or_path="x")
    with pytest.raises(ValueError, match="teacher_tokenizer_mode must be one of"):
        make_config(teacher_tokenizer_mode="loose")
    with pytest.raises(ValueError, match="a same-tokenizer teacher scores every token itself"):
        make_config(teacher_cross_credit="chunk")
    with pytest.raises(ValueError, match="teacher_cross_credit must be one of"):
        make_config(teacher_tokenizer_mode="cross", teacher_cross_credit="word")
    # the strict default names the option
    with pytest.raises(ValueError, match="tokenizers differ.*teacher_tokenizer_mode: cross"):
        OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny_other_teacher), args=make_config(),
                   train_dataset=prompts)
    # a cross run defaults to the sampled estimator whatever the source's usual default
    config = make_config(teacher_tokenizer_mode="cross", opd_estimator=None)
    config = config.resolved(str(tiny_other_teacher))
    assert config.opd_estimator == "sampled"


@pytest.mark.parametrize("with_rewards", [False, True])
def test_tokens_the_teacher_cannot_align_leave_the_teacher_s_terms_only(tiny, prompts, make_config,
                                                                       tiny_other_teacher, with_rewards):
    def length_reward(completions, **kwargs):
        return [float(len(str(completion))) for completion in completions]

    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny_other_teacher), train_dataset=prompts,
                         reward_funcs=[length_reward] if with_rewards else None,
                         args=make_config(teacher_tokenizer_mode="cross", num_generations=2 if with_rewards else 1))
    sampled = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    output = {"action_mask": sampled, "tool_mask": sampled, "num_items_in_batch": sampled.sum()}
    scores = SimpleNamespace(aligned=torch.tensor([[True, False, True, True], [True] * 4]),
                             text_chunk_ends=torch.tensor([[False, False, True, False], [False, True, False, True]]))
    distilled = trainer._restrict_action_mask(output, scores)
    assert distilled.tolist() == [[1, 0, 1, 0], [1, 1, 1, 1]] and output["action_mask"] is distilled
    # GRPO's mask: without rewards the teacher's objective is the whole loss, over the distilled tokens; with rewards
    # its reward term trains every token the student sampled (old main dropped the unaligned one from it too)
    expected = sampled if with_rewards else distilled
    assert torch.equal(output["tool_mask"], expected) and output["num_items_in_batch"] == expected.sum()


def test_text_prompts_are_tokenised_by_the_teacher(tiny, make_config, tiny_other_teacher):
    dataset = Dataset.from_dict({"prompt": ["What is 2 plus 3?"] * 4})
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny_other_teacher),
                         args=make_config(teacher_tokenizer_mode="cross", max_steps=1), train_dataset=dataset)
    teacher_tokenizer = AutoTokenizer.from_pretrained(tiny_other_teacher)
    assert trainer.teacher.prompt_ids("What is 2 plus 3?") == teacher_tokenizer("What is 2 plus 3?")["input_ids"]
    trainer.train()
    assert trainer.state.log_history[0]["opd/aligned_chunk_tokens_mean"] >= 1.0


def test_check_shows_both_tokenisations_of_a_rollout_chunk_by_chunk(tiny, tiny_other_teacher, tmp_path, capsys):
    from trl_opd.tools import cli

    argv = ["check", "--config", "recipes/smoke_cpu.yaml", "--model_name_or_path", str(tiny / "student"),
            "--teacher_model_name_or_path", str(tiny_other_teacher), "--teacher_tokenizer_mode", "cross",
            "--dataset_name", str(tiny / "train.jsonl"), "--output_dir", str(tmp_path / "unused")]
    with pytest.raises(SystemExit) as exit_code:
        cli.main(argv)
    out = capsys.readouterr().out
    assert exit_code.value.code == 0
    assert "reference as teacher: opd/reverse_kl = 0.000000 (OK" in out
    assert "first prompt, teacher's chat template: '<|user|>\\nWhat is" in out
    table = out.split("one column per chunk")[1].splitlines()
    student, teacher = (next(line for line in table if line.startswith(who)) for who in ("student |", "teacher |"))
    assert len(student) == len(teacher) and student.count("|") == teacher.count("|")  # the columns line up


def test_check_shows_a_tool_rollout_with_the_teachers_own_observations(tiny_agent, tiny_other_teacher, tmp_path,
                                                                        capsys):
    from trl_opd.tools import cli

    argv = ["check", "--config", "recipes/agent_tools_cpu.yaml", "--model_name_or_path", str(tiny_agent / "student"),
            "--teacher_model_name_or_path", str(tiny_other_teacher), "--teacher_tokenizer_mode", "cross",
            "--dataset_name", str(tiny_agent / "train.jsonl"), "--output_dir", str(tmp_path / "unused"),
            "--per_device_train_batch_size", "8"]  # one batch of 8 is enough to show a tool rollout
    torch.manual_seed(0)
    with pytest.raises(SystemExit) as exit_code:
        cli.main(argv)
    out = capsys.readouterr().out
    assert exit_code.value.code == 0
    table = out.split("one column per chunk")[1]
    teacher = "".join(line.split("|", 1)[1] for line in table.splitlines() if line.startswith("teacher |"))
    student = "".join(line.split("|", 1)[1] for line in table.splitlines() if line.startswith("student |"))
    # the rollout shown is a multi-turn one: the student's tool result markers on its side, the teacher's on its own
    assert "|⟦\\n<|im_start|>tool\\n" in student
    assert "|⟦\\n<|tool|>\\n" in teacher and "<|im_start|>tool" not in teacher


def test_the_held_out_text_kl_of_a_model_against_itself_is_zero(tiny, tokenizer, prompts):
    from trl_opd.evaluation import heldout_text_reverse_kl

    student = AutoModelForCausalLM.from_pretrained(tiny / "student")
    rows = [row["prompt"] for row in prompts.select(range(6))]
    metrics = heldout_text_reverse_kl(student, tokenizer, student, tokenizer, rows, max_new_tokens=8, batch_size=4)
    assert metrics["reverse_kl_per_sequence"] == pytest.approx(0.0, abs=1e-4)
    assert metrics["characters"] > 6 and metrics["unaligned_token_fraction"] == 0.0


def test_routed_teachers_of_other_families_each_read_the_text_their_own_way(tiny, prompts, make_config,
                                                                             tiny_other_teacher, tokenizer):
    """Cross mode with routed teachers: each route's rows reach only that teacher, rendered by its own template, and
    the batch's scores are each teacher's scores of its own rows, every field, put back in place."""
    routes = ["other", "same", "other", "same"]
    dataset = prompts.select(range(4)).add_column("domain", routes)
    config = make_config(teacher_tokenizer_mode="cross", max_steps=1, teacher_route_column="domain",
                         teachers={"same": str(tiny / "teacher"), "other": str(tiny_other_teacher)})
    trainer = OPDTrainer(model=str(tiny / "student"), args=config, train_dataset=dataset)
    assert set(trainer.teacher.scorers) == {"same", "other"}
    seen = {name: _recorded(cross.scorer)[0] for name, cross in trainer.teacher.scorers.items()}
    trainer.train()
    for name, path in (("same", tiny / "student"), ("other", tiny_other_teacher)):
        own = AutoTokenizer.from_pretrained(path)
        expected = [own.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
                    for row, route in zip(dataset, routes, strict=True) if route == name]
        assert sorted(seen[name]) == sorted(expected)
    assert trainer.state.log_history[0]["opd/unaligned_token_fraction"] == 0.0

    # the routed batch's scores, against each teacher scoring its own rows alone
    messages = [row["prompt"] for row in dataset]
    ids, mask = _completions(tokenizer, TEXTS + TEXTS[:1])
    routed = trainer.teacher.score(messages, ids, mask, mask, routes=routes)
    for name, cross in trainer.teacher.scorers.items():
        rows = [i for i, route in enumerate(routes) if route == name]
        alone = cross.score([messages[i] for i in rows], ids[rows], mask[rows], mask[rows])
        for field in ("logps", "aligned", "text_chunk_ends"):
            assert torch.equal(getattr(routed, field)[rows], getattr(alone, field)), (name, field)
    assert routed.aligned[mask.bool()].all()  # both vocabularies spell every byte of these texts


def test_check_shows_the_routed_teacher_of_the_first_row(tiny, tiny_other_teacher, tmp_path, capsys):
    import json

    from trl_opd.tools import cli

    rows = [json.loads(line) for line in open(tiny / "train.jsonl")][:64]
    data = tmp_path / "routed.jsonl"
    data.write_text("".join(json.dumps({**row, "domain": ["other", "same"][i % 2]}) + "\n"
                            for i, row in enumerate(rows)))
    teachers = json.dumps({"same": str(tiny / "teacher"), "other": str(tiny_other_teacher)})
    argv = ["check", "--config", "recipes/smoke_cpu.yaml", "--model_name_or_path", str(tiny / "student"),
            "--teacher_model_name_or_path", "", "--teachers", teachers, "--teacher_route_column", "domain",
            "--teacher_tokenizer_mode", "cross", "--dataset_name", str(data), "--output_dir", str(tmp_path / "unused")]
    with pytest.raises(SystemExit) as exit_code:
        cli.main(argv)
    out = capsys.readouterr().out
    assert exit_code.value.code == 0
    assert "first prompt, teacher's chat template (other): '<|user|>\\nWhat is" in out  # the other family's template
    assert "the same rollout in both tokenisations (teacher " in out


@pytest.mark.parametrize("family", ["same", "other"])
def test_the_tool_loop_s_observations_reach_the_teacher_through_its_own_template(tiny_agent, tiny_other_teacher,
                                                                                 make_config, family):
    # GRPO's tool loop: the teacher receives each tool result rendered by its own chat template. With the student's
    # own template that is exactly the ids the tool loop appended; with another family's, its role markers.
    from datasets import load_dataset

    from trl_opd.envs import ARITHMETIC_TOOLS

    teacher = tiny_agent / "teacher" if family == "same" else tiny_other_teacher
    prompts = load_dataset("json", data_files=str(tiny_agent / "train.jsonl"), split="train")
    config = make_config(max_completion_length=128, teacher_tokenizer_mode="cross", max_tool_calling_iterations=3)
    trainer = OPDTrainer(model=str(tiny_agent / "student"), teacher_model=str(teacher), train_dataset=prompts,
                         tools=ARITHMETIC_TOOLS, args=config)
    _, seen = _recorded(trainer.teacher.scorer)
    torch.manual_seed(0)
    output = trainer._generate_and_score_completions([dict(prompts[i]) for i in range(8)])
    teacher_tokenizer = trainer.teacher.teacher_tokenizer
    called = 0
    for row, messages in enumerate(trainer._student_completions):
        results = [message["content"] for k, message in enumerate(messages)  # those a student turn follows
                   if message["role"] == "tool" and any(m["role"] == "assistant" for m in messages[k:])]
        length = int(output["completion_mask"][row].sum())
        ids, sampled = output["completion_ids"][row, :length].tolist(), output["sampled_mask"][row, :length].tolist()
        teacher_ids = seen[row]
        last = max(k for k, flag in enumerate(sampled) if flag)  # context after it changes no score: not sent
        if family == "same":  # the tool loop's own observation ids, token for token
            assert teacher_ids == ids[: last + 1]
        else:
            text = teacher_tokenizer.decode(teacher_ids)
            assert "<|im_start|>" not in text
            for result in results:
                assert f"<|end|>\n<|tool|>\n{result}<|end|>\n<|assistant|>\n" in text
        called += bool(results)
    assert called > 0, "no rollout called a tool"


class _AddingEnv:
    """An environment that serves `add` only, beside `ArithmeticToolEnv`'s `add` and `multiply`."""

    def reset(self, **row) -> None:
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b


def test_with_several_environments_the_teacher_renders_each_prompt_with_its_own_tools(tiny_agent, make_config):
    # GRPO renders each row's prompt with its environment's tools; so does the teacher. With the student's own
    # tokenizer and template, its prompt ids are the student's, row by row
    from datasets import Dataset, load_dataset

    from trl_opd.envs import ArithmeticToolEnv

    rows = load_dataset("json", data_files=str(tiny_agent / "train.jsonl"), split="train").select(range(4))
    rows = Dataset.from_list([{**row, "environment": "both" if i % 2 else "adding"} for i, row in enumerate(rows)])
    trainer = OPDTrainer(
        model=str(tiny_agent / "student"), teacher_model=str(tiny_agent / "teacher"), train_dataset=rows,
        environment_factory={"both": ArithmeticToolEnv, "adding": _AddingEnv},
        args=make_config(max_completion_length=16, max_tool_calling_iterations=1, teacher_tokenizer_mode="cross"),
    )
    seen, _ = _recorded(trainer.teacher.scorer)
    output = trainer._generate_and_score_completions([dict(row) for row in rows])
    student = [ids[mask.bool()].tolist() for ids, mask in zip(output["prompt_ids"], output["prompt_mask"], strict=True)]
    assert seen == student
    assert "multiply" in trainer.processing_class.decode(student[1])
    assert "multiply" not in trainer.processing_class.decode(student[0])


# ------------------------------------------------------------------------------- the byte credit is exact


def _old_policy(model, prompts: list[list[int]], completion_ids, completion_mask):
    """The student's log-probs of the sampled tokens (B, T) and its final hidden states before each (B, T, H), by
    one plain, unpadded forward per row: what the trainer's old-policy forward gives."""
    logps = torch.zeros(completion_ids.shape)
    hidden = torch.zeros(*completion_ids.shape, model.config.hidden_size)
    for i, (ids, keep) in enumerate(zip(completion_ids, completion_mask.bool(), strict=True)):
        sampled = ids[keep].tolist()
        sequence = torch.tensor([prompts[i] + sampled])
        with torch.no_grad():
            states = model.model(sequence).last_hidden_state[0, len(prompts[i]) - 1 : -1]
            logps[i, : len(sampled)] = model.lm_head(states).log_softmax(-1).gather(
                -1, torch.tensor(sampled)[:, None])[:, 0]
        hidden[i, : len(sampled)] = states
    return logps, hidden


def _advantages(cross, student, tokenizer, prompts, completion_ids, completion_mask, action_mask=None):
    """Per-token byte-credit advantages `A = log pi_T-credit - shift - log pi_old` (B, T), as the trainer forms
    them, with the teacher's scores and the student's shift."""
    from trl_opd.heads import OutputHead
    from trl_opd.teachers.byte_credit import student_prefix_shift

    action_mask = completion_mask if action_mask is None else action_mask
    scores = cross.score(prompts, completion_ids, completion_mask, action_mask)
    student_prompts = [tokenizer(p)["input_ids"] if isinstance(p, str) else
                       tokenizer.apply_chat_template(p, add_generation_prompt=True)["input_ids"] for p in prompts]
    logps, hidden = _old_policy(student, student_prompts, completion_ids, completion_mask)
    shift = student_prefix_shift(ByteVocabulary.of(tokenizer), completion_ids, completion_mask, action_mask,
                                 [tokenizer.eos_token_id], logps, hidden, OutputHead.of(student))
    distilled = scores.aligned & action_mask.bool()
    return torch.where(distilled, scores.logps - shift - logps, 0.0), scores, shift, distilled


def test_by_byte_each_token_gets_both_models_log_ratio_of_its_own_bytes(tiny, tokenizer, tiny_other_teacher,
                                                                        other_teacher):
    """A_i = [log P_T(text[:b_i]) - log P_T(text[:b_{i-1}])] - [log P_S(text[:b_i]) - log P_S(text[:b_{i-1}])], each
    side's prefix probability by its definition along its own tokens (`_prefix_logp`, plain forwards, extensions
    searched over the whole vocabulary); so over a finished completion the advantages add up to
    log pi_T(text) - log pi_S(text), and over a completion cut inside a character to the log-ratio of the two
    models' probabilities that the text starts so."""
    student = AutoModelForCausalLM.from_pretrained(tiny / "student")
    teacher_tokenizer = AutoTokenizer.from_pretrained(tiny_other_teacher)
    cross = CrossTokenizerTeacher(LocalTeacher(other_teacher, batch_size=2), student_tokenizer=tokenizer,
                                  teacher_tokenizer=teacher_tokenizer, stop_ids=[tokenizer.eos_token_id])
    prompts = [[{"role": "user", "content": f"Say {text[:5]}"}] for text in TEXTS]
    completion_ids, completion_mask = _completions(tokenizer, TEXTS)
    cut = len(tokenizer(TEXTS[2], add_special_tokens=False)["input_ids"]) - 2  # row 2: cut inside "ü", no eos
    completion_ids[2, cut:], completion_mask[2, cut:] = tokenizer.pad_token_id, 0
    advantages, _, shift, distilled = _advantages(cross, student, tokenizer, prompts, completion_ids, completion_mask)
    assert distilled[completion_mask.bool()].all()
    assert shift[completion_mask.bool()].abs().max() > 0.05  # the student's own extension mass is not nothing

    student_bytes, teacher_bytes = ByteVocabulary(tokenizer), ByteVocabulary(teacher_tokenizer)
    student_added, teacher_added = set(tokenizer.added_tokens_decoder), set(teacher_tokenizer.added_tokens_decoder)
    teacher_eos = teacher_tokenizer.eos_token_id
    for i in range(len(TEXTS)):
        sampled = completion_ids[i][completion_mask[i].bool()].tolist()
        stopped = sampled[-1] == tokenizer.eos_token_id
        spelled = b"".join(student_bytes(sampled[: len(sampled) - stopped]))
        teacher_ids = teacher_bytes.encode_bytes(spelled) + [teacher_eos] * stopped
        student_prompt = tokenizer.apply_chat_template(prompts[i], add_generation_prompt=True)["input_ids"]
        teacher_prompt = teacher_tokenizer.apply_chat_template(prompts[i], add_generation_prompt=True)["input_ids"]
        ends = list(itertools.accumulate(len(piece) for piece in student_bytes(sampled[: len(sampled) - stopped])))
        teacher_prefixes = [_prefix_logp(other_teacher, teacher_prompt, teacher_ids, teacher_bytes.table,
                                         teacher_added, cut=end) for end in ends]
        student_prefixes = [_prefix_logp(student, student_prompt, sampled, student_bytes.table, student_added,
                                         cut=end) for end in ends]
        if stopped:  # the end of turn: each side's whole sequence
            teacher_prefixes.append(_sequence_logp(other_teacher, teacher_prompt, teacher_ids))
            student_prefixes.append(_sequence_logp(student, student_prompt, sampled))
        expected = (torch.tensor(teacher_prefixes) - torch.tensor(student_prefixes)).diff(prepend=torch.zeros(1))
        torch.testing.assert_close(advantages[i, : len(sampled)], expected, atol=2e-4, rtol=0)
        whole = teacher_prefixes[-1] - student_prefixes[-1]
        if stopped:
            whole = _sequence_logp(other_teacher, teacher_prompt, teacher_ids) - _sequence_logp(
                student, student_prompt, sampled)
        assert advantages[i].sum().item() == pytest.approx(whole, abs=2e-4)


def _spelling_tokenizer(tokenizer):
    """A second tokenizer that reads every text as `tokenizer` does, with one unused special token more: another
    vocabulary, so a teacher with it reads the sampled text by re-encoding it."""
    other = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    other.add_tokens(["<|unused|>"], special_tokens=True)
    return other


@pytest.mark.parametrize("reader", ["its own tokenizer", "another tokenizer of the same text"])
def test_an_identical_teacher_gives_every_token_zero_even_where_a_marker_is_spelled_out(tiny, tokenizer, reader):
    """The student's own checkpoint as a cross-tokenizer teacher: every token's advantage is 0 (not only their
    sum), on completions that spell the end-of-turn marker `<|im_end|>` in plain characters too."""
    student = AutoModelForCausalLM.from_pretrained(tiny / "student")
    teacher_tokenizer = tokenizer if reader == "its own tokenizer" else _spelling_tokenizer(tokenizer)
    cross = CrossTokenizerTeacher(LocalTeacher(freeze_teacher(AutoModelForCausalLM.from_pretrained(tiny / "student")),
                                               batch_size=2), student_tokenizer=tokenizer,
                                  teacher_tokenizer=teacher_tokenizer, stop_ids=[tokenizer.eos_token_id])
    assert cross.same_vocabulary == (reader == "its own tokenizer")
    texts = ["3 plus 4 is 7. The answer is 7.", "The answer is 7.<|im_end|>", "12 plus 7 is 19<|im_end|> ok"]
    rows = [tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
            for text in texts]
    assert all(tokenizer.eos_token_id not in row[:-1] for row in rows)  # the markers are spelled out
    width = max(map(len, rows))
    completion_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    completion_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    prompts = [[{"role": "user", "content": "What is 3 plus 4?"}]] * len(texts)
    advantages, scores, shift, distilled = _advantages(cross, student, tokenizer, prompts, completion_ids,
                                                       completion_mask)
    assert distilled[completion_mask.bool()].all()
    assert advantages.abs().max() < 1e-5
    assert shift.abs().max() > 0.05  # the teacher's byte credit alone is not the student's log-prob here


def test_the_trainer_s_first_step_is_zero_with_an_identical_cross_tokenizer_teacher(tiny, tokenizer, prompts,
                                                                                     make_config):
    """On the student's own samples, an identical teacher read by re-encoding the text: every advantage 0 and
    the first step's gradient 0, as on the same-tokenizer path."""
    config = make_config(teacher_tokenizer_mode="cross", max_steps=1, max_completion_length=24)
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "student"), args=config,
                         train_dataset=prompts.select(range(8)),
                         teacher_processing_class=_spelling_tokenizer(tokenizer))
    assert not trainer.teacher.same_vocabulary
    finished, finish = [], trainer._signal
    trainer._signal = lambda output, scores, **kwargs: finished.append(finish(output, scores, **kwargs)) or finished[-1]
    trainer.train()
    output = finished[0]
    mask = output["action_mask"].bool()
    sampled = [ids[keep].tolist() for ids, keep in zip(output["completion_ids"], output["completion_mask"].bool(),
                                                       strict=True)]
    # the teacher reads each sample in the student's own tokens (its text re-encoded gives them back), so both
    # sides of the credit follow the same path
    assert all(trainer.teacher.translate(ids, [1] * len(ids))[0] == ids for ids in sampled)
    assert mask.sum() > 40 and output["student_prefix_shift"][mask].abs().max() > 0.05
    assert output["advantages"][mask].abs().max() < 1e-5
    logged = trainer.state.log_history[0]
    assert logged["grad_norm"] < 1e-4 and abs(logged["opd/reverse_kl"]) < 1e-5


FAMILY_MARKERS = {  # each family's special tokens, its end of turn last
    "ChatML (Qwen)": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "Llama 3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "Gemma": ["<pad>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
    "SmolLM2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"],
}


@pytest.mark.parametrize("family", FAMILY_MARKERS)
def test_a_special_token_spelled_out_is_read_as_its_characters(family):
    """The teacher reads exactly the characters the student wrote: each family's markers written out in plain text
    are its ordinary tokens, never its special tokens (which its tokenizer alone would read them as)."""
    from trl_opd.tiny import _arithmetic_corpus, _byte_level_bpe

    specials = FAMILY_MARKERS[family]
    teacher_tokenizer = _byte_level_bpe(_arithmetic_corpus(["user", "assistant", "end", "turn"], seed=0),
                                        vocab_size=400, special_tokens=specials, eos_token=specials[-1],
                                        pad_token=specials[0])
    vocabulary = ByteVocabulary(teacher_tokenizer)
    special_ids = set(teacher_tokenizer.all_special_ids)
    for marker in specials:
        text = f"The answer is 7.{marker}\n{marker}user"
        assert special_ids & set(teacher_tokenizer(text, add_special_tokens=False)["input_ids"])  # as a template
        ids = vocabulary.encode_bytes(text.encode())
        assert not special_ids & set(ids), marker
        assert b"".join(vocabulary(ids)) == text.encode()


def test_a_student_that_spells_the_teachers_end_of_turn_is_not_read_as_ending(tiny, tokenizer, tiny_other_teacher,
                                                                              other_teacher):
    """Another family's teacher (end of turn `<|end|>`): a completion that writes "<|end|>" in characters is read
    by the teacher as those characters, and its only end-of-turn token is the one for the student's own."""
    teacher_tokenizer = AutoTokenizer.from_pretrained(tiny_other_teacher)
    scorer = LocalTeacher(other_teacher, batch_size=2)
    _, completions = _recorded(scorer)
    cross = CrossTokenizerTeacher(scorer, student_tokenizer=tokenizer, teacher_tokenizer=teacher_tokenizer,
                                  stop_ids=[tokenizer.eos_token_id])
    text = "The answer is 7.<|end|>"
    completion_ids, completion_mask = _completions(tokenizer, [text])
    scores = cross.score([[{"role": "user", "content": "What is 3 plus 4?"}]], completion_ids, completion_mask,
                         completion_mask)
    end = teacher_tokenizer.convert_tokens_to_ids("<|end|>")
    assert completions[0].count(end) == 1 and completions[0][-1] == end
    assert completions[0][:-1] == teacher_tokenizer(text, add_special_tokens=False,
                                                    split_special_tokens=True)["input_ids"]
    assert scores.aligned[completion_mask.bool()].all()


def test_nothing_is_carried_from_one_run_of_sampled_text_into_the_next(tiny, tokenizer, tiny_other_teacher,
                                                                       other_teacher):
    """A run that ends without an end of turn (context follows: a tool's reply) is credited up to the probability
    that the text starts with it; the next run starts afresh: its first token's value is the teacher's probability
    of any token starting with its bytes there, on each side, whatever token ended the run before."""
    teacher_tokenizer = AutoTokenizer.from_pretrained(tiny_other_teacher)
    scorer = LocalTeacher(other_teacher, batch_size=2)
    _, completions = _recorded(scorer)
    cross = CrossTokenizerTeacher(scorer, student_tokenizer=tokenizer, teacher_tokenizer=teacher_tokenizer,
                                  stop_ids=[tokenizer.eos_token_id])

    def student(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    first, context, second = student("12 plus 7 is "), student("nineteen"), student(".") + [tokenizer.eos_token_id]
    ids = first + context + second
    action = [1] * len(first) + [0] * len(context) + [1] * len(second)
    prompt = "What is 12 plus 7? "  # a text prompt: the context between runs is read as text
    student_model = AutoModelForCausalLM.from_pretrained(tiny / "student")
    _, scores, shift, _ = _advantages(cross, student_model, tokenizer, [prompt], torch.tensor([ids]),
                                      torch.ones(1, len(ids), dtype=torch.long), torch.tensor([action]))
    teacher_ids = completions[0]
    teacher_bytes, added = ByteVocabulary(teacher_tokenizer), set(teacher_tokenizer.added_tokens_decoder)
    teacher_prompt = teacher_tokenizer(prompt)["input_ids"]
    run = len(teacher_bytes.encode_bytes(b"12 plus 7 is "))
    # the first run: the teacher's probability that the text starts with it
    assert scores.logps[0, : len(first)].sum().item() == pytest.approx(_prefix_logp(
        other_teacher, teacher_prompt, teacher_ids[:run], teacher_bytes.table, added, cut=len(b"12 plus 7 is ")),
        abs=1e-4)
    assert scores.logps[0, : len(first)].sum() > _sequence_logp(other_teacher, teacher_prompt, teacher_ids[:run])
    # the second run's "." (the teacher's position of its "." token): any token starting with "." there
    at = len(teacher_ids) - 2
    assert teacher_bytes.table[teacher_ids[at]].startswith(b".")
    with torch.no_grad():
        logps = other_teacher(torch.tensor([teacher_prompt + teacher_ids])).logits[0, len(teacher_prompt) + at - 1]
    starting = [v for v, piece in enumerate(teacher_bytes.table) if piece.startswith(b".") and v not in added]
    assert scores.logps[0, len(first) + len(context)].item() == pytest.approx(
        logps.float().log_softmax(-1)[starting].logsumexp(0).item(), abs=1e-4)
    # the student's side likewise: its "." shift is its own mass of tokens starting with "." there, nothing before
    student_prompt = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        logps = student_model(torch.tensor([student_prompt + ids])).logits[0, len(student_prompt) + len(first)
                                                                            + len(context) - 1].log_softmax(-1)
    student_bytes = ByteVocabulary(tokenizer)
    starting = [v for v, piece in enumerate(student_bytes.table)
                if piece.startswith(b".") and v not in tokenizer.added_tokens_decoder]
    dot = second[0]
    assert shift[0, len(first) + len(context)].item() == pytest.approx(
        (logps[starting].logsumexp(0) - logps[dot]).item(), abs=1e-4)


def test_a_token_of_no_bytes_is_never_distilled(tokenizer, tiny_other_teacher, other_teacher):
    """A sampled id that spells nothing (past the tokenizer's vocabulary, which a model's embedding may be larger
    than) is in no chunk and not distilled; the other tokens are scored as without it."""
    teacher_tokenizer = AutoTokenizer.from_pretrained(tiny_other_teacher)
    cross = CrossTokenizerTeacher(LocalTeacher(other_teacher, batch_size=2), student_tokenizer=tokenizer,
                                  teacher_tokenizer=teacher_tokenizer, stop_ids=[tokenizer.eos_token_id])
    plain = tokenizer("is 7.", add_special_tokens=False)["input_ids"]
    empty = len(ByteVocabulary(tokenizer).table)
    rows = [plain + [tokenizer.eos_token_id], plain[:1] + [empty] + plain[1:] + [tokenizer.eos_token_id]]
    completion_ids = torch.tensor([rows[0] + [tokenizer.pad_token_id], rows[1]])
    completion_mask = torch.tensor([[1] * len(rows[0]) + [0], [1] * len(rows[1])])
    prompt = [{"role": "user", "content": "What is 3 plus 4?"}]
    scores = cross.score([prompt, prompt], completion_ids, completion_mask, completion_mask)
    assert scores.aligned[1].tolist() == [True, False] + [True] * (len(rows[1]) - 2)
    assert scores.logps[1, 1] == 0
    kept = torch.tensor([0, *range(2, len(rows[1]))])
    alone = scores.logps[0, : len(rows[0])]  # the same tokens scored in another batch shape: round-off, at scale
    torch.testing.assert_close(scores.logps[1, kept], alone, rtol=1e-6, atol=1e-6 * alone.abs().max().item())
