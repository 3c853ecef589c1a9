"""Tiny student/teacher pairs, tokenizers and arithmetic prompt sets built locally, for tests, recipes and notebooks.

Tiny so that they build in seconds on a CPU with no model hub: a byte-level BPE tokenizer is trained on generated
arithmetic text, and Qwen3-architecture models are initialised from configs with fixed seeds. The teacher is then
trained on chat-formatted arithmetic answers for ten times as long as the student, so it is peaked and structured
where the student is not: a real reverse KL to close.

    python -m trl_opd.tiny artifacts/tiny     # or: trl-opd make-tiny artifacts/tiny
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def arithmetic_prompt(rng: random.Random) -> tuple[str, str]:
    """One question and its worked answer, e.g. ("What is 3 plus 4?", "3 plus 4 is 7. The answer is 7.")."""
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    op, value = rng.choice([("plus", a + b), ("minus", a - b), ("times", a * b)])
    return f"What is {a} {op} {b}?", f"{a} {op} {b} is {value}. The answer is {value}."


def arithmetic_answer_reward(completions, answer, **kwargs) -> list[float]:
    """GRPO reward for the arithmetic prompts: 1.0 if the completion's last number is the expected answer."""
    import re

    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        expected = re.findall(r"-?\d+", reference)[-1]
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return rewards


def _arithmetic_corpus(words: list[str], *, seed: int, size: int = 3000) -> list[str]:
    """Generated arithmetic questions and answers, each followed by three of `words`: a tokenizer's training text."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(size):
        question, answer = arithmetic_prompt(rng)
        corpus.append(f"{question} {answer} " + " ".join(rng.sample(words, 3)))
    return corpus


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE tokenizer with a ChatML template, trained on generated arithmetic text."""
    wrapped = _byte_level_bpe(_arithmetic_corpus(NUMBER_WORDS, seed=seed), vocab_size=vocab_size,
                              special_tokens=SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _byte_level_bpe(corpus, *, vocab_size: int, special_tokens: list[str], eos_token: str, pad_token: str,
                    split_digits: bool = False):
    """A byte-level BPE tokenizer trained on `corpus` with left padding: `special_tokens` first (the ones other than
    eos and pad become additional special tokens), then the 256 bytes, then merges up to `vocab_size`; with
    `split_digits`, every digit is a token of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if split_digits else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=eos_token, pad_token=pad_token, padding_side="left",
        additional_special_tokens=[token for token in special_tokens if token not in (eos_token, pad_token)],
    )


# A second model family for cross-tokenizer teachers: other special tokens, another chat template, other merges
OTHER_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
OTHER_SPECIAL_TOKENS = ["<pad>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Words whose characters take 2 to 4 bytes in UTF-8, so that some tokens of a byte-level BPE end inside a character
MULTIBYTE_WORDS = ["café", "naïve", "über", "中文", "数字", "答案", "🙂", "≥", "→", "π"]


def other_family_tokenizer(vocab_size: int = 400, *, seed: int = 0, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer of another "model family" than `build_tokenizer`'s: trained on the same arithmetic
    text plus accented, CJK and emoji words (so some of its tokens end inside a UTF-8 character), or on `corpus`,
    with other merges, other special tokens (eos `<|end|>`, pad `<pad>`) and another chat template (`<|user|>` ...
    `<|end|>`).

    `vocab_size=len(OTHER_SPECIAL_TOKENS) + 256` leaves no room for merges: every token is one byte, so every
    tokenisation of a text is the tokenizer's own."""
    if corpus is None:
        corpus = _arithmetic_corpus(MULTIBYTE_WORDS, seed=seed)
    wrapped = _byte_level_bpe(corpus, vocab_size=vocab_size, special_tokens=OTHER_SPECIAL_TOKENS, eos_token="<|end|>",
                              pad_token="<pad>")
    wrapped.chat_template = OTHER_CHAT_TEMPLATE
    return wrapped


def make_tiny_other_teacher(output_dir: str | Path, *, steps: int = 300, overwrite: bool = False) -> Path:
    """A teacher of another model family for the tiny pair (`other_family_tokenizer`), trained on the same answers
    as `make_tiny`'s teacher, in `output_dir` (cached)."""
    output_dir = Path(output_dir)
    if (output_dir / "config.json").exists() and not overwrite:
        return output_dir
    tokenizer = other_family_tokenizer()
    model = build_model(tokenizer, hidden_size=96, seed=1)
    train_on_answers(model, tokenizer, steps=steps, seed=1)
    tokenizer.save_pretrained(output_dir)
    model.save_pretrained(output_dir)
    return output_dir


def digit_split_bpe(corpus, *, vocab_size: int):
    """A byte-level BPE tokenizer trained on `corpus`, digits split one per token, with ChatML's special tokens
    (eos `<|im_end|>`, pad `<|endoftext|>`) and left padding; no chat template yet.

    Single digits make copying or adding numbers a per-token affair, whatever the spacing around them."""
    return _byte_level_bpe(corpus, vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, eos_token="<|im_end|>",
                           pad_token="<|endoftext|>", split_digits=True)


def build_model(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, vocab_size: int | None = None, seed: int = 0):
    """A random Qwen3 causal LM over `tokenizer` (or a larger `vocab_size`, for memory tests)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # vLLM's CPU attention rejects head_dim 16
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def train_on_answers(model, tokenizer, *, steps: int = 300, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
                     desc: str | None = None):
    """Plain next-token training on chat-formatted question/answer pairs (seconds to a minute for a tiny model), with
    a progress bar named `desc` if given."""
    import torch
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in tqdm(range(steps), desc=desc, disable=desc is None):
        texts = []
        for _ in range(batch_size):
            question, answer = arithmetic_prompt(rng)
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
        batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return loss.item()


def write_prompts(path: Path, n: int, seed: int) -> None:
    """A JSON-lines file of chat prompts ({"prompt": [{"role": "user", ...}], "answer": ...})."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            question, answer = arithmetic_prompt(rng)
            f.write(json.dumps({"prompt": [{"role": "user", "content": question}], "answer": answer}) + "\n")


def make_tiny(output_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Build `student/`, `teacher/`, `train.jsonl` and `heldout.jsonl` under `output_dir` (cached: skipped if there)."""
    output_dir = Path(output_dir)
    done = output_dir / "DONE"
    if done.exists() and not overwrite:
        return output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    # The student is "pretrained" briefly (so a LoRA adapter can move it), the teacher for ten times longer
    for name, hidden_size, steps, seed in (("student", 64, 30, 0), ("teacher", 96, 300, 1)):
        model = build_model(tokenizer, hidden_size=hidden_size, seed=seed)
        train_on_answers(model, tokenizer, steps=steps, seed=seed, desc=f"make-tiny: the {name} learns sums")
        model.save_pretrained(output_dir / name)
        tokenizer.save_pretrained(output_dir / name)
    write_prompts(output_dir / "train.jsonl", 512, seed=1)
    write_prompts(output_dir / "heldout.jsonl", 64, seed=2)
    done.write_text("ok\n")
    return output_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trl-opd make-tiny", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", nargs="?", default="artifacts/tiny")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    print(make_tiny(args.output_dir, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
