"""The embedded dataset: a small English corpus, tokenized once, served as shifted (input, label) batches.

The corpus is split into paragraphs (documents), each framed by BOS/EOS and concatenated into one
token stream, which is cut into non-overlapping windows of seq_len + 1 tokens. Each epoch the windows
are shuffled by (seed, epoch), identically on every rank, and data-parallel rank r of n takes windows
r, r+n, r+2n, ...: dp ranks read disjoint streams, and every rank of one dp group (its TP/CP/PP peers)
reads the same one. The loader loops forever.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .tokenizer import ByteTokenizer

CORPUS_PATH = Path(__file__).parent / "corpus" / "corpus.txt"


def load_tokens(tokenizer: ByteTokenizer, path: Path = CORPUS_PATH) -> torch.Tensor:
    """The whole corpus as one int64 token stream, each paragraph framed by BOS/EOS."""
    docs = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer.encode(doc, bos=True, eos=True)
    return torch.tensor(ids, dtype=torch.long)


class TokenBatches:
    """Infinite iterator of (input, label) int64 micro-batches, each (local_batch_size, seq_len).

    The global batch of step k is a function of (seed, global_batch_size, seq_len, k) alone: the
    windows at positions [k * G, (k + 1) * G) of the epoch's shuffled order (G = global_batch_size).
    Data-parallel rank r takes its contiguous part of G / dp_size windows, and yields it as
    G / (dp_size * local_batch_size) micro-batches in order. So any dp degree and any accumulation
    split of one global batch read exactly the same sequences.

    Args:
        tokens: the token stream.
        local_batch_size: sequences per micro-batch on this rank.
        seq_len: tokens per sequence; labels are inputs shifted left by one.
        dp_rank, dp_size: this rank's index on the data-parallel ("dp") mesh dim and its size.
        seed: shuffling seed (same on every rank).
        global_batch_size: sequences per optimizer step over all dp ranks; None: local x dp.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        local_batch_size: int,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        global_batch_size: int | None = None,
    ) -> None:
        global_batch = global_batch_size or local_batch_size * dp_size
        self.accumulation_steps = accumulation_steps(global_batch, local_batch_size, dp_size)
        n_windows = (tokens.numel() - 1) // (seq_len + 1)
        if n_windows < global_batch:
            raise ValueError(
                f"corpus of {tokens.numel()} tokens gives {n_windows} windows of seq_len+1={seq_len + 1}, fewer than "
                f"one global batch of {global_batch} sequences; lower training.seq_len or the batch size"
            )
        # (n_windows, seq_len + 1)
        self.windows = tokens[: n_windows * (seq_len + 1)].view(n_windows, seq_len + 1)
        self.local_batch_size, self.dp_rank, self.dp_size, self.seed = local_batch_size, dp_rank, dp_size, seed
        self.global_batch = global_batch
        self.batches_per_epoch = n_windows // global_batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = 0
        per_rank = self.global_batch // self.dp_size
        while True:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            order = torch.randperm(self.windows.shape[0], generator=g)
            for b in range(self.batches_per_epoch):
                mine = order[b * self.global_batch + self.dp_rank * per_rank :][:per_rank]
                for m in range(self.accumulation_steps):
                    idx = mine[m * self.local_batch_size : (m + 1) * self.local_batch_size]
                    batch = self.windows[idx]  # (B, T + 1)
                    yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # (B, T), (B, T)
            epoch += 1


def accumulation_steps(global_batch_size: int, local_batch_size: int, dp_size: int) -> int:
    """Micro-batches per optimizer step: global / (local x dp), which must divide exactly."""
    per_step = local_batch_size * dp_size
    if global_batch_size <= 0 or global_batch_size % per_step:
        raise ValueError(
            f"training.global_batch_size({global_batch_size}) must be a positive multiple of "
            f"training.local_batch_size({local_batch_size}) x data-parallel degree({dp_size}) = {per_step}; "
            f"{global_batch_size} / {per_step} = {global_batch_size / per_step:g} micro-batches per step"
        )
    return global_batch_size // per_step


def build_data_loader(dataset: str, tokenizer: ByteTokenizer, **options: Any) -> TokenBatches:
    """The loader for `dataset` (only "embedded" exists); `options` are TokenBatches' keyword
    arguments (batch sizes, seq_len, dp_rank / dp_size, seed)."""
    if dataset != "embedded":
        raise ValueError(f"training.dataset={dataset!r}: only 'embedded' (trainer/corpus/corpus.txt) is available")
    return TokenBatches(load_tokens(tokenizer), **options)
