"""Two tokenisations of one text, cut into chunks where both have a token boundary (cross-tokenizer teachers).

A teacher with another tokenizer cannot score the student's token ids, but it can score the text they spell. Both
sides are read as bytes (a byte-level BPE token may end inside a UTF-8 character), and the text is cut at every byte
offset where a student token and a teacher token both end. Each chunk then has a student log-prob (the sum over its
student tokens) and a teacher log-prob (the sum over its teacher tokens), both of exactly the chunk's bytes given
exactly the same preceding text, so the chunks' log-prob differences add up to `log pi_T(text) - log pi_S(text)`.

    vocabulary = ByteVocabulary.of(tokenizer)       # the bytes of every token id
    vocabulary.check_lossless(name="teacher")       # text -> ids -> bytes must give the text back
    teacher_ids = teacher_vocabulary.encode_bytes(b"".join(student_pieces))   # the same bytes, the teacher's way
    student_chunk, teacher_chunk, n = align_bytes(student_pieces, teacher_vocabulary(teacher_ids))
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
import weakref

# Texts a tokenizer must give back byte for byte: words, digits, punctuation, runs of spaces, tabs and newlines,
# accented letters, CJK and an emoji (4 UTF-8 bytes, split inside by most byte-level vocabularies)
PROBE_TEXTS = (
    "Distil: 12 + 7 = 19, isn't it?\n  The answer is 19.",
    "def f(x):\n\treturn x ** 2  # square\n\n",
    "naïve café, 中文, 🙂 and ≥ 3",
)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_INVALID_BYTES = re.compile("([\udc80-\udcff]+)")  # bytes that spell no character, as decode(errors="surrogateescape")


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table (GPT-2's)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {character: byte for byte, character in bytes_to_unicode().items()}


def _piece_decoder(decoder: dict | None):
    """A function from one vocabulary entry to its bytes, read from the tokenizer's decoder configuration. Decoder
    steps that only act between tokens or at the start of a decoded text (Fuse, Strip) do not change a token's bytes.
    """
    steps = [] if decoder is None else decoder["decoders"] if decoder["type"] == "Sequence" else [decoder]
    byte_decoder = None
    for step in steps:
        if step["type"] not in ("ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"):
            raise ValueError(f"its decoder step {step['type']!r} is not read byte for byte (supported: ByteLevel, "
                             "Replace, ByteFallback, Metaspace, Fuse, Strip)")
        if step["type"] == "ByteLevel":
            byte_decoder = _gpt2_byte_decoder()

    def to_bytes(piece: str) -> bytes:
        for step in steps:
            kind = step["type"]
            if kind == "ByteLevel":
                return bytes(byte_decoder[character] for character in piece)
            if kind == "ByteFallback" and _BYTE_TOKEN.fullmatch(piece):
                return bytes([int(piece[3:5], 16)])
            if kind == "Replace":
                piece = piece.replace(step["pattern"]["String"], step["content"])
            if kind == "Metaspace":
                piece = piece.replace(step["replacement"], " ")
        return piece.encode()

    return to_bytes


class ByteVocabulary:
    """The bytes every token id of a (fast) tokenizer stands for: `vocabulary(ids) -> list[bytes]`.

    Added and special tokens stand for their text (`<|im_end|>` is those ten bytes), as the tokenizer reads them
    in a text. Whether the table is faithful is checked on real texts by `check_lossless`.
    """

    def __init__(self, tokenizer):
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        self.name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        self.tokenizer = tokenizer
        if not hasattr(tokenizer, "backend_tokenizer"):
            raise ValueError(f"The tokenizer of {self.name} is not a fast tokenizer, so its tokens cannot be read as "
                             "bytes: load it with use_fast=True.")
        decoder = json.loads(tokenizer.backend_tokenizer.to_str())["decoder"]
        try:
            to_bytes = _piece_decoder(decoder)
        except ValueError as error:
            raise ValueError(f"The tokenizer of {self.name} cannot be aligned by bytes: {error}.") from None
        vocab = tokenizer.get_vocab()
        added = {token.content for token in tokenizer.added_tokens_decoder.values()}
        self.table = [b""] * (max(vocab.values()) + 1)
        for piece, index in vocab.items():
            self.table[index] = piece.encode() if piece in added else to_bytes(piece)
        # the token of each single byte, where the vocabulary has one (all 256 in a byte-level BPE)
        self._ranked = None
        self.byte_ids = {piece[0]: index for piece, index in sorted((self.table[i], i) for i in vocab.values())
                         if len(piece) == 1 and index not in tokenizer.added_tokens_decoder}

    @classmethod
    def of(cls, tokenizer) -> ByteVocabulary:
        """The vocabulary of `tokenizer`, built once per tokenizer object (a 152k-token table takes about a second)."""
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        if tokenizer not in _BUILT:
            _BUILT[tokenizer] = cls(tokenizer)
        return _BUILT[tokenizer]

    def extensions(self, prefix: bytes) -> list[int]:
        """The ids of the plain (not added or special) tokens whose bytes start with `prefix`."""
        pieces, ids = self._plain_sorted()
        # the byte strings that start with `prefix` sort between it and its successor (its last byte below 0xff,
        # plus one, past the trailing 0xff bytes)
        stem = prefix.rstrip(b"\xff")
        end = bisect.bisect_left(pieces, stem[:-1] + bytes([stem[-1] + 1])) if stem else len(pieces)
        return ids[bisect.bisect_left(pieces, prefix) : end]

    def _plain_sorted(self) -> tuple[list[bytes], list[int]]:
        """The bytes and ids of the plain tokens, sorted by bytes (built once)."""
        if self._ranked is None:
            added = set(self.tokenizer.added_tokens_decoder)
            ranked = sorted((piece, index) for index, piece in enumerate(self.table) if piece and index not in added)
            self._ranked = ([piece for piece, _ in ranked], [index for _, index in ranked])
        return self._ranked

    def __call__(self, ids) -> list[bytes]:
        """The bytes of each id; none for an id past the tokenizer's vocabulary (a model's embedding may be larger)."""
        size = len(self.table)
        return [self.table[index] if index < size else b"" for index in ids]

    def encode(self, text: str) -> list[int]:
        """The tokenizer's own ids for `text`, no special tokens added around it, its added tokens read as such (a
        chat template's rendering)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_plain(self, text: str) -> list[int]:
        """The ids of `text` read as plain text: characters that spell a special token (`<|im_end|>` written out)
        are read as the ordinary tokens they are, never as that token."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def encode_bytes(self, data: bytes) -> list[int]:
        """Ids spelling `data` as plain text: the tokenizer's own tokenisation of each run of valid UTF-8 (special
        tokens spelled out read as plain text, `encode_plain`), and its single-byte token for each byte that spells no
        character (a sample cut inside a character, or sampled bytes that form none). Stops before a byte the
        vocabulary has no token for, so the ids may spell only a prefix of `data`."""
        ids = []
        for run in _INVALID_BYTES.split(data.decode(errors="surrogateescape")):
            if not run or not _INVALID_BYTES.fullmatch(run):
                ids += self.encode_plain(run) if run else []
                continue
            for character in run:  # surrogateescape writes byte b >= 0x80 as the code point 0xDC00 + b
                byte = ord(character) - 0xDC00
                if byte not in self.byte_ids:
                    return ids
                ids.append(self.byte_ids[byte])
        return ids

    def check_lossless(self, *, role: str) -> None:
        """Raise unless the tokenizer gives every probe text back byte for byte (text -> ids -> bytes): a tokenizer
        that adds a prefix space, lower-cases or drops characters cannot be aligned exactly."""
        for text in PROBE_TEXTS:
            ids = self.encode(text)
            spelled = b"".join(self(ids))
            if spelled != text.encode():
                raise ValueError(
                    f"The {role}'s tokenizer ({self.name}) does not give text back byte for byte: {text!r} is "
                    f"tokenised to {len(ids)} tokens that spell {spelled.decode(errors='replace')!r}. Cross-tokenizer "
                    "distillation compares both models on the exact sampled text, so both tokenizers must be "
                    "lossless (byte-level BPE, or byte-fallback SentencePiece without an added prefix space)."
                )


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its ByteVocabulary


def align_bytes(student: list[bytes], teacher: list[bytes]) -> tuple[list[int], list[int], int]:
    """Chunk the two tokenisations at every byte offset where both have a token boundary, over the bytes they
    share from the start (normally all of them).

    Returns the chunk index of each student token and of each teacher token (-1 for a token past the last common
    boundary, or of no bytes) and the number of chunks. Every chunk holds at least one token of each side.
    """
    student_ends = list(itertools.accumulate(len(piece) for piece in student))
    teacher_ends = list(itertools.accumulate(len(piece) for piece in teacher))
    shared = _common_prefix(b"".join(student), b"".join(teacher))
    cuts = sorted(set(student_ends) & set(teacher_ends) - {0})
    cuts = cuts[: bisect.bisect_right(cuts, shared)]

    def chunk_of(pieces: list[bytes], ends: list[int]) -> list[int]:
        # a token belongs to the first chunk that ends at or after its own end; a token of no bytes to none (it
        # spells nothing to compare)
        chunks = [bisect.bisect_left(cuts, end) if piece else len(cuts) for piece, end in zip(pieces, ends,
                                                                                               strict=True)]
        return [chunk if chunk < len(cuts) else -1 for chunk in chunks]

    return chunk_of(student, student_ends), chunk_of(teacher, teacher_ends), len(cuts)


def _common_prefix(a: bytes, b: bytes) -> int:
    """How many leading bytes `a` and `b` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])
