"""Tokenizers: the byte tokenizer, a Hugging Face tokenizer.json with BOS/EOS from tokenizer_config.json or its
special tokens, model.vocab_size resolution, and the errors that name the key and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.llama3 import llama3_configs
from trainer.config import load_config
from trainer.preflight import check_config
from trainer.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer, model_vocab_size

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A tokenizer splits text into pieces; a model learns from the pieces.",
    "Pack the documents into windows, then shift the labels by one token.",
    "Ünïcödé and 日本語 survive a byte-level round trip.",
] * 4


def write_tiny_tokenizer(
    folder: Path, *, specials: tuple[str, ...] = (BOS, EOS), config: dict | None = None, vocab_size: int = 300
) -> Path:
    """A byte-level BPE trained on a few sentences, saved as folder/tokenizer.json (plus a
    tokenizer_config.json when `config` is given); its post-processor adds BOS, as Llama 3's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(SENTENCES, trainer)
    if specials:
        first = specials[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{first} $A", special_tokens=[(first, tok.token_to_id(first))]
        )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def test_byte_tokenizer_round_trip() -> None:
    tok = build_tokenizer("")
    assert isinstance(tok, ByteTokenizer)
    text = "Hello, world! Ünïcödé — 日本語 ✓"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.vocab_size <= llama3_configs["debugmodel"].vocab_size


def test_hf_tokenizer_from_folder_takes_bos_eos_from_tokenizer_config(tmp_path: Path) -> None:
    # the config names the tokens (one as an AddedToken dict), not the first candidates found
    path = write_tiny_tokenizer(
        tmp_path, specials=(BOS, EOS, "<s>", "</s>"), config={"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    )
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and tok.path == path
    vocab = json.loads(path.read_text())["model"]["vocab"]
    assert (tok.bos_id, tok.eos_id) == (vocab["<s>"], vocab["</s>"])
    text = SENTENCES[3]
    ids = tok.encode(text, bos=True, eos=True)
    plain = tok.encode(text)
    assert ids == [tok.bos_id, *plain, tok.eos_id]  # the file's post-processor adds no second BOS
    assert len(plain) < len(text.encode())  # merges were learnt
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size <= 300


def test_hf_tokenizer_file_without_config_finds_the_special_tokens(tmp_path: Path) -> None:
    tok = build_tokenizer(str(write_tiny_tokenizer(tmp_path)))
    assert (tok.bos_id, tok.eos_id) == (0, 1)  # trained specials come first
    # GPT-2 style: one <|endoftext|> serves as both
    gpt2 = build_tokenizer(str(write_tiny_tokenizer(tmp_path / "gpt2", specials=("<|endoftext|>",))))
    assert gpt2.bos_id == gpt2.eos_id == 0


def test_hf_tokenizer_without_bos_names_the_file_and_the_candidates(tmp_path: Path) -> None:
    path = write_tiny_tokenizer(tmp_path, specials=(EOS,))
    with pytest.raises(ValueError, match=r"tokenizer .*tokenizer.json: no BOS token found: there is no .*"
                       r"tokenizer_config.json, and none of \['<\|begin_of_text\|>', '<s>'"):  # fmt: skip
        build_tokenizer(str(path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    with pytest.raises(ValueError, match=r"bos_token '<bos>' is not a token of"):
        build_tokenizer(str(path))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "nope", r"model.tokenizer_path='.*nope' does not exist; point it at a tokenizer.json"),
        (lambda p: p, r"model.tokenizer_path='.*' is a folder without a tokenizer.json"),
        (lambda p: (p / "tokenizer.json").write_text("{not json") and p, r"is not a tokenizer.json that"),
    ],
    ids=["missing", "folder_without_file", "malformed"],
)
def test_bad_tokenizer_path_names_the_key(tmp_path: Path, make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        build_tokenizer(str(make(tmp_path)))


def test_model_vocab_size_pads_or_refuses() -> None:
    tok = ByteTokenizer()
    assert model_vocab_size(tok, 0) == 258
    assert model_vocab_size(tok, 2048) == 2048
    with pytest.raises(ValueError, match=r"model.vocab_size\(200\) is smaller than the tokenizer's vocab_size\(258\)"):
        model_vocab_size(tok, 200)


def test_preflight_checks_the_vocabulary(tmp_path: Path) -> None:
    path = write_tiny_tokenizer(tmp_path)
    cfg = load_config(["--model.tokenizer_path", str(path), "--model.vocab_size", "2048"])
    check_config(cfg)
    cfg.model.vocab_size = 100
    with pytest.raises(ValueError, match=r"model.vocab_size\(100\) is smaller"):
        check_config(cfg)
    cfg.model.vocab_size = -1
    with pytest.raises(ValueError, match=r"model.vocab_size=-1: must be >= 0"):
        check_config(cfg)
    cfg = load_config(["--parallelism.tensor_parallel_degree", "4"])  # bytes: 258 = 4 x 64.5
    with pytest.raises(ValueError, match=r"vocabulary\(258\) must be divisible by .*\(4\); set model.vocab_size=260"):
        check_config(cfg)
    cfg.model.tokenizer_path = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="model.tokenizer_path="):
        check_config(cfg)
