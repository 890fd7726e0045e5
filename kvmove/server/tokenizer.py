"""kvmove's own deterministic tokenizer: one token per UTF-8 byte, folded into the vocabulary.

Token ``t`` of a text is ``byte % vocab_size``; decoding keeps tokens below 256 as bytes (invalid UTF-8 replaced).
Good enough to drive the tiny seeded models from text; RL clients send ``input_ids``.
"""

from __future__ import annotations


class ByteTokenizer:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode()]

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode(errors="replace")
