"""Tokenizers: the byte tokenizer (the default) and a Hugging Face `tokenizer.json`, behind one interface.

`build_tokenizer(model.tokenizer_path)` picks one: "" gives the byte tokenizer (UTF-8 bytes are tokens
0..255, then BOS and EOS: vocab 258, no merges); a path gives a `tokenizers.Tokenizer` read from a
`tokenizer.json` (or a folder holding one), with BOS/EOS taken from the `tokenizer_config.json` next to
it or, failing that, from well-known special tokens. `model_vocab_size` resolves `model.vocab_size`
(0: the tokenizer's; larger: padding of the embedding and output) against the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

# Special-token spellings of common tokenizers, in the order they are tried: Llama 3, Llama 2 /
# Mistral, Gemma, and GPT-2 style ones whose single <|endoftext|> serves as both.
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>")
EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


class Tokenizer(Protocol):
    """What the data loader and the model need of a tokenizer."""

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Ids are in [0, vocab_size): the smallest vocabulary a model for this tokenizer can have."""
        ...

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


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


class HFTokenizer:
    """A `tokenizers.Tokenizer` (from a tokenizer.json) with resolved BOS/EOS ids.

    encode() never lets the file's post-processor add special tokens (Llama 3's adds BOS): framing
    is the caller's choice, through `bos` / `eos`, the same as for the byte tokenizer.
    """

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer  # imported here: the byte tokenizer needs none of it

        self.path = path
        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on a malformed file
            raise ValueError(
                f"model.tokenizer_path: {path} is not a tokenizer.json that the tokenizers package reads ({e}); "
                f"point it at a Hugging Face 'fast' tokenizer file"
            ) from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # the largest id + 1, not the entry count: added tokens may leave holes in the id range
        self.vocab_size = max(vocab.values()) + 1
        self.bos_id = self._special_id(vocab, "bos_token", BOS_CANDIDATES)
        self.eos_id = self._special_id(vocab, "eos_token", EOS_CANDIDATES)

    def _special_id(self, vocab: dict[str, int], key: str, candidates: tuple[str, ...]) -> int:
        """The id of tokenizer_config.json's `key` when it names one, else of the first candidate present."""
        config_path = self.path.parent / "tokenizer_config.json"
        configured = _configured_token(config_path, key)
        if configured is not None:
            if configured not in vocab:
                raise ValueError(
                    f"{config_path}: {key} {configured!r} is not a token of {self.path}; "
                    f"fix {key} there or use the tokenizer it was written for"
                )
            return vocab[configured]
        for token in candidates:
            if token in vocab:
                return vocab[token]
        where = f"{config_path} has no {key}" if config_path.is_file() else f"there is no {config_path}"
        raise ValueError(
            f"tokenizer {self.path}: no {key[:3].upper()} token found: {where}, and none of {list(candidates)} is "
            f"in its vocabulary; add {key!r} to a tokenizer_config.json next to it (set model.tokenizer_path)"
        )

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed by BOS / EOS."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens (BOS/EOS among them) dropped."""
        return self._tok.decode(ids, skip_special_tokens=True)


def _configured_token(config_path: Path, key: str) -> str | None:
    """tokenizer_config.json's `key`: a string, or a dict (an AddedToken) whose "content" is; None if unset."""
    if not config_path.is_file():
        return None
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{config_path}: {key} must be a string or {{'content': string}}, found {value!r}")
    return value


def resolve_tokenizer_file(tokenizer_path: str) -> Path:
    """The tokenizer.json that `model.tokenizer_path` names: the file itself, or the one in a folder."""
    path = Path(tokenizer_path).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"model.tokenizer_path={tokenizer_path!r} is a folder without a tokenizer.json; point it at a "
                f"tokenizer.json (Hugging Face 'fast' format) or a folder holding one, or set it to '' for bytes"
            )
    elif not path.is_file():
        raise ValueError(
            f"model.tokenizer_path={tokenizer_path!r} does not exist; point it at a tokenizer.json or a folder "
            f"holding one, or set it to '' for the byte tokenizer"
        )
    return path


def build_tokenizer(tokenizer_path: str) -> Tokenizer:
    """The byte tokenizer for "", else the Hugging Face tokenizer at `tokenizer_path` (model.tokenizer_path)."""
    if not tokenizer_path:
        return ByteTokenizer()
    return HFTokenizer(resolve_tokenizer_file(tokenizer_path))


def build_model_tokenizer(tokenizer_path: str, hf_assets_path: str) -> Tokenizer:
    """The job's tokenizer: model.tokenizer_path's, else the tokenizer.json in model.hf_assets_path (torchtitan's
    place for it), else the byte tokenizer."""
    if tokenizer_path or not hf_assets_path:
        return build_tokenizer(tokenizer_path)
    try:
        return build_tokenizer(hf_assets_path)
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(str(e).replace("model.tokenizer_path", "model.hf_assets_path")) from None


def model_vocab_size(tokenizer: Tokenizer, vocab_size: int) -> int:
    """The model's vocabulary: `vocab_size` (model.vocab_size) when > 0, which pads the embedding and
    output past the tokenizer's ids (e.g. to a multiple of the TP degree), else the tokenizer's."""
    if vocab_size <= 0:
        return tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size({vocab_size}) is smaller than the tokenizer's vocab_size({tokenizer.vocab_size}): "
            f"its ids would index past the embedding; set model.vocab_size >= {tokenizer.vocab_size}, or 0 for the "
            f"tokenizer's"
        )
    return vocab_size
