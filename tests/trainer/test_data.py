"""Tokenizer round trip; data batches: shapes, shift, determinism, dp-disjoint and tp-identical streams."""

from __future__ import annotations

import itertools

import pytest
import torch

from models.llama3 import llama3_configs
from trainer.data import TokenBatches, build_data_loader, load_tokens
from trainer.tokenizer import ByteTokenizer


def _batches(dp_rank: int, dp_size: int, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = build_data_loader(
        "embedded", ByteTokenizer(), local_batch_size=2, seq_len=64, dp_rank=dp_rank, dp_size=dp_size, seed=seed
    )
    return list(itertools.islice(iter(loader), n))


def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "Hello, world! Ünïcödé — 日本語 ✓"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.vocab_size <= llama3_configs["debugmodel"].vocab_size


def test_corpus_is_embedded_and_sized() -> None:
    tokens = load_tokens(ByteTokenizer())
    assert 100_000 <= tokens.numel() <= 400_000
    assert int(tokens.max()) < ByteTokenizer.vocab_size


def test_batches_are_shifted_and_shaped() -> None:
    for inputs, labels in _batches(0, 1, 3):
        assert inputs.shape == labels.shape == (2, 64) and inputs.dtype == torch.long
        assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_batches_deterministic_by_seed() -> None:
    a, b, c = _batches(0, 2, 4, seed=1), _batches(0, 2, 4, seed=1), _batches(0, 2, 4, seed=2)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))


def test_dp_ranks_read_disjoint_windows() -> None:
    # a stream of distinct tokens, so every window is distinguishable by its content
    tokens, dp_size = torch.arange(20_000), 4
    seen: list[set[int]] = []
    for rank in range(dp_size):
        loader = TokenBatches(tokens, local_batch_size=2, seq_len=63, dp_rank=rank, dp_size=dp_size, seed=0)
        n = loader.batches_per_epoch  # a whole epoch: disjointness holds within an epoch
        starts = {int(row[0]) for inputs, _ in itertools.islice(iter(loader), n) for row in inputs}
        assert len(starts) == 2 * n
        seen.append(starts)
    for i, j in itertools.combinations(range(dp_size), 2):
        assert not seen[i] & seen[j], f"dp ranks {i} and {j} read the same window"
    assert sum(len(s) for s in seen) >= 20_000 // 64 - dp_size * 2  # together they cover (almost) the corpus


def test_tp_peers_of_one_dp_rank_see_the_same_batches() -> None:
    # TP ranks of one dp group have the same dp coordinates, so they build identical loaders
    peer0, peer1 = _batches(1, 2, 5), _batches(1, 2, 5)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(peer0, peer1))


def test_loader_loops_forever() -> None:
    tokens = torch.arange(1000)
    loader = TokenBatches(tokens, local_batch_size=2, seq_len=9, dp_rank=0, dp_size=1, seed=0)
    batches = list(itertools.islice(iter(loader), loader.batches_per_epoch * 3 + 1))
    assert len(batches) == loader.batches_per_epoch * 3 + 1


def test_loader_too_small_corpus_errors() -> None:
    with pytest.raises(ValueError, match="lower training.seq_len"):
        TokenBatches(torch.arange(100), local_batch_size=4, seq_len=50, dp_rank=0, dp_size=2, seed=0)
