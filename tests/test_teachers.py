"""The local teacher scorer: exact per-token values, and no (batch, tokens, vocab) tensor."""

import torch

from trl_opd.teachers import LocalTeacher
from trl_opd.teachers.local import freeze_teacher
from trl_opd.tiny import build_model
from trl_opd.tools.testing import TensorMemoryMeter


def _batch(tokenizer, vocab_size, *, seed=0, rows=3, prompt_len=6, completion_len=5):
    """Left-padded prompts and right-padded completions of different lengths, like GRPO builds them."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab_size, (rows, prompt_len), generator=g)
    completion_ids = torch.randint(3, vocab_size, (rows, completion_len), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    completion_mask = torch.ones_like(completion_ids)
    prompt_mask[0, :2] = 0  # row 0: a shorter prompt
    completion_mask[1, 3:] = 0  # row 1: a shorter completion
    prompt_ids[prompt_mask == 0] = tokenizer.pad_token_id
    completion_ids[completion_mask == 0] = tokenizer.pad_token_id
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _naive_scores(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Full logits, log_softmax, gather: the reference the scorer must equal, row by row without padding."""
    logps = torch.zeros(completion_ids.shape)
    top1 = torch.zeros(completion_ids.shape, dtype=torch.bool)
    entropy = torch.zeros(completion_ids.shape)
    for i in range(prompt_ids.size(0)):
        p = prompt_ids[i][prompt_mask[i].bool()]
        c = completion_ids[i][completion_mask[i].bool()]
        ids = torch.cat([p, c])[None]
        with torch.no_grad():
            log_probs = model(ids).logits.log_softmax(-1)[0, len(p) - 1 : -1]  # predicts c
        logps[i, : len(c)] = log_probs.gather(-1, c[:, None])[:, 0]
        top1[i, : len(c)] = log_probs.argmax(-1) == c
        entropy[i, : len(c)] = -(log_probs.exp() * log_probs).sum(-1)
    return logps, top1, entropy


def test_local_teacher_matches_a_naive_unpadded_forward(tiny, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny / "teacher")
    batch = _batch(tokenizer, len(tokenizer))
    expected_logps, expected_top1, expected_entropy = _naive_scores(model, *batch)

    scores = LocalTeacher(freeze_teacher(model), batch_size=2).score(*batch)
    completion_mask = batch[3].bool()
    assert scores.logps.shape == batch[2].shape
    torch.testing.assert_close(scores.logps[completion_mask], expected_logps[completion_mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores.entropy[completion_mask], expected_entropy[completion_mask], atol=1e-5, rtol=1e-5)
    assert torch.equal(scores.is_top1[completion_mask], expected_top1[completion_mask])
    assert scores.logps[~completion_mask].abs().sum() == 0  # padding is never scored
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_teacher_scoring_never_builds_batch_by_tokens_by_vocab(tokenizer):
    """Peak tensor memory on a 262k-vocabulary teacher (Gemma-3 size), the scorer against the naive log_softmax.

    The scorer projects tiles of about 2^23 logits (32 positions here), so its peak is bounded by the tile, not by
    batch x tokens x vocab.
    """
    vocab_size = 262144
    model = build_model(tokenizer, vocab_size=vocab_size, hidden_size=64, num_layers=1)
    batch = _batch(tokenizer, len(tokenizer), rows=4, prompt_len=16, completion_len=112)
    full_logits_bytes = 4 * 128 * vocab_size * 4  # (B, P+T, V) float32: 512 MiB

    with TensorMemoryMeter() as naive, torch.no_grad():
        input_ids, attention_mask = torch.cat(batch[0:3:2], 1), torch.cat(batch[1:4:2], 1)
        log_probs = model(input_ids=input_ids, attention_mask=attention_mask).logits.log_softmax(-1)
        naive_logps = log_probs[:, 15:-1].gather(-1, batch[2][..., None])[..., 0]
        del log_probs

    teacher = LocalTeacher(freeze_teacher(model), batch_size=4)
    with TensorMemoryMeter() as tiled:
        scores = teacher.score(*batch)

    mask = batch[3].bool()
    torch.testing.assert_close(scores.logps[mask], naive_logps[mask], atol=1e-4, rtol=1e-4)
    assert naive.largest >= full_logits_bytes  # the meter sees the naive path's logits
    assert tiled.largest < full_logits_bytes / 4
    assert tiled.peak < naive.peak / 3, f"tiled peak {tiled.peak / 2**20:.0f} MiB, naive {naive.peak / 2**20:.0f} MiB"


def test_only_the_sampled_positions_are_projected_onto_the_vocabulary(tiny, tokenizer, monkeypatch):
    """A prompt is most of a sequence (60 of 65 tokens on the real code task): its positions are context, never
    projected; neither is completion padding. Counted at the one place logits are formed (`OutputHead.logits`)."""
    from transformers import AutoModelForCausalLM

    from trl_opd.heads import OutputHead

    projected, logits = [], OutputHead.logits

    def counted(head, hidden):
        projected.append(len(hidden))
        return logits(head, hidden)

    monkeypatch.setattr(OutputHead, "logits", counted)
    model = AutoModelForCausalLM.from_pretrained(tiny / "teacher")
    batch = _batch(tokenizer, len(tokenizer), rows=3, prompt_len=40, completion_len=5)
    scores = LocalTeacher(freeze_teacher(model), batch_size=2).score(*batch)
    assert sum(projected) == batch[3].sum() == 13  # 5 + 3 + 5 sampled tokens, of 3 x 45 positions
    expected_logps, _, _ = _naive_scores(model, *batch)
    torch.testing.assert_close(scores.logps, expected_logps, atol=1e-5, rtol=1e-5)


def test_the_teacher_loads_in_the_students_dtype_unless_told_otherwise(tiny, prompts, make_config):
    import torch

    from trl_opd import OPDTrainer

    def teacher_dtype(**overrides):
        args = make_config(model_init_kwargs={"dtype": "bfloat16"}, **overrides)
        trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=args,
                             train_dataset=prompts)
        assert trainer.model.dtype == torch.bfloat16
        return trainer.teacher_model.dtype

    assert teacher_dtype() == torch.bfloat16  # an 8B teacher in float32 would take twice the student's memory share
    assert teacher_dtype(teacher_model_init_kwargs={"dtype": "float32"}) == torch.float32
