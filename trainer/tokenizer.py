"""Byte-level tokenizer: UTF-8 bytes are tokens 0..255, then BOS and EOS (vocab 258, no merges)."""

from __future__ import annotations


class ByteTokenizer:
    """Encodes text as its UTF-8 bytes; lossless on any string, so decode(encode(s)) == s."""

    bos_id: int = 256
    eos_id: int = 257
    vocab_size: int = 258

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed by BOS / EOS."""
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; BOS/EOS are dropped and invalid UTF-8 is replaced, never raised."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
