"""Output heads: every logit formed from hidden states follows the model's own transform and the temperature rule."""

import pytest
import torch

from trl_opd.heads import OutputHead, head_mass_beyond, head_token_logps, head_token_stats, head_topk_logps
from trl_opd.loss import dense_reverse_kl, dense_topk_reverse_kl


def _logps(hidden, head: OutputHead):
    """The head's log-probs written out: bias, scale, soft cap, temperature, softmax, in float64."""
    z = hidden.double() @ head.weight.double().T
    if head.bias is not None:
        z = z + head.bias.double()
    z = z * head.scale
    if head.softcap is not None:
        z = head.softcap * torch.tanh(z / head.softcap)
    return (z / head.temperature).log_softmax(-1)


def _kl(student_hidden, student_head, teacher_hidden, teacher_head):
    student, teacher = _logps(student_hidden, student_head), _logps(teacher_hidden, teacher_head)
    return (student.exp() * (student - teacher)).sum(-1)


HEAD_PAIRS = {
    # (student scale, softcap, temperature), (teacher scale, softcap, temperature)
    "temperatures": ((1.0, None, 0.7), (1.0, None, 0.5)),
    "scaled-teacher": ((1.0, None, 1.0), (4.0, None, 1.0)),
    "softcapped-both": ((30.0, 5.0, 1.0), (30.0, 5.0, 1.0)),
    "softcapped-student-other-temperature": ((30.0, 5.0, 0.8), (2.0, None, 1.3)),
    "softcapped-teacher-other-temperature": ((2.0, None, 0.8), (30.0, 5.0, 1.3)),
}


@pytest.mark.parametrize("pair", HEAD_PAIRS.values(), ids=HEAD_PAIRS.keys())
def test_dense_terms_follow_each_models_transform_and_temperature(pair):
    torch.manual_seed(0)
    student_hidden = (torch.randn(2, 4, 16) * 0.5).requires_grad_()
    student_weight = torch.randn(50, 16, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(2, 4, 24) * 0.5, torch.randn(50, 24)
    student_head = OutputHead(student_weight, None, *pair[0])
    teacher_head = OutputHead(teacher_weight, None, *pair[1])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    naive = _kl(student_hidden, student_head, teacher_hidden, teacher_head) * mask

    kl = dense_reverse_kl(student_hidden, student_head, teacher_hidden, teacher_head, mask)
    torch.testing.assert_close(kl.double(), naive, atol=1e-4, rtol=1e-4)
    got = torch.autograd.grad(kl.sum(), [student_hidden, student_weight])
    want = torch.autograd.grad(naive.sum(), [student_hidden, student_weight])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-4, rtol=1e-3)

    # top-k over the whole vocabulary is the full KL: both sides through the same transforms
    ids, logps = head_topk_logps(teacher_hidden.flatten(0, 1), teacher_head, k=50)
    topk = dense_topk_reverse_kl(student_hidden, student_head, ids.view(2, 4, 50), logps.view(2, 4, 50), mask)
    torch.testing.assert_close(topk.double(), naive, atol=1e-4, rtol=1e-4)
    got = torch.autograd.grad(topk.sum(), [student_hidden, student_weight])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), atol=1e-4, rtol=1e-3)


def test_token_logps_entropy_and_argmax_follow_the_transform():
    torch.manual_seed(0)
    hidden, head = torch.randn(6, 16), OutputHead(torch.randn(50, 16), torch.randn(50), 3.0, 4.0, 0.6)
    expected = _logps(hidden, head)
    ids = torch.randint(50, (6,))
    ids[:3] = expected[:3].argmax(-1)  # three positions where the token is the argmax
    logps, entropy, is_top1 = head_token_stats(hidden, head, ids, tile_elements=100)
    assert is_top1.tolist() == (expected.argmax(-1) == ids).tolist() and is_top1[:3].all()
    torch.testing.assert_close(logps.double(), expected.gather(-1, ids[:, None])[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), -(expected.exp() * expected).sum(-1), atol=1e-5, rtol=1e-5)
    tiled = head_token_logps(hidden, head, ids[:, None], tile_elements=100)
    torch.testing.assert_close(tiled.double(), expected.gather(-1, ids[:, None]), atol=1e-5, rtol=1e-5)


def test_two_soft_capped_models_at_different_temperatures_are_refused():
    student = OutputHead(torch.randn(5, 4), softcap=5.0, temperature=0.7)
    teacher = OutputHead(torch.randn(5, 4), softcap=5.0, temperature=1.0)
    with pytest.raises(ValueError, match="two soft-capped models"):
        dense_reverse_kl(torch.randn(1, 2, 4), student, torch.randn(1, 2, 4), teacher, torch.ones(1, 2))


@pytest.mark.parametrize("family", ["gemma2", "cohere"])
def test_output_head_of_a_model_gives_its_own_forwards_logits(family):
    """Gemma 2 soft-caps its logits, Cohere scales them: the head read from the config reproduces `model(...)`."""
    from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                  num_key_value_heads=1, head_dim=32)
    config = (Gemma2Config(**common, final_logit_softcapping=5.0) if family == "gemma2"
              else CohereConfig(**common, logit_scale=4.0))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)  # large logits, where the soft cap acts
        ids = torch.randint(64, (1, 7))
        logits = model(input_ids=ids).logits[0]
        hidden = model.base_model(input_ids=ids).last_hidden_state[0]
    head = OutputHead.of(model, temperature=0.5)
    assert (head.softcap, head.scale) == ((5.0, 1.0) if family == "gemma2" else (None, 4.0))
    torch.testing.assert_close(head.logits(hidden), logits / 0.5, atol=1e-4, rtol=1e-5)


def test_mass_beyond_a_smaller_vocabulary_is_the_softmax_tail():
    torch.manual_seed(0)
    hidden, head = torch.randn(5, 8), OutputHead(torch.randn(40, 8), torch.randn(40), 2.0, 3.0, 0.9)
    logps = _logps(hidden, head)
    ids = torch.randint(32, (5,))
    mass = head_mass_beyond(hidden, head, ids, logps.gather(-1, ids[:, None])[:, 0].float(), vocab_size=32)
    torch.testing.assert_close(mass.double(), logps[:, 32:].exp().sum(-1), atol=1e-5, rtol=1e-4)
    top_ids, _ = head_topk_logps(hidden, head, k=3, vocab_size=32)
    assert (top_ids < 32).all()



def test_tiles_are_sized_for_the_head_s_device():
    from trl_opd.heads import OutputHead

    vocab, hidden = 151_936, 8
    assert OutputHead(torch.empty(vocab, hidden)).tile_rows() == 55  # 2^23 logits on a CPU
    # anywhere else (a GPU; here the meta device, which holds no memory) 2^27: 64 x 2048 positions in 149 tiles
    on_accelerator = OutputHead(torch.empty(vocab, hidden, device="meta"))
    assert on_accelerator.tile_rows() == 883 and -(-64 * 2048 // on_accelerator.tile_rows()) == 149
    assert on_accelerator.tile_rows(tile_elements=100 * vocab) == 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_head_gradient_in_tiles_equals_the_float64_hand_computation(dtype):
    # the backward accumulates the head's gradient in float32 over tiles of positions, from inputs in the head's
    # dtype (on a GPU a 16-bit product with float32 accumulation); the gradient is returned in the head's dtype
    torch.manual_seed(0)
    hidden = (torch.randn(37, 16) * 0.5).to(dtype).requires_grad_()
    weight = torch.randn(50, 16).to(dtype).requires_grad_()
    bias = torch.randn(50).to(dtype).requires_grad_()
    ids = torch.randint(0, 50, (37, 2))
    grad = torch.randn(37, 2)
    head = OutputHead(weight, bias, temperature=0.7)
    logps = head_token_logps(hidden, head, ids, tile_elements=8 * 50)  # 5 tiles of 8 positions
    (logps * grad).sum().backward()
    exact = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    expected = _logps(exact[0], OutputHead(exact[1], exact[2], temperature=0.7)).gather(-1, ids)
    (expected * grad.double()).sum().backward()
    # in bf16 the logits are rounded to bf16 (as the model's own bf16 head gives them): 2^-9 of their size each, a
    # few times that in the log-probs and the gradients built from them; float32 is exact to round-off
    rtol = 1e-5 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(logps.double(), expected.detach(), rtol=rtol,
                               atol=rtol * expected.abs().max().item())
    for got, want in zip((hidden.grad, weight.grad, bias.grad), exact, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want.grad, rtol=rtol, atol=rtol * want.grad.abs().max().item())
